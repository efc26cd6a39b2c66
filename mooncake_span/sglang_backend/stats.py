"""What the backend counts and reports: sglang's storage metrics, error counters
and rate-limited error logs."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from sglang.srt.observability.metrics_collector import StorageMetrics

logger = logging.getLogger(__name__)

_LOG_INTERVAL_S = 10.0


class RateLimitedLog:
    """At most one line per kind every few seconds, with a count of what was dropped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._dropped: dict[str, int] = {}

    def error(self, kind: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
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
    lock: threading.Lock = field(default_factory=threading.Lock)
    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)
    prefetch_tokens: int = 0
    backup_tokens: int = 0
    rejected_calls: dict[str, int] = field(default_factory=dict)


class SpanStorageMetrics(StorageMetrics):
    """sglang's StorageMetrics plus span-aware token counts and fault counters.

    ``prefetch_pgs`` / ``backup_pgs`` count storage pages (keys); with K > 1
    each is ``storage_page_size`` tokens, as ``*_tokens`` reports.
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
