"""The backend's Prometheus hooks and its router-facing layout description.

``CallObserver`` is fed from three places of the backend: ``guard.never_raise``
(every sglang-facing call: duration and outcome), ``_run`` (keys, host pages
and bytes actually moved) and the hit queries (keys asked vs restorable, existence RPCs and objects
probed). It
also folds the store client's cumulative counters (failed objects by Mooncake
code, breaker openings and state) into the metrics after each call. It never
raises: metrics must not turn a served request into a miss.

Outcomes: ``ok`` (every key succeeded, or the call answered), ``partial``
(some keys), ``miss`` (none), ``rejected`` (bad input or a cluster failure the
guard turned into a miss), ``error`` (an unexpected bug, also a miss).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from mooncake_span.errors import ConfigError
from mooncake_span.metrics import ClientStatsSync, SpanMetrics, get_metrics
from mooncake_span.span.object_layout import NamespaceFacts, describe_object_layout, pool_inputs
from mooncake_span.store.layout_guard import GeometryRecord, namespace_key
from mooncake_span.store.native import checksum_setting

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
    done = sum(flags)
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

    def moved(self, is_set: bool, batches: Sequence[Any], results: Sequence[list[bool]]) -> None:
        if self._metrics is None:
            return
        try:
            operation = "set" if is_set else "get"
            for batch, per_key in zip(batches, results, strict=True):
                ok = sum(per_key)
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
        """``tally``: a ``span.probe.ProbeTally`` (existence RPCs, objects probed)."""
        if self._metrics is not None:
            self._metrics.observe_hit_query(
                queried_keys, hit_keys, rpcs=tally.rpcs, probed_objects=tally.objects
            )


def describe_layout(backend: Any) -> dict[str, Any]:
    """The backend's L3 object layout (see ``span.object_layout``)."""
    record: GeometryRecord = backend.geometry_record()
    pools = backend.pools
    inputs = pool_inputs(
        record.pools,
        {name: pools[name].kind for name in record.pools},
        {name: tuple(c.scope.value for c in pools[name].components) for name in record.pools},
    )
    schema = backend.key_schema
    cfg = backend.storage_config
    layout = describe_object_layout(
        NamespaceFacts.from_schema(schema),
        inputs,
        ranks=schema.ranks,
        is_mla=backend.is_mla,
        pp_rank=int(getattr(cfg, "pp_rank", 0) or 0),
        pp_size=int(getattr(cfg, "pp_size", 1) or 1),
        source="backend",
        layout_guard_key=namespace_key(schema.model, schema.tag),
    )
    layout["integrity"] = _integrity(backend.options)
    return layout


def _integrity(options: Any) -> dict[str, Any]:
    """Whether restores are verified against Mooncake's per-object CRC-64, and why."""
    try:
        verify, source = checksum_setting(options, os.environ)
    except ConfigError as exc:  # the environment changed after setup
        return {"verify_checksums": None, "source": str(exc)}
    return {
        "verify_checksums": verify,
        "checksum": "crc64-ecma182" if verify else None,
        "source": source,
    }
