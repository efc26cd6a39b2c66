"""The backend's per-call fast paths, on the contract-checked fake store.

Group ids are sent only when a key owns more than one object (an MHA key is
one ``kv`` object, so it sends none); a put whose
objects are partly stored writes only the missing ones; the bytes round-trip
either way. Plans themselves are checked against naive references in
``test_plan.py``.
"""

from __future__ import annotations

import pytest
import torch

from mooncake_span_tools.testing import pools as P
from mooncake_span_tools.testing.fake_store import FakeCluster
from tests.span_helpers import FAKE_CLIENT, slots_of

PAGE = 64
SPAN = 4 * PAGE
CLIENT = {
    **FAKE_CLIENT,
    "storage_page_size": SPAN,
    "span_layout_guard": "off",  # no geometry record among the objects counted here
}


def _kv_keys(cluster: FakeCluster) -> list[str]:
    return sorted(k for k in cluster.objects if k.endswith("_k"))


def test_mla_only_keys_are_one_object_and_carry_no_group_ids(make_backend):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    cluster = FakeCluster()
    kv = P.build_mla_host("page_first", layers=2, host_pages=16)
    store = make_backend(CLIENT, {PoolName.KV: kv}, cluster=cluster)
    pages = [7, 2, 9, 4, 0, 13, 11, 5]
    P.fill_random_pages(kv, [p * PAGE for p in pages], seed=3)
    expected = [P.page_bytes(kv, p * PAGE) for p in pages]
    assert store.batch_set_v1(["a", "b"], slots_of(pages, PAGE)) == [True, True]
    assert len(cluster.objects) == 2
    assert cluster.groups == {}
    P.wipe_pages(kv, [p * PAGE for p in pages])
    assert store.batch_get_v1(["a", "b"], slots_of(pages, PAGE)) == [True, True]
    assert [P.page_bytes(kv, p * PAGE) for p in pages] == expected


def test_group_ids_tie_a_keys_objects_across_pools(make_backend):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    cluster = FakeCluster()
    pools = P.build_compressed_hybrid_dsa("page_first", host_pages=16, mamba_slots=4)
    store = make_backend(CLIENT, pools.pools, cluster=cluster)
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


def test_group_ids_can_be_switched_off(make_backend):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    cluster = FakeCluster()
    pools = P.build_compressed_hybrid_dsa("page_first", host_pages=16, mamba_slots=4)
    store = make_backend({**CLIENT, "span_group_ids": False}, pools.pools, cluster=cluster)
    slots = slots_of([0, 1, 2, 3], PAGE)
    indexer = PoolTransfer(
        PoolName.INDEXER, host_indices=slots, keys=["m"], indices_from_pool=PoolName.KV
    )
    assert store.batch_set_v2([indexer])[PoolName.INDEXER] == [True]
    assert store.batch_set_v1(["m"], slots) == [True]
    assert len(cluster.objects) == 2  # KV and indexer
    assert cluster.groups == {}


def _raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def _mha_object(host, pages: list[int]) -> bytes:
    """The ms2 MHA object, typed out from docs/span-format.md: every k slot of the
    layout (one per layer for layer_first, one per page otherwise) over the K
    pages in token order, then the same for v."""
    buf, t = host.kv_buffer, host.page_size
    if host.layout == "layer_first":
        layers = range(host.layer_num)
        return b"".join(
            _raw(buf[c, n, p * t : (p + 1) * t]) for c in (0, 1) for n in layers for p in pages
        )
    if host.layout == "page_first":
        return b"".join(_raw(buf[c, p * t : (p + 1) * t]) for c in (0, 1) for p in pages)
    return b"".join(_raw(buf[c, p]) for c in (0, 1) for p in pages)  # page_first_direct


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "layer_first"])
def test_mha_keys_are_one_object_without_group_ids(make_backend, layout):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    cluster = FakeCluster()
    kv = P.build_mha_host(layout, layers=3, host_pages=12)
    store = make_backend(CLIENT, {PoolName.KV: kv}, cluster=cluster, is_mla=False)
    pages = [9, 2, 3, 4, 11, 0, 7, 6]
    P.fill_random_pages(kv, [p * PAGE for p in pages], seed=4)
    assert store.batch_set_v1(["m0", "m1"], slots_of(pages, PAGE)) == [True, True]
    prefix = store.key_schema.prefix
    assert sorted(cluster.objects) == [f"{prefix}_m0_0_kv", f"{prefix}_m1_0_kv"]
    assert cluster.groups == {}
    assert cluster.objects[f"{prefix}_m0_0_kv"] == _mha_object(kv, pages[:4])
    assert cluster.objects[f"{prefix}_m1_0_kv"] == _mha_object(kv, pages[4:])
    # A hit query probes one object per key (KV in chunks: the first key, then the rest).
    cluster.calls.clear()
    hit = store.batch_exists_v2(["m0", "m1", "m2"], [])
    assert hit.kv_hit_pages == 2
    assert cluster.calls == [("batch_is_exist", 1), ("batch_is_exist", 2)]
    # The generic flat-tensor path reads and writes the same objects.
    flats = store.batch_get(["m0", "m1"])
    for flat, part in zip(flats, (pages[:4], pages[4:]), strict=True):
        assert _raw(flat) == b"".join(P.page_bytes(kv, p * PAGE) for p in part)
    assert store.batch_set(["g0", "g1"], flats)
    assert cluster.objects[f"{prefix}_g0_0_kv"] == cluster.objects[f"{prefix}_m0_0_kv"]
    P.wipe_pages(kv, [p * PAGE for p in pages])
    assert store.batch_get_v1(["g0", "g1"], slots_of(pages, PAGE)) == [True, True]
    restored = [_mha_object(kv, pages[:4]), _mha_object(kv, pages[4:])]
    assert restored == [cluster.objects[f"{prefix}_{k}_0_kv"] for k in ("m0", "m1")]


def test_old_format_objects_read_as_misses(make_backend):
    """ms1 wrote an MHA key as ``_k`` + ``_v`` objects under an ms1 prefix; the
    ms2 backend must find nothing there and leave the host pages as they were."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    cluster = FakeCluster()
    kv = P.build_mha_host("page_first", layers=2, host_pages=8)
    store = make_backend(CLIENT, {PoolName.KV: kv}, cluster=cluster, is_mla=False)
    pages = [0, 1, 2, 3]
    P.fill_random_pages(kv, [p * PAGE for p in pages], seed=6)
    whole = _mha_object(kv, pages)
    old = store.key_schema.prefix.replace("ms2_", "ms1_", 1) + "_old"
    cluster.objects[old + "_0_k"] = whole[: len(whole) // 2]
    cluster.objects[old + "_0_v"] = whole[len(whole) // 2 :]
    P.wipe_pages(kv, [p * PAGE for p in pages])
    assert store.batch_exists(["old"]) == 0
    assert store.batch_exists_v2(["old"], []).kv_hit_pages == 0
    assert store.batch_get_v1(["old"], slots_of(pages, PAGE)) == [False]
    assert store.batch_get(["old"]) == [None]
    assert _mha_object(kv, pages) == bytes(len(whole))
    # A put under the new format writes its own object next to the old ones.
    assert store.batch_set_v1(["old"], slots_of(pages, PAGE)) == [True]
    assert {old + "_0_k", old + "_0_v"} < set(cluster.objects)
    assert f"{store.key_schema.prefix}_old_0_kv" in cluster.objects


def test_partly_stored_put_writes_only_the_missing_objects(make_backend):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    cluster = FakeCluster()
    kv = P.build_mha_host("page_first", layers=2, host_pages=16)
    store = make_backend(CLIENT, {PoolName.KV: kv}, cluster=cluster, is_mla=False)
    pages = list(range(12))
    P.fill_random_pages(kv, [p * PAGE for p in pages], seed=8)
    expected = [P.page_bytes(kv, p * PAGE) for p in pages]
    keys = ["p0", "p1", "p2"]
    assert store.batch_set_v1(keys, slots_of(pages, PAGE)) == [True] * 3
    # Eviction took the middle key: only that object is rewritten.
    (lost,) = [k for k in cluster.objects if "_p1_" in k]
    assert cluster.drop(lost)
    cluster.calls.clear()
    assert store.batch_set_v1(keys, slots_of(pages, PAGE)) == [True] * 3
    puts = [n for op, n in cluster.calls if op == "batch_put_from_multi_buffers"]
    assert puts == [2] and lost in cluster.objects  # one call: the k run and the v run
    P.wipe_pages(kv, [p * PAGE for p in pages])
    assert store.batch_get_v1(keys, slots_of(pages, PAGE)) == [True] * 3
    assert [P.page_bytes(kv, p * PAGE) for p in pages] == expected


def test_int32_host_indices_plan_the_same_pages(make_backend):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    cluster = FakeCluster()
    kv = P.build_mla_host("page_first", layers=1, host_pages=8)
    store = make_backend(CLIENT, {PoolName.KV: kv}, cluster=cluster)
    P.fill_random_pages(kv, [p * PAGE for p in (6, 1, 3, 2)], seed=5)
    slots = slots_of([6, 1, 3, 2], PAGE).to(torch.int32)
    assert store.batch_set_v1(["i32"], slots) == [True]
    (key,) = _kv_keys(cluster)
    expected = b"".join(P.page_bytes(kv, p * PAGE) for p in (6, 1, 3, 2))
    assert cluster.objects[key] == expected
