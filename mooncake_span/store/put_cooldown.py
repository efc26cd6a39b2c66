"""Backpressure on a full cluster: the put cool-down. Pure state; the caller's clock.

On a full cluster Mooncake answers every put with a no-space code
(``NO_AVAILABLE_HANDLE``, or ``TENANT_QUOTA_EXCEEDED`` for a tenant over its
quota) until eviction frees space. Each refused put still costs an allocation
RPC and the caller's copy work, and HiCache keeps backing up, so without a
pause a full cluster turns into a storm of doomed puts. After a no-space
answer the client skips puts for ``cooldown_s`` (backups of new keys read as
failed; gets and existence queries are untouched). The cool-down ends early on
the first success of a put already in flight (space came back), and otherwise
when its time is up: the next put is then the probe, and a no-space answer to
it starts the next cool-down. At most one batch of puts per cool-down is
thereby spent on a cluster that stays full.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from mooncake_span.errors import ErrorCode, is_no_space

logger = logging.getLogger(__name__)

# The client's counter (failed_objects_total{code=...}) of puts not sent in a cool-down.
FULL_SKIPPED_LABEL = "FULL_COOLDOWN_SKIPPED"
# What a put skipped in a cool-down reads as: the answer that started it.
SKIPPED_CODE = int(ErrorCode.NO_AVAILABLE_HANDLE)
# One log line per this many seconds at most, however often the cluster fills.
LOG_INTERVAL_S = 60.0


class PutPressure:
    """Whether puts pause, and how many cool-downs began. Thread-safe."""

    def __init__(self, cooldown_s: float, now_s: Callable[[], float] = time.monotonic) -> None:
        if cooldown_s < 0:
            raise ValueError(f"cooldown_s must be >= 0, got {cooldown_s}")
        self._cooldown_s = cooldown_s
        self._now_s = now_s
        self._lock = threading.Lock()
        self._until_s: float | None = None  # end of the current cool-down
        self._last_log_s: float | None = None
        self._unlogged = 0  # cool-downs started since the last log line
        self.cooldowns_started = 0

    @property
    def cooling(self) -> bool:
        """True while puts should be skipped (never when the cool-down is disabled).
        Only reads: once its time is up the next put probes, and its answer
        (``record``) ends the cool-down or starts the next one."""
        until_s = self._until_s  # read once, without the lock: record() rebinds it
        return until_s is not None and self._now_s() < until_s

    def record(self, codes: list[int]) -> list[int]:
        """Take note of the answers of one native put call, and pass them on.
        Any no-space code (re)starts the cool-down, even beside successes: the
        space ran out within the call. A call with successes and no such code
        ends it."""
        if self._cooldown_s:
            self._note(codes)
        return codes

    def _note(self, codes: list[int]) -> None:
        full = [c for c in codes if is_no_space(c)]
        if not full and (self._until_s is None or 0 not in codes):
            return
        with self._lock:
            now = self._now_s()
            if not full:
                self._until_s = None
                return
            if self._until_s is None or now >= self._until_s:
                self.cooldowns_started += 1
                self._unlogged += 1
            self._until_s = now + self._cooldown_s
            if self._last_log_s is not None and now - self._last_log_s < LOG_INTERVAL_S:
                return
            started = self._unlogged  # cool-downs since the last line, this one included
            self._unlogged = 0
            self._last_log_s = now
        logger.warning(
            "mooncake-span: cluster full (%d of %d objects refused: %s); skipping backups of new "
            "keys for %.1fs after each refusal (%d cool-down(s) since the last such line)",
            len(full),
            len(codes),
            ErrorCode(full[0]).name,
            self._cooldown_s,
            started,
        )
