"""Registered memory only: the staging arena, its planning, and the fake's refusal.

On the contract-checked fake, which refuses zero-copy buffers outside
registered memory as RDMA does: the generic path and the layer_first DSA
indexer stage through the arena, cut into parts when the arena is small,
under concurrent callers too; a key row larger than the arena is a logged
miss, never an unregistered send.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
import torch

from mooncake_span.errors import ErrorCode, InvalidRequestError, RegistrationError
from mooncake_span.span.byte_budget import largest_gap, next_part, rows_left_bytes
from mooncake_span.store.arena import StagingArena, StagingBusyError
from mooncake_span.store.layout_guard import create_text, read_text
from mooncake_span_tools.testing import pools as P
from mooncake_span_tools.testing.fake_store import FakeCluster, FakeStore
from mooncake_span_tools.testing.registered_ranges import ByteRanges
from tests.harness.registered import CheckedStore, UnregisteredMemoryError
from tests.span_helpers import FAKE_CLIENT, fake_client, listening_port, slots_of

PAGE = 64
PUT = "batch_put_from_multi_buffers"
CLIENT = {**FAKE_CLIENT, "storage_page_size": 4 * PAGE}

# ---- pure planning ---------------------------------------------------------------


def test_byte_ranges_cover_only_whole_buffers_inside_one_region():
    ranges = ByteRanges()
    ranges.add(1000, 100)
    ranges.add(2000, 50)
    assert ranges.covers(1000, 100) and ranges.covers(1050, 50) and ranges.covers(2010, 40)
    assert not ranges.covers(999, 2)  # starts before
    assert not ranges.covers(1090, 20)  # runs past the end
    assert not ranges.covers(1050, 1000)  # spans the gap between regions
    assert ranges.uncovered([1000, 3000, 2000], [10, 10, 51]) == [(3000, 10), (2000, 51)]


@pytest.mark.parametrize(
    ("leased", "expected"),
    [
        ([], (0, 1024)),
        ([(0, 256)], (256, 768)),
        ([(0, 100)], (128, 896)),  # the next lease starts aligned
        ([(0, 256), (768, 256)], (256, 512)),
        ([(256, 256)], (512, 512)),
        ([(0, 1024)], (0, 0)),
    ],
)
def test_largest_gap(leased, expected):
    assert largest_gap(leased, 1024) == expected


def test_next_part_takes_whole_rows_that_fit_the_lease():
    row_of = [0, 0, 0, 2, 2, 2, 5, 7, 7]  # objects of rows 0, 2, 5, 7 (some skipped)
    assert rows_left_bytes(row_of, 0, 10) == 40
    first = next_part(row_of, 0, 25, 10)  # room for two rows
    assert (first.objects, first.rows) == (range(0, 6), [0, 2])
    second = next_part(row_of, 6, 25, 10)
    assert (second.objects, second.rows) == (range(6, 9), [5, 7])
    assert rows_left_bytes(row_of, 6, 10) == 20
    with pytest.raises(InvalidRequestError, match="cannot hold one 10-byte key row"):
        next_part(row_of, 0, 9, 10)


# ---- the arena ---------------------------------------------------------------------


def _arena(size_bytes: int, timeout_s: float = 2.0) -> tuple[StagingArena, list[tuple[int, int]]]:
    registered: list[tuple[int, int]] = []
    arena = StagingArena(size_bytes, lambda p, s: registered.append((p, s)), timeout_s)
    return arena, registered


def test_the_arena_registers_once_and_leases_inside_itself():
    arena, registered = _arena(4096)
    assert registered == [(arena.base_ptr, 4096)]
    with arena.lease(1000, 100) as a, arena.lease(10_000, 100) as b:
        assert a.size_bytes == 1024 and b.size_bytes == 4096 - 1024  # b got what was left
        for lease in (a, b):
            assert (
                arena.base_ptr <= lease.ptr
                and lease.ptr + lease.size_bytes <= 4096 + arena.base_ptr
            )
    with arena.lease(4096, 4096) as whole:
        assert whole.size_bytes == 4096
    with pytest.raises(InvalidRequestError, match="raise span_staging_buffer_size"):
        with arena.lease(8192, 8192):
            pass


def test_a_caller_without_room_waits_bounded_then_gets_the_space():
    arena, _ = _arena(4096, timeout_s=5.0)
    got: list[int] = []
    with arena.lease(4096, 4096):
        worker = threading.Thread(target=lambda: got.append(_take(arena, 2048)))
        worker.start()
        time.sleep(0.1)
        assert got == []  # waiting: the arena is full
    worker.join(timeout=5)
    assert got == [2048]


def _take(arena: StagingArena, nbytes: int) -> int:
    with arena.lease(nbytes, nbytes) as lease:
        return lease.size_bytes


def test_a_caller_that_never_gets_room_fails_after_the_timeout():
    arena, _ = _arena(4096, timeout_s=0.2)
    with arena.lease(4096, 4096):
        started = time.monotonic()
        with pytest.raises(StagingBusyError, match="freed within 0.2s"):
            _take(arena, 1024)
        assert time.monotonic() - started < 2


# ---- the fake and the checking proxy refuse unregistered memory ---------------------------


def test_the_fake_fails_unregistered_buffers_with_transfer_fail():
    cluster = FakeCluster()
    store = FakeStore(cluster)
    data = np.arange(256, dtype=np.uint8)
    ptr = data.ctypes.data
    assert store.batch_put_from_multi_buffers(["k"], [[ptr]], [[256]]) == [
        int(ErrorCode.TRANSFER_FAIL)
    ]
    assert cluster.unregistered_buffers == 1 and "k" not in cluster.objects
    assert store.register_buffer(ptr, 128) == 0  # half the array
    assert store.batch_put_from_multi_buffers(["k"], [[ptr, ptr + 128]], [[128, 128]]) == [
        int(ErrorCode.TRANSFER_FAIL)
    ]
    assert store.batch_put_from_multi_buffers(["k"], [[ptr]], [[128]]) == [0]
    target = np.zeros(128, dtype=np.uint8)
    assert store.batch_get_into_multi_buffers(["k"], [[target.ctypes.data]], [[128]]) == [
        int(ErrorCode.TRANSFER_FAIL)
    ]
    assert not target.any()  # nothing written to unregistered memory
    assert cluster.unregistered_buffers == 3


def test_the_checking_proxy_refuses_unregistered_memory_and_unknown_zero_copy_calls():
    proxy = CheckedStore(FakeStore())
    data = np.arange(64, dtype=np.uint8)
    with pytest.raises(UnregisteredMemoryError, match="1 of 1 buffers"):
        proxy.batch_put_from_multi_buffers(["k"], [[data.ctypes.data]], [[64]])
    assert proxy.violations == [(PUT, data.ctypes.data, 64)]
    assert proxy.register_buffer(data.ctypes.data, 64) == 0
    assert proxy.batch_put_from_multi_buffers(["k"], [[data.ctypes.data]], [[64]]) == [0]
    assert proxy.calls[PUT] == 2
    with pytest.raises(UnregisteredMemoryError, match="cannot check"):
        _ = proxy.batch_get_into_multi_buffer_ranges


def test_records_move_through_the_arena():
    cluster = FakeCluster()
    with listening_port() as master:
        client = fake_client(master, cluster)
        try:
            arena = StagingArena(4096, client.register_buffer, 1.0)
            assert create_text(client, arena, "guard", "geometry") is True
            assert create_text(client, arena, "guard", "other") is False  # create-if-absent
            assert read_text(client, arena, "guard") == "geometry"
            assert read_text(client, arena, "absent") is None
            with pytest.raises(InvalidRequestError, match="staging arena holds 4096"):
                create_text(client, arena, "big", "x" * 5000)
        finally:
            client.close()
    assert cluster.unregistered_buffers == 0


# ---- the backend on the fake ------------------------------------------------------------------


def _span_bytes(store) -> int:
    return store.pools["kv"].layout.flat_page_bytes * store.geometry.pages_per_span


def _values(store, count: int, seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    n = _span_bytes(store)
    return [torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8)) for _ in range(count)]


def _puts(cluster: FakeCluster) -> int:
    return sum(1 for op, _ in cluster.calls if op == PUT)


def test_the_generic_path_is_cut_into_arena_sized_parts(make_backend):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    cluster = FakeCluster()
    kv = P.build_mla_host("page_first", layers=2, host_pages=8)
    probe = make_backend(CLIENT, {PoolName.KV: kv})
    row = _span_bytes(probe)
    # Room for two key rows and a bit: a five-key call needs three parts.
    store = make_backend(
        {**CLIENT, "span_staging_buffer_size": str(2 * row + 100)},
        {PoolName.KV: kv},
        cluster=cluster,
    )
    keys = [f"g{i}" for i in range(5)]
    values = _values(store, 5, seed=1)
    before = _puts(cluster)
    assert store.batch_set(keys, values) is True
    assert _puts(cluster) - before == 3
    targets = [torch.zeros_like(v) for v in values]
    got = store.batch_get(keys, targets)
    assert all(g is not None for g in got)
    assert all(torch.equal(t, v) for t, v in zip(targets, values, strict=True))
    assert cluster.unregistered_buffers == 0


def test_a_key_row_larger_than_the_arena_is_a_logged_miss(make_backend, caplog):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    cluster = FakeCluster()
    kv = P.build_mla_host("page_first", layers=2, host_pages=8)
    store = make_backend(
        {**CLIENT, "span_staging_buffer_size": "4kb"}, {PoolName.KV: kv}, cluster=cluster
    )
    assert _span_bytes(store) > 4096
    before = _puts(cluster)
    with caplog.at_level(logging.ERROR):
        assert store.batch_set(["big"], _values(store, 1, seed=2)) is False
        assert store.batch_get(["big"]) == [None]
    assert "raise span_staging_buffer_size" in caplog.text
    assert "generic path (interface_v1 off) misses" in caplog.text  # warned at registration
    assert _puts(cluster) == before and cluster.unregistered_buffers == 0


def test_a_staged_pool_whose_key_row_exceeds_the_arena_is_refused_at_startup(make_backend):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    dsa = P.build_dsa_pools("layer_first", layers=2, host_pages=8)
    with pytest.raises(RegistrationError, match="pool 'indexer': one storage key is"):
        make_backend(
            {**CLIENT, "span_staging_buffer_size": "4kb"},
            {PoolName.KV: dsa.kv, PoolName.INDEXER: dsa.indexer},
        )


def test_the_layer_first_indexer_stages_through_the_arena_under_concurrent_callers(make_backend):
    """Four threads back up and restore the DSA indexer (staged) at once through
    an arena holding one and a half key rows: every call ends, byte-exact."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    cluster = FakeCluster()
    dsa = P.build_dsa_pools("layer_first", layers=2, host_pages=32)
    pools = {PoolName.KV: dsa.kv, PoolName.INDEXER: dsa.indexer}
    probe = make_backend(CLIENT, pools).pools["indexer"]
    row = probe.layout.flat_page_bytes * 4
    store = make_backend(
        {**CLIENT, "span_staging_buffer_size": str(row + row // 2)}, pools, cluster=cluster
    )
    assert store.pools["indexer"].staged
    failures: list[str] = []

    def worker(t: int) -> None:
        pages = list(range(8 * t, 8 * t + 8))  # two keys of 4 pages, this thread's own
        starts, slots, keys = [p * PAGE for p in pages], slots_of(pages, PAGE), [f"t{t}a", f"t{t}b"]
        P.fill_random_pages(dsa.indexer, starts, seed=t)
        ref = [P.page_bytes(dsa.indexer, s) for s in starts]
        transfer = [PoolTransfer(PoolName.INDEXER, host_indices=slots, keys=keys)]
        for _ in range(5):
            if store.batch_set_v2(transfer) != {PoolName.INDEXER: [True, True]}:
                failures.append(f"thread {t}: backup failed")
            P.wipe_pages(dsa.indexer, starts)
            if store.batch_get_v2(transfer) != {PoolName.INDEXER: [True, True]}:
                failures.append(f"thread {t}: restore failed")
            if [P.page_bytes(dsa.indexer, s) for s in starts] != ref:
                failures.append(f"thread {t}: wrong bytes")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a staged call never ended"
    assert failures == []
    # Each two-key restore took two native gets: one key row per lease.
    gets = sum(1 for op, _ in cluster.calls if op == "batch_get_into_multi_buffers")
    assert gets >= 4 * 5 * 2
    assert cluster.unregistered_buffers == 0
