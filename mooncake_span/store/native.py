"""How the client reaches the native library: the binding, its environment defaults,
and the reachability probe run before ``setup`` (which can block for minutes)."""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mooncake_span.config import MooncakeSettings, SpanOptions
from mooncake_span.errors import ConfigError, SetupError
from mooncake_span.store.protocol import NativeStore
from mooncake_span.store.segments import fetch_segments

logger = logging.getLogger(__name__)

REACHABILITY_TIMEOUT_S = 2.0
# Mooncake's TCP transport queues 1024 transfers per peer plus 1024 pending admissions.
TCP_QUEUE_BUFFERS = 2048
# Mooncake 0.3.13 reads this once per process, when the first store client is
# set up (later changes, and later clients, keep the first answer): puts then
# record a CRC-64 per object and full-object gets verify it.
CHECKSUM_ENV = "MOONCAKE_STORE_CHECKSUM"
# The values Mooncake reads as on (case-insensitive); anything else is off.
_CHECKSUM_ON = frozenset({"1", "true", "yes", "on"})
_checksum_lock = threading.Lock()
_process_checksums: bool | None = None  # what the first setup by this package got


@dataclass(frozen=True)
class NativeBinding:
    """Where the store class comes from: the real wheel, or a fake in tests."""

    store_factory: Callable[[], NativeStore]
    replicate_config_factory: Callable[[], Any]
    # Lists the live segment names given the admin URL (None: no answer).
    list_segments: Callable[[str], list[str] | None] = fetch_segments
    # The wheel's client: one checksum setting per process (CHECKSUM_ENV).
    shares_process_env: bool = False


def native_env_defaults(options: SpanOptions) -> dict[str, str]:
    return {
        # One stalled transfer (a partitioned peer) blocks this long, then -800.
        "MC_TCP_STATUS_TIMEOUT_SEC": str(options.transfer_timeout_s),
        # With etcd metadata, each setup retry can take ~12 s.
        "MC_STORE_CLIENT_SETUP_RETRIES": "2",
    }


def _probe_tcp(endpoint: str, timeout_s: float) -> None:
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise SetupError(f"cannot reach {endpoint}: {exc}") from exc


def checksum_setting(options: SpanOptions, environ: Mapping[str, str]) -> tuple[bool, str]:
    """Whether Mooncake will verify checksums in this process, and what decided it.

    ``span_verify_checksums`` given explicitly (extra-config or its env) and an
    exported ``MOONCAKE_STORE_CHECKSUM`` must agree: two explicit settings that
    disagree are a ConfigError naming both, never a silent choice. Without the
    option, the operator's export (or Mooncake's default, off) stands."""
    exported = environ.get(CHECKSUM_ENV) or None  # exported empty: Mooncake's default
    exported_on = exported is not None and exported.strip().lower() in _CHECKSUM_ON
    origin = options.sources.get("verify_checksums")
    if origin is None:
        return (exported_on, f"{CHECKSUM_ENV}={exported}") if exported else (False, "default")
    if exported is not None and exported_on != options.verify_checksums:
        raise ConfigError(
            f"span_verify_checksums={options.verify_checksums} ({origin}) contradicts "
            f"{CHECKSUM_ENV}={exported!r} in the environment; set one of them, or make them agree"
        )
    return options.verify_checksums, f"span_verify_checksums ({origin})"


def _apply_checksum_setting(options: SpanOptions, shares_process_env: bool) -> None:
    global _process_checksums
    verify, why = checksum_setting(options, os.environ)
    if shares_process_env:
        with _checksum_lock:
            first = _process_checksums
            if first is None:
                _process_checksums = verify
        if first is not None and first != verify:
            raise ConfigError(
                f"checksum verification {'on' if verify else 'off'} ({why}) asked for in a "
                f"process whose first Mooncake client was set up with it "
                f"{'on' if first else 'off'}: Mooncake reads {CHECKSUM_ENV} once per process, "
                "so all clients of one process share one setting"
            )
    if verify and os.environ.get(CHECKSUM_ENV, "").strip().lower() not in _CHECKSUM_ON:
        os.environ[CHECKSUM_ENV] = "1"
        logger.info("mooncake-span: %s=1 (%s)", CHECKSUM_ENV, why)


def prepare_native_env(
    settings: MooncakeSettings, options: SpanOptions, shares_process_env: bool = False
) -> None:
    """Export bounded native defaults the operator did not set and the checksum
    setting; warn about known traps."""
    _apply_checksum_setting(options, shares_process_env)
    for name, value in native_env_defaults(options).items():
        if name not in os.environ:
            os.environ[name] = value
            logger.info("mooncake-span: %s=%s (set it yourself to override)", name, value)
    if (
        settings.protocol == "tcp"
        and options.max_buffers_per_call > TCP_QUEUE_BUFFERS
        and "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER" not in os.environ
    ):
        # Past the queue a TCP call does not just slow down: it stalls for
        # Mooncake's 60 s transfer wait and every key in it fails.
        logger.warning(
            "mooncake-span: span_max_buffers_per_call=%d exceeds the TCP transport's %d "
            "queued transfers per peer; raise MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER or lower "
            "the option",
            options.max_buffers_per_call,
            TCP_QUEUE_BUFFERS,
        )
