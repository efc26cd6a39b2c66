"""Metrics and accounting of the backend's calls, kept in one place.

Accounting wraps the calls (``guard.never_raise`` for each sglang call's
outcome, ``recorded`` for what a path moved), so the read and write paths know
nothing of metrics. Each counter has one owner that locks its own writes:
``CallCounters`` (``get_stats()``) and ``CallObserver`` (Prometheus).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from mooncake_span.metrics import ClientStatsSync, SpanMetrics, get_metrics
from mooncake_span.sglang_backend.stats import CallCounters, RateLimitedLog, SpanStorageMetrics
from mooncake_span.sglang_backend.stored_pool import PoolBatch
from mooncake_span.span.geometry import SpanGeometry
from mooncake_span.span.hit_rounds import ProbeTally
from mooncake_span.span.hits import leading_run
from mooncake_span.store.client import MooncakeClient

logger = logging.getLogger(__name__)


def outcome_of(result: Any) -> str:
    if type(result) is list and result and set(map(type, result)) == {bool}:
        flags = result  # per-key results of a data call: C-level passes only
    elif isinstance(result, dict):
        flat = [flag for flags in result.values() if isinstance(flags, list) for flag in flags]
        flags = [bool(flag) for flag in flat]
    elif isinstance(result, list):
        flags = [flag is not None and flag is not False for flag in result]
    elif isinstance(result, bool):
        flags = [result]
    else:
        flags = []  # not per key
    if not flags:
        return "ok"
    done = flags.count(True)
    return "ok" if done == len(flags) else "partial" if done else "miss"


class CallObserver:
    """The backend's Prometheus metrics (``mooncake_span_*``), with the store client's
    cumulative counters folded in after each call. Nothing here raises: metrics must
    not turn a served request into a miss (outcomes: docs/operating.md, "Prometheus
    metrics")."""

    def __init__(self, client: Any, metrics: SpanMetrics | None = None) -> None:
        self._client = client
        self._metrics = metrics if metrics is not None else get_metrics()
        self._sync = ClientStatsSync(self._metrics) if self._metrics is not None else None
        self._revision: Any = None  # the client's stats_revision() at the last sync

    def call(self, op_name: str, failure: str | None, result: Any, elapsed_s: float) -> None:
        if self._metrics is None:
            return
        try:
            outcome = failure or outcome_of(result)
            self._metrics.observe_call(op_name, outcome, elapsed_s)
            revision = self._client.stats_revision()
            if revision != self._revision:  # building stats() on every call costs more
                self._revision = revision
                self._sync.sync(self._client.stats())
        except Exception:  # metrics are best effort; the call's answer stands
            logger.debug("mooncake-span: metrics update failed", exc_info=True)

    def moved(self, operation: str, batches: Sequence[Any], results: Sequence[list[bool]]) -> None:
        """``operation``: "get" or "set"; per batch, its per-key results."""
        if self._metrics is None:
            return
        try:
            for batch, per_key in zip(batches, results, strict=True):
                ok = per_key.count(True)
                self._metrics.observe_transfer(
                    operation,
                    batch.pool.name,
                    ok_keys=ok,
                    failed_keys=len(per_key) - ok,
                    pages=ok * batch.pages_per_key,
                    moved_bytes=batch.pool.moved_bytes(batch, per_key),
                )
        except Exception:
            logger.debug("mooncake-span: metrics update failed", exc_info=True)

    def hit_query(self, queried_keys: int, hit_keys: int, tally: ProbeTally) -> None:
        if self._metrics is None:
            return
        try:
            self._metrics.observe_hit_query(
                queried_keys, hit_keys, rpcs=tally.rpcs, probed_objects=tally.objects
            )
        except Exception:
            logger.debug("mooncake-span: metrics update failed", exc_info=True)


GET = "get"
SET = "set"

# A read or write path of a backend: its prepared batches -> per batch, per key results.
Path = Callable[[Any, list[PoolBatch]], list[list[bool]]]


def recorded(operation: str) -> Callable[[Path], Callable[..., list[list[bool]]]]:
    """Wrap a path so that what it moved is recorded (``operation``: GET or SET).
    The wrapped path takes ``kv_call=True`` for the one KV batch of a v1 or
    generic call, which also adds sglang's per-call records."""

    def decorate(path: Path) -> Callable[..., list[list[bool]]]:
        @functools.wraps(path)
        def recorded_path(self: Any, batches: list[PoolBatch], kv_call: bool = False):
            started = time.perf_counter()
            results = path(self, batches)
            self.recorder.observer.moved(operation, batches, results)
            if kv_call:
                elapsed_s = time.perf_counter() - started
                geometry = self.registration.geometry
                self.recorder.kv_call(operation, batches[0], results[0], elapsed_s, geometry)
            return results

        return recorded_path

    return decorate


class CallRecorder:
    def __init__(self, client: MooncakeClient, window: int) -> None:
        self._client = client
        self.observer = CallObserver(client)  # mooncake_span_* Prometheus metrics
        self.counters = CallCounters(window)  # sglang's StorageMetrics, drained by get_stats()
        self._log = RateLimitedLog()  # rejected calls, rate limited

    def reject(self, op_name: str, exc: Exception) -> None:
        """A call (or one transfer of a v2 call) refused: bad input or a cluster failure."""
        label = type(exc).__name__
        self.counters.count_rejected(label)
        self._log.error(f"{op_name}:{label}", "mooncake-span %s rejected: %s", op_name, exc)

    def kv_call(
        self,
        operation: str,
        batch: PoolBatch,
        results: list[bool],
        elapsed_s: float,
        geometry: SpanGeometry,
    ) -> None:
        """sglang's per-call records of a KV call (keys, tokens, GiB/s)."""
        tokens = leading_run(results) * geometry.storage_page_tokens
        gib = batch.pool.moved_bytes(batch, results) / (1 << 30)
        gib_per_s = gib / elapsed_s if elapsed_s else None
        self.counters.record(operation == SET, len(results), tokens, gib_per_s)

    def hit_query(self, queried_keys: int, hit_keys: int, tally: ProbeTally) -> None:
        self.counters.record_hit_query(tally.rpcs, tally.objects)
        self.observer.hit_query(queried_keys, hit_keys, tally)

    def storage_metrics(self, geometry: SpanGeometry | None) -> SpanStorageMetrics:
        client_stats = self._client.stats()
        return self.counters.drain(
            pages_per_span=geometry.pages_per_span if geometry else 1,
            storage_page_tokens=geometry.storage_page_tokens if geometry else 0,
            error_counts=client_stats["error_counts"],
            breaker_state=client_stats["breaker_state"],
            breaker_times_opened=client_stats["breaker_times_opened"],
        )
