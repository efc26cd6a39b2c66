"""A multi-host Mooncake topology on one Linux machine, built from network namespaces.

Every "host" is a network namespace with one interface (``mc0``) and one
address from ``198.18.0.0/24`` (RFC 2544 benchmarking space, never routed).
The hosts are joined by a bridge that itself lives in a namespace of its own,
so nothing is added to, or changed in, the machine's own network namespace::

    msp1a2b3c-br      bridge br0, one veth port per host (v-master, v-store1 ...)
    msp1a2b3c-master  mc0 198.18.0.1   mooncake_master (+ HTTP metadata, etcd)
    msp1a2b3c-store1  mc0 198.18.0.2   python -m mooncake_span.storage_node
    msp1a2b3c-store2  mc0 198.18.0.3   python -m mooncake_span.storage_node
    msp1a2b3c-prefill mc0 198.18.0.4   sglang prefill node (or node_worker)
    msp1a2b3c-decode  mc0 198.18.0.5   sglang decode node (or node_worker)

Namespace names carry a random run id, so concurrent runs never collide and
fixed ports are safe inside them (each namespace has its own port space).

Three modules, re-exported here (the public path):

* ``namespaces``: ``ip`` commands, per-thread ``setns`` probes, process sweeps;
* ``topology``: ``NetnsTopology``: the namespaces, ``partition(host)`` / ``heal(host)``
  (link down/up of the host's port on the bridge), and processes started in
  a host (``ip netns exec``) in their own session with logs in files. It is
  torn down by ``destroy()``, its context manager, and at interpreter exit.
* ``cluster``: ``NetnsCluster``, the Mooncake side on a topology: optional etcd, one
  master (embedded HTTP metadata) or several HA masters (metadata in etcd),
  and storage nodes, each process bound to its host's address
  (``MC_TCP_BIND_ADDRESS``, ``--rpc_address`` ...).

Command line (``scripts/netns_cluster.sh`` wraps it)::

    python -m mooncake_span_tools.lab.netns up [--ha] [--oplog] [--detach]
    python -m mooncake_span_tools.lab.netns list
    python -m mooncake_span_tools.lab.netns exec RUN_ID HOST -- COMMAND...
    python -m mooncake_span_tools.lab.netns down RUN_ID | --stale

Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and iproute2's ``ip``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mooncake_span_tools.lab.namespaces import (
    _NETNS_DIR,
    DEFAULT_HOSTS,
    NetnsCommandError,
    NetnsUnavailableError,
    _ip,
    _kill_namespace_processes,
    _process_alive,
    _state_dir,
    netns_unavailable_reason,
    run_in_namespace,
)
from mooncake_span_tools.lab.netns_cluster import (
    ETCD_CLIENT_PORT,
    HTTP_METADATA_PORT,
    MASTER_METRICS_PORT,
    MASTER_RPC_PORT,
    ClusterStartError,
    NetnsCluster,
    NetnsClusterSpec,
)
from mooncake_span_tools.lab.topology import (
    _LIVE_TOPOLOGIES,
    NetnsProcess,
    NetnsTopology,
    TopologySpec,
)

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_HOSTS",
    "ETCD_CLIENT_PORT",
    "HTTP_METADATA_PORT",
    "MASTER_METRICS_PORT",
    "MASTER_RPC_PORT",
    "ClusterStartError",
    "NetnsCluster",
    "NetnsClusterSpec",
    "NetnsProcess",
    "NetnsTopology",
    "NetnsUnavailableError",
    "TopologySpec",
    "netns_unavailable_reason",
    "remove_stale_runs",
    "run_in_namespace",
]


# ---------------------------------------------------------------------------
# command line


def _load_states() -> list[dict[str, Any]]:
    directory = _state_dir()
    states = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        state["_path"] = str(path)
        states.append(state)
    return states


def _find_state(run_id: str) -> dict[str, Any]:
    for state in _load_states():
        if run_id in (state.get("run_id"), state.get("tag")):
            return state
    raise SystemExit(f"no netns run {run_id!r} in {_state_dir()}; see `list`")


def _teardown_state(state: Mapping[str, Any]) -> None:
    for namespace in state.get("namespaces", []):
        if (_NETNS_DIR / namespace).exists():
            killed = _kill_namespace_processes(namespace, grace_s=3.0)
            if killed:
                logger.warning("%s: stopped pids %s", namespace, killed)
            _ip("netns", "del", namespace, check=False)
            logger.warning("deleted namespace %s", namespace)
    path = state.get("_path")
    if path:
        Path(path).unlink(missing_ok=True)


def _cmd_up(args: argparse.Namespace) -> int:
    hosts = list(DEFAULT_HOSTS)
    if args.ha:
        hosts.insert(1, "master2")
    spec = TopologySpec(hosts=tuple(hosts))
    topology = NetnsTopology(spec, log_dir=args.log_dir, outlive_owner=args.detach)
    cluster_spec = NetnsClusterSpec(
        master_hosts=("master", "master2") if args.ha else ("master",),
        storage_hosts=("store1", "store2"),
        etcd_host="master" if (args.ha or not args.no_etcd) else None,
        enable_oplog=args.oplog,
        segment_bytes=args.segment_size,
    )
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        topology.create()
        cluster = NetnsCluster(topology, cluster_spec).start()
        topology.record(cluster=cluster.describe())
        run_id = spec.run_id
        config_file = "ha-etcd.json" if args.ha else "prefill-decode.json"
        # the node worker is test support: run it from a checkout of this repository
        worker = "env PYTHONPATH=.:tools python -m tests.netns.node_worker"
        lines = [
            f"netns topology {spec.tag} is up (logs {topology.log_dir})",
            *(
                f"  {h:8s} {topology.address(h):14s} namespace {topology.namespace(h)}"
                for h in spec.hosts
            ),
            "",
            *(f"  {key}: {value}" for key, value in cluster.describe().items()),
            "",
            f"# sglang extra-config on the prefill host (merge with configs/{config_file}):",
            "  " + json.dumps(cluster.client_config("prefill")),
            "",
            "# run a command on a host (binds MC_TCP_BIND_ADDRESS to its address):",
            f"  python -m mooncake_span_tools.lab.netns exec {run_id} prefill -- {worker} write "
            f"--master {cluster.master_address} --metadata {cluster.metadata_server}",
            f"  python -m mooncake_span_tools.lab.netns exec {run_id} decode -- {worker} read "
            f"--master {cluster.master_address} --metadata {cluster.metadata_server}",
            "",
        ]
        if args.detach:
            topology.detach()
            lines.append(
                f"detached; tear down with: python -m mooncake_span_tools.lab.netns down {run_id}"
            )
            print("\n".join(lines), flush=True)
            return 0
        lines.append("ready; Ctrl-C tears everything down")
        print("\n".join(lines), flush=True)
        while not stop.wait(1.0):
            for process in topology.processes():
                if not process.running():
                    print(
                        f"warning: {process.name} exited ({process.returncode}); "
                        f"log {process.log_path}",
                        file=sys.stderr,
                    )
                    stop.set()
        return 0
    except (NetnsUnavailableError, NetnsCommandError, ClusterStartError, FileNotFoundError) as exc:
        print(f"netns up: {exc}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        # A detached run left _LIVE_TOPOLOGIES; anything else is torn down here.
        if topology in _LIVE_TOPOLOGIES:
            topology.destroy()


def remove_stale_runs() -> list[str]:
    """Tear down every recorded run whose owner process died without detaching it
    (a killed test run, say): its processes, namespaces and state file. Returns
    the run tags removed; runs whose owner lives are left alone."""
    removed = []
    for state in _load_states():
        owner = int(state.get("owner_pid", 0))
        if state.get("detached") or (owner and _process_alive(owner)):
            continue
        logger.warning(
            "tearing down stale netns run %s (owner pid %d is gone)", state.get("tag"), owner
        )
        _teardown_state(state)
        removed.append(str(state.get("tag")))
    return removed


def _cmd_down(args: argparse.Namespace) -> int:
    if args.stale:
        for tag in remove_stale_runs():
            print(f"tore down stale run {tag}")
        return 0
    if not args.run_id:
        raise SystemExit("down: name a RUN_ID (see `list`) or pass --stale")
    _teardown_state(_find_state(args.run_id))
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    states = _load_states()
    if not states:
        print(f"no netns runs recorded in {_state_dir()}")
    for state in states:
        owner = int(state.get("owner_pid", 0))
        alive = (
            "detached"
            if state.get("detached")
            else ("running" if _process_alive(owner) else "stale")
        )
        print(
            f"{state.get('run_id')}  {alive:8s}  hosts {json.dumps(state.get('hosts'))}  "
            f"logs {state.get('log_dir')}"
        )
        cluster = state.get("cluster")
        if cluster:
            print(
                f"        master {cluster.get('master_address')}  "
                f"metadata {cluster.get('metadata_server')}"
            )
    return 0


def _cmd_exec(args: argparse.Namespace) -> int:
    state = _find_state(args.run_id)
    hosts = state.get("hosts", {})
    if args.host not in hosts:
        raise SystemExit(f"exec: run {args.run_id} has hosts {sorted(hosts)}, not {args.host!r}")
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise SystemExit("exec: give a command after --")
    namespace = f"{state['tag']}-{args.host}"
    address = hosts[args.host]
    os.execvp(
        "ip",
        [
            "ip",
            "netns",
            "exec",
            namespace,
            "env",
            f"MC_TCP_BIND_ADDRESS={address}",
            f"MOONCAKE_LOCAL_HOSTNAME={address}",
            *command,
        ],
    )
    return 127  # not reached


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mooncake_span_tools.lab.netns",
        description=(
            "A multi-host Mooncake topology on one machine: network namespaces (master, "
            "store1, store2, prefill, decode; master2 with --ha) joined by a bridge that lives "
            "in its own namespace, addresses 198.18.0.x/24. Needs root and iproute2."
        ),
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    up = commands.add_parser("up", help="create the topology and start Mooncake on it")
    up.add_argument(
        "--ha", action="store_true", help="two masters (master, master2) in etcd HA mode"
    )
    up.add_argument(
        "--oplog", action="store_true", help="with --ha: replicate metadata (--enable_oplog=true)"
    )
    up.add_argument(
        "--no-etcd",
        action="store_true",
        help="without --ha: skip the etcd on the master host (used by span_layout_guard=etcd)",
    )
    up.add_argument("--segment-size", default="1gb", help="memory per storage node (default 1gb)")
    up.add_argument(
        "--log-dir", default=None, help="directory for process logs (default: a temp dir)"
    )
    up.add_argument(
        "--detach",
        action="store_true",
        help="exit after start-up and leave everything running (tear down with `down RUN_ID`)",
    )
    up.set_defaults(func=_cmd_up)
    down = commands.add_parser("down", help="tear a run down (its processes and namespaces)")
    down.add_argument("run_id", nargs="?", help="run id (from `list` or the `up` output)")
    down.add_argument(
        "--stale", action="store_true", help="tear down every run whose owner process died"
    )
    down.set_defaults(func=_cmd_down)
    listing = commands.add_parser("list", help="show recorded runs")
    listing.set_defaults(func=_cmd_list)
    execute = commands.add_parser("exec", help="run a command on a host of a run")
    execute.add_argument("run_id")
    execute.add_argument("host")
    execute.add_argument("command", nargs=argparse.REMAINDER)
    execute.set_defaults(func=_cmd_exec)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "up" and args.oplog and not args.ha:
        print("netns up: --oplog needs --ha", file=sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
