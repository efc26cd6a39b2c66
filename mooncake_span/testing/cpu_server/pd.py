"""Prefill/decode disaggregated sglang servers on this host, CPU build.

KV moves prefill -> decode over the Mooncake transfer engine; on a CPU box it
runs over TCP on loopback (``server_env`` sets ``MOONCAKE_PROTOCOL=tcp`` and
``SGLANG_HOST_IP``). The ``fake`` transfer backend moves no KV and a prefill
server refuses it, so it cannot stand in end to end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from mooncake_span.testing.cpu_server.servers import ServerOptions, SglangServer

TRANSFER_BACKEND = "mooncake"
# sglang 0.5.23 turns the radix cache off on a decode server, and refuses
# --enable-hierarchical-cache together with a disabled radix cache. Decode's
# L3 offload needs only the other hicache flags (host pool size and layout,
# storage backend), from which it builds its own host pool.
_DECODE_DROPPED_FLAGS = ("--enable-hierarchical-cache",)


def _with_args(options: ServerOptions, *args: str) -> ServerOptions:
    return dataclasses.replace(options, extra_args=(*options.extra_args, *args))


def prefill_options(options: ServerOptions, bootstrap_port: int) -> ServerOptions:
    """``options`` as a prefill server whose KV bootstrap server listens on ``bootstrap_port``."""
    return _with_args(
        options,
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-transfer-backend",
        TRANSFER_BACKEND,
        "--disaggregation-bootstrap-port",
        str(bootstrap_port),
    )


def decode_options(options: ServerOptions, offload_to_l3: bool = True) -> ServerOptions:
    """``options`` as a decode server; with ``offload_to_l3`` it writes its answers' pages to L3."""
    args = [
        "--disaggregation-mode",
        "decode",
        "--disaggregation-transfer-backend",
        TRANSFER_BACKEND,
    ]
    if offload_to_l3:
        if options.storage_backend is None:
            raise ValueError("decode offload writes to L3: set options.storage_backend")
        args.append("--disaggregation-decode-enable-offload-kvcache")
    return _with_args(options, *args)


class DecodeServer(SglangServer):
    """A decode server: :class:`SglangServer` without the flags sglang refuses in decode mode."""

    def __init__(
        self,
        name: str,
        options: ServerOptions,
        log_dir: Path,
        port: int | None = None,
        env: Mapping[str, str] = (),
    ) -> None:
        args = list(options.extra_args)
        if "--disaggregation-mode" not in args or "decode" not in args:
            raise ValueError("DecodeServer needs options from decode_options()")
        super().__init__(name, options, log_dir, port, env)
        argv = self.process.argv
        self.process.argv = [arg for arg in argv if arg not in _DECODE_DROPPED_FLAGS]
