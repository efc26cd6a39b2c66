"""The ``mooncake-span`` command line: each subcommand's ``register(subparsers)`` sets
``func``, which ``main()`` dispatches to. The tooling distribution adds its commands
through the ``COMMANDS_GROUP`` entry points, so this module never imports it."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import logging
import shlex
import signal
import sys
import threading

from mooncake_span.ops import doctor, inspect_cmd, validate_cmd
from mooncake_span.ops.cli_common import non_negative_int_arg, positive_int_arg, size_arg
from mooncake_span.ops.cluster import ClusterSpec, ClusterStartError, LocalCluster
from mooncake_span.ops.cluster_spec import (
    CLUSTER_UP_EVICTION_HIGH_WATERMARK_RATIO,
    CLUSTER_UP_EVICTION_RATIO,
    CLUSTER_UP_LEASE_TTL_MS,
    SSD_EVICTION_HIGH_WATERMARK_RATIO,
    SSD_EVICTION_RATIO,
    SSD_LEASE_TTL_MS,
)
from mooncake_span.store.ssd_tier import CHECK_MODES
from mooncake_span.units import parse_size_bytes

# The entry-point group through which another distribution adds subcommands:
# each entry point is named after its command and loads to a register(subparsers).
COMMANDS_GROUP = "mooncake_span.commands"
# The tooling distribution's commands, named here only so that asking for one
# without it installed says how to get it instead of "invalid choice".
TOOLS_COMMANDS = ("bench", "demo", "demo-span", "soak")
TOOLS_INSTALL_HINT = (
    "not installed here; it comes with the tooling distribution, mooncake-span-tools: "
    "pip install ./tools from a checkout of mooncake-span (scripts/setup.sh installs both)"
)


def _register_cluster(subparsers: argparse._SubParsersAction) -> None:
    cluster = subparsers.add_parser(
        "cluster",
        help="run a local Mooncake cluster",
        description="Run a local Mooncake cluster (master, metadata, storage nodes).",
    )
    actions = cluster.add_subparsers(dest="cluster_command", metavar="ACTION", required=True)
    up = actions.add_parser(
        "up",
        help="start a cluster in the foreground until Ctrl-C or SIGTERM",
        description=(
            "Start a local Mooncake cluster in the foreground, print its addresses, a "
            "ready-to-paste SGLang extra-config JSON and the client environment, and keep it "
            "running until Ctrl-C or SIGTERM; then stop every process it started."
        ),
    )
    # (flag, keywords, help); every help text names its own default. Each flag's dest is
    # the ClusterSpec field it sets (cluster_spec_from_args).
    switch = {"action": "store_true"}
    size = {"type": size_arg, "metavar": "SIZE"}
    ratio = {"type": float, "metavar": "RATIO"}
    flags = (
        (
            "--storage-nodes",
            {"type": non_negative_int_arg, "default": 1, "metavar": "N"},
            "number of storage-only processes contributing memory (default: 1)",
        ),
        (
            "--segment-size",
            {**size, "default": parse_size_bytes("1gb"), "dest": "storage_node_segment_bytes"},
            "memory each storage node contributes, e.g. 1gb, 512mb or bytes (default: 1gb)",
        ),
        (
            "--host",
            {"default": "127.0.0.1"},
            "IPv4 address every process binds and advertises (default: 127.0.0.1)",
        ),
        ("--etcd", switch, "also run etcd (required for --ha-masters > 1)"),
        (
            "--standalone-metadata",
            switch,
            "run mooncake_http_metadata_server instead of the master's embedded metadata server",
        ),
        (
            "--ha-masters",
            {"type": positive_int_arg, "default": 1, "metavar": "N"},
            "number of masters; > 1 runs them in etcd-backed HA mode (needs --etcd) (default: 1)",
        ),
        (
            "--enable-oplog",
            switch,
            "replicate object metadata between HA masters so keys survive a failover",
        ),
        (
            "--ssd-dir",
            {"metavar": "DIR"},
            "give every storage node an SSD tier on DIR/node<i> (DIR must exist); a new "
            "cluster on the same DIR finds the cache again (docs/operating.md, 'The SSD tier')",
        ),
        (
            "--ssd-size",
            {**size, "dest": "ssd_size_bytes"},
            "disk cap of each node's SSD tier, oldest objects evicted first (default: 90%% of "
            "the disk); at least --segment-size",
        ),
        (
            "--ssd-read-buffer",
            {**size, "dest": "ssd_read_buffer_bytes"},
            "RAM each node stages SSD reads in (default: 256mb)",
        ),
        (
            "--ssd-check",
            {"choices": CHECK_MODES},
            "each node's check of its SSD directory at start: size (metadata only: torn and "
            "orphaned files), full (also reads every sealed object; the whole tier, per start) or "
            "off (default: $MOONCAKE_SPAN_SSD_CHECK as the nodes inherit it, else size)",
        ),
        (
            "--lease-ttl-ms",
            {"type": positive_int_arg, "metavar": "MS"},
            f"master's default_kv_lease_ttl in milliseconds (default: {CLUSTER_UP_LEASE_TTL_MS}, "
            f"{SSD_LEASE_TTL_MS} with --ssd-dir; Mooncake's 10000 keeps every looked-up object "
            "unevictable for 10 s, see docs/benchmarks.md)",
        ),
        (
            "--client-ttl-s",
            {"type": positive_int_arg, "metavar": "S"},
            "seconds before the master drops a silent client's segments (default: Mooncake's, 10)",
        ),
        (
            "--eviction-high-watermark-ratio",
            ratio,
            f"memory usage ratio in (0, 1] that triggers eviction (default: "
            f"{CLUSTER_UP_EVICTION_HIGH_WATERMARK_RATIO}, {SSD_EVICTION_HIGH_WATERMARK_RATIO} with "
            "--ssd-dir)",
        ),
        (
            "--eviction-ratio",
            ratio,
            f"share of objects one eviction pass frees, in (0, 1] (default: "
            f"{CLUSTER_UP_EVICTION_RATIO}, {SSD_EVICTION_RATIO} with --ssd-dir)",
        ),
        (
            "--log-dir",
            {"metavar": "DIR"},
            "directory for the processes' logs (default: a new temporary directory)",
        ),
        (
            "--start-timeout-s",
            {"type": float, "default": 60.0, "metavar": "S"},
            "give up if the cluster is not ready after this many seconds (default: 60)",
        ),
    )
    for flag, keywords, text in flags:
        up.add_argument(flag, **keywords, help=text)
    up.set_defaults(func=cluster_up)


def _raise_stop(signum: int, frame: object) -> None:
    # SIGTERM stops as Ctrl-C does. One-shot: a second signal must not interrupt the
    # teardown half-way.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


def cluster_spec_from_args(args: argparse.Namespace) -> ClusterSpec:
    """The ``ClusterSpec`` of ``cluster up``'s flags (ValueError on a bad combination)."""
    fields = {field.name for field in dataclasses.fields(ClusterSpec)}
    given = {name: value for name, value in vars(args).items() if name in fields}
    # Master tunables not given: CLUSTER_UP_*, or ClusterSpec's SSD_* values with --ssd-dir.
    if not args.ssd_dir:
        for name, default in (
            ("lease_ttl_ms", CLUSTER_UP_LEASE_TTL_MS),
            ("eviction_high_watermark_ratio", CLUSTER_UP_EVICTION_HIGH_WATERMARK_RATIO),
            ("eviction_ratio", CLUSTER_UP_EVICTION_RATIO),
        ):
            if given[name] is None:
                given[name] = default
    return ClusterSpec(**given)


def cluster_up(args: argparse.Namespace) -> int:
    try:
        spec = cluster_spec_from_args(args)
    except ValueError as exc:
        print(f"mooncake-span cluster up: {exc}", file=sys.stderr)
        return 2

    cluster = LocalCluster(spec)
    previous_handlers = {
        sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        try:
            cluster.start()
            _print_ready(cluster)
            _watch_until_signal(cluster)
        finally:
            for sig in previous_handlers:
                signal.signal(sig, signal.SIG_IGN)
            if cluster.started:
                print("stopping the cluster...", flush=True)
            cluster.stop()
    except KeyboardInterrupt:
        print("cluster stopped", flush=True)
        return 0
    except (ClusterStartError, FileNotFoundError) as exc:
        print(f"mooncake-span cluster up: {exc}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
    return 0


def _watch_until_signal(cluster: LocalCluster) -> None:
    """Block until a stop signal; report cluster processes that die meanwhile."""
    expected = set(cluster.pids())
    reported: set[str] = set()
    idle = threading.Event()
    while True:
        # The signal handler raises out of this wait.
        idle.wait(1.0)
        for name in sorted(expected - reported - set(cluster.pids())):
            reported.add(name)
            print(
                f"warning: {name} exited unexpectedly; see {cluster.log_dir / (name + '.log')}",
                file=sys.stderr,
                flush=True,
            )


def _print_ready(cluster: LocalCluster) -> None:
    spec = cluster.spec
    lines = [
        f"mooncake cluster is up: {spec.ha_masters} master(s), {spec.storage_nodes} storage "
        f"node(s) of {spec.storage_node_segment_bytes} bytes",
        f"master_address:  {cluster.master_address}",
        f"metadata_server: {cluster.metadata_server}",
        f"metrics_url:     {cluster.metrics_url}",
    ]
    if cluster.etcd_endpoint is not None:
        lines.append(f"etcd_endpoint:   {cluster.etcd_endpoint}")
    # Each node's SSD directory and disk cap, as the node itself reported them.
    lines += [
        f"ssd node{i}:       {tier['ssd_dir']} (cap {tier['ssd_cap_bytes']} bytes)"
        for i, tier in enumerate(cluster.ssd_tiers())
    ]
    lines += [
        f"log_dir:         {cluster.log_dir}",
        f"pids:            {json.dumps(cluster.pids())}",
        "",
        "# SGLang --hicache-storage-backend-extra-config (merge with your backend keys):",
        json.dumps(cluster.client_config()),
        "",
        "# environment for client processes:",
        *(f"export {name}={shlex.quote(value)}" for name, value in cluster.client_env().items()),
        "",
        "# check a client host / list what is stored:",
        f"mooncake-span doctor --master {cluster.master_address} --metadata "
        f"{cluster.metadata_server} --admin-url {cluster.metrics_url}",
        f"mooncake-span inspect --admin-url {cluster.metrics_url}",
        "",
        "ready; press Ctrl-C to stop",
    ]
    print("\n".join(lines), flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mooncake-span",
        description="Tools for mooncake-span, the SGLang HiCache backend on Mooncake.",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="log more (-v: info, -vv: debug)"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _register_cluster(subparsers)
    doctor.register(subparsers)
    inspect_cmd.register(subparsers)
    validate_cmd.register(subparsers)
    _register_installed_commands(subparsers)
    return parser


def _register_installed_commands(subparsers: argparse._SubParsersAction) -> None:
    """The commands other installed distributions add; each tooling command that none
    added answers with how to install it."""
    added = {point.name: point for point in importlib.metadata.entry_points(group=COMMANDS_GROUP)}
    for name in sorted(added):
        added[name].load()(subparsers)
    for name in TOOLS_COMMANDS:
        if name not in added:
            # No option prefix: whatever follows the command (--help too) is taken
            # as it comes, so every form of the command gets the same one line.
            missing = subparsers.add_parser(
                name,
                help="(not installed: needs mooncake-span-tools)",
                add_help=False,
                prefix_chars="\0",
            )
            missing.add_argument("ignored", nargs=argparse.REMAINDER)
            missing.set_defaults(func=_say_how_to_install)


def _say_how_to_install(args: argparse.Namespace) -> int:
    print(f"mooncake-span {args.command}: {TOOLS_INSTALL_HINT}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
