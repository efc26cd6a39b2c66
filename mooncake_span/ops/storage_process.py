"""``python -m mooncake_span.storage_node``: a storage-only Mooncake process.

It mounts its global segment, prints one ``READY`` line to stdout and holds it
until SIGTERM or SIGINT, then closes the store once and exits 0; setup failures
exit 1, bad arguments 2 (docs/operating.md, "A storage node").
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping

from mooncake_span.errors import ConfigError
from mooncake_span.mooncake_settings import (
    CONFIG_PATH_ENV,
    MooncakeSettings,
    load_mooncake_settings,
)
from mooncake_span.ops.storage_ssd import (
    NodeSsd,
    add_ssd_arguments,
    prepare_node_ssd,
    publish_marker,
    size_flag,
    wait_after_crash,
)
from mooncake_span.store.native import setup_arguments

logger = logging.getLogger(__name__)

_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
# Each overrides one field of the node's settings (settings_from_args).
_CONNECTION_FLAGS = (
    ("--master", "master address, HOST:PORT or etcd://HOST:PORT for HA masters"),
    ("--metadata", "metadata server: http://HOST:PORT/metadata, etcd://HOST:PORT or P2PHANDSHAKE"),
    (
        "--segment-bytes",
        "size of the global segment this node contributes, e.g. 512mb or 1073741824",
    ),
    ("--local-buffer-bytes", "size of the client's local transfer buffer (default: 16mb)"),
    ("--host", "local hostname/IP this node advertises (default: 127.0.0.1 with --master)"),
    ("--protocol", "transfer protocol (default: tcp with --master)"),
    ("--device", "RDMA device name; empty for tcp"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mooncake_span.storage_node",
        description=(
            "Mount a Mooncake global segment and keep it alive until SIGTERM/SIGINT. Without "
            "--master the settings come from SGLANG_HICACHE_MOONCAKE_CONFIG_PATH or the "
            "MOONCAKE_* environment, like a serving node's; flags override single fields."
        ),
    )
    for flag, text in _CONNECTION_FLAGS:
        parser.add_argument(flag, help=text)
    add_ssd_arguments(parser)
    return parser


def settings_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> MooncakeSettings:
    """The node's ``MooncakeSettings``: flags over the loader's sources.

    Raises:
        ConfigError: a value is malformed, or the segment size is not > 0.
    """
    environ = os.environ if environ is None else environ
    if args.master is not None:
        if args.segment_bytes is None:
            raise ConfigError("--segment-bytes is required with --master")
        # Explicit flags describe the whole connection; defaults suit a local TCP
        # cluster. MOONCAKE_LOCAL_HOSTNAME still wins over the default host, as on
        # a serving node; --host wins over both (applied below).
        extra = {"master_server_address": args.master, "protocol": "tcp"}
        settings = load_mooncake_settings({**extra, "local_hostname": "127.0.0.1"}, environ)
    elif not environ.get(CONFIG_PATH_ENV) and not environ.get("MOONCAKE_MASTER"):
        raise ConfigError(
            f"no Mooncake master configured: pass --master HOST:PORT, or set {CONFIG_PATH_ENV} "
            "(a JSON file with master_server_address) or MOONCAKE_MASTER"
        )
    else:
        settings = load_mooncake_settings(None, environ)
    given = {
        "metadata_server": args.metadata,
        "global_segment_size_bytes": size_flag(args.segment_bytes, "--segment-bytes"),
        "local_buffer_size_bytes": size_flag(args.local_buffer_bytes, "--local-buffer-bytes"),
        "local_hostname": args.host,
        "protocol": args.protocol,
        "device_name": args.device,
    }
    overrides = {name: value for name, value in given.items() if value is not None}
    settings = dataclasses.replace(settings, **overrides)  # validated again
    if settings.global_segment_size_bytes <= 0:
        raise ConfigError(
            f"a storage node exists to contribute memory: the segment size must be > 0, got "
            f"{settings.global_segment_size_bytes} bytes (from {settings.source}); "
            f"pass --segment-bytes"
        )
    return settings


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s storage_node[%(process)d] %(message)s",
    )
    try:
        # Validation happens here: an unknown metadata scheme would make the
        # native setup abort the whole process.
        settings = settings_from_args(args)
        ssd = prepare_node_ssd(args, settings)
    except ConfigError as exc:
        parser.error(str(exc))
    if ssd is not None:
        wait_after_crash(ssd, args, settings)
        # Mooncake reads these when setup starts the disk tier.
        os.environ.update(ssd.tier.native_env())
        settings = dataclasses.replace(
            settings, enable_ssd_offload=True, ssd_offload_path=ssd.tier.directory
        )

    # Blocked before the native library starts its threads, which inherit the
    # mask: a SIGTERM during setup waits for sigwait() below.
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)

    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    started_s = time.monotonic()
    # By name, as the backend: tenant_id and the SSD options reach a storage node too.
    rc = store.setup(**setup_arguments(settings))
    setup_s = time.monotonic() - started_s
    if rc != 0:
        _log_setup_failure(rc, setup_s, settings)
        if ssd is not None:
            ssd.lock.release()
        return 1
    if ssd is not None:
        ssd.lock.update(state="running", segment=store.get_hostname())
        try:
            publish_marker(store)
        except ConfigError as exc:
            logger.error("%s", exc)
            _stop(store, ssd, finish_offloads=False)
            return 1
    ready = (
        f"READY pid={os.getpid()} segment={store.get_hostname()} "
        f"segment_bytes={settings.global_segment_size_bytes} setup_s={setup_s:.3f}"
    )
    if ssd is not None:
        ready += f" ssd_dir={ssd.tier.directory} ssd_cap_bytes={ssd.tier.cap_bytes}"
    print(ready, flush=True)
    received = signal.sigwait(_STOP_SIGNALS)
    logger.info("got %s, closing the store", signal.Signals(received).name)
    _stop(store, ssd)
    return 0


def _log_setup_failure(rc: int, setup_s: float, settings: MooncakeSettings) -> None:
    hint = (
        "; with the SSD tier, code -1300 (UNABLE_OFFLOAD) means the master runs without "
        "--enable_offload=true"
        if settings.enable_ssd_offload
        else ""
    )
    logger.error(
        "setup failed rc=%s after %.1fs (master=%s metadata=%s segment_bytes=%d); the "
        "native log above names the cause, e.g. a segment larger than free memory, an "
        "unreachable master or MC_TCP_BIND_ADDRESS not set to a local address%s",
        rc,
        setup_s,
        settings.master_server_address,
        settings.metadata_server,
        settings.global_segment_size_bytes,
        hint,
    )


def _stop(store: object, ssd: NodeSsd | None, finish_offloads: bool = True) -> None:
    """Unmount the disk segment once the accepted offloads are written, then close
    (docs/operating.md, "Restart procedure", says why). ``close()`` exactly once: any call
    on the store afterwards segfaults."""
    state = "stopped"
    if ssd is not None:
        if finish_offloads:
            ssd.finish_offloads()
        rc = store.unmount_local_disk_segment(0)
        if rc != 0:
            state = "unmount-failed"
            logger.warning("unmount_local_disk_segment returned %s; the next start waits", rc)
    store.close()
    if ssd is not None:
        ssd.lock.release(state)
    logger.info("closed")


if __name__ == "__main__":
    sys.exit(main())
