"""The backend's Prometheus metrics (``mooncake_span_*``): ``CallObserver``.

Fed only by the wrappers around the calls (``recording.py``), it also folds
the store client's cumulative counters in after each call. Nothing here
raises: metrics must not turn a served request into a miss. The outcomes:
docs/operating.md, "Prometheus metrics".
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from mooncake_span.metrics import ClientStatsSync, SpanMetrics, get_metrics

logger = logging.getLogger(__name__)


def _flags(result: Any) -> list[bool] | None:
    """Per-key booleans of a call's result, None when the result is not per key."""
    if isinstance(result, dict):
        flat = [flag for flags in result.values() if isinstance(flags, list) for flag in flags]
        return [bool(flag) for flag in flat]
    if isinstance(result, list):
        return [flag is not None and flag is not False for flag in result]
    if isinstance(result, bool):
        return [result]
    return None


def outcome_of(result: Any) -> str:
    if type(result) is list and result and set(map(type, result)) == {bool}:
        flags = result  # per-key results of a data call: C-level passes only
    else:
        flags = _flags(result)
    if not flags:
        return "ok"
    done = flags.count(True)
    return "ok" if done == len(flags) else "partial" if done else "miss"


class CallObserver:
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

    def hit_query(self, queried_keys: int, hit_keys: int, tally: Any) -> None:
        """``tally``: a ``span.hit_rounds.ProbeTally`` (existence RPCs, objects probed)."""
        if self._metrics is None:
            return
        try:
            self._metrics.observe_hit_query(
                queried_keys, hit_keys, rpcs=tally.rpcs, probed_objects=tally.objects
            )
        except Exception:
            logger.debug("mooncake-span: metrics update failed", exc_info=True)
