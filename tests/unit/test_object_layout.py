"""span.object_layout: the router-facing layout document and the key parser."""

from __future__ import annotations

import json

import pytest

from mooncake_span.span.geometry import PoolKind
from mooncake_span.span.keys import ComponentSpec, KeySchema, RankScope, RankTags
from mooncake_span.span.object_layout import (
    NamespaceFacts,
    describe_object_layout,
    parse_guard_key,
    parse_object_key,
)
from mooncake_span.store.layout_guard import PoolGeometry, namespace_key

R, S = RankScope.REPLICATED, RankScope.SHARDED


def _facts(**over) -> NamespaceFacts:
    base = dict(
        key_prefix="ms2_m_h64x4_pf_bfloat16",
        model="m",
        tag=None,
        host_page_tokens=64,
        pages_per_span=4,
        layout="page_first",
        kv_dtype="bfloat16",
    )
    return NamespaceFacts(**{**base, **over})


def test_mla_span_example_from_the_docstring():
    doc = describe_object_layout(
        _facts(),
        {"kv": PoolGeometry(("k",), (4096,), 64)},
        {"kv": PoolKind.KV_ANCHOR},
        scopes={"kv": ("replicated",)},
        ranks=RankTags.from_ranks(tp_rank=3),
    )
    assert doc["page_size"] == 256
    (pool,) = doc["hicache_object_layout"]["pools"]
    assert pool["suffixes"] == ["__k"]
    assert pool["components"][0]["bytes_per_object"] == 16384
    assert doc["span"]["bytes_per_key"] == 16384
    assert json.loads(json.dumps(doc)) == doc  # JSON-ready


def test_upstream_fields_are_all_present():
    doc = describe_object_layout(_facts(), {}, {})
    assert {"enabled", "backend", "page_size", "hicache_object_layout"} <= set(doc)
    assert {"pools", "key_prefix", "is_mla_backend", "pp_rank", "pp_size"} <= set(
        doc["hicache_object_layout"]
    )


def test_sharded_components_carry_the_tp_rank_and_state_sizes_stay_unknown():
    ranks = RankTags.from_ranks(tp_rank=2, pp_rank=1, pp_size=2)
    pools = {
        "kv": PoolGeometry(("kv",), (200,), 64),
        "mamba": PoolGeometry(("temporal",), (4096,), 1),
        "indexer": PoolGeometry(("indexer",), (10,), 64),
    }
    kinds = {"kv": PoolKind.KV_ANCHOR, "mamba": PoolKind.STATE, "indexer": PoolKind.KV_DERIVED}
    scopes = {"kv": ("sharded",), "mamba": ("sharded",), "indexer": ("replicated",)}
    doc = describe_object_layout(_facts(), pools, kinds, scopes=scopes, ranks=ranks)
    by_name = {p["pool"]: p for p in doc["hicache_object_layout"]["pools"]}
    assert [p["pool"] for p in doc["hicache_object_layout"]["pools"]][0] == "kv"
    assert by_name["kv"]["suffixes"] == ["_2_1_kv"]
    assert by_name["kv"]["bytes_per_key"] == 800
    assert by_name["indexer"]["suffixes"] == ["_1_indexer"]
    assert by_name["mamba"]["bytes_per_key"] is None
    assert by_name["mamba"]["hit_policy"] == "trailing_pages"
    assert doc["span"]["bytes_per_key"] is None
    assert doc["span"]["rank_suffixes"] == {"replicated": "1", "sharded": "2_1"}


def test_unknown_scopes_give_no_suffix_rather_than_a_guess():
    pools = {"kv": PoolGeometry(("k",), (64,), 64)}
    kinds = {"kv": PoolKind.KV_ANCHOR}
    doc = describe_object_layout(_facts(), pools, kinds, ranks=RankTags.from_ranks(tp_rank=0))
    assert doc["hicache_object_layout"]["pools"][0]["suffixes"] == [None]


@pytest.mark.parametrize("tag", [None, "prod-a"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
def test_parse_object_key_inverts_the_key_schema(tag, layout):
    schema = KeySchema(
        model="DeepSeek/V3.2",
        host_page_tokens=64,
        pages_per_span=4,
        layout=layout,
        kv_dtype="bfloat16",
        ranks=RankTags.from_ranks(tp_rank=1),
        tag=tag,
    )
    comps = (ComponentSpec("k", R), ComponentSpec("conv_0", S))
    for key in schema.object_keys(["ab12" * 16], comps):
        parsed = parse_object_key(key)
        assert parsed is not None, key
        facts, rest = parsed
        assert facts.key_prefix == schema.prefix
        assert facts.tag == (tag if tag is None else "prod-a")
        assert facts.model == "DeepSeek-V3.2"
        assert (facts.host_page_tokens, facts.pages_per_span) == (64, 4)
        assert facts.layout == layout
        assert rest.startswith("ab12" * 16 + "_")


@pytest.mark.parametrize(
    "key",
    [
        "",
        "foo",
        "ms2",
        "ms2_model",
        "ms3_m_h64x4_pf_bf16_abc",
        "sglang-hicache:abc__k",
        "ms2_m_64x4_pf",
        # The previous key format (k and v apart) is foreign to this one.
        "ms1_m_h64x4_pf_bf16_abc_0_k",
    ],
)
def test_foreign_keys_are_not_parsed(key):
    assert parse_object_key(key) is None


@pytest.mark.parametrize("tag", [None, "blue"])
def test_guard_keys_round_trip(tag):
    key = namespace_key("my model", tag)
    assert parse_guard_key(key) == (tag, "my-model")
    assert parse_object_key(key) is None
    assert parse_guard_key("ms2_m_h64x4_pf_bf16_abc__k") is None
    assert parse_guard_key("ms1_my-model__geometry") is None
