"""What the backend counts and reports: sglang's storage metrics, error counters
and rate-limited error logs."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from sglang.srt.observability.metrics_collector import StorageMetrics

logger = logging.getLogger(__name__)

_LOG_INTERVAL_S = 10.0
# Kinds are built from operation and error names, but the bound must not rely
# on that: past it, kinds quiet for an interval are forgotten, else one entry
# takes the overflow.
_MAX_LOG_KINDS = 256
_OVERFLOW_KIND = "(other kinds)"
# Per-call records live in windows because only get_stats() drains them, and
# sglang 0.5.23 polls it only with enable_storage_metrics (unbounded, they grew
# ~2 MB per 100k calls with metrics off). METRIC_WINDOW spans sglang's polls, a
# few seconds apart; UNPOLLED_WINDOW keeps the latest calls for a direct caller.
METRIC_WINDOW = 4096
UNPOLLED_WINDOW = 64
_RECORDS = ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth")


class RateLimitedLog:
    """At most one line per kind every few seconds, with a count of what was dropped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._dropped: dict[str, int] = {}

    def _bounded(self, kind: str, now: float) -> str:
        if kind in self._last or len(self._last) < _MAX_LOG_KINDS:
            return kind
        for quiet in [k for k, t in self._last.items() if now - t >= _LOG_INTERVAL_S]:
            if quiet not in self._dropped:  # a pending count still has to be reported
                del self._last[quiet]
        return kind if len(self._last) < _MAX_LOG_KINDS else _OVERFLOW_KIND

    def error(self, kind: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            kind = self._bounded(kind, now)
            last = self._last.get(kind)
            if last is not None and now - last < _LOG_INTERVAL_S:
                self._dropped[kind] = self._dropped.get(kind, 0) + 1
                return
            self._last[kind] = now
            dropped = self._dropped.pop(kind, 0)
        if dropped:
            msg += " (%d similar messages suppressed)"
            args = (*args, dropped)
        logger.error(msg, *args)


@dataclass
class CallCounters:
    """Per-call metric records in windows of ``window`` entries, plus totals: the one
    owner of what ``get_stats()`` reports of the backend's own calls. Every write
    takes ``_lock`` (sglang's backup and prefetch threads call at once)."""

    window: int = UNPOLLED_WINDOW
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    prefetch_pgs: deque[int] = field(init=False)
    backup_pgs: deque[int] = field(init=False)
    prefetch_bandwidth: deque[float] = field(init=False)
    backup_bandwidth: deque[float] = field(init=False)
    prefetch_tokens: int = 0
    backup_tokens: int = 0
    # records pushed out of a full window before get_stats() took them
    dropped_records: int = 0
    # keyed by exception class name: bounded by the error classes that exist
    rejected_calls: dict[str, int] = field(default_factory=dict)
    # since the last get_stats(); each probed object that exists is leased ~10 s
    hit_queries: int = 0
    hit_query_rpcs: int = 0
    hit_query_probed_objects: int = 0

    def __post_init__(self) -> None:
        for name in _RECORDS:
            setattr(self, name, deque(maxlen=self.window))

    def record(self, backup: bool, keys: int, tokens: int, gib_per_s: float | None) -> None:
        """One KV call: a backup (put) or else a prefetch (get)."""
        with self._lock:
            if backup:
                pgs, bandwidth = self.backup_pgs, self.backup_bandwidth
                self.backup_tokens += tokens
            else:
                pgs, bandwidth = self.prefetch_pgs, self.prefetch_bandwidth
                self.prefetch_tokens += tokens
            if len(pgs) == self.window:
                self.dropped_records += 1
            pgs.append(keys)
            if gib_per_s is not None:
                bandwidth.append(gib_per_s)

    def record_hit_query(self, rpcs: int, probed_objects: int) -> None:
        with self._lock:
            self.hit_queries += 1
            self.hit_query_rpcs += rpcs
            self.hit_query_probed_objects += probed_objects

    def count_rejected(self, label: str) -> None:
        with self._lock:
            self.rejected_calls[label] = self.rejected_calls.get(label, 0) + 1

    def drain(self, **client_fields: Any) -> SpanStorageMetrics:
        """sglang's StorageMetrics since the last drain, with ``client_fields``
        (the geometry and the store client's fault counters) beside them."""
        with self._lock:
            metrics = SpanStorageMetrics(
                prefetch_tokens=self.prefetch_tokens,
                backup_tokens=self.backup_tokens,
                rejected_calls=dict(self.rejected_calls),
                dropped_metric_records=self.dropped_records,
                hit_queries=self.hit_queries,
                hit_query_rpcs=self.hit_query_rpcs,
                hit_query_probed_objects=self.hit_query_probed_objects,
                **client_fields,
            )
            for name in _RECORDS:
                records = getattr(self, name)
                getattr(metrics, name).extend(records)
                records.clear()
            self.prefetch_tokens = self.backup_tokens = 0
            self.hit_queries = self.hit_query_rpcs = self.hit_query_probed_objects = 0
        return metrics


class SpanStorageMetrics(StorageMetrics):
    """sglang's StorageMetrics plus span-aware token counts and fault counters.

    ``prefetch_pgs`` / ``backup_pgs`` count storage pages (keys); with K > 1
    each is ``storage_page_size`` tokens, as ``*_tokens`` reports. ``hit_queries``,
    ``hit_query_rpcs`` and ``hit_query_probed_objects`` count since the previous
    ``get_stats()``: RPCs and probed objects per query are their ratios.
    """

    def __init__(self, **extra: Any) -> None:
        super().__init__()
        self.prefetch_tokens: int = extra.pop("prefetch_tokens", 0)
        self.backup_tokens: int = extra.pop("backup_tokens", 0)
        self.pages_per_span: int = extra.pop("pages_per_span", 1)
        self.storage_page_tokens: int = extra.pop("storage_page_tokens", 0)
        self.error_counts: dict[str, int] = extra.pop("error_counts", {})
        self.rejected_calls: dict[str, int] = extra.pop("rejected_calls", {})
        self.breaker_state: str = extra.pop("breaker_state", "closed")
        self.breaker_times_opened: int = extra.pop("breaker_times_opened", 0)
        self.dropped_metric_records: int = extra.pop("dropped_metric_records", 0)
        self.hit_queries: int = extra.pop("hit_queries", 0)
        self.hit_query_rpcs: int = extra.pop("hit_query_rpcs", 0)
        self.hit_query_probed_objects: int = extra.pop("hit_query_probed_objects", 0)
