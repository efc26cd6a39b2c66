"""The backend's per-call fast paths, on the contract-checked fake store.

Group ids are sent only when a key owns more than one object; a put whose
objects are partly stored writes only the missing ones; the bytes round-trip
either way. Plans themselves are checked against naive references in
``test_plan.py``.
"""

from __future__ import annotations

import pytest
import torch

from mooncake_span.bench import pools as P
from mooncake_span.store.client import NativeBinding
from mooncake_span.store.fake import FakeCluster, FakeReplicateConfig, FakeStore
from tests.span_helpers import make_storage_config, slots_of

PAGE = 64
SPAN = 4 * PAGE
CLIENT = {
    "master_server_address": "127.0.0.1:1",
    "metadata_server": "P2PHANDSHAKE",
    "protocol": "tcp",
    "storage_page_size": SPAN,
    "span_layout_guard": "off",  # no geometry record among the objects counted here
}


@pytest.fixture
def make_store(monkeypatch):
    from mooncake_span.sglang_backend import MooncakeSpanStore

    monkeypatch.setattr("mooncake_span.store.client._probe_tcp", lambda *a: None)
    stores = []

    def make(pools: dict, cluster: FakeCluster, is_mla: bool = True, **extra):
        from sglang.srt.mem_cache.hicache_storage import PoolName

        store = MooncakeSpanStore(
            make_storage_config({**CLIENT, **extra}, is_mla=is_mla),
            {},
            binding=NativeBinding(lambda: FakeStore(cluster), FakeReplicateConfig),
        )
        store.register_mem_pool_host(pools[PoolName.KV])
        for name, pool in pools.items():
            store.register_mem_host_pool_v2(pool, name)
        store.on_host_pools_registered()
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def _kv_keys(cluster: FakeCluster) -> list[str]:
    return sorted(k for k in cluster.objects if k.endswith("_k"))


def test_mla_only_keys_are_one_object_and_carry_no_group_ids(make_store):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    cluster = FakeCluster()
    kv = P.build_mla_host("page_first", layers=2, host_pages=16)
    store = make_store({PoolName.KV: kv}, cluster)
    pages = [7, 2, 9, 4, 0, 13, 11, 5]
    P.fill_random_pages(kv, [p * PAGE for p in pages], seed=3)
    expected = [P.page_bytes(kv, p * PAGE) for p in pages]
    assert store.batch_set_v1(["a", "b"], slots_of(pages, PAGE)) == [True, True]
    assert len(cluster.objects) == 2
    assert cluster.groups == {}
    P.wipe_pages(kv, [p * PAGE for p in pages])
    assert store.batch_get_v1(["a", "b"], slots_of(pages, PAGE)) == [True, True]
    assert [P.page_bytes(kv, p * PAGE) for p in pages] == expected


def test_group_ids_tie_a_keys_objects_across_pools(make_store):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    cluster = FakeCluster()
    pools = P.build_compressed_hybrid_dsa("page_first", host_pages=16, mamba_slots=4)
    store = make_store(dict(pools.pools), cluster)
    slots = slots_of([1, 3, 5, 7, 8, 10, 12, 14], PAGE)
    indexer = PoolTransfer(
        PoolName.INDEXER, host_indices=slots, keys=["x", "y"], indices_from_pool=PoolName.KV
    )
    assert store.batch_set_v2([indexer])[PoolName.INDEXER] == [True, True]
    assert store.batch_set_v1(["x", "y"], slots) == [True, True]
    assert len(cluster.objects) == 4
    schema = store.key_schema
    for key in cluster.objects:
        page_key = "x" if "_x_" in key else "y"
        assert cluster.groups[key] == schema.group_id(page_key)


def test_group_ids_can_be_switched_off(make_store):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    cluster = FakeCluster()
    kv = P.build_mha_host("page_first", layers=2, host_pages=8)
    store = make_store({PoolName.KV: kv}, cluster, is_mla=False, span_group_ids=False)
    assert store.batch_set_v1(["m"], slots_of([0, 1, 2, 3], PAGE)) == [True]
    assert len(cluster.objects) == 2  # k and v
    assert cluster.groups == {}


def test_mha_keys_are_two_objects_with_one_group(make_store):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    cluster = FakeCluster()
    kv = P.build_mha_host("page_first", layers=2, host_pages=8)
    store = make_store({PoolName.KV: kv}, cluster, is_mla=False)
    assert store.batch_set_v1(["m"], slots_of([4, 5, 6, 7], PAGE)) == [True]
    assert sorted(cluster.groups.values()) == [store.key_schema.group_id("m")] * 2


def test_partly_stored_put_writes_only_the_missing_objects(make_store):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    cluster = FakeCluster()
    kv = P.build_mha_host("page_first", layers=2, host_pages=16)
    store = make_store({PoolName.KV: kv}, cluster, is_mla=False)
    pages = list(range(12))
    P.fill_random_pages(kv, [p * PAGE for p in pages], seed=8)
    expected = [P.page_bytes(kv, p * PAGE) for p in pages]
    keys = ["p0", "p1", "p2"]
    assert store.batch_set_v1(keys, slots_of(pages, PAGE)) == [True] * 3
    # Eviction took one component of the middle key: only that object is rewritten.
    lost = next(k for k in cluster.objects if "_p1_" in k and k.endswith("_v"))
    assert cluster.drop(lost)
    cluster.calls.clear()
    assert store.batch_set_v1(keys, slots_of(pages, PAGE)) == [True] * 3
    puts = [n for op, n in cluster.calls if op == "batch_put_from_multi_buffers"]
    assert len(puts) == 1 and lost in cluster.objects
    assert cluster.groups[lost] == store.key_schema.group_id("p1")
    P.wipe_pages(kv, [p * PAGE for p in pages])
    assert store.batch_get_v1(keys, slots_of(pages, PAGE)) == [True] * 3
    assert [P.page_bytes(kv, p * PAGE) for p in pages] == expected


def test_int32_host_indices_plan_the_same_pages(make_store):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    cluster = FakeCluster()
    kv = P.build_mla_host("page_first", layers=1, host_pages=8)
    store = make_store({PoolName.KV: kv}, cluster)
    P.fill_random_pages(kv, [p * PAGE for p in (6, 1, 3, 2)], seed=5)
    slots = slots_of([6, 1, 3, 2], PAGE).to(torch.int32)
    assert store.batch_set_v1(["i32"], slots) == [True]
    (key,) = _kv_keys(cluster)
    expected = b"".join(P.page_bytes(kv, p * PAGE) for p in (6, 1, 3, 2))
    assert cluster.objects[key] == expected
