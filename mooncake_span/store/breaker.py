"""Circuit breaker state machine. Pure: the caller supplies the clock.

HiCache calls the backend from its prefetch and backup threads. With the master
down every Mooncake call takes ~4.3 s before returning -900, which would stall
those threads for minutes. After ``failure_threshold`` consecutive whole-call
transport failures the breaker opens: calls are refused at once (the backend
answers "miss") while a background probe checks the cluster; the first
successful probe closes it again.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"


@dataclass(frozen=True)
class BreakerSnapshot:
    state: BreakerState
    consecutive_failures: int
    times_opened: int
    opened_at_s: float | None


class CircuitBreaker:
    def __init__(self, failure_threshold: int) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        self._threshold = failure_threshold
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._times_opened = 0
        self._opened_at_s: float | None = None

    @property
    def is_open(self) -> bool:
        return self._state is BreakerState.OPEN

    def record_success(self) -> bool:
        """Returns True when this success closed an open breaker."""
        with self._lock:
            was_open = self._state is BreakerState.OPEN
            self._state = BreakerState.CLOSED
            self._failures = 0
            self._opened_at_s = None
            return was_open

    def record_failure(self, now_s: float) -> bool:
        """Returns True when this failure opened the breaker."""
        with self._lock:
            self._failures += 1
            if self._state is BreakerState.CLOSED and self._failures >= self._threshold:
                self._state = BreakerState.OPEN
                self._times_opened += 1
                self._opened_at_s = now_s
                return True
            return False

    def snapshot(self) -> BreakerSnapshot:
        with self._lock:
            return BreakerSnapshot(
                self._state, self._failures, self._times_opened, self._opened_at_s
            )
