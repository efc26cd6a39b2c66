"""Arguments the commands share: value types whose error names what was wrong;
where the cluster is, resolved by the backend's own loader with the flags laid over it
(docs/operating.md, "Where the cluster is"); where Mooncake's native log lines go
(docs/operating.md, "Native logs")."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import tempfile
from collections.abc import Mapping
from typing import Any

from mooncake_span.errors import ConfigError
from mooncake_span.mooncake_settings import MooncakeSettings, RankInfo, load_mooncake_settings
from mooncake_span.units import parse_size_bytes


def size_arg(text: str) -> int:
    try:
        return parse_size_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {value}")
    return value


positive_int_arg = functools.partial(_int_at_least, least=1)
non_negative_int_arg = functools.partial(_int_at_least, least=0)


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--master", metavar="HOST:PORT", help="master RPC address (or etcd://...)")
    parser.add_argument(
        "--metadata",
        metavar="URL",
        help="metadata server, e.g. http://HOST:PORT/metadata, etcd://HOST:PORT, P2PHANDSHAKE",
    )
    parser.add_argument("--protocol", help="transfer protocol (tcp, rdma, ...)")
    parser.add_argument(
        "--extra-config",
        metavar="JSON|@FILE",
        help="the backend's --hicache-storage-backend-extra-config (JSON text or @path)",
    )
    parser.add_argument(
        "--admin-url",
        metavar="URL",
        help="the master's HTTP admin server (its --metrics_port), e.g. http://HOST:9003 "
        "(default: span_master_admin_url from the extra-config, else the master host on "
        "master_metrics_port from the config source, default 9003)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    add_native_log_arg(parser)


def add_native_log_arg(parser: Any) -> None:
    parser.add_argument(
        "--native-log",
        metavar="PATH",
        help="file for Mooncake's native log lines (default: a new temporary file, printed at "
        "the end; '-' shows them on stderr)",
    )


def resolve_native_log(choice: str | None, command: str) -> str | None:
    """The log file for ``--native-log`` (None: leave fd 2, where the native client logs
    every setup and connection at INFO, alone)."""
    if choice == "-":
        return None
    if choice:
        return choice
    directory = tempfile.mkdtemp(prefix=f"mooncake-span-{command}-")
    return os.path.join(directory, "native.log")


def parse_extra_config(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    source = "--extra-config"
    if text.startswith("@"):
        source = text[1:]
        try:
            with open(source, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise ConfigError(f"cannot read --extra-config file {source!r}: {exc}") from exc
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{source} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{source} must be a JSON object, got {type(value).__name__}")
    return value


def resolve_settings(
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
    ranks: RankInfo | None = None,
) -> tuple[MooncakeSettings, dict[str, Any]]:
    """Settings the backend of rank ``ranks`` would use, with the command-line flags on top."""
    extra = parse_extra_config(args.extra_config)
    overlay = {
        key: value
        for key, value in (
            ("master_server_address", args.master),
            ("metadata_server", args.metadata),
            ("protocol", args.protocol),
        )
        if value
    }
    try:
        base = load_mooncake_settings(extra, environ, ranks)
    except ConfigError:
        if not args.master:
            raise
        # No config source at all: the flags are the whole configuration, over TCP unless
        # told otherwise (sglang's default, rdma, needs a device the flags did not name).
        overlay.setdefault("protocol", "tcp")
        settings = load_mooncake_settings({**extra, **overlay}, environ, ranks)
        return dataclasses.replace(settings, source="command line"), extra
    if not overlay:
        return base, extra
    # replace() validates again; the flags name the fields they set.
    settings = dataclasses.replace(base, **overlay, source=f"{base.source} + command line")
    return settings, extra


def admin_url(
    args: argparse.Namespace, settings: MooncakeSettings, extra: Mapping[str, Any]
) -> str | None:
    # The flag, else the backend's own option for the same server (failure-domain
    # placement), else master_metrics_port from whichever source the settings came from.
    configured = args.admin_url or extra.get("span_master_admin_url")
    return str(configured).rstrip("/") if configured else settings.admin_url()
