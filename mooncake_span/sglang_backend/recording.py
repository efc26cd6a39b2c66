"""Metrics and accounting of the backend's calls, kept in one place.

A ``CallRecorder`` is the one place the backend's calls are recorded from,
wrapped around the calls rather than threaded through them (the read and
write paths know nothing of metrics). The counters themselves have one owner
each, which takes its own lock on every write: ``CallCounters`` (``stats.py``:
what ``get_stats()`` reports) and ``CallObserver`` (``observability.py``: the
Prometheus metrics). The recorder feeds them:

* ``guard.never_raise`` hands it each sglang call's outcome: duration and
  outcome for Prometheus (``finished``), refused input (``reject``: the
  rejected-calls counter and a rate-limited log line);
* ``transfer`` wraps a read or write path: keys, host pages and bytes moved
  per pool for Prometheus; ``kv_transfer`` adds sglang's ``StorageMetrics``
  records (pages, tokens, bandwidth) of a KV call (v1, generic);
* ``hit_query`` counts existence RPCs and probed objects of a hit query.

``storage_metrics`` builds what ``get_stats()`` returns to sglang.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from mooncake_span.sglang_backend.observability import CallObserver
from mooncake_span.sglang_backend.stats import CallCounters, RateLimitedLog, SpanStorageMetrics
from mooncake_span.sglang_backend.stored_pool import PoolBatch
from mooncake_span.span.geometry import SpanGeometry
from mooncake_span.span.hit_rounds import ProbeTally
from mooncake_span.span.hits import leading_run
from mooncake_span.store.client import MooncakeClient

GET = "get"
SET = "set"

# A read or write path: prepared batches -> per batch, per key results.
Path = Callable[[list[PoolBatch]], list[list[bool]]]


class CallRecorder:
    def __init__(self, client: MooncakeClient, window: int) -> None:
        self._client = client
        self.observer = CallObserver(client)  # mooncake_span_* Prometheus metrics
        self.counters = CallCounters(window)  # sglang's StorageMetrics, drained by get_stats()
        self._log = RateLimitedLog()  # rejected calls, rate limited

    def finished(self, op_name: str, failure: str | None, result: Any, elapsed_s: float) -> None:
        """One sglang call answered: ``failure`` is None, "rejected" or "error"."""
        self.observer.call(op_name, failure, result, elapsed_s)

    def reject(self, op_name: str, exc: Exception) -> None:
        """A call (or one transfer of a v2 call) refused: bad input or a cluster failure."""
        label = type(exc).__name__
        self.counters.count_rejected(label)
        self._log.error(f"{op_name}:{label}", "mooncake-span %s rejected: %s", op_name, exc)

    def transfer(self, operation: str, path: Path, batches: list[PoolBatch]) -> list[list[bool]]:
        """``path`` over ``batches``, with what it moved recorded per pool."""
        results = path(batches)
        self.observer.moved(operation, batches, results)
        return results

    def kv_transfer(
        self, operation: str, path: Path, batch: PoolBatch, geometry: SpanGeometry
    ) -> list[bool]:
        """A KV call's one batch: also sglang's per-call records (keys, tokens, GiB/s)."""
        started = time.perf_counter()
        (results,) = path([batch])
        self.observer.moved(operation, [batch], [results])
        elapsed_s = time.perf_counter() - started
        tokens = leading_run(results) * geometry.storage_page_tokens
        gib = batch.pool.moved_bytes(batch, results) / (1 << 30)
        gib_per_s = gib / elapsed_s if elapsed_s else None
        self.counters.record(operation == SET, len(results), tokens, gib_per_s)
        return results

    def hit_query(self, queried_keys: int, hit_keys: int, tally: ProbeTally) -> None:
        self.counters.record_hit_query(tally.rpcs, tally.objects)
        self.observer.hit_query(queried_keys, hit_keys, tally)

    def storage_metrics(self, geometry: SpanGeometry | None) -> SpanStorageMetrics:
        """sglang's StorageMetrics since the last call, with the client's fault counters."""
        client_stats = self._client.stats()
        return self.counters.drain(
            pages_per_span=geometry.pages_per_span if geometry else 1,
            storage_page_tokens=geometry.storage_page_tokens if geometry else 0,
            error_counts=client_stats["error_counts"],
            breaker_state=client_stats["breaker_state"],
            breaker_times_opened=client_stats["breaker_times_opened"],
        )
