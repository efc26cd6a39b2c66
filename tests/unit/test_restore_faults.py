"""The restore-fault hook (``testing/restore_faults.py``): each fault does what the
negative controls rely on, to a real sglang host pool."""

from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("needs sglang 0.5.23", allow_module_level=True)

import torch  # noqa: E402

from mooncake_span_tools.testing import restore_faults  # noqa: E402


class _Pool:
    """A host pool's page API (get_data_page / set_from_flat_data_page), 4-slot pages."""

    page_size = 4

    def __init__(self, pages: int) -> None:
        self.data = torch.arange(pages * 4 * 3, dtype=torch.float32).view(pages, 12)

    def get_data_page(self, index, flat=True):
        return self.data[index // self.page_size]

    def set_from_flat_data_page(self, index, page):
        self.data[index // self.page_size] = page


class _Backend:
    """The wrapped backend: registrations and calls recorded, reads answer True."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.span_field = "the backend's own"

    def register_mem_pool_host(self, pool):
        self.calls.append("register_mem_pool_host")

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        self.calls.append("batch_get_v1")
        return [True] * len(keys)

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        self.calls.append("batch_set_v1")
        return [True] * len(keys)


def _store(monkeypatch, tmp_path, fault, pool):
    path = tmp_path / "fault.json"
    restore_faults.write_fault(path, fault)
    monkeypatch.setenv(restore_faults.FAULT_FILE_ENV, str(path))
    store = restore_faults.FaultyRestoreStore(backend=_Backend())
    store.register_mem_pool_host(pool)
    return store, path


def test_read_fault_refuses_what_it_cannot_apply(tmp_path):
    path = tmp_path / "f.json"
    assert restore_faults.read_fault(None) == {} and restore_faults.read_fault(str(path)) == {}
    path.write_text('{"kind": "flip", "pool": "kv"}')
    with pytest.raises(ValueError, match="kind"):
        restore_faults.read_fault(str(path))


def test_swap_trades_two_keys_pages_and_is_logged(monkeypatch, tmp_path):
    pool = _Pool(4)
    before = pool.data.clone()
    store, path = _store(
        monkeypatch, tmp_path, {"kind": "swap", "pool": "kv", "first": 0, "second": 2}, pool
    )
    host_indices = torch.tensor([4, 5, 6, 7, 8, 9, 10, 11, 0, 1, 2, 3])  # keys on pages 1, 2, 0
    results = store._spoil(
        restore_faults.read_fault(str(path)), ["a", "b", "c"], host_indices, [True] * 3
    )
    assert results == [True] * 3
    assert torch.equal(pool.data[1], before[0]) and torch.equal(pool.data[0], before[1])
    assert torch.equal(pool.data[2], before[2])
    assert restore_faults.applied(path) == [
        {"kind": "swap", "pool": "kv", "first": 0, "second": 2, "keys": 3}
    ]


def test_zero_answers_success_over_a_fresh_pools_bytes(monkeypatch, tmp_path):
    pool = _Pool(3)
    store, path = _store(monkeypatch, tmp_path, {"kind": "zero", "pool": "kv"}, pool)
    results = store._spoil(
        restore_faults.read_fault(str(path)), ["a"], torch.arange(8, 12), [False]
    )
    assert results == [True] and not pool.data[2].any() and pool.data[0].any()


def test_a_numbered_fault_applies_to_that_call_only(monkeypatch, tmp_path):
    fault = {"kind": "zero", "pool": "kv", "call": 1}
    store, path = _store(monkeypatch, tmp_path, fault, _Pool(2))
    assert [store._due(restore_faults.read_fault(str(path))) for _ in range(3)] == [
        False,
        True,
        False,
    ]
    restore_faults.write_fault(path, fault)  # written again (later): counted afresh
    os.utime(path, ns=(1, path.stat().st_mtime_ns + 10**9))
    assert [store._due(fault) for _ in range(2)] == [False, True]
    assert store._due({"kind": "zero", "pool": "kv"})


def test_the_wrapper_forwards_sglangs_whole_interface():
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    wanted = [n for n, m in vars(HiCacheStorage).items() if callable(m) and n[0] != "_"]
    missing = [n for n in wanted if n not in vars(restore_faults.FaultyRestoreStore)]
    assert wanted and missing == []


def test_calls_without_a_fault_reach_the_backend_unchanged(monkeypatch, tmp_path):
    pool = _Pool(3)
    before = pool.data.clone()
    store, path = _store(monkeypatch, tmp_path, None, pool)
    assert store.batch_get_v1(["a"], torch.arange(0, 4)) == [True]
    assert store.batch_set_v1(["a"], torch.arange(0, 4)) == [True]
    assert store._backend.calls == ["register_mem_pool_host", "batch_get_v1", "batch_set_v1"]
    assert store.span_field == "the backend's own"  # what the wrapper lacks is the backend's
    assert torch.equal(pool.data, before) and restore_faults.applied(path) == []


def test_an_assigned_storage_page_reaches_the_wrapped_backend(monkeypatch, tmp_path):
    store, _ = _store(monkeypatch, tmp_path, None, _Pool(2))
    store._backend.storage_page_size = 64
    store.storage_page_size = 256  # the span fork's late assignment
    assert store._backend.storage_page_size == 256 == store.storage_page_size
