"""``python -m mooncake_span.storage_node``: a storage-only Mooncake process.

Its contract (the ``READY`` line, signals, exit codes) and its SSD tier's checks, all
made before anything in the directory is touched: docs/operating.md, "A storage node"
and "The SSD tier".
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping
from typing import Any

from mooncake_span.errors import ConfigError
from mooncake_span.mooncake_settings import (
    CONFIG_PATH_ENV,
    MooncakeSettings,
    load_mooncake_settings,
)
from mooncake_span.store import ssd_marker, ssd_scan, ssd_tier
from mooncake_span.store.gate import replicate_config
from mooncake_span.store.native import setup_arguments
from mooncake_span.store.segments import fetch_segments
from mooncake_span.store.ssd_tier import DEFAULT_READ_BUFFER_BYTES
from mooncake_span.units import parse_size_bytes

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
    parser.add_argument(
        "--ssd-dir",
        metavar="DIR",
        help="keep every object on this SSD directory too (it must exist); the node uses "
        "DIR/<node name>, which a restart with the same name finds again",
    )
    parser.add_argument(
        "--ssd-size",
        metavar="SIZE",
        help="disk cap of the SSD tier, oldest objects evicted first (default: 90%% of the "
        "disk, Mooncake's default); at least the segment size",
    )
    parser.add_argument(
        "--ssd-read-buffer",
        metavar="SIZE",
        help=f"RAM staging objects read from the SSD for a reader (default: "
        f"{DEFAULT_READ_BUFFER_BYTES >> 20}mb; a larger batch is read in parts)",
    )
    parser.add_argument(
        "--ssd-check",
        choices=ssd_scan.CHECK_MODES,
        help="before registering the directory, delete objects that could only read as "
        "misses: size reads metadata only (torn and orphaned files); full also reads every "
        "sealed object and deletes those whose checksum fails (the whole directory, per "
        f"start); off trusts it (default: ${ssd_scan.CHECK_ENV}, else {ssd_scan.DEFAULT_CHECK})",
    )
    parser.add_argument(
        "--ssd-stop-wait-s",
        type=float,
        metavar="S",
        help="on SIGTERM, wait at most this long for the objects the node holds unwritten to "
        f"reach the disk before it stops (default: ${ssd_tier.STOP_WAIT_ENV}, else "
        f"{ssd_tier.DEFAULT_STOP_WAIT_S:g}; 0 stops at once and loses them)",
    )
    parser.add_argument(
        "--node-name",
        help="stable name of this node: its SSD sub-directory (default: this host's name)",
    )
    parser.add_argument(
        "--admin-url",
        metavar="URL",
        help="the master's admin server http://HOST:PORT (its --metrics_port): after a crash "
        "the node waits there until the master has dropped its predecessor",
    )
    parser.add_argument(
        "--client-ttl-s",
        type=int,
        default=10,  # Mooncake's default --client_ttl
        metavar="S",
        help="the master's --client_ttl, the longest wait after a crash (default: %(default)s)",
    )
    return parser


@dataclasses.dataclass
class NodeSsd:
    """A storage node's SSD tier, its directory locked."""

    tier: ssd_tier.SsdTier
    lock: ssd_tier.DirLock
    previous: dict[str, Any]
    stop_wait_s: float = ssd_tier.DEFAULT_STOP_WAIT_S

    def finish_offloads(self) -> None:
        """On a graceful stop, before the disk segment is unmounted: every object the
        node holds unwritten reaches the disk and the master's listing first."""
        if not self.stop_wait_s:
            logger.warning("--ssd-stop-wait-s 0: stopping without waiting for offloads")
            return
        started_s = time.monotonic()
        quiet_s = ssd_tier.offload_quiet_s(os.environ)
        if ssd_tier.wait_offloads_written(self.tier.directory, self.stop_wait_s, quiet_s):
            logger.info("offloads written (%.1f s)", time.monotonic() - started_s)
        else:
            logger.warning(
                "still writing offloads after %.0f s (--ssd-stop-wait-s); stopping anyway: "
                "objects put in the last heartbeat may be lost",
                self.stop_wait_s,
            )


def size_flag(text: str | None, flag: str) -> int | None:
    """A size flag's bytes (None when not given); ConfigError naming the flag."""
    try:
        return None if text is None else parse_size_bytes(text)
    except ValueError as exc:
        raise ConfigError(f"{flag}: {exc}") from None


def _root(args: argparse.Namespace, settings: MooncakeSettings) -> tuple[str, str] | None:
    """(root, the flag or key it came from), or None without an SSD tier."""
    if args.ssd_dir is not None:
        return args.ssd_dir, "--ssd-dir"
    if settings.enable_ssd_offload and settings.ssd_offload_path:
        return settings.ssd_offload_path, f"ssd_offload_path ({settings.source})"
    if settings.enable_ssd_offload:
        raise ConfigError(
            f"enable_ssd_offload is set ({settings.source}) but no directory: set "
            "ssd_offload_path, or pass --ssd-dir"
        )
    for flag in ("ssd_size", "ssd_read_buffer", "ssd_stop_wait_s", "node_name"):
        if getattr(args, flag) is not None:
            raise ConfigError(f"--{flag.replace('_', '-')} needs --ssd-dir")
    return None


def prepare_node_ssd(args: argparse.Namespace, settings: MooncakeSettings) -> NodeSsd | None:
    """Check the SSD flags and lock the node's directory; None without ``--ssd-dir``.

    Raises:
        ConfigError: a bad value, or the directory is in use; the message says what to do.
    """
    found = _root(args, settings)
    if found is None:
        return None
    root = ssd_tier.check_root(*found)
    check, check_source = ssd_scan.resolve_check(args.ssd_check, os.environ)
    name = args.node_name or socket.gethostname()
    cap = size_flag(args.ssd_size, "--ssd-size")
    read_buffer = size_flag(args.ssd_read_buffer, "--ssd-read-buffer")
    stop_wait = ssd_tier.resolve_stop_wait_s(args.ssd_stop_wait_s, os.environ)
    # Every value is checked before anything is created or locked.
    tier = ssd_tier.SsdTier(
        directory=os.path.join(root, name),
        cap_bytes=cap if cap is not None else ssd_tier.default_cap_bytes(root),
        largest_object_bytes=settings.global_segment_size_bytes,
        read_buffer_bytes=read_buffer if read_buffer is not None else DEFAULT_READ_BUFFER_BYTES,
    )
    # What the tier holds counts as room; summed up front (a stat per file) only
    # where free space alone cannot hold one object, else the check counts it.
    held = None
    if ssd_tier.usable_bytes(root) < tier.largest_object_bytes:
        held = ssd_tier.held_bytes(tier.directory)
        ssd_tier.check_room(
            ssd_tier.usable_bytes(root, held), tier.cap_bytes, tier.largest_object_bytes, root
        )
    directory = ssd_tier.process_dir(root, name, found[1])
    lock = ssd_tier.DirLock(root, name)
    previous = lock.acquire(f"{directory} (node {name!r})")
    logger.info("SSD check %s (from %s)", check, check_source)
    report = ssd_scan.check_directory(directory, check)
    if held is None:
        held = report.kept_bytes if check != "off" else ssd_tier.held_bytes(directory)
    short = ssd_tier.check_room(
        ssd_tier.usable_bytes(root, held), tier.cap_bytes, tier.largest_object_bytes, root
    )
    if short:
        logger.warning("%s", short)
    return NodeSsd(tier, lock, previous, stop_wait)


def wait_after_crash(node: NodeSsd, args: argparse.Namespace, settings: MooncakeSettings) -> None:
    """A predecessor that crashed stays registered at the master for its client_ttl, and
    a restart registered before that is ignored: wait it out (bounded)."""
    if not ssd_tier.crashed(node.previous):
        return
    admin_url = args.admin_url or settings.configured_admin_url()
    lister = (lambda: fetch_segments(admin_url)) if admin_url else None
    logger.warning(
        "the previous node on %s (pid %s, segment %s) did not stop cleanly; waiting for the "
        "master (%s) to drop it, at most %d s",
        node.tier.directory,
        node.previous.get("pid"),
        node.previous.get("segment"),
        admin_url or "no admin URL",
        args.client_ttl_s + ssd_tier.EXPIRY_MARGIN_S,
    )
    waited_s = ssd_tier.wait_for_owner_expiry(node.previous, args.client_ttl_s, lister)
    logger.info("waited %.1f s for the master to drop the crashed node", waited_s)


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

    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

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
        segment = store.get_hostname()
        ssd.lock.update(state="running", segment=segment)
        # Tells the cluster's clients it has an SSD tier (store/ssd_marker.py); hard-pinned
        # on this node's own segment, so it lives as long as the node.
        config = replicate_config(ReplicateConfig, 1, None, True, segment)
        try:
            ssd_marker.publish(lambda key, data: store.put(key, data, config), segment)
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
