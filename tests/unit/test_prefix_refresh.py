"""A chain's prefix in the existence query a backup or a hit query sends anyway
(``span_refresh_prefix``), and backups behind a hole in the chain
(``span_skip_unreachable``), on the contract-checked fake.

Mooncake leases every object an existence query finds and evicts the oldest
lease stamp first, so asking about the prefix right before the tail is put
leaves the prefix newer than the tail; the real master's order is checked in
tests/integration/test_eviction_order.py. Here: what is asked, in how many
calls, and what is written.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mooncake_span.errors import InvalidRequestError
from mooncake_span.sglang_backend.stored_pool import prefix_keys_of, prefix_objects
from mooncake_span.store.router import STORED, UNREACHABLE
from mooncake_span_tools.testing import controller as sg
from mooncake_span_tools.testing import pools as P
from mooncake_span_tools.testing.fake_store import FakeCluster, FakeStore
from tests.span_helpers import FAKE_CLIENT, slots_of

PAGE = 64


class AskedStore(FakeStore):
    """A fake that keeps the keys of every existence query."""

    asked: list[list[str]] = []

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        AskedStore.asked.append(list(keys))
        return super().batch_is_exist(keys)


@pytest.fixture
def rig(make_backend):
    """``make(pools, **extra)``: a backend on DSA (KV + indexer) or MLA host pools,
    K=1, on one fake cluster; the keys each existence query asked."""
    cluster = FakeCluster()
    AskedStore.asked = []

    def make(dsa: bool = True, **extra):
        if dsa:
            pools = P.build_dsa_pools("page_first", layers=1, host_pages=16)
            host = {P.PoolName.KV: pools.kv, P.PoolName.INDEXER: pools.indexer}
        else:
            host = {P.PoolName.KV: P.build_mla_host("page_first", layers=1, host_pages=16)}
        config = {**FAKE_CLIENT, "span_layout_guard": "off", **extra}
        return make_backend(config, host, cluster=cluster, native=AskedStore)

    return make, cluster


def _info(prefix):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    return HiCacheStorageExtraInfo(prefix_keys=prefix)


def _backup(store, keys, first_page, prefix):
    """sglang's order: the indexer (v2), then KV (v1); per key, both stored?"""
    slots = slots_of(list(range(first_page, first_page + len(keys))), PAGE)
    side = store.batch_set_v2([sg.indexer(keys, slots)], _info(prefix))
    kv = store.batch_set_v1(keys, slots, _info(prefix))
    return [a and b for a, b in zip(kv, next(iter(side.values())), strict=True)]


def _objects(store, pool, keys):
    return store.pools[pool].object_keys(store.key_schema, keys)


def test_prefix_keys_are_validated_and_named():
    assert prefix_keys_of(None) == []
    assert prefix_keys_of(SimpleNamespace(prefix_keys=None)) == []
    assert prefix_keys_of(SimpleNamespace(prefix_keys=["a", "b"])) == ["a", "b"]
    with pytest.raises(InvalidRequestError, match=r"extra_info.prefix_keys: key #1"):
        prefix_keys_of(SimpleNamespace(prefix_keys=["a", ""]))


def test_a_backup_asks_once_about_both_pools_and_its_prefix(rig):
    make, _ = rig
    store = make()
    assert _backup(store, ["a", "b"], 0, []) == [True, True]
    AskedStore.asked.clear()
    assert _backup(store, ["c", "d"], 2, ["a", "b"]) == [True, True]
    # One query for the whole backup: the sidecar call asks for the KV call too.
    (asked,) = AskedStore.asked
    idx, kv = (lambda keys: _objects(store, "indexer", keys)), (lambda k: _objects(store, "kv", k))
    assert asked == idx(["c", "d"]) + kv(["c", "d"]) + idx(["a", "b"]) + kv(["a", "b"])


def test_a_kv_call_asks_itself_unless_its_sidecar_call_just_asked_for_the_same_keys(rig):
    make, _ = rig
    store = make()
    slots = slots_of([0, 1], PAGE)
    store.batch_set_v2([sg.indexer(["a", "b"], slots)], _info([]))
    AskedStore.asked.clear()
    assert store.batch_set_v1(["a"], slots_of([0], PAGE), _info([])) == [True]
    assert AskedStore.asked == [_objects(store, "kv", ["a"])]  # other keys: asked
    assert store.batch_set_v1(["b"], slots_of([1], PAGE), _info([])) == [True]
    assert len(AskedStore.asked) == 2  # the kept answer was used up by the first call


def test_a_kept_answer_is_used_once_by_its_thread_while_fresh():
    import threading

    from mooncake_span.sglang_backend.writes import FRESH_S, KvAhead, StoredAnswer

    now = [100.0]
    ahead = KvAhead(clock=lambda: now[0])
    ahead.keep(["x", "y"], StoredAnswer([False, True], True))
    elsewhere = []
    thread = threading.Thread(target=lambda: elsewhere.append(ahead.take(["x", "y"])))
    thread.start()
    thread.join()
    assert elsewhere == [None]
    kept = ahead.take(["x", "y"])
    assert (kept.stored, kept.prefix_head_stored) == ([False, True], True)
    assert ahead.take(["x", "y"]) is None
    ahead.keep(["x"], StoredAnswer([False], False))
    now[0] += FRESH_S + 0.01
    assert ahead.take(["x"]) is None


def test_without_refresh_only_the_calls_keys_are_asked(rig):
    make, _ = rig
    store = make(span_refresh_prefix=False)
    assert _backup(store, ["a"], 0, []) == [True]
    AskedStore.asked.clear()
    assert _backup(store, ["b"], 1, ["a"]) == [True]
    assert AskedStore.asked == [_objects(store, "indexer", ["b"]) + _objects(store, "kv", ["b"])]


def test_a_backup_behind_a_hole_writes_nothing_and_stored_keys_read_true(rig):
    make, cluster = rig
    store = make()
    assert _backup(store, ["a", "b", "c"], 0, []) == [True] * 3
    assert _backup(store, ["d"], 3, ["a", "b", "c"]) == [True]
    # Evicted from the middle (a key's objects go together: one eviction group).
    assert all(
        cluster.drop(o) for o in _objects(store, "kv", ["b"]) + _objects(store, "indexer", ["b"])
    )
    cluster.calls.clear()
    # "d" is stored already, "e" is new: the chain cannot reach either any more.
    assert _backup(store, ["d", "e"], 3, ["a", "b", "c"]) == [True, False]
    assert [op for op, _ in cluster.calls] == ["batch_is_exist"]
    skipped = store.client.stats()["skipped_backups"]
    assert skipped[UNREACHABLE] == 2  # e's indexer and KV objects
    assert skipped[STORED] >= 2


def test_with_skip_off_a_backup_behind_a_hole_is_written(rig):
    make, cluster = rig
    store = make(span_skip_unreachable=False)
    assert _backup(store, ["a", "b"], 0, []) == [True, True]
    assert cluster.drop(_objects(store, "kv", ["a"])[0])
    assert _backup(store, ["c"], 2, ["a", "b"]) == [True]
    assert UNREACHABLE not in store.client.stats()["skipped_backups"]


def test_a_hit_query_renews_its_prefix_in_its_first_round_without_an_extra_call(rig):
    make, _ = rig
    store = make(dsa=False)
    keys = [f"k{i}" for i in range(6)]
    assert store.batch_set_v1(keys, slots_of(list(range(6)), PAGE), _info([])) == [True] * 6
    AskedStore.asked.clear()
    assert store.batch_exists(keys[3:], _info(keys[:3])) == 3
    with_prefix = list(AskedStore.asked)
    AskedStore.asked.clear()
    assert store.batch_exists(keys[3:], _info(None)) == 3
    assert len(with_prefix) == len(AskedStore.asked)  # the same number of RPCs
    assert with_prefix[0] == _objects(store, "kv", keys[3:4]) + _objects(store, "kv", keys[:3])
    assert with_prefix[1:] == AskedStore.asked[1:]


def test_bad_prefix_keys_refuse_the_call_and_write_nothing(rig):
    make, cluster = rig
    store = make(dsa=False)
    cluster.calls.clear()
    assert store.batch_set_v1(["a"], slots_of([0], PAGE), _info(["ok", 7])) == [False]
    assert cluster.calls == []


def test_prefix_objects_interleave_pools_key_by_key():
    schema = SimpleNamespace()
    kv = SimpleNamespace(num_components=1, object_keys=lambda s, keys: [f"kv-{k}" for k in keys])
    two = SimpleNamespace(
        num_components=2, object_keys=lambda s, keys: [f"{k}-{c}" for k in keys for c in "xy"]
    )
    batches = [
        SimpleNamespace(pool=kv, prefix_keys=["a", "b"]),
        SimpleNamespace(pool=two, prefix_keys=["a", "b"]),
        SimpleNamespace(pool=kv, prefix_keys=[]),
    ]
    assert prefix_objects(batches, schema) == ["kv-a", "a-x", "a-y", "kv-b", "b-x", "b-y"]
    assert prefix_objects(batches[:1], schema) == ["kv-a", "kv-b"]
    assert prefix_objects([], schema) == []


# ---- chain records (span/chains.py, sglang_backend/writes.py) ---------------------


def test_chain_record_keys_round_trip_and_refuse_other_keys():
    from mooncake_span.span.chains import chain_record_key, parse_chain_record_key

    key = chain_record_key("ms2_m_h64x1_pf_bf16", "ab_cd", 12)
    assert key == "ms2_m_h64x1_pf_bf16__chain_ab_cd_12"
    assert parse_chain_record_key(key) == ("ms2_m_h64x1_pf_bf16", "ab_cd", 12)
    for other in (
        "ms2_m_h64x1_pf_bf16_abcd_0_kv",
        "ms2_m__geometry",
        "__chain_a_1",
        "x__chain_a_b",
    ):
        assert parse_chain_record_key(other) is None
    with pytest.raises(ValueError):
        chain_record_key("p", "root", 0)


def test_a_fixed_share_of_roots_is_sampled_alike_everywhere():
    from mooncake_span.span.chains import chain_sampled

    roots = [f"{i:064x}" for i in range(4000)]
    picked = [r for r in roots if chain_sampled(r, 8)]
    assert 400 <= len(picked) <= 600
    assert picked == [r for r in roots if chain_sampled(r, 8)]
    assert all(chain_sampled(r, 1) for r in roots[:10])
    assert not any(chain_sampled(r, 0) for r in roots[:10])


def test_the_reachable_estimate_counts_stored_keys_before_the_first_hole():
    from mooncake_span.span.chains import reachable_estimate

    chains = [["a", "b", "c", "d"], ["e", "f"], ["g"]]
    estimate = reachable_estimate(chains, {"a", "b", "d", "f"})
    assert (
        estimate["chains_sampled"],
        estimate["stored_keys"],
        estimate["reachable_keys"],
    ) == (3, 4, 2)
    assert estimate["share"] == 0.5
    assert reachable_estimate([], set())["share"] is None


def test_sampled_chains_keep_a_record_of_their_keys(rig):
    from mooncake_span.span.chains import chain_record_key, record_keys

    make, cluster = rig
    store = make(dsa=False, span_chain_sample_every=1)
    prefix = store.key_schema.prefix
    slots = slots_of([0, 1], PAGE)
    assert store.batch_set_v1(["a", "b"], slots, _info([])) == [True, True]
    assert store.batch_set_v1(["c"], slots_of([2], PAGE), _info(["a", "b"])) == [True]
    assert store.batch_set_v1(["x"], slots_of([3], PAGE), None) == [True]  # no chain named
    records = sorted(k for k in cluster.objects if "__chain_" in k)
    assert records == [chain_record_key(prefix, "a", 2), chain_record_key(prefix, "a", 3)]
    text = bytes(cluster.objects[records[1]]).decode()
    assert record_keys(text) == ["a", "b", "c"]


def test_no_records_unless_sampled_and_stored(rig):
    make, cluster = rig
    store = make(dsa=False, span_chain_sample_every=0)
    assert store.batch_set_v1(["a"], slots_of([0], PAGE), _info([])) == [True]
    sampled = make(dsa=False, span_chain_sample_every=1, span_refresh_prefix=False)
    assert sampled.batch_set_v1(["b"], slots_of([1], PAGE), _info(["a"])) == [True]
    assert not [k for k in cluster.objects if "__chain_" in k]
