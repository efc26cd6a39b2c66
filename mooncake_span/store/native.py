"""How the client reaches the native library: the binding, its environment defaults,
the reachability probe run before ``setup`` (which can block for minutes), and the
``ReplicateConfig`` of a put."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mooncake_span.config import MooncakeSettings, SpanOptions
from mooncake_span.errors import SetupError
from mooncake_span.store.protocol import NativeStore
from mooncake_span.store.segments import fetch_segments

logger = logging.getLogger(__name__)

REACHABILITY_TIMEOUT_S = 2.0
# Mooncake's TCP transport queues 1024 transfers per peer plus 1024 pending admissions.
TCP_QUEUE_BUFFERS = 2048


@dataclass(frozen=True)
class NativeBinding:
    """Where the store class comes from: the real wheel, or a fake in tests."""

    store_factory: Callable[[], NativeStore]
    replicate_config_factory: Callable[[], Any]
    # Lists the live segment names given the admin URL (None: no answer).
    list_segments: Callable[[str], list[str] | None] = fetch_segments


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


def prepare_native_env(settings: MooncakeSettings, options: SpanOptions) -> None:
    """Export bounded native defaults the operator did not set; warn about known traps."""
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


def replicate_config(
    factory: Callable[[], Any],
    replica_num: int,
    group_ids: Sequence[str] | None,
    hard_pin: bool,
    segment: str,
) -> Any:
    """The ``ReplicateConfig`` of one put call. Fields an older wheel lacks
    (``with_hard_pin``, ``group_ids``) are left out rather than failing the put."""
    config = factory()
    config.replica_num = replica_num
    if segment:
        config.preferred_segment = segment
    if hard_pin and hasattr(config, "with_hard_pin"):
        config.with_hard_pin = True
    if group_ids is not None and hasattr(config, "group_ids"):
        config.group_ids = list(group_ids)
    return config
