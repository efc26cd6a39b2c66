"""Objects whose stored bytes no longer match what was written (a CRC or seal mismatch,
a torn or missing SSD file): counted, logged (rate-limited) and force-removed, so no
hit query offers them again. Why and what is removed: docs/reliability.md, "What the
backend does with it".
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence

from mooncake_span.errors import StoreClosedError, TransportError, code_name, is_integrity_failure

logger = logging.getLogger(__name__)

_LOG_INTERVAL_S = 10.0


class IntegrityFailures:
    """Counts, logs and removes objects a get found corrupt. Thread-safe."""

    def __init__(
        self, remove_object: Callable[[str], int], clock: Callable[[], float] = time.monotonic
    ) -> None:
        # remove_object(object key) -> Mooncake's code (0: removed); may raise
        # the client's whole-call errors. clock: for the log rate limit.
        self._remove_object = remove_object
        self._clock = clock
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()
        self._removed = 0
        self._last_log_s = float("-inf")
        self._unlogged = 0

    def record(self, failed: Sequence[tuple[str, int, int]]) -> list[str]:
        """``failed``: (object key, planned bytes, code) of reads that failed.
        Handles those that failed their integrity check; returns their keys."""
        failed = [(key, code) for key, _, code in failed if is_integrity_failure(code)]
        if not failed:
            return []
        removed = 0
        for object_key, _ in failed:
            # A removal that fails leaves the key to the lost-key cache.
            with contextlib.suppress(TransportError, StoreClosedError):
                removed += self._remove_object(object_key) == 0
        now = self._clock()
        with self._lock:
            self._counts.update(code_name(code) for _, code in failed)
            self._removed += removed
            quiet = now - self._last_log_s >= _LOG_INTERVAL_S
            if quiet:
                unlogged = self._unlogged  # held back since the last line
                self._unlogged = 0
                self._last_log_s = now
            else:
                self._unlogged += len(failed)
        if quiet:
            object_key, code = failed[0]
            logger.error(
                "mooncake-span: %d object(s) failed their integrity check (%s, e.g. %s); read as "
                "misses, %d removed so they are not offered again%s",
                len(failed),
                code_name(code),
                object_key,
                removed,
                f" ({unlogged} more since the last line)" if unlogged else "",
            )
        return [object_key for object_key, _ in failed]

    def snapshot(self) -> dict[str, object]:
        """The client's ``stats()`` entries: failures by code name, objects removed."""
        with self._lock:
            return {"integrity_failures": dict(self._counts), "integrity_removed": self._removed}
