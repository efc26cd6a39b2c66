"""Every structure that lives as long as the backend has a bound; each test drives one past it.

Bounds (also listed in docs/reliability.md, "Long-running state"):

* per-call metric records: none while storage metrics are off; a window of
  ``METRIC_WINDOW`` records per list while on (aggregate counters always);
* rate-limited log state: at most ``_MAX_LOG_KINDS`` kinds + one overflow kind;
* learned KV-derived pools: a subset of the registered pools;
* client error counters: ``_MAX_ERROR_LABELS`` code labels + one overflow label
  + five fixed labels;
* circuit breaker: three scalars, whatever the number of failures;
* layout guard: one record per namespace, whatever the number of nodes/checks.
"""

from __future__ import annotations

import logging

import pytest

from mooncake_span.sglang_backend.stats import (
    _MAX_LOG_KINDS,
    METRIC_WINDOW,
    UNPOLLED_WINDOW,
    CallCounters,
    RateLimitedLog,
)
from mooncake_span.store.gate import _MAX_ERROR_LABELS, CircuitBreaker
from mooncake_span.store.layout_guard import GeometryRecord, PoolGeometry, check_or_publish
from mooncake_span_tools.testing import pools as P
from mooncake_span_tools.testing.fake_store import FakeCluster
from tests.span_helpers import FAKE_CLIENT, make_storage_config, slots_of

PAGE = 64


def _store(make_backend, *, metrics: bool):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    cluster = FakeCluster()
    config = make_storage_config({**FAKE_CLIENT, "storage_page_size": 2 * PAGE})
    config.enable_storage_metrics = metrics
    kv = P.build_mla_host("page_first", layers=1, host_pages=8)
    return make_backend(config, {PoolName.KV: kv}, cluster=cluster), cluster


@pytest.fixture
def rig(make_backend):
    return _store(make_backend, metrics=False)


def test_client_error_counters_fold_unknown_codes_past_the_label_cap(rig):
    store, cluster = rig
    calls = 3 * _MAX_ERROR_LABELS
    for i in range(calls):
        cluster.inject("batch_is_exist", -50_000 - i)  # codes Mooncake does not define
        assert store.batch_exists([f"k{i}"]) == 0
    counts = store.get_stats().error_counts
    assert len(counts) <= _MAX_ERROR_LABELS + 1
    # Folded, not dropped: every failure is still counted.
    assert sum(counts.values()) == calls
    assert counts["CODE_OTHER"] == calls - _MAX_ERROR_LABELS


def test_breaker_state_is_the_same_three_scalars_after_many_open_close_cycles():
    breaker = CircuitBreaker(2)
    fields = set(vars(breaker))
    for _ in range(20_000):
        breaker.record_failure()
        breaker.record_failure()
        breaker.record_success()
    assert set(vars(breaker)) == fields
    stats = breaker.stats()
    assert (stats["breaker_times_opened"], stats["breaker_consecutive_failures"]) == (20_000, 0)


def test_layout_guard_keeps_one_record_per_namespace_however_many_checks():
    registry: dict[str, str] = {}

    def create(key: str, value: str) -> bool:
        if key in registry:
            return False
        registry[key] = value
        return True

    record = GeometryRecord(
        64, 256, "page_first", "bfloat16", {"kv": PoolGeometry(("kv",), (1,), 64)}
    )
    results = [check_or_publish(record, "ns__geometry", registry.get, create) for _ in range(5000)]
    assert results[0] == "published" and set(results[1:]) == {"matched"}
    assert registry == {"ns__geometry": record.to_json()}


def test_learned_kv_derived_pools_stay_within_the_registered_pools(rig):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    store, _ = rig
    slots = slots_of([0, 1], PAGE)
    for i in range(2000):
        transfer = PoolTransfer(
            f"made-up-{i}", host_indices=slots, keys=["k"], indices_from_pool=PoolName.KV
        )
        assert store.batch_set_v2([transfer]) == {f"made-up-{i}": [False]}
    assert store.registration.learned_kv_derived <= set(store.pools)


@pytest.mark.parametrize("metrics", [False, True], ids=["metrics-off", "metrics-on"])
def test_per_call_records_stay_in_their_window_and_totals_stay_exact(make_backend, metrics):
    store, _ = _store(make_backend, metrics=metrics)
    try:
        window = METRIC_WINDOW if metrics else UNPOLLED_WINDOW
        assert store.recorder.counters.window == window
        slots = slots_of([0, 1], PAGE)
        calls = UNPOLLED_WINDOW * 3
        for i in range(calls):
            assert store.batch_set_v1([f"k{i}"], slots) == [True]
        stats = store.get_stats()
    finally:
        store.close()
    kept = min(calls, window)
    assert list(stats.backup_pgs) == [1] * kept
    assert stats.dropped_metric_records == calls - kept
    assert stats.backup_tokens == calls * 2 * PAGE  # totals are counters, never windowed
    assert store.get_stats().backup_pgs == []  # drained


def test_metric_window_holds_at_most_its_size_past_many_calls():
    counters = CallCounters(METRIC_WINDOW)
    calls = 3 * METRIC_WINDOW
    for i in range(calls):
        counters.record(i % 2 == 0, 4, 256, 1.5)
    sizes = [len(counters.backup_pgs), len(counters.prefetch_pgs)]
    sizes += [len(counters.backup_bandwidth), len(counters.prefetch_bandwidth)]
    assert sizes == [METRIC_WINDOW] * 4
    assert counters.dropped_records == calls - 2 * METRIC_WINDOW
    assert (counters.backup_tokens, counters.prefetch_tokens) == (calls // 2 * 256,) * 2


def test_rate_limited_log_keeps_at_most_its_kinds_and_counts_the_rest(monkeypatch, caplog):
    clock = [1000.0]
    monkeypatch.setattr("mooncake_span.sglang_backend.stats.time.monotonic", lambda: clock[0])
    log = RateLimitedLog()
    kinds = 4 * _MAX_LOG_KINDS
    with caplog.at_level(logging.ERROR, logger="mooncake_span.sglang_backend.stats"):
        for i in range(kinds):
            kind = f"op:pool-{i}"
            log.error(kind, "failure %d", i)
            assert len(log._last) <= _MAX_LOG_KINDS + 1
        # Full: every further kind shares the overflow entry, which logged once
        # and is counting the rest.
        assert len(caplog.records) == _MAX_LOG_KINDS + 1
        assert log._dropped == {"(other kinds)": kinds - _MAX_LOG_KINDS - 1}
        clock[0] += 11.0  # one interval later the quiet kinds are forgotten
        log.error("op:new", "fresh")
        assert caplog.records[-1].getMessage() == "fresh"
    # Only the quiet kinds went; the overflow entry keeps its pending count.
    assert set(log._last) == {"op:new", "(other kinds)"}
    assert log._dropped == {"(other kinds)": kinds - _MAX_LOG_KINDS - 1}
