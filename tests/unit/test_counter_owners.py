"""Every counter has one owner, and every increment takes that owner's lock.

sglang's backup and prefetch threads call the backend at once, so two threads
make a known number of events through each owner's public path and the totals
must come out exact. The switch interval is cut to 1 µs so that the threads
interleave as finely as CPython allows.

How it failed before: on CPython 3.11 an unlocked ``counters[label] += 1``
of a label already present lost nothing even so (the interpreter switches
threads only at calls and backward jumps, none of which falls inside that
statement), so these totals came out exact then too. What the lock guards is
the read-modify-write itself, which free-threaded and later builds do not keep
in one piece; the tests pin the totals those builds must still produce.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator

import pytest

from mooncake_span.config import SpanOptions
from mooncake_span.errors import ErrorCode
from mooncake_span.sglang_backend.stats import CallCounters
from mooncake_span.store.gate import NativeGate
from mooncake_span.store.integrity import IntegrityFailures

THREADS = 2
EVENTS_PER_THREAD = 50_000
TOTAL = THREADS * EVENTS_PER_THREAD
NOT_FOUND = int(ErrorCode.OBJECT_NOT_FOUND)
CORRUPT = int(ErrorCode.CHECKSUM_MISMATCH)


@pytest.fixture(autouse=True)
def fine_switching() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _race(event: Callable[[], object], per_thread: int = EVENTS_PER_THREAD) -> None:
    """``event`` ``per_thread`` times on each of ``THREADS`` threads, started together."""
    start = threading.Barrier(THREADS)

    def work() -> None:
        start.wait()
        for _ in range(per_thread):
            event()

    threads = [threading.Thread(target=work) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _open_gate() -> NativeGate:
    gate = NativeGate(SpanOptions())
    gate.store = object()  # the calls below never touch the native store
    return gate


def test_gate_counts_every_code_of_concurrent_calls():
    gate = _open_gate()
    _race(lambda: gate.invoke("batch_is_exist", lambda _: [NOT_FOUND], 1))
    assert gate.counts() == {"OBJECT_NOT_FOUND": TOTAL}
    assert gate.revision() == (TOTAL, False)


def test_gate_counts_every_skip_the_client_reports_concurrently():
    gate = _open_gate()
    _race(lambda: gate.count("SHORT_READ"))
    _race(lambda: gate.count("DOMAIN_BAD_SKIPPED", 3))
    assert gate.counts() == {"SHORT_READ": TOTAL, "DOMAIN_BAD_SKIPPED": 3 * TOTAL}
    assert gate.revision()[0] == 4 * TOTAL


def test_call_counters_lose_no_rejection_call_or_hit_query():
    counters = CallCounters(window=8)
    _race(lambda: counters.count_rejected("TransportError"))
    _race(lambda: counters.record(True, 1, 256, None))
    _race(lambda: counters.record_hit_query(2, 5))
    metrics = counters.drain()
    assert metrics.rejected_calls == {"TransportError": TOTAL}
    assert metrics.backup_tokens == 256 * TOTAL
    assert metrics.dropped_metric_records == TOTAL - 8
    assert (metrics.hit_queries, metrics.hit_query_rpcs) == (TOTAL, 2 * TOTAL)
    assert metrics.hit_query_probed_objects == 5 * TOTAL


def test_integrity_failures_count_every_corrupt_object():
    failures = IntegrityFailures(lambda _key: 0, clock=lambda: 0.0)
    per_thread = EVENTS_PER_THREAD // 10  # each event also logs (rate-limited) and removes
    _race(lambda: failures.record([("k", 64, CORRUPT)]), per_thread)
    assert failures.snapshot() == {
        "integrity_failures": {"CHECKSUM_MISMATCH": THREADS * per_thread},
        "integrity_removed": THREADS * per_thread,
    }


def test_prometheus_adds_each_failure_once_whatever_order_snapshots_arrive():
    """Each thread takes the client's cumulative stats() and syncs it; an older
    snapshot can arrive after a newer one. Before, the stale one moved the seen
    counts back and the next sync added the difference again (5 + 6 = 11 here)."""
    prom = pytest.importorskip("prometheus_client")
    from mooncake_span import metrics as M

    registry = prom.CollectorRegistry()
    sync = M.ClientStatsSync(M.get_metrics(registry))
    for total in (5, 3, 9):
        sync.sync(
            {
                "error_counts": {"OBJECT_NOT_FOUND": total},
                "integrity_failures": {"CHECKSUM_MISMATCH": total},
                "breaker_times_opened": total,
            }
        )
    value = registry.get_sample_value
    assert value("mooncake_span_failed_objects_total", {"code": "OBJECT_NOT_FOUND"}) == 9
    assert value("mooncake_span_integrity_failures_total", {"code": "CHECKSUM_MISMATCH"}) == 9
    assert value("mooncake_span_breaker_opens_total", {}) == 9
