"""Prometheus metrics of the backend: families named ``mooncake_span_*``. No sglang import.

The families are created once per registry and shared by every backend of the
process (a second backend or a module reload gets the same collectors, not
prometheus_client's duplicate-name error). Multiprocess mode and how the client's
cumulative counts become counters: docs/operating.md, "Prometheus metrics".
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

# 0.5 ms .. 60 s: a local memcpy-speed hit up to a call stuck behind a partition.
DURATION_BUCKETS_S = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

# name (without prefix) -> (kind, help, labels)
FAMILIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "operation_duration_seconds": (
        "histogram",
        "Duration of each sglang-facing backend call",
        ("operation", "outcome"),
    ),
    "bytes_total": (
        "counter",
        "Bytes moved to (set) or from (get) Mooncake, by host pool",
        ("operation", "pool"),
    ),
    "keys_total": (
        "counter",
        "Storage keys (storage pages) transferred, by host pool and result",
        ("operation", "pool", "result"),
    ),
    "pages_total": (
        "counter",
        "Host pages moved successfully, by host pool",
        ("operation", "pool"),
    ),
    "hit_query_keys_total": (
        "counter",
        "Keys asked about in hit queries, by answer (hit: inside the restorable prefix)",
        ("result",),
    ),
    "hit_queries_total": ("counter", "Hit queries answered (batch_exists, batch_exists_v2)", ()),
    "hit_query_rpcs_total": (
        "counter",
        "Native RPCs sent by hit queries (batch_is_exist calls, and replica lookups while a "
        "segment is bad)",
        (),
    ),
    "hit_query_probed_objects_total": (
        "counter",
        "Objects hit queries asked about; Mooncake leases each existing one for ~10 s",
        (),
    ),
    "failed_objects_total": (
        "counter",
        "Objects a Mooncake call failed, by Mooncake code name",
        ("code",),
    ),
    "backup_objects_skipped_total": (
        "counter",
        "Objects of backups that were not written, by reason: stored (already in the "
        "cluster), cooldown (not sent: puts paused after refused puts; the cluster was not "
        "asked), refused (sent; the cluster answered no space), unreachable (not sent: the "
        "chain's prefix is not in the cluster)",
        ("reason",),
    ),
    "integrity_failures_total": (
        "counter",
        "Objects a restore found corrupt (Mooncake's checksum did not match), by code; each "
        "read as a miss and removed",
        ("code",),
    ),
    "breaker_state": (
        "gauge",
        "Circuit breaker state (0 closed, 1 open: calls answered as misses)",
        (),
    ),
    "breaker_opens_total": ("counter", "Times the circuit breaker opened", ()),
    "node_failures_total": (
        "counter",
        "Times a storage node (segment, a failure domain) was marked bad after a failed transfer",
        ("node",),
    ),
    "ssd_reads_total": (
        "counter",
        "Reads Mooncake served from a storage node's SSD tier (its count: one per owner asked "
        "in a get call); refused reads are in failed_objects_total (SSD_OWNER_DOWN, "
        "BUFFER_OVERFLOW), refused puts there too (NO_AVAILABLE_HANDLE)",
        (),
    ),
}


class SpanMetrics:
    """The ``mooncake_span_*`` collectors of one registry. Use ``get_metrics()``."""

    def __init__(self, registry: Any) -> None:
        import prometheus_client as prom

        self.registry = registry
        self._collectors = {name: self._make(prom, name, *spec) for name, spec in FAMILIES.items()}
        # prometheus_client's labels() takes a lock and builds keys on every
        # call; the backend's hot path asks for the same few children again.
        self._children: dict[tuple[str, ...], Any] = {}

    def _make(self, prom: Any, name: str, kind: str, help_text: str, labels: tuple[str, ...]):
        full = f"mooncake_span_{name}"
        existing = getattr(self.registry, "_names_to_collectors", {}).get(full)
        if existing is not None:
            # Created before by another SpanMetrics (or a reloaded module).
            return existing
        kwargs: dict[str, Any] = {"labelnames": labels, "registry": self.registry}
        if kind == "histogram":
            return prom.Histogram(full, help_text, buckets=DURATION_BUCKETS_S, **kwargs)
        if kind == "gauge":
            return prom.Gauge(full, help_text, multiprocess_mode="livemax", **kwargs)
        # prometheus_client appends _total to counters itself.
        return prom.Counter(full.removesuffix("_total"), help_text, **kwargs)

    def _child(self, name: str, *labels: str) -> Any:
        key = (name, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._collectors[name].labels(*labels)
        return child

    def observe_call(self, operation: str, outcome: str, duration_s: float) -> None:
        """One sglang-facing call; ``outcome``: ok, partial, miss, rejected or error."""
        self._child("operation_duration_seconds", operation, outcome).observe(duration_s)

    def observe_transfer(
        self,
        operation: str,
        pool: str,
        *,
        ok_keys: int,
        failed_keys: int,
        pages: int,
        moved_bytes: int,
    ) -> None:
        # Explicit, not through add(): this runs on every call (add() costs 1 us more).
        if ok_keys:
            self._child("keys_total", operation, pool, "ok").inc(ok_keys)
        if failed_keys:
            self._child("keys_total", operation, pool, "failed").inc(failed_keys)
        if pages:
            self._child("pages_total", operation, pool).inc(pages)
        if moved_bytes:
            self._child("bytes_total", operation, pool).inc(moved_bytes)

    def observe_hit_query(
        self, queried_keys: int, hit_keys: int, *, rpcs: int = 0, probed_objects: int = 0
    ) -> None:
        self._collectors["hit_queries_total"].inc()
        if rpcs:
            self._collectors["hit_query_rpcs_total"].inc(rpcs)
        if probed_objects:
            self._collectors["hit_query_probed_objects_total"].inc(probed_objects)
        hit_keys = max(0, min(hit_keys, queried_keys))
        if hit_keys:
            self._child("hit_query_keys_total", "hit").inc(hit_keys)
        if queried_keys > hit_keys:
            self._child("hit_query_keys_total", "miss").inc(queried_keys - hit_keys)

    def add(self, family: str, count: int, *labels: str) -> None:
        """``count`` more of counter ``family`` (nothing when it is not positive)."""
        if count > 0:
            (self._child(family, *labels) if labels else self._collectors[family]).inc(count)

    def set_breaker_state(self, state: str) -> None:
        self._collectors["breaker_state"].set(0 if state == "closed" else 1)


_lock = threading.Lock()
_by_registry: dict[int, SpanMetrics] = {}


def get_metrics(registry: Any = None) -> SpanMetrics | None:
    """The shared ``SpanMetrics`` of ``registry`` (default: prometheus' global one);
    None when prometheus_client is not installed (metrics are optional)."""
    try:
        import prometheus_client as prom
    except ImportError:
        return None
    target = registry if registry is not None else prom.REGISTRY
    with _lock:
        metrics = _by_registry.get(id(target))
        if metrics is None or metrics.registry is not target:
            metrics = SpanMetrics(target)
            _by_registry[id(target)] = metrics
        return metrics


def exposition_registry() -> Any:
    """The registry a scraper should render: the multiprocess view when
    ``PROMETHEUS_MULTIPROC_DIR`` is set, the process' own registry otherwise."""
    import prometheus_client as prom

    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not directory:
        return prom.REGISTRY
    from prometheus_client import multiprocess

    registry = prom.CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=directory)
    return registry


def _advance(seen: dict[str, int], now: Mapping[str, int]) -> dict[str, int]:
    """What cumulative counts grew by since ``seen``, which moves up to them.
    A count below the one seen comes from an older snapshot (sglang's threads
    take and sync theirs in either order): it adds nothing and moves nothing."""
    grown = {key: n - seen.get(key, 0) for key, n in now.items() if n > seen.get(key, 0)}
    seen.update((key, seen.get(key, 0) + n) for key, n in grown.items())
    return grown


# The client's ``stats()`` entries that count by label (code name, reason) and those
# that are one total, each with the counter family its growth feeds.
_BY_LABEL = {
    "error_counts": "failed_objects_total",
    "integrity_failures": "integrity_failures_total",
    "skipped_backups": "backup_objects_skipped_total",
}
_TOTALS = {"breaker_times_opened": "breaker_opens_total", "ssd_read_rpcs": "ssd_reads_total"}


class ClientStatsSync:
    """Turns one client's cumulative ``stats()`` into counter increments."""

    def __init__(self, metrics: SpanMetrics) -> None:
        self._metrics = metrics
        self._lock = threading.Lock()
        self._seen: dict[str, dict[str, int]] = {key: {} for key in _BY_LABEL}
        self._seen |= {key: {"": 0} for key in _TOTALS}
        self._state: str | None = None  # None: the gauge was never set
        self._seen_bad: frozenset[str] = frozenset()

    def sync(self, stats: Mapping[str, Any]) -> None:
        counts = {key: stats.get(key, {}) for key in _BY_LABEL}
        counts |= {key: {"": int(stats.get(key, 0))} for key in _TOTALS}
        state = str(stats.get("breaker_state", "closed"))
        bad = frozenset(stats.get("bad_segments", ()))
        with self._lock:
            if (counts, state, bad) == (self._seen, self._state, self._seen_bad):
                return  # the common case: nothing failed since the last call
            grown = {key: _advance(self._seen[key], now) for key, now in counts.items()}
            newly_bad = bad - self._seen_bad
            self._state, self._seen_bad = state, bad
        for key, deltas in grown.items():
            for label, delta in deltas.items():
                if key in _TOTALS:
                    self._metrics.add(_TOTALS[key], delta)
                else:
                    self._metrics.add(_BY_LABEL[key], delta, label)
        self._metrics.set_breaker_state(state)
        for segment in newly_bad:
            self._metrics.add("node_failures_total", 1, segment)
