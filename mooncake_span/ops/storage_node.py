"""A storage-only Mooncake process: it contributes memory and holds data.

Run as ``python -m mooncake_span.storage_node --master HOST:PORT --metadata URL
--segment-bytes 512mb``. The process mounts a global segment of that size,
prints exactly one line starting with ``READY`` to stdout, then waits for
SIGTERM or SIGINT, closes the store once and exits 0. Setup failures print an
error to stderr and exit 1; bad arguments exit 2.

Objects written by any client land in such segments, so data outlives the
writer process (but not this process or the master).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

from mooncake_span.ops.cluster import validate_master_address, validate_metadata_server
from mooncake_span.units import parse_size_bytes

logger = logging.getLogger(__name__)

_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mooncake_span.storage_node",
        description="Mount a Mooncake global segment and keep it alive until SIGTERM/SIGINT.",
    )
    parser.add_argument(
        "--master",
        required=True,
        help="master address, HOST:PORT or etcd://HOST:PORT for HA masters",
    )
    parser.add_argument(
        "--metadata",
        required=True,
        help="metadata server: http://HOST:PORT/metadata, etcd://HOST:PORT or P2PHANDSHAKE",
    )
    parser.add_argument(
        "--segment-bytes",
        required=True,
        help="size of the global segment this node contributes, e.g. 512mb or 1073741824",
    )
    parser.add_argument(
        "--local-buffer-bytes",
        default="16mb",
        help="size of the client's local transfer buffer (default: 16mb)",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="local hostname/IP this node advertises (default: 127.0.0.1)",
    )
    parser.add_argument("--protocol", default="tcp", help="transfer protocol (default: tcp)")
    parser.add_argument("--device", default="", help="RDMA device name; empty for tcp")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        segment_bytes = parse_size_bytes(args.segment_bytes)
        local_buffer_bytes = parse_size_bytes(args.local_buffer_bytes)
        validate_master_address(args.master)
        # An unknown scheme makes the native setup abort the whole process.
        validate_metadata_server(args.metadata)
    except ValueError as exc:
        parser.error(str(exc))
    if segment_bytes <= 0:
        parser.error(f"--segment-bytes must be > 0 for a storage node, got {args.segment_bytes!r}")

    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s storage_node[%(process)d] %(message)s",
    )

    # Block the stop signals before the native library starts its threads:
    # they inherit the mask, so a SIGTERM that arrives during setup stays
    # pending and is picked up by sigwait() below instead of killing us
    # half-initialised.
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)

    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    started_s = time.monotonic()
    rc = store.setup(
        args.host,
        args.metadata,
        segment_bytes,
        local_buffer_bytes,
        args.protocol,
        args.device,
        args.master,
    )
    setup_s = time.monotonic() - started_s
    if rc != 0:
        logger.error(
            "setup failed rc=%s after %.1fs (master=%s metadata=%s segment_bytes=%d); the "
            "native log above names the cause, e.g. a segment larger than free memory, an "
            "unreachable master or MC_TCP_BIND_ADDRESS not set to a local address",
            rc,
            setup_s,
            args.master,
            args.metadata,
            segment_bytes,
        )
        return 1

    print(
        f"READY pid={os.getpid()} segment={store.get_hostname()} "
        f"segment_bytes={segment_bytes} setup_s={setup_s:.3f}",
        flush=True,
    )
    received = signal.sigwait(_STOP_SIGNALS)
    logger.info("got %s, closing the store", signal.Signals(received).name)
    # close() exactly once; any call on the store afterwards segfaults.
    store.close()
    logger.info("closed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
