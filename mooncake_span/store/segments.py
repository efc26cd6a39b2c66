"""The master's admin HTTP server, asked: the live segment list (``SegmentDirectory``,
kept fresh by one thread; a failed fetch keeps the last list, so a master outage
does not turn placement off), the SSD owners of keys, whether a segment's transfer
endpoint answers.
"""

from __future__ import annotations

import functools
import json
import logging
import socket
import threading
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mooncake_span.config import SpanOptions

logger = logging.getLogger(__name__)

_FETCH_TIMEOUT_S = 1.0


def _get(url: str, parse: Callable[[str], Any] = json.loads) -> Any:
    """``parse`` of the answer to a GET, or None without one within the bound."""
    try:
        with urllib.request.urlopen(url, timeout=_FETCH_TIMEOUT_S) as response:
            return parse(response.read().decode("utf-8", "replace"))
    except (OSError, ValueError):  # URLError is an OSError
        return None


def fetch_segments(admin_url: str) -> list[str] | None:
    """The master's segment names, or None if it did not answer within the bound."""
    text = _get(admin_url.rstrip("/") + "/get_all_segments", str)
    return None if text is None else [line.strip() for line in text.splitlines() if line.strip()]


# Keys per /batch_query_keys request: they travel in the URL.
_QUERY_KEYS_PER_REQUEST = 32


def fetch_disk_owners(admin_url: str, keys: Sequence[str]) -> dict[str, set[str]] | None:
    """Per key, the segments of the clients whose SSD holds it (its ``LOCAL_DISK``
    replicas; an owner without a listed segment is ``client:<id>``), from the master's
    admin server; None if it did not answer. Why: docs/operating.md, "Known upstream issues"."""
    base = admin_url.rstrip("/")
    detail = _get(base + "/get_segments_detail")
    if not isinstance(detail, dict):
        return None
    segment_of = {
        s.get("client_id"): s.get("segment_name") for s in detail.get("segments", []) or []
    }
    owners: dict[str, set[str]] = {}
    for start in range(0, len(keys), _QUERY_KEYS_PER_REQUEST):
        chunk = ",".join(keys[start : start + _QUERY_KEYS_PER_REQUEST])
        answer = _get(f"{base}/batch_query_keys?keys={urllib.parse.quote(chunk)}")
        if not isinstance(answer, dict) or not isinstance(answer.get("data"), dict):
            return None
        for key, item in answer["data"].items():
            for disk in (item or {}).get("local_disk_values") or []:
                client = disk.get("client_id")
                owners.setdefault(key, set()).add(segment_of.get(client) or f"client:{client}")
    return owners


# A live transfer endpoint accepts at once; a dead one on a reachable host refuses.
_PROBE_TIMEOUT_S = 0.3


def probe_segment(metadata_server: str, admin_url: str | None, segment: str) -> bool | None:
    """Whether ``segment``'s transfer RPC endpoint accepts a TCP connection within the
    bound; None when nothing says where it is (docs/reliability.md, "What the backend does")."""
    endpoint = _rpc_endpoint(metadata_server, admin_url, segment)
    if endpoint is None:
        return None
    try:
        socket.create_connection(endpoint, timeout=_PROBE_TIMEOUT_S).close()
    except OSError:
        return False
    return True


def _rpc_endpoint(
    metadata_server: str, admin_url: str | None, segment: str
) -> tuple[str, int] | None:
    # A segment's name is not an endpoint (measured: no process listens on it).
    if metadata_server.startswith(("http://", "https://")):
        key = urllib.parse.quote("mooncake/rpc_meta/" + segment, safe="")
        meta = _get(f"{metadata_server}?key={key}")
        if isinstance(meta, dict) and str(meta.get("rpc_port", "")).isdigit():
            host = str(meta.get("ip_or_host_name") or segment.rpartition(":")[0])
            return host, int(meta["rpc_port"])
    elif metadata_server == "P2PHANDSHAKE" and admin_url:
        # The master's segment detail names the endpoint a handshake dials.
        detail = _get(admin_url.rstrip("/") + "/get_segments_detail")
        for entry in detail.get("segments") or [] if isinstance(detail, dict) else []:
            if entry.get("segment_name") == segment:
                host, _, port = str(entry.get("te_endpoint") or "").rpartition(":")
                if host and port.isdigit():
                    return host.strip("[]"), int(port)
    return None


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
        self._warned = False

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
        return True

    def start(self) -> None:
        self.refresh()
        threading.Thread(target=self._loop, name="mooncake-span-segments", daemon=True).start()

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
    admin_url: str | None, options: SpanOptions, list_segments: Callable[[str], list[str] | None]
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
