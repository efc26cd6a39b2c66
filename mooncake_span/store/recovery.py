"""The thread that notices when the cluster answers again after the breaker opened.

While the circuit breaker is open every store call is refused at once, so
nothing on the request path would ever see the cluster recover; this thread
asks it, at a fixed interval, and closes the breaker on the first answer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from mooncake_span.store.breaker import CircuitBreaker

logger = logging.getLogger(__name__)


class RecoveryProbe:
    """``probe()`` answers True (the cluster answered), False (not yet) or None
    (the client closed: stop)."""

    def __init__(
        self, breaker: CircuitBreaker, interval_s: float, probe: Callable[[], bool | None]
    ) -> None:
        self._breaker = breaker
        self._interval_s = interval_s
        self._probe = probe
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start probing unless a probe thread is already running."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._thread = threading.Thread(
                target=self._loop, name="mooncake-span-probe", daemon=True
            )
            self._thread.start()

    def _loop(self) -> None:
        while True:
            time.sleep(self._interval_s)
            alive = self._probe()
            if alive is None:
                return
            if alive:
                if self._breaker.record_success():
                    logger.warning(
                        "mooncake-span: circuit breaker CLOSED, the cluster answers again"
                    )
                return
