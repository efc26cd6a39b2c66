"""Object-key schema (mooncake_span.span.keys).

Key strings are a persistent format: objects written by one release must be
found by the next. The golden strings below are typed out by hand from the
grammar ``ms2[_{tag}]_{model}_h{host_page}x{K}_{layout}_{kv_dtype}_{page_key}_{rank}_{component}``;
changing any of them requires a KEY_SCHEMA_VERSION bump.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mooncake_span.errors import InvalidRequestError
from mooncake_span.span.keys import (
    KEY_SCHEMA_VERSION,
    MAX_PAGE_KEY_CHARS,
    ComponentSpec,
    KeySchema,
    RankScope,
    RankTags,
    check_page_keys,
    layout_code,
    sanitize_token,
)

HASH = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"

K = ComponentSpec("k", RankScope.SHARDED)
V = ComponentSpec("v", RankScope.SHARDED)
MHA_KV = ComponentSpec("kv", RankScope.SHARDED, parts=2)
MLA_KV = ComponentSpec("k", RankScope.REPLICATED)
INDEXER = ComponentSpec("indexer", RankScope.REPLICATED)
TEMPORAL = ComponentSpec("temporal", RankScope.SHARDED)
CONV0 = ComponentSpec("conv_0", RankScope.SHARDED)


def schema(**overrides) -> KeySchema:
    fields = dict(
        model="DeepSeek-V3",
        host_page_tokens=64,
        pages_per_span=4,
        layout="page_first",
        kv_dtype="bfloat16",
        ranks=RankTags.from_ranks(tp_rank=3),
        tag=None,
    )
    fields.update(overrides)
    return KeySchema(**fields)


def one_key(s: KeySchema, component: ComponentSpec, page_key: str = HASH) -> str:
    (key,) = s.object_keys([page_key], (component,))
    return key


# ---------------------------------------------------------------------------
# Golden strings

P = "ms2_DeepSeek-V3_h64x4_pf_bfloat16"


@pytest.mark.parametrize(
    ("ranks", "component", "expected"),
    [
        # MLA without PP: upstream's "{hash}__k" (empty rank part).
        (dict(tp_rank=3), MLA_KV, f"{P}_{HASH}__k"),
        (dict(tp_rank=0), INDEXER, f"{P}_{HASH}__indexer"),
        # MHA: one object per TP rank and component.
        (dict(tp_rank=3), K, f"{P}_{HASH}_3_k"),
        (dict(tp_rank=3), V, f"{P}_{HASH}_3_v"),
        # Mamba state is sharded even under MLA.
        (dict(tp_rank=1), TEMPORAL, f"{P}_{HASH}_1_temporal"),
        (dict(tp_rank=1), CONV0, f"{P}_{HASH}_1_conv_0"),
        # PP: the stage index joins both scopes.
        (dict(tp_rank=3, pp_rank=2, pp_size=4), MLA_KV, f"{P}_{HASH}_2_k"),
        (dict(tp_rank=3, pp_rank=2, pp_size=4), V, f"{P}_{HASH}_3_2_v"),
        (dict(tp_rank=3, pp_rank=0, pp_size=2), MLA_KV, f"{P}_{HASH}_0_k"),
        # CP > 1 keeps layer-split CP ranks apart (sglang #37122).
        (dict(tp_rank=3, attn_cp_rank=1, attn_cp_size=2), MLA_KV, f"{P}_{HASH}_cp1_k"),
        (dict(tp_rank=3, attn_cp_rank=1, attn_cp_size=2), K, f"{P}_{HASH}_3_cp1_k"),
        (
            dict(tp_rank=3, pp_rank=2, pp_size=4, attn_cp_rank=1, attn_cp_size=2),
            MLA_KV,
            f"{P}_{HASH}_cp1_2_k",
        ),
        (
            dict(tp_rank=3, pp_rank=2, pp_size=4, attn_cp_rank=1, attn_cp_size=2),
            K,
            f"{P}_{HASH}_3_2_cp1_k",
        ),
        # DCP: decode-context-parallel rank plus the CP rank (even when CP == 1).
        (dict(tp_rank=3, dcp_rank=1, dcp_size=2), MLA_KV, f"{P}_{HASH}_dcp1_cp0_k"),
        (
            dict(tp_rank=3, dcp_rank=1, dcp_size=2, pp_rank=2, pp_size=4),
            MLA_KV,
            f"{P}_{HASH}_dcp1_cp0_2_k",
        ),
        (dict(tp_rank=3, dcp_rank=1, dcp_size=2), K, f"{P}_{HASH}_3_k"),
        # Sizes of 1 leave their rank out, whatever the rank argument says.
        (
            dict(tp_rank=3, pp_rank=1, pp_size=1, attn_cp_rank=1, attn_cp_size=1),
            MLA_KV,
            f"{P}_{HASH}__k",
        ),
    ],
)
def test_golden_object_keys(ranks, component, expected):
    assert one_key(schema(ranks=RankTags.from_ranks(**ranks)), component) == expected


def test_golden_mha_layer_first_fp8():
    s = schema(
        model="meta-llama/Llama-3.1-8B",
        host_page_tokens=32,
        pages_per_span=8,
        layout="layer_first",
        kv_dtype="float8_e4m3fn",
    )
    # ms2: one object per key and rank, k and v inside it.
    assert s.object_keys(["a1", "b2"], (MHA_KV,)) == [
        "ms2_meta-llama-Llama-3.1-8B_h32x8_lf_float8-e4m3fn_a1_3_kv",
        "ms2_meta-llama-Llama-3.1-8B_h32x8_lf_float8-e4m3fn_b2_3_kv",
    ]
    assert s.group_ids(["a1", "b2"], 1) == [
        "ms2_meta-llama-Llama-3.1-8B_h32x8_lf_float8-e4m3fn_a1",
        "ms2_meta-llama-Llama-3.1-8B_h32x8_lf_float8-e4m3fn_b2",
    ]


def test_golden_tag_and_group_id():
    s = schema(tag="prod/east")
    assert s.prefix == "ms2_prod-east_DeepSeek-V3_h64x4_pf_bfloat16"
    assert one_key(s, MLA_KV, "abc") == "ms2_prod-east_DeepSeek-V3_h64x4_pf_bfloat16_abc__k"
    assert s.group_id("abc") == "ms2_prod-east_DeepSeek-V3_h64x4_pf_bfloat16_abc"
    # An empty tag is no tag.
    assert schema(tag="").prefix == P


@pytest.mark.parametrize(
    ("layout", "code"),
    [
        ("page_first", "pf"),
        ("page_first_direct", "pfd"),
        ("layer_first", "lf"),
        ("page_head", "ph"),
        ("page_first_kv_split", "pfkv"),
        # Unknown layouts still get an unambiguous (underscore-free) field.
        ("some_new_layout", "some-new-layout"),
    ],
)
def test_layout_codes(layout, code):
    assert layout_code(layout) == code
    assert schema(layout=layout).prefix == f"ms2_DeepSeek-V3_h64x4_{code}_bfloat16"


@pytest.mark.parametrize(
    ("raw", "token"),
    [
        ("Qwen/Qwen3-8B", "Qwen-Qwen3-8B"),
        ("/models/llama 3", "models-llama-3"),
        ("a__b", "a-b"),
        ("v1.2-rc", "v1.2-rc"),
        ("___", "none"),
        ("", "none"),
    ],
)
def test_sanitize_token(raw, token):
    assert sanitize_token(raw) == token


def test_schema_version_is_ms2():
    # Bumping it orphans every stored object; this test makes that deliberate.
    # ms1 -> ms2: MHA-style pools became one "kv" object per key and rank.
    assert KEY_SCHEMA_VERSION == "ms2"
    assert schema().prefix.startswith("ms2_")


def test_object_keys_are_key_major_component_minor():
    s = schema()
    keys = s.object_keys(["p0", "p1", "p2"], (K, V))
    assert keys == [f"{P}_{p}_3_{c}" for p in ("p0", "p1", "p2") for c in ("k", "v")]
    assert s.object_keys([], (K, V)) == []


def test_rank_tags_from_ranks_by_hand():
    assert RankTags.from_ranks(tp_rank=7) == RankTags(replicated="", sharded="7")
    assert RankTags.from_ranks(tp_rank=7, pp_rank=1, pp_size=2) == RankTags("1", "7_1")
    assert RankTags.from_ranks(tp_rank=7, attn_cp_rank=3, attn_cp_size=4) == RankTags(
        "cp3", "7_cp3"
    )
    assert RankTags.from_ranks(
        tp_rank=0, dcp_rank=2, dcp_size=4, attn_cp_rank=1, attn_cp_size=2
    ) == (RankTags("dcp2_cp1", "0_cp1"))


# ---------------------------------------------------------------------------
# Disjointness

SAFE_TOKEN = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-",
    min_size=1,
    max_size=12,
).filter(lambda t: t.strip("-") == t)
schemas = st.builds(
    KeySchema,
    model=SAFE_TOKEN,
    host_page_tokens=st.integers(1, 1024),
    pages_per_span=st.integers(1, 64),
    layout=st.sampled_from(
        ["page_first", "page_first_direct", "layer_first", "page_head", "page_first_kv_split"]
    ),
    kv_dtype=st.sampled_from(["bfloat16", "float16", "float8-e4m3fn", "float8", "float32"]),
    ranks=st.just(RankTags.from_ranks(tp_rank=0)),
    tag=st.one_of(st.none(), SAFE_TOKEN),
)


def _identity(s: KeySchema) -> tuple:
    return (s.model, s.host_page_tokens, s.pages_per_span, s.layout, s.kv_dtype, s.tag)


@settings(max_examples=100, deadline=None)
@given(schemas, schemas)
def test_different_deployments_never_share_a_namespace(a, b):
    assume(_identity(a) != _identity(b))
    assert a.prefix != b.prefix
    # The backend clears its namespace with remove_prefix(prefix + "_"); that
    # must never reach into another deployment's objects.
    assert not (b.prefix + "_").startswith(a.prefix + "_")
    assert not (a.prefix + "_").startswith(b.prefix + "_")
    pages = ["0a1b", "ffee"]
    assert not set(a.object_keys(pages, (MLA_KV, K))) & set(b.object_keys(pages, (MLA_KV, K)))


@settings(max_examples=100, deadline=None)
@given(
    schemas, st.sampled_from(["model", "host_page_tokens", "pages_per_span", "layout", "kv_dtype"])
)
def test_each_field_alone_changes_the_prefix(s, field):
    changed = {
        "model": s.model + "x",
        "host_page_tokens": s.host_page_tokens + 1,
        "pages_per_span": s.pages_per_span + 1,
        "layout": "layer_first" if s.layout != "layer_first" else "page_first",
        "kv_dtype": "float16" if s.kv_dtype != "float16" else "bfloat16",
    }[field]
    assert dataclasses.replace(s, **{field: changed}).prefix != s.prefix


def test_span_and_native_page_of_equal_tokens_are_disjoint():
    # 4 x 64-token host pages vs one native 256-token page: same tokens, same
    # page hash, different bytes layout -> different keys.
    span = schema(host_page_tokens=64, pages_per_span=4)
    native = schema(host_page_tokens=256, pages_per_span=1)
    assert span.prefix == "ms2_DeepSeek-V3_h64x4_pf_bfloat16"
    assert native.prefix == "ms2_DeepSeek-V3_h256x1_pf_bfloat16"
    assert one_key(span, MLA_KV) != one_key(native, MLA_KV)


def test_digit_boundaries_cannot_alias():
    # h{host}x{K}: "6x44" and "64x4" must stay distinct.
    assert (
        schema(host_page_tokens=6, pages_per_span=44).prefix
        != schema(host_page_tokens=64, pages_per_span=4).prefix
    )


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, 7), st.integers(0, 3), st.integers(1, 4), st.integers(0, 3), st.integers(1, 4)
)
def test_distinct_rank_coordinates_give_distinct_sharded_tags(tp, pp, pp_size, cp, cp_size):
    assume(pp < pp_size and cp < cp_size)
    base = RankTags.from_ranks(
        tp_rank=tp, pp_rank=pp, pp_size=pp_size, attn_cp_rank=cp, attn_cp_size=cp_size
    )
    if pp_size > 1:
        other_pp = RankTags.from_ranks(
            tp_rank=tp,
            pp_rank=(pp + 1) % pp_size,
            pp_size=pp_size,
            attn_cp_rank=cp,
            attn_cp_size=cp_size,
        )
        assert other_pp.sharded != base.sharded and other_pp.replicated != base.replicated
    if cp_size > 1:
        other_cp = RankTags.from_ranks(
            tp_rank=tp,
            pp_rank=pp,
            pp_size=pp_size,
            attn_cp_rank=(cp + 1) % cp_size,
            attn_cp_size=cp_size,
        )
        assert other_cp.sharded != base.sharded and other_cp.replicated != base.replicated
    other_tp = RankTags.from_ranks(
        tp_rank=tp + 1, pp_rank=pp, pp_size=pp_size, attn_cp_rank=cp, attn_cp_size=cp_size
    )
    assert other_tp.sharded != base.sharded
    # Replicated objects are shared by every TP rank.
    assert other_tp.replicated == base.replicated


# ---------------------------------------------------------------------------
# check_page_keys


def test_accepts_lists_and_tuples_and_returns_a_fresh_list():
    keys = [HASH, "abc", "x" * MAX_PAGE_KEY_CHARS]
    out = check_page_keys(keys)
    assert out == keys and out is not keys and type(out) is list
    assert check_page_keys(tuple(keys)) == keys
    assert check_page_keys([]) == []


def test_none_is_rejected():
    with pytest.raises(InvalidRequestError, match="None"):
        check_page_keys(None)


@pytest.mark.parametrize("bad", ["abc", {"a": 1}, 5, (k for k in ["a"]), {"a"}])
def test_non_list_is_rejected_naming_the_type(bad):
    with pytest.raises(InvalidRequestError, match="list") as excinfo:
        check_page_keys(bad)
    assert type(bad).__name__ in str(excinfo.value)


@pytest.mark.parametrize(
    ("bad", "fragment"),
    [
        ("", "non-empty"),
        (None, "non-empty"),
        (7, "non-empty"),
        (b"abc", "non-empty"),
        ("a b", "whitespace"),
        ("ab\t", "whitespace"),
        ("\nab", "whitespace"),
        ("a\x00b", "control"),
        ("a\x1fb", "control"),
        ("a\x7fb", "control"),
        ("x" * (MAX_PAGE_KEY_CHARS + 1), str(MAX_PAGE_KEY_CHARS)),
    ],
    ids=[
        "empty",
        "none",
        "int",
        "bytes",
        "space",
        "tab",
        "newline",
        "nul",
        "unit-sep",
        "del",
        "too-long",
    ],
)
@pytest.mark.parametrize("index", [0, 2])
def test_bad_key_is_rejected_naming_its_index(bad, fragment, index):
    keys = ["good0", "good1", "good2"]
    keys[index] = bad
    with pytest.raises(InvalidRequestError) as excinfo:
        check_page_keys(keys)
    message = str(excinfo.value)
    assert f"#{index}" in message
    assert fragment in message


def test_first_bad_key_is_the_one_named():
    with pytest.raises(InvalidRequestError, match="#1 "):
        check_page_keys(["ok", "", "a b"])


@pytest.mark.parametrize(
    "char",
    ["\x85", "\xa0", "\u2028", "\u3000", "\x9b"],
    ids=["NEL", "NBSP", "line-sep", "ideographic-space", "C1-CSI"],
)
def test_non_ascii_whitespace_and_control_chars_are_rejected(char):
    # The docstring's rule is "whitespace and control characters", not just
    # their ASCII forms; Python itself treats all of these as whitespace or Cc.
    assert char.isspace() or not char.isprintable()
    with pytest.raises(InvalidRequestError, match="#0"):
        check_page_keys([f"ab{char}cd"])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(alphabet="0123456789abcdef", min_size=1, max_size=64), max_size=10))
def test_hex_digests_always_pass(keys):
    assert check_page_keys(keys) == keys


# ---------------------------------------------------------------------------
# Placement domains of a call, built from page keys


@given(
    st.lists(
        st.text(alphabet="abcdef0123456789_-", min_size=1, max_size=20), min_size=1, max_size=8
    ),
    st.sampled_from([(MLA_KV,), (K, V), (MLA_KV, INDEXER, CONV0)]),
)
@settings(max_examples=200, deadline=None)
def test_domains_of_a_call_equal_domain_of_each_object_key(page_keys, components):
    s = schema()
    expected = [s.domain_of(k) for k in s.object_keys(page_keys, components)]
    assert s.domains(page_keys, len(components)) == expected
    groups = s.group_ids(page_keys, len(components))
    assert s.domains(page_keys, len(components), groups) == expected
