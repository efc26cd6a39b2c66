"""Backpressure on a full cluster: the put cool-down, decided by the cluster's answers.
Pure state; the caller's clock.

Mooncake answers a put that finds no space with a no-space code
(``NO_AVAILABLE_HANDLE``, or ``TENANT_QUOTA_EXCEEDED`` for a tenant over its
quota). What comes next is the master's doing: a failed allocation sets its
``need_mem_eviction`` flag and its eviction thread, which wakes every 10 ms,
frees the least recently used objects that no lease or pin holds. On a
cluster that evicts, the very next put usually finds room; on one whose
objects are all leased or pinned, nothing is freed until leases end.

So one refusal pauses nothing: the next put asks again, and every backup the
cluster would accept is sent. Only ``STREAK_TO_PAUSE`` refused calls in a row
(calls that stored nothing and got a no-space answer) are taken as a cluster
that stays full. Puts then pause for ``FIRST_PAUSE_S`` (about one eviction
period), and each refused probe (the first put after a pause) doubles the
pause, up to ``max_pause_s`` (``span_full_cooldown_s``). Any call that stores
an object ends it. A cluster that stays full thereby gets a handful of
refused calls and then about one per ``max_pause_s``, not one per backup.

Why the answers and not the master's usage: the master publishes usage only on
its admin HTTP server (``master_allocated_bytes``), never to a client over its
RPCs, so watching it costs requests of its own; and usage cannot say whether
anything is evictable (a full segment of unleased objects takes the next put
after one eviction pass, one full of leased objects takes none). A refused put
costs one allocation RPC and moves no bytes, and its answer is exactly the
question asked.

``PutPressure`` also owns the counts of backup objects that were not written,
by reason (``SKIP_REASONS``): already stored, skipped in a pause (without
asking the cluster), refused by it, or not sent because the chain's prefix is
not in the cluster (``span_skip_unreachable``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from mooncake_span.errors import ErrorCode, is_no_space

logger = logging.getLogger(__name__)

# The client's counter (failed_objects_total{code=...}) of puts not sent in a pause.
FULL_SKIPPED_LABEL = "FULL_COOLDOWN_SKIPPED"
# What a put skipped in a pause reads as: the answer that started it.
SKIPPED_CODE = int(ErrorCode.NO_AVAILABLE_HANDLE)
# One log line per this many seconds at most, however often the cluster fills.
LOG_INTERVAL_S = 60.0
# Refused calls in a row (nothing stored, a no-space answer) before puts pause:
# eviction runs within ~10 ms of a refusal, so one or two refusals say little.
STREAK_TO_PAUSE = 3
# The first pause: about one period of Mooncake's eviction thread (10 ms).
FIRST_PAUSE_S = 0.01

# Why a backup's object was not written.
STORED = "stored"  # already in the cluster (the existence query before the put)
COOLDOWN = "cooldown"  # not sent: a pause after refused puts (the cluster was not asked)
REFUSED = "refused"  # sent; the cluster answered no space
UNREACHABLE = "unreachable"  # not sent: the chain's prefix is not in the cluster
SKIP_REASONS = (STORED, COOLDOWN, REFUSED, UNREACHABLE)


class PutPressure:
    """Whether puts pause, how many pauses began, and why backup objects were
    not written. Thread-safe."""

    def __init__(self, max_pause_s: float, now_s: Callable[[], float] = time.monotonic) -> None:
        if max_pause_s < 0:
            raise ValueError(f"max_pause_s must be >= 0, got {max_pause_s}")
        self._max_pause_s = max_pause_s
        self._now_s = now_s
        self._lock = threading.Lock()
        self._streak = 0  # refused calls in a row
        self._pause_s = 0.0  # length of the current pause (0: none yet)
        self._until_s: float | None = None  # end of the current pause
        self._last_log_s: float | None = None
        self._unlogged = 0  # pauses started since the last log line
        self._skipped: collections.Counter[str] = collections.Counter()
        self.skipped_total = 0  # every count() adds to it: the metrics' cue to look
        self.cooldowns_started = 0

    @property
    def cooling(self) -> bool:
        """True while puts should be skipped (never with ``max_pause_s`` 0). Only
        reads: once the pause is over the next put is the probe, and its answer
        (``record``) ends the pause or starts a longer one."""
        until_s = self._until_s  # read once, without the lock: record() rebinds it
        return until_s is not None and self._now_s() < until_s

    def record(self, codes: list[int]) -> list[int]:
        """Take note of the answers of one native put call, and pass them on. A
        call that stored an object ends the pause and the streak; one that
        stored nothing and got a no-space answer extends the streak."""
        refused = sum(1 for c in codes if is_no_space(c))
        stored = 0 in codes
        if refused:
            self.count(REFUSED, refused)
        if stored:
            if self._streak or self._until_s is not None:
                with self._lock:
                    self._streak, self._pause_s, self._until_s = 0, 0.0, None
        elif refused and self._max_pause_s:
            self._refused(codes[next(i for i, c in enumerate(codes) if is_no_space(c))])
        return codes

    def count(self, reason: str, n: int) -> None:
        """Count ``n`` backup objects not written, for ``reason`` (``SKIP_REASONS``)."""
        if reason not in SKIP_REASONS:
            raise ValueError(f"unknown skip reason {reason!r}; one of {SKIP_REASONS}")
        with self._lock:
            self._skipped[reason] += n
            self.skipped_total += n

    def skip(self, n: int) -> list[int]:
        """``n`` objects not sent in a pause: counted (``COOLDOWN``), and each answered
        as the refusal that started the pause (``SKIPPED_CODE``)."""
        self.count(COOLDOWN, n)
        return [SKIPPED_CODE] * n

    def skipped(self) -> dict[str, int]:
        """A copy of the counts of backup objects not written, by reason."""
        with self._lock:
            return dict(self._skipped)

    def _refused(self, code: int) -> None:
        with self._lock:
            self._streak += 1
            now = self._now_s()
            if self._streak < STREAK_TO_PAUSE:
                return
            if self._until_s is not None and now < self._until_s:
                return  # a call sent before this pause began: the pause stands
            # No pause yet, or this call was the probe after one: (re)start, doubled.
            self._pause_s = min(2 * self._pause_s or FIRST_PAUSE_S, self._max_pause_s)
            self._until_s = now + self._pause_s
            self.cooldowns_started += 1
            self._unlogged += 1
            if self._last_log_s is not None and now - self._last_log_s < LOG_INTERVAL_S:
                return
            started, streak, pause_s = self._unlogged, self._streak, self._pause_s
            self._unlogged = 0
            self._last_log_s = now
        logger.warning(
            "mooncake-span: cluster full (%d put calls in a row refused with %s); pausing "
            "backups of new keys for %.3fs, doubling while probes are refused, at most %.1fs "
            "(%d pause(s) since the last such line)",
            streak,
            ErrorCode(code).name,
            pause_s,
            self._max_pause_s,
            started,
        )
