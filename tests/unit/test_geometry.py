"""Span geometry and per-pool stride rules (mooncake_span.span.geometry)."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_span.errors import InvalidRequestError, RegistrationError
from mooncake_span.span.geometry import (
    KV_DERIVED_POOLS,
    KV_POOL,
    PoolKind,
    SpanGeometry,
    classify_pool,
    derive_slots_per_key,
)

# ---------------------------------------------------------------------------
# SpanGeometry


@pytest.mark.parametrize(
    ("host", "storage", "k"),
    [(64, 64, 1), (64, 256, 4), (1, 1, 1), (1, 4096, 4096), (32, 1024, 32)],
)
def test_pages_per_span(host, storage, k):
    geometry = SpanGeometry(host, storage)
    assert geometry.pages_per_span == k
    assert geometry.pages_per_span * host == storage


@pytest.mark.parametrize(("host", "storage"), [(64, 100), (64, 32), (64, 0), (64, -64), (3, 10)])
def test_storage_page_must_be_a_positive_multiple_naming_both_sizes(host, storage):
    with pytest.raises(RegistrationError) as excinfo:
        SpanGeometry(host, storage)
    message = str(excinfo.value)
    assert f"({storage} tokens)" in message
    assert f"({host} tokens)" in message


@pytest.mark.parametrize("host", [0, -1])
def test_host_page_must_be_positive(host):
    with pytest.raises(RegistrationError, match=f"got {host}"):
        SpanGeometry(host, 64)


def test_geometry_is_frozen():
    geometry = SpanGeometry(64, 256)
    with pytest.raises(dataclasses.FrozenInstanceError):
        geometry.storage_page_tokens = 128  # type: ignore[misc]


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 512), st.integers(-10, 5000))
def test_span_geometry_accepts_exactly_the_positive_multiples(host, storage):
    valid = storage >= 1 and storage % host == 0
    if valid:
        assert SpanGeometry(host, storage).pages_per_span == storage // host
    else:
        with pytest.raises(RegistrationError):
            SpanGeometry(host, storage)


@pytest.mark.parametrize(
    ("candidates", "expected"),
    [
        ((), 64),
        ((None,), 64),
        ((0,), 64),
        ((None, 0, None), 64),
        ((256,), 256),
        ((256, 512), 256),  # the first positive candidate wins
        ((None, 512, 256), 512),
        ((0, None, 128), 128),
    ],
)
def test_resolve_precedence(candidates, expected):
    geometry = SpanGeometry.resolve(64, *candidates)
    assert geometry == SpanGeometry(64, expected)


def test_resolve_validates_the_chosen_candidate_only():
    # The first positive value is taken even if a later one would have been valid.
    with pytest.raises(RegistrationError, match="100"):
        SpanGeometry.resolve(64, None, 100, 256)
    assert SpanGeometry.resolve(64, 256, 100).storage_page_tokens == 256


def test_resolve_accepts_numeric_strings_coerced_to_int():
    # extra-config values may arrive as strings from JSON/CLI.
    assert SpanGeometry.resolve(64, "256").storage_page_tokens == 256  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("pool_page", "ok"),
    [(1, True), (64, True), (128, True), (256, True), (96, False), (512, False), (0, False)],
)
def test_check_pool_page(pool_page, ok):
    geometry = SpanGeometry(64, 256)
    if ok:
        geometry.check_pool_page("indexer", pool_page)
    else:
        with pytest.raises(RegistrationError) as excinfo:
            geometry.check_pool_page("indexer", pool_page)
        message = str(excinfo.value)
        assert "'indexer'" in message
        assert "(256 tokens)" in message and f"({pool_page} tokens)" in message


# ---------------------------------------------------------------------------
# classify_pool


def test_kv_is_the_anchor():
    assert classify_pool(KV_POOL) is PoolKind.KV_ANCHOR
    assert classify_pool("kv", frozenset({"kv"})) is PoolKind.KV_ANCHOR


@pytest.mark.parametrize(
    "name",
    [
        "indexer",
        "draft",
        "draft_indexer",
        "deepseek_v4_c4",
        "deepseek_v4_c4_indexer_scale",
        "deepseek_v4_c128_rope",
    ],
)
def test_kv_derived_names(name):
    assert classify_pool(name) is PoolKind.KV_DERIVED


@pytest.mark.parametrize(
    "name",
    [
        "mamba",
        "swa",
        "auxiliary_swa",
        "draft_swa",
        "deepseek_v4_c4_state",
        "deepseek_v4_c128_state",
        "something_new",
    ],
)
def test_state_pools(name):
    assert classify_pool(name) is PoolKind.STATE


def test_learned_kv_derived_pools():
    learned = frozenset({"my_sidecar"})
    assert classify_pool("my_sidecar") is PoolKind.STATE
    assert classify_pool("my_sidecar", learned) is PoolKind.KV_DERIVED


def _sglang_pool_names() -> set[str]:
    """PoolName values read from sglang's source; importing it would pull in torch (~5 s)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "srt/mem_cache/hicache_storage.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    (pool_name,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PoolName"]
    return {
        stmt.value.value
        for stmt in pool_name.body
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant)
    }


def test_kv_derived_table_only_names_real_sglang_pools():
    # A typo in the table would silently classify that pool as STATE.
    sglang_names = _sglang_pool_names()
    assert KV_DERIVED_POOLS <= sglang_names, sorted(KV_DERIVED_POOLS - sglang_names)
    # Every non-state, non-SWA, non-Mamba sglang pool is KV-derived.
    expected = {
        n
        for n in sglang_names
        if n != "kv" and not n.endswith("_state") and "swa" not in n and n != "mamba"
    }
    assert KV_DERIVED_POOLS == expected


# ---------------------------------------------------------------------------
# derive_slots_per_key


def derive(**kw) -> int:
    base = dict(
        pool_name="kv",
        kind=PoolKind.KV_ANCHOR,
        num_slots=512,
        num_keys=2,
        pool_page_tokens=64,
        storage_page_tokens=256,
    )
    base.update(kw)
    return derive_slots_per_key(**base)


def test_kv_anchor_carries_one_storage_page_per_key():
    assert derive() == 256
    assert derive(kind=PoolKind.KV_DERIVED, pool_name="indexer") == 256


@pytest.mark.parametrize("kind", [PoolKind.KV_ANCHOR, PoolKind.KV_DERIVED])
def test_kv_kinds_must_match_the_storage_page(kind):
    # 2 keys x 64 slots: a host page per key instead of a storage page.
    with pytest.raises(InvalidRequestError) as excinfo:
        derive(pool_name="draft", kind=kind, num_slots=128, num_keys=2)
    message = str(excinfo.value)
    assert "'draft'" in message
    assert "256" in message and "64" in message
    assert "128 indices / 2 keys" in message


def test_state_pool_one_checkpoint_slot_per_key():
    assert (
        derive(pool_name="mamba", kind=PoolKind.STATE, num_slots=3, num_keys=3, pool_page_tokens=1)
        == 1
    )


def test_state_pool_swa_window():
    assert (
        derive(
            pool_name="swa", kind=PoolKind.STATE, num_slots=4 * 128, num_keys=4, pool_page_tokens=64
        )
        == 128
    )


def test_state_pool_needs_whole_pool_pages():
    with pytest.raises(InvalidRequestError) as excinfo:
        derive(
            pool_name="swa", kind=PoolKind.STATE, num_slots=2 * 96, num_keys=2, pool_page_tokens=64
        )
    message = str(excinfo.value)
    assert "'swa'" in message and "96" in message and "64" in message


@pytest.mark.parametrize(("num_slots", "num_keys"), [(513, 2), (0, 2), (-4, 2), (5, 3)])
def test_indices_must_divide_among_keys(num_slots, num_keys):
    with pytest.raises(InvalidRequestError) as excinfo:
        derive(
            pool_name="mamba",
            kind=PoolKind.STATE,
            num_slots=num_slots,
            num_keys=num_keys,
            pool_page_tokens=1,
        )
    message = str(excinfo.value)
    assert "'mamba'" in message
    assert f"{num_slots} host indices" in message and f"{num_keys} keys" in message


@pytest.mark.parametrize("num_keys", [0, -1])
def test_no_keys_is_an_error(num_keys):
    with pytest.raises(InvalidRequestError, match="'kv'.*no keys"):
        derive(num_keys=num_keys)


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(list(PoolKind)),
    st.integers(0, 2048),
    st.integers(1, 16),
    st.sampled_from([1, 16, 32, 64, 128]),
    st.sampled_from([64, 128, 256, 512]),
)
def test_derive_slots_per_key_rule(kind, num_slots, num_keys, pool_page, storage_page):
    # The rule written out once, without any of the implementation's early exits.
    divides = num_slots >= 1 and num_slots % num_keys == 0
    per_key = num_slots // num_keys if divides else None
    valid = (
        divides and (kind is PoolKind.STATE or per_key == storage_page) and per_key % pool_page == 0
    )
    kw = dict(
        pool_name="p",
        kind=kind,
        num_slots=num_slots,
        num_keys=num_keys,
        pool_page_tokens=pool_page,
        storage_page_tokens=storage_page,
    )
    if valid:
        assert derive_slots_per_key(**kw) == per_key
    else:
        with pytest.raises(InvalidRequestError, match="'p'"):
            derive_slots_per_key(**kw)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 32), st.sampled_from([16, 64]), st.integers(1, 8))
def test_kv_transfer_of_whole_storage_pages_always_derives(host_pages_per_key, host_page, num_keys):
    storage = host_pages_per_key * host_page
    for kind in (PoolKind.KV_ANCHOR, PoolKind.KV_DERIVED):
        assert (
            derive_slots_per_key(
                pool_name="kv",
                kind=kind,
                num_slots=num_keys * storage,
                num_keys=num_keys,
                pool_page_tokens=host_page,
                storage_page_tokens=storage,
            )
            == storage
        )
