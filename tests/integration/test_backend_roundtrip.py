"""MooncakeSpanStore on a real master + storage node with real sglang host pools.

Every test writes random bytes, wipes the host pages, restores through the
backend and compares every byte. Pages are scattered and out of order in host
memory, so a plan that assumed contiguity or sorted slots would fail.
"""

from __future__ import annotations

import pytest
import torch

from mooncake_span_tools.testing import pools as P
from tests.span_helpers import scattered_pages, slots_of

pytestmark = pytest.mark.integration

PAGE = 64


def _pool_names():
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    return PoolName, PoolTransfer, PoolHitPolicy


def _snapshot(pool, starts):
    return {s: P.page_bytes(pool, s) for s in starts}


def _assert_restored(pool, snapshot):
    bad = [s for s, expected in snapshot.items() if P.page_bytes(pool, s) != expected]
    assert not bad, f"{type(pool).__name__}: pages at slots {bad} differ after restore"


@pytest.mark.parametrize("pages_per_span", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "layer_first"])
def test_mla_kv_round_trip(span_store_factory, layout, pages_per_span):
    PoolName, _, _ = _pool_names()
    kv = P.build_mla_host(layout, layers=3, host_pages=4 * pages_per_span + 3)
    store = span_store_factory({PoolName.KV: kv}, storage_page_size=PAGE * pages_per_span)
    keys = [f"k{i}" for i in range(3)]
    pages = scattered_pages(4 * pages_per_span + 3, 3 * pages_per_span, seed=pages_per_span)
    starts = [p * PAGE for p in pages]
    P.fill_random_pages(kv, starts, seed=7)
    expected = _snapshot(kv, starts)
    slots = slots_of(pages, PAGE)

    assert store.batch_set_v1(keys, slots) == [True] * 3
    P.wipe_pages(kv, starts)
    assert store.batch_exists(keys + ["absent"]) == 3
    assert store.batch_get_v1(keys, slots) == [True] * 3
    _assert_restored(kv, expected)


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
def test_mha_kv_round_trip_k4(span_store_factory, layout):
    PoolName, _, _ = _pool_names()
    kv = P.build_mha_host(layout, layers=2, host_pages=12)
    store = span_store_factory({PoolName.KV: kv}, storage_page_size=4 * PAGE, is_mla=False)
    pages = scattered_pages(12, 8, seed=3)
    starts = [p * PAGE for p in pages]
    P.fill_random_pages(kv, starts, seed=11)
    expected = _snapshot(kv, starts)
    slots = slots_of(pages, PAGE)
    assert store.batch_set_v1(["a", "b"], slots) == [True, True]
    P.wipe_pages(kv, starts)
    assert store.batch_get_v1(["a", "b"], slots) == [True, True]
    _assert_restored(kv, expected)


def test_old_key_format_objects_read_as_misses(span_store_factory):
    """Objects an ms1 backend wrote for an MHA key (``_k`` and ``_v`` under an ms1
    prefix, with the real bytes) are invisible to this format: misses, host pages
    untouched, the old objects left alone."""
    import numpy as np

    from mooncake_span.span.plan import ObjectPlan, plan_batch

    PoolName, _, _ = _pool_names()
    kv = P.build_mha_host("page_first", layers=2, host_pages=12)
    store = span_store_factory({PoolName.KV: kv}, storage_page_size=4 * PAGE, is_mla=False)
    pages = scattered_pages(12, 4, seed=5)
    starts = [p * PAGE for p in pages]
    P.fill_random_pages(kv, starts, seed=13)
    (row,) = plan_batch(store.pools["kv"].layout, np.asarray([pages])).plans()
    half = len(row.ptrs) // 2  # the kv object: k buffers, then v buffers
    old = store.key_schema.prefix.replace("ms2_", "ms1_", 1) + "_old_0_"
    old_keys = [old + "k", old + "v"]
    halves = [
        ObjectPlan(row.ptrs[:half], row.sizes[:half]),
        ObjectPlan(row.ptrs[half:], row.sizes[half:]),
    ]
    assert store.client.put(old_keys, halves) == [True, True]
    P.wipe_pages(kv, starts)
    wiped = _snapshot(kv, starts)
    slots = slots_of(pages, PAGE)
    assert store.batch_exists(["old"]) == 0
    assert store.batch_get_v1(["old"], slots) == [False]
    _assert_restored(kv, wiped)
    assert store.client.exists(old_keys) == [True, True]


def test_restore_into_different_host_pages(span_store_factory):
    """The object holds token order, not host placement: a reader with other
    host pages gets the same bytes in its own slots."""
    PoolName, _, _ = _pool_names()
    kv = P.build_mla_host("page_first", layers=2, host_pages=16)
    store = span_store_factory({PoolName.KV: kv}, storage_page_size=4 * PAGE)
    src = [3, 9, 1, 14]
    dst = [7, 0, 12, 5]
    P.fill_random_pages(kv, [p * PAGE for p in src], seed=5)
    expected = [P.page_bytes(kv, p * PAGE) for p in src]
    assert store.batch_set_v1(["x"], slots_of(src, PAGE)) == [True]
    assert store.batch_get_v1(["x"], slots_of(dst, PAGE)) == [True]
    assert [P.page_bytes(kv, p * PAGE) for p in dst] == expected


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "layer_first"])
def test_compressed_hybrid_dsa_mixed_batch(span_store_factory, layout):
    """MLA KV + DSA indexer + Mamba, K=4, backed up and restored as sglang does."""
    PoolName, PoolTransfer, PoolHitPolicy = _pool_names()
    pool_set = P.build_compressed_hybrid_dsa(layout, host_pages=16, mamba_slots=6)
    kv, indexer, mamba = (pool_set[n] for n in (PoolName.KV, PoolName.INDEXER, PoolName.MAMBA))
    store = span_store_factory(dict(pool_set.pools), storage_page_size=pool_set.storage_page_tokens)
    keys = ["h0", "h1", "h2"]
    pages = scattered_pages(16, 12, seed=21)
    starts = [p * PAGE for p in pages]
    slots = slots_of(pages, PAGE)
    P.fill_random_pages(kv, starts, seed=1)
    P.fill_random_pages(indexer, starts, seed=2)
    P.fill_random_pages(mamba, [4], seed=3)
    kv_ref, idx_ref, mamba_ref = (
        _snapshot(kv, starts),
        _snapshot(indexer, starts),
        P.page_bytes(mamba, 4),
    )

    sidecars = store.batch_set_v2(
        [
            PoolTransfer(
                PoolName.INDEXER, host_indices=slots, keys=keys, indices_from_pool=PoolName.KV
            ),
            PoolTransfer(
                PoolName.MAMBA,
                host_indices=torch.tensor([4]),
                keys=[keys[-1]],
                hit_policy=PoolHitPolicy.TRAILING_PAGES,
            ),
        ]
    )
    assert sidecars == {PoolName.INDEXER: [True] * 3, PoolName.MAMBA: [True]}
    assert store.batch_set_v1(keys, slots) == [True] * 3
    P.wipe_pages(kv, starts)
    P.wipe_pages(indexer, starts)
    P.wipe_pages(mamba, [4, 2])

    hit = store.batch_exists_v2(
        keys,
        [
            PoolTransfer(PoolName.INDEXER, keys=None, indices_from_pool=PoolName.KV),
            PoolTransfer(
                PoolName.MAMBA, keys=["__placeholder__"], hit_policy=PoolHitPolicy.TRAILING_PAGES
            ),
        ],
    )
    # Mamba has one checkpoint, at the last key: only the full prefix is restorable.
    assert hit.kv_hit_pages == 3
    assert hit.restorable_prefix_pages == [3]
    assert hit.extra_pool_hit_pages[PoolName.KV] == 3
    assert hit.extra_pool_hit_pages[PoolName.INDEXER] == 3

    assert store.batch_get_v1(keys, slots) == [True] * 3
    # prefetch rebuilds KV-derived transfers without indices_from_pool
    got = store.batch_get_v2([PoolTransfer(PoolName.INDEXER, host_indices=slots, keys=keys)])
    assert got == {PoolName.INDEXER: [True] * 3}
    got = store.batch_get_v2(
        [
            PoolTransfer(
                PoolName.MAMBA,
                host_indices=torch.tensor([2]),
                keys=[keys[-1]],
                hit_policy=PoolHitPolicy.TRAILING_PAGES,
            )
        ]
    )
    assert got == {PoolName.MAMBA: [True]}
    _assert_restored(kv, kv_ref)
    _assert_restored(indexer, idx_ref)
    assert P.page_bytes(mamba, 2) == mamba_ref


def test_mha_kv_swa_mamba(span_store_factory):
    """KV + SWA (MHA, k/v components) + Mamba (temporal + conv) with K=2."""
    PoolName, PoolTransfer, PoolHitPolicy = _pool_names()
    kv = P.build_mha_host("page_first", layers=2, host_pages=12)
    swa = P.build_swa_host("page_first", attention="mha", layers=2, host_pages=8)
    mamba = P.build_mamba_host(layers=2, slots=4)
    store = span_store_factory(
        {PoolName.KV: kv, PoolName.SWA: swa, PoolName.MAMBA: mamba},
        storage_page_size=2 * PAGE,
        is_mla=False,
    )
    keys = ["s0", "s1", "s2"]
    kv_pages = scattered_pages(12, 6, seed=4)
    swa_pages = [5, 2]  # window of 1 key = 2 host pages
    P.fill_random_pages(kv, [p * PAGE for p in kv_pages], seed=1)
    P.fill_random_pages(swa, [p * PAGE for p in swa_pages], seed=2)
    P.fill_random_pages(mamba, [1], seed=3)
    swa_ref = [P.page_bytes(swa, p * PAGE) for p in swa_pages]
    mamba_ref = P.page_bytes(mamba, 1)
    result = store.batch_set_v2(
        [
            PoolTransfer(
                PoolName.SWA,
                host_indices=slots_of(swa_pages, PAGE),
                keys=keys[-1:],
                hit_policy=PoolHitPolicy.TRAILING_PAGES,
            ),
            PoolTransfer(
                PoolName.MAMBA,
                host_indices=torch.tensor([1]),
                keys=keys[-1:],
                hit_policy=PoolHitPolicy.TRAILING_PAGES,
            ),
        ]
    )
    assert result == {PoolName.SWA: [True], PoolName.MAMBA: [True]}
    assert store.batch_set_v1(keys, slots_of(kv_pages, PAGE)) == [True] * 3
    hit = store.batch_exists_v2(
        keys,
        [
            PoolTransfer(
                PoolName.SWA, keys=["__placeholder__"], hit_policy=PoolHitPolicy.TRAILING_PAGES
            ),
            PoolTransfer(
                PoolName.MAMBA, keys=["__placeholder__"], hit_policy=PoolHitPolicy.TRAILING_PAGES
            ),
        ],
    )
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (3, [3])
    new_swa = [7, 0]
    got = store.batch_get_v2(
        [
            PoolTransfer(PoolName.SWA, host_indices=slots_of(new_swa, PAGE), keys=keys[-1:]),
            PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([3]), keys=keys[-1:]),
        ]
    )
    assert got == {PoolName.SWA: [True], PoolName.MAMBA: [True]}
    assert [P.page_bytes(swa, p * PAGE) for p in new_swa] == swa_ref
    assert P.page_bytes(mamba, 3) == mamba_ref


def test_trailing_holes_and_removed_component(span_store_factory):
    """Mamba checkpoints at keys 2 and 4 only -> restorable {2, 4}; removing one
    component object of key 3's indexer shrinks the indexer boundary to 2."""
    PoolName, PoolTransfer, PoolHitPolicy = _pool_names()
    pool_set = P.build_compressed_hybrid_dsa("page_first", host_pages=20, mamba_slots=6)
    kv, indexer, mamba = (pool_set[n] for n in (PoolName.KV, PoolName.INDEXER, PoolName.MAMBA))
    store = span_store_factory(dict(pool_set.pools), storage_page_size=4 * PAGE)
    keys = [f"t{i}" for i in range(5)]
    slots = slots_of(list(range(20)), PAGE)
    assert store.batch_set_v2(
        [
            PoolTransfer(
                PoolName.INDEXER, host_indices=slots, keys=keys, indices_from_pool=PoolName.KV
            )
        ]
    ) == {PoolName.INDEXER: [True] * 5}
    for key, slot in (("t1", 1), ("t3", 2)):
        assert store.batch_set_v2(
            [
                PoolTransfer(
                    PoolName.MAMBA,
                    host_indices=torch.tensor([slot]),
                    keys=[key],
                    hit_policy=PoolHitPolicy.TRAILING_PAGES,
                )
            ]
        ) == {PoolName.MAMBA: [True]}
    assert store.batch_set_v1(keys, slots) == [True] * 5
    queries = [
        PoolTransfer(PoolName.INDEXER, keys=None, indices_from_pool=PoolName.KV),
        PoolTransfer(
            PoolName.MAMBA, keys=["__placeholder__"], hit_policy=PoolHitPolicy.TRAILING_PAGES
        ),
    ]
    hit = store.batch_exists_v2(keys, queries)
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (4, [2, 4])
    assert hit.extra_pool_hit_pages[PoolName.MAMBA] == 4

    victim = store.key_schema.object_keys(["t2"], store.pools["indexer"].components)[0]
    assert store.client.remove([victim]) == 1
    hit = store.batch_exists_v2(keys, queries)
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (2, [2])
    assert hit.extra_pool_hit_pages[PoolName.INDEXER] == 2
    # a KV get of the same keys still works, the indexer read stops at the hole
    got = store.batch_get_v2([PoolTransfer(PoolName.INDEXER, host_indices=slots, keys=keys)])
    assert got == {PoolName.INDEXER: [True, True, False, False, False]}


def test_duplicate_keys_in_one_get(span_store_factory):
    PoolName, _, _ = _pool_names()
    kv = P.build_mla_host("page_first", layers=2, host_pages=8)
    store = span_store_factory({PoolName.KV: kv}, storage_page_size=2 * PAGE)
    P.fill_random_pages(kv, [0, PAGE], seed=9)
    expected = [P.page_bytes(kv, 0), P.page_bytes(kv, PAGE)]
    assert store.batch_set_v1(["d"], slots_of([0, 1], PAGE)) == [True]
    targets = [2, 3, 4, 5]
    assert store.batch_get_v1(["d", "d"], slots_of(targets, PAGE)) == [True, True]
    assert [P.page_bytes(kv, p * PAGE) for p in targets] == expected * 2


def test_batch_above_tcp_buffer_limit(span_store_factory):
    """64 keys x K=4 x 16 layers (layer_first, scattered) = 4096 buffers per call,
    twice the 2048 TCP per-peer queue; the storage node is another process."""
    PoolName, _, _ = _pool_names()
    kv = P.build_mla_host("layer_first", layers=16, host_pages=256, kv_lora_rank=16, rope_dim=16)
    store = span_store_factory({PoolName.KV: kv}, storage_page_size=4 * PAGE)
    pages = scattered_pages(256, 256, seed=2)
    starts = [p * PAGE for p in pages]
    P.fill_random_pages(kv, starts, seed=4)
    expected = _snapshot(kv, starts)
    keys = [f"big{i}" for i in range(64)]
    slots = slots_of(pages, PAGE)
    assert store.batch_set_v1(keys, slots) == [True] * 64
    P.wipe_pages(kv, starts)
    assert store.batch_get_v1(keys, slots) == [True] * 64
    _assert_restored(kv, expected)


def test_existing_objects_are_not_rewritten(span_store_factory):
    """Mooncake keeps the old value on re-put; the backend must not pretend it
    wrote new bytes, and the first writer's bytes stay authoritative."""
    PoolName, _, _ = _pool_names()
    kv = P.build_mla_host("page_first", layers=2, host_pages=8)
    store = span_store_factory({PoolName.KV: kv}, storage_page_size=2 * PAGE)
    P.fill_random_pages(kv, [0, PAGE], seed=1)
    first = [P.page_bytes(kv, 0), P.page_bytes(kv, PAGE)]
    assert store.batch_set_v1(["same"], slots_of([0, 1], PAGE)) == [True]
    P.fill_random_pages(kv, [0, PAGE], seed=2)
    assert store.batch_set_v1(["same"], slots_of([0, 1], PAGE)) == [True]
    assert store.batch_get_v1(["same"], slots_of([4, 5], PAGE)) == [True]
    assert [P.page_bytes(kv, 4 * PAGE), P.page_bytes(kv, 5 * PAGE)] == first
