"""How the backend learns the storage page, in each order a build hands it
(issue #36; facts: shared reference ``span-aware-builds.md``).

Real sglang host pools (MLA KV + DSA indexer + Mamba state), the
contract-checked fake store, and the calls in the order each build makes them:
the span fork builds and registers at the host page, then assigns
``storage_page_size`` on the live backend; a runtime attach carries the page on
the config; a build that names none lets the first transfer tell it. Every
round trip compares bytes. The refusals (an assignment after the first data
call, a transfer that contradicts the page) are misses with one log line.
"""

from __future__ import annotations

import logging

import pytest
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

from mooncake_span.errors import LayoutConflictError, RegistrationError
from mooncake_span_tools.testing import pools as P
from mooncake_span_tools.testing.fake_store import FakeCluster
from tests.span_helpers import FAKE_CLIENT, make_storage_config, register_pools, slots_of

PAGE = 64
K = 4
SPAN = PAGE * K
LOGGER = "mooncake_span.sglang_backend.storage_page"


def _pools() -> dict:
    """MLA KV + compressed DSA indexer + Mamba, as GLM-5.3-Flash's stack."""
    return dict(P.build_compressed_hybrid_dsa(host_pages=16, index_kpool=K).pools)


def _config(field=None, **extra):
    config = make_storage_config({**FAKE_CLIENT, **extra})
    if field is not None:
        config.storage_page_size = field
    return config


def _fork_startup(make_backend, cluster=None, pools=None):
    """The span fork's startup: built with the field at the host page, pools
    registered, then the tree page assigned on the live backend."""
    pools = pools or _pools()
    store = make_backend(_config(field=PAGE), pools, cluster=cluster)
    store.storage_page_size = SPAN
    return store, pools


def _round_trip(store, pools, pages, keys, *, seed=1) -> list[bool]:
    """Back up ``keys`` from host ``pages`` (K per key, in order) with the
    indexer first (as sglang's backup thread), wipe, restore, compare bytes."""
    kv, indexer = pools[PoolName.KV], pools[PoolName.INDEXER]
    slots = slots_of(pages, PAGE)
    P.fill_random_pages(kv, [p * PAGE for p in pages], seed=seed)
    P.fill_random_pages(indexer, [p * PAGE for p in pages], seed=seed + 1)
    before = [(P.page_bytes(kv, p * PAGE), P.page_bytes(indexer, p * PAGE)) for p in pages]
    sidecar = PoolTransfer(
        name=PoolName.INDEXER, keys=keys, host_indices=slots, indices_from_pool=PoolName.KV
    )
    put = store.batch_set_v2([sidecar])[PoolName.INDEXER]
    put_kv = store.batch_set_v1(keys, slots)
    P.wipe_pages(kv, [p * PAGE for p in pages])
    P.wipe_pages(indexer, [p * PAGE for p in pages])
    got_kv = store.batch_get_v1(keys, slots)
    got = store.batch_get_v2([sidecar])[PoolName.INDEXER]
    after = [(P.page_bytes(kv, p * PAGE), P.page_bytes(indexer, p * PAGE)) for p in pages]
    ok = [a and b and c and d for a, b, c, d in zip(put, put_kv, got_kv, got, strict=True)]
    if all(ok):
        assert after == before
    return ok


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_fork_startup_order_gets_span_mode(make_backend):
    store, pools = _fork_startup(make_backend)
    assert (store.geometry.pages_per_span, store.storage_page_size) == (K, SPAN)
    assert f"h{PAGE}x{K}" in store.key_schema.prefix
    # Host pages of one key need not be contiguous.
    assert _round_trip(store, pools, [9, 2, 14, 5, 0, 11, 7, 3], ["a", "b"]) == [True, True]
    assert store.batch_exists(["a", "b", "c"]) == 2


def test_runtime_attach_carries_the_page_on_the_config(make_backend):
    pools = _pools()
    store = make_backend(_config(field=SPAN), pools)
    assert store.geometry.pages_per_span == K
    assert _round_trip(store, pools, [1, 3, 5, 7], ["a"]) == [True]


@pytest.mark.parametrize(
    ("field", "extra"),
    [(None, {}), (PAGE, {}), (0, {})],
    ids=["stock-no-field", "transfer-page-hashing", "field-zero"],
)
def test_k1_shapes_stay_k1(make_backend, field, extra):
    pools = _pools()
    store = make_backend(_config(field=field, **extra), pools)
    assert store.geometry.pages_per_span == 1
    kv, indexer = pools[PoolName.KV], pools[PoolName.INDEXER]
    # One host page per key: the indexer's pool page is the host page too.
    slots = slots_of([4, 2], PAGE)
    P.fill_random_pages(kv, [4 * PAGE, 2 * PAGE], seed=3)
    P.fill_random_pages(indexer, [4 * PAGE, 2 * PAGE], seed=4)
    assert store.batch_set_v1(["x", "y"], slots) == [True, True]
    assert store.geometry.pages_per_span == 1
    assert store.batch_get_v1(["x", "y"], slots) == [True, True]


def test_a_build_that_names_no_page_is_told_by_its_first_transfer(make_backend):
    pools = _pools()
    store = make_backend(_config(), pools)  # no field, no extra-config
    assert store.geometry.pages_per_span == 1  # provisional
    # The indexer's backup (batch_set_v2, before the KV call) carries 256 slots a key.
    assert _round_trip(store, pools, [8, 1, 6, 3], ["d"]) == [True]
    assert store.geometry.pages_per_span == K
    assert f"h{PAGE}x{K}" in store.key_schema.prefix


def test_assignment_after_the_first_data_call_is_refused(make_backend, caplog):
    caplog.set_level(logging.ERROR)
    pools = _pools()
    store = make_backend(_config(field=PAGE), pools)
    kv = pools[PoolName.KV]
    P.fill_random_pages(kv, [2 * PAGE], seed=7)
    stored = P.page_bytes(kv, 2 * PAGE)
    assert store.batch_set_v1(["k1"], slots_of([2], PAGE)) == [True]
    with pytest.raises(RegistrationError, match=r"after the first data call.*stays 64 tokens"):
        store.storage_page_size = SPAN
    (line,) = _errors(caplog)
    assert "storage_page_size=256" in line and "64 tokens" in line
    # Nothing changed: K=1 data reads back, in the same namespace.
    assert store.geometry.pages_per_span == 1 and store.storage_page_size == PAGE
    P.wipe_pages(kv, [2 * PAGE])
    assert store.batch_get_v1(["k1"], slots_of([2], PAGE)) == [True]
    assert P.page_bytes(kv, 2 * PAGE) == stored
    store.storage_page_size = PAGE  # the same value again is no change


def test_assignment_after_a_hit_query_is_refused(make_backend):
    store = make_backend(_config(field=PAGE), _pools())
    assert store.batch_exists(["nothing"]) == 0
    with pytest.raises(RegistrationError, match="after the first data call"):
        store.storage_page_size = SPAN
    assert store.geometry.pages_per_span == 1


@pytest.mark.parametrize("value", [100, -64, "256", 2.5, True])
def test_a_bad_assignment_is_refused_and_changes_nothing(make_backend, value):
    store = make_backend(_config(field=PAGE), _pools())
    with pytest.raises(RegistrationError, match="storage_page_size"):
        store.storage_page_size = value
    assert store.geometry.pages_per_span == 1


def test_a_transfer_that_contradicts_the_page_is_a_miss_logged_once(make_backend, caplog):
    caplog.set_level(logging.ERROR, logger=LOGGER)
    pools = _pools()
    store = make_backend(_config(field=SPAN), pools)
    for _ in range(3):  # the controller hashes one host page per key: 64 slots a key
        assert store.batch_set_v1(["p", "q"], slots_of([0, 1], PAGE)) == [False, False]
    (line,) = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert "sent 64 host slots per key" in line and "storage page is 256 tokens" in line
    assert "K=4" in line and "HiCacheStorageConfig" in line
    assert store.batch_exists(["p"]) == 0  # nothing was stored


def test_derived_page_then_a_contradiction_is_a_miss(make_backend, caplog):
    caplog.set_level(logging.ERROR, logger=LOGGER)
    pools = _pools()
    store = make_backend(_config(), pools)
    assert _round_trip(store, pools, [0, 1, 2, 3], ["first"]) == [True]
    assert store.batch_set_v1(["later"], slots_of([5], PAGE)) == [False]
    assert store.geometry.pages_per_span == K
    assert any("first transfer" in r.getMessage() for r in caplog.records)
    # The page stays fixed once data moved.
    with pytest.raises(RegistrationError):
        store.storage_page_size = PAGE


def test_k1_and_k4_data_of_one_model_never_mix(make_backend):
    cluster = FakeCluster()
    pools = _pools()
    k1 = make_backend(_config(field=PAGE), pools, cluster=cluster)
    P.fill_random_pages(pools[PoolName.KV], [0], seed=1)
    assert k1.batch_set_v1(["same-key"], slots_of([0], PAGE)) == [True]
    k4, _ = _fork_startup(make_backend, cluster=cluster)
    assert k4.key_schema.prefix != k1.key_schema.prefix
    assert k4.batch_exists(["same-key"]) == 0
    assert k4.batch_get_v1(["same-key"], slots_of([0, 1, 2, 3], PAGE)) == [False]


@pytest.mark.parametrize("seals", [False, True], ids=["plain", "sealed"])
def test_layout_guard_follows_the_assigned_page(make_backend, seals):
    """Two fork nodes of one namespace start together: each publishes or
    matches the host-page record at registration, then the assignment
    replaces it; whichever assigns first, both end on the 256-token record,
    and a node that really runs another geometry is still refused."""
    cluster = FakeCluster()
    sealed = {"span_object_checksums": seals}
    a = make_backend(_config(field=PAGE, **sealed), _pools(), cluster=cluster)
    b = make_backend(_config(field=PAGE, **sealed), _pools(), cluster=cluster)
    assert (a.layout_guard_result, b.layout_guard_result) == ("published", "matched")
    b.storage_page_size = SPAN
    a.storage_page_size = SPAN
    assert b.layout_guard_result == "published" and a.layout_guard_result == "matched"
    assert a.registration.geometry_record().storage_page_tokens == SPAN
    # A node that then runs another page is refused when its page is fixed
    # (its first data call: every call a miss), ...
    other = make_backend(_config(field=SPAN * 2, **sealed), _pools(), cluster=cluster)
    assert other.layout_guard_result == "deferred"
    assert other.batch_exists(["x"]) == 0
    with pytest.raises(LayoutConflictError, match="storage_page_tokens"):
        other.registration.begin_io()
    # ... and a node whose pool shapes differ, at start-up.
    three_layers = dict(P.build_compressed_hybrid_dsa(host_pages=16, layers=3).pools)
    with pytest.raises(LayoutConflictError, match="indexer|kv"):
        make_backend(_config(field=PAGE, **sealed), three_layers, cluster=cluster)


def test_assignment_before_registration_is_used_at_registration(make_backend):
    store = make_backend(_config(field=PAGE))
    store.storage_page_size = SPAN
    assert store.storage_page_size == SPAN
    pools = _pools()
    register_pools(store, pools)
    assert store.geometry.pages_per_span == K
    assert _round_trip(store, pools, [3, 2, 1, 0], ["z"]) == [True]


def test_a_restarted_fork_node_finds_the_span_record(make_backend):
    """A fork node starting after the span record exists registers at the host
    page first: the guard waits for the assignment instead of refusing it."""
    cluster = FakeCluster()
    first, pools = _fork_startup(make_backend, cluster=cluster)
    assert _round_trip(first, pools, [0, 1, 2, 3], ["kept"]) == [True]
    again = make_backend(_config(field=PAGE), _pools(), cluster=cluster)
    assert again.layout_guard_result == "deferred"
    again.storage_page_size = SPAN
    assert again.layout_guard_result == "matched"
    assert again.batch_exists(["kept"]) == 1
