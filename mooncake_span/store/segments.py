"""The live segment list, read from the master's admin HTTP server and kept fresh.

``SegmentDirectory`` holds the last list the master gave (``/get_all_segments``
on its ``--metrics_port``), refreshed by one daemon thread every
``refresh_s`` and at once after a transfer failure (``wake``). Callers read the
list without blocking; a failed fetch keeps the previous list, so a master
outage does not empty it and turn placement off.
"""

from __future__ import annotations

import functools
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

from mooncake_span.config import SpanOptions

logger = logging.getLogger(__name__)

_FETCH_TIMEOUT_S = 1.0


def fetch_segments(admin_url: str) -> list[str] | None:
    """The master's segment names, or None if it did not answer within the bound."""
    try:
        with urllib.request.urlopen(
            admin_url.rstrip("/") + "/get_all_segments", timeout=_FETCH_TIMEOUT_S
        ) as response:
            text = response.read().decode("utf-8", "replace")
    except (OSError, urllib.error.URLError, ValueError):
        return None
    return [line.strip() for line in text.splitlines() if line.strip()]


def replica_segments(
    found: Mapping[str, Any] | None, sizes: Mapping[str, int] | None = None
) -> dict[str, set[str]]:
    """Per object key, the segments ``batch_get_replica_desc`` names for its memory replicas;
    with ``sizes``, only replicas of exactly that many bytes.

    A memory replica's ``transport_endpoint`` is its segment's name (measured:
    the master's ``te_endpoint`` equals ``segment_name`` for TCP segments)."""
    out: dict[str, set[str]] = {}
    for key, replicas in (found or {}).items():
        for replica in replicas:
            if not replica.is_memory_replica():
                continue
            buffer = replica.get_memory_descriptor().buffer_descriptor
            if buffer.transport_endpoint and (sizes is None or buffer.size == sizes.get(key)):
                out.setdefault(key, set()).add(buffer.transport_endpoint)
    return out


class SegmentDirectory:
    def __init__(self, fetch: Callable[[], list[str] | None], refresh_s: float, name: str) -> None:
        self._fetch = fetch
        self._refresh_s = refresh_s
        self._name = name
        self._segments: tuple[str, ...] = ()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False
        self.refreshes = 0

    @property
    def segments(self) -> tuple[str, ...]:
        return self._segments

    def refresh(self) -> bool:
        """Fetch once now; True if the master answered."""
        found = self._fetch()
        if found is None:
            if not self._warned:
                logger.warning(
                    "mooncake-span: %s did not list segments; placement keeps the last list "
                    "(%d segments)",
                    self._name,
                    len(self._segments),
                )
                self._warned = True
            return False
        self._warned = False
        new = tuple(sorted(set(found)))
        if new != self._segments:
            logger.info("mooncake-span: live segments %s", list(new))
        self._segments = new
        self.refreshes += 1
        return True

    def start(self) -> None:
        self.refresh()
        self._thread = threading.Thread(
            target=self._loop, name="mooncake-span-segments", daemon=True
        )
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._refresh_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            self.refresh()


@functools.cache
def _warn_no_admin_url() -> None:
    # Once per process: every rank's store would say the same.
    logger.warning(
        "mooncake-span: no master admin URL is configured (span_master_admin_url, or "
        "master_metrics_port with a master address), so the backend cannot list the storage "
        "nodes: Mooncake alone places objects, a conversation's keys spread over every node, "
        "and losing one node can cut every conversation's cached prefix there"
    )


def start_directory(
    admin_url: str | None,
    options: SpanOptions,
    list_segments: Callable[[str], list[str] | None],
) -> SegmentDirectory | None:
    """A running directory for the master's admin server, or None when no URL is known."""
    if admin_url is None:
        _warn_no_admin_url()
        return None
    directory = SegmentDirectory(
        lambda: list_segments(admin_url), options.segment_refresh_s, admin_url
    )
    directory.start()
    return directory
