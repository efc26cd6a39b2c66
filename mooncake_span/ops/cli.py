"""The ``mooncake-span`` command line.

Each subcommand is a ``_register_<name>(subparsers)`` function that adds its
parser and sets ``func``; ``main()`` only parses and dispatches via
``args.func(args)``, so new subcommands (``demo``, ``bench``) plug in by adding
one registration call to ``build_parser()``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import shlex
import signal
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mooncake_span.ops import doctor, inspect_cmd, validate_cmd
from mooncake_span.ops.arg_types import non_negative_int_arg as _non_negative_int_arg
from mooncake_span.ops.arg_types import positive_int_arg as _positive_int_arg
from mooncake_span.ops.arg_types import size_arg as _size_arg
from mooncake_span.ops.cluster_spec import (
    CLUSTER_UP_EVICTION_HIGH_WATERMARK_RATIO,
    CLUSTER_UP_EVICTION_RATIO,
    CLUSTER_UP_LEASE_TTL_MS,
    SSD_EVICTION_HIGH_WATERMARK_RATIO,
    SSD_EVICTION_RATIO,
    SSD_LEASE_TTL_MS,
)
from mooncake_span.ops.native_log import add_native_log_arg, native_stderr_to, resolve_native_log
from mooncake_span.units import parse_size_bytes

if TYPE_CHECKING:
    from mooncake_span.ops.cluster import ClusterSpec, LocalCluster

logger = logging.getLogger(__name__)

_WATCH_INTERVAL_S = 1.0


# ---------------------------------------------------------------------------
# cluster


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
    up.add_argument(
        "--storage-nodes",
        type=_non_negative_int_arg,
        default=1,
        metavar="N",
        help="number of storage-only processes contributing memory (default: 1)",
    )
    up.add_argument(
        "--segment-size",
        type=_size_arg,
        default=parse_size_bytes("1gb"),
        metavar="SIZE",
        help="memory each storage node contributes, e.g. 1gb, 512mb or bytes (default: 1gb)",
    )
    up.add_argument(
        "--host",
        default="127.0.0.1",
        help="IPv4 address every process binds and advertises (default: 127.0.0.1)",
    )
    up.add_argument(
        "--etcd",
        action="store_true",
        help="also run etcd (required for --ha-masters > 1)",
    )
    up.add_argument(
        "--standalone-metadata",
        action="store_true",
        help="run mooncake_http_metadata_server instead of the master's embedded metadata server",
    )
    up.add_argument(
        "--ha-masters",
        type=_positive_int_arg,
        default=1,
        metavar="N",
        help="number of masters; > 1 runs them in etcd-backed HA mode (needs --etcd) (default: 1)",
    )
    up.add_argument(
        "--enable-oplog",
        action="store_true",
        help="replicate object metadata between HA masters so keys survive a failover",
    )
    up.add_argument(
        "--ssd-dir",
        default=None,
        metavar="DIR",
        help="give every storage node an SSD tier on DIR/node<i> (DIR must exist); a new "
        "cluster on the same DIR finds the cache again (docs/operating.md, 'The SSD tier')",
    )
    up.add_argument(
        "--ssd-size",
        type=_size_arg,
        default=None,
        metavar="SIZE",
        help="disk cap of each node's SSD tier, oldest objects evicted first (default: 90%% of "
        "the disk); at least --segment-size",
    )
    up.add_argument(
        "--ssd-read-buffer",
        type=_size_arg,
        default=None,
        metavar="SIZE",
        help="RAM each node stages SSD reads in (default: 256mb)",
    )
    up.add_argument(
        "--lease-ttl-ms",
        type=_positive_int_arg,
        default=None,
        metavar="MS",
        help=f"master's default_kv_lease_ttl in milliseconds (default: {CLUSTER_UP_LEASE_TTL_MS}, "
        f"{SSD_LEASE_TTL_MS} with --ssd-dir; Mooncake's 10000 keeps every looked-up object "
        "unevictable for 10 s, see docs/benchmarks.md)",
    )
    up.add_argument(
        "--client-ttl-s",
        type=_positive_int_arg,
        default=None,
        metavar="S",
        help="seconds before the master drops a silent client's segments (default: Mooncake's, 10)",
    )
    up.add_argument(
        "--eviction-high-watermark-ratio",
        type=float,
        default=None,
        metavar="RATIO",
        help=f"memory usage ratio in (0, 1] that triggers eviction (default: "
        f"{CLUSTER_UP_EVICTION_HIGH_WATERMARK_RATIO}, {SSD_EVICTION_HIGH_WATERMARK_RATIO} with "
        "--ssd-dir)",
    )
    up.add_argument(
        "--eviction-ratio",
        type=float,
        default=None,
        metavar="RATIO",
        help=f"share of objects one eviction pass frees, in (0, 1] (default: "
        f"{CLUSTER_UP_EVICTION_RATIO}, {SSD_EVICTION_RATIO} with --ssd-dir)",
    )
    up.add_argument(
        "--log-dir",
        default=None,
        metavar="DIR",
        help="directory for the processes' logs (default: a new temporary directory)",
    )
    up.add_argument(
        "--start-timeout-s",
        type=float,
        default=60.0,
        metavar="S",
        help="give up if the cluster is not ready after this many seconds (default: 60)",
    )
    up.set_defaults(func=cluster_up)


class _StopRequested(Exception):
    pass


def _raise_stop(signum: int, frame: object) -> None:
    # One-shot: a second Ctrl-C must not interrupt the teardown half-way.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    raise _StopRequested(signal.Signals(signum).name)


def cluster_spec_from_args(args: argparse.Namespace) -> ClusterSpec:
    """The ``ClusterSpec`` of ``cluster up``'s flags (ValueError on a bad combination)."""
    from mooncake_span.ops.cluster import ClusterSpec

    # Master tunables not given: CLUSTER_UP_*, or ClusterSpec's SSD_* values with --ssd-dir.
    def given_or(value: float | None, default: float) -> float | None:
        return value if value is not None or args.ssd_dir else default

    return ClusterSpec(
        host=args.host,
        storage_nodes=args.storage_nodes,
        storage_node_segment_bytes=args.segment_size,
        etcd=args.etcd,
        standalone_metadata=args.standalone_metadata,
        ha_masters=args.ha_masters,
        enable_oplog=args.enable_oplog,
        lease_ttl_ms=given_or(args.lease_ttl_ms, CLUSTER_UP_LEASE_TTL_MS),
        client_ttl_s=args.client_ttl_s,
        eviction_high_watermark_ratio=given_or(
            args.eviction_high_watermark_ratio, CLUSTER_UP_EVICTION_HIGH_WATERMARK_RATIO
        ),
        eviction_ratio=given_or(args.eviction_ratio, CLUSTER_UP_EVICTION_RATIO),
        ssd_dir=args.ssd_dir,
        ssd_size_bytes=args.ssd_size,
        ssd_read_buffer_bytes=args.ssd_read_buffer,
        log_dir=args.log_dir,
        start_timeout_s=args.start_timeout_s,
    )


def cluster_up(args: argparse.Namespace) -> int:
    """``mooncake-span cluster up``: run a LocalCluster until SIGINT/SIGTERM."""
    from mooncake_span.ops.cluster import ClusterStartError, LocalCluster

    try:
        spec = cluster_spec_from_args(args)
    except ValueError as exc:
        print(f"mooncake-span cluster up: {exc}", file=sys.stderr)
        return 2

    cluster = LocalCluster(spec)
    # SIGTERM gets the same treatment as Ctrl-C: unwind and tear down.
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
    except _StopRequested:
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
        idle.wait(_WATCH_INTERVAL_S)
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
    lines += _ssd_lines(cluster)
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


def _ssd_lines(cluster: LocalCluster) -> list[str]:
    """Each node's SSD directory and disk cap, as the node itself reported them."""
    tiers = cluster.ssd_tiers()
    return [
        f"ssd node{i}:       {tier['ssd_dir']} (cap {tier['ssd_cap_bytes']} bytes)"
        for i, tier in enumerate(tiers)
    ]


# ---------------------------------------------------------------------------
# demo


def _register_serve_demo(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser(
        "demo",
        help="two real sglang servers share one Mooncake L3 (the main job)",
        description=(
            "Start an embedded local Mooncake cluster, make a tiny model locally, start two "
            "sglang.launch_server processes with this backend, send a prompt to the first and "
            "the same prompt to the second, and print the tokens the second restored from L3, "
            "whether both answers match, and the timings. Exits 1 if nothing came from L3 or "
            "the answers differ. On a host without CUDA the servers run with the CPU stand-ins."
        ),
    )
    demo.add_argument(
        "--model",
        choices=("llama", "deepseek_v2", "glm5_next"),
        default="llama",
        help="MHA, MLA, or GLM-5.3-Flash (MLA KV + DSA indexer + KDA state, 256-token pages)",
    )
    demo.add_argument(
        "--layout",
        choices=("page_first_direct", "layer_first"),
        default="page_first_direct",
        help="host pool layout (default page_first_direct)",
    )
    demo.add_argument(
        "--prompt-tokens", type=_positive_int_arg, default=2048, help="prompt length (2048)"
    )
    demo.add_argument(
        "--answer-tokens", type=_positive_int_arg, default=16, help="greedy answer length (16)"
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed of the prompt")
    demo.set_defaults(func=run_serve_demo_command)


def run_serve_demo_command(args: argparse.Namespace) -> int:
    from mooncake_span.lab.serve_demo import ServeDemoConfig, run_serve_demo

    try:
        config = ServeDemoConfig(
            architecture=args.model,
            layout=args.layout,
            prompt_tokens=args.prompt_tokens,
            answer_tokens=args.answer_tokens,
            seed=args.seed,
        )
    except ValueError as exc:
        print(f"mooncake-span demo: {exc}", file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C, so the servers and the cluster are stopped.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    report = run_serve_demo(config)
    print("demo OK" if report.ok else "demo FAILED", flush=True)
    return 0 if report.ok else 1


def _register_demo(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser(
        "demo-span",
        help="back up and restore a compressed hybrid DSA model's KV cache through Mooncake",
        description=(
            "Start an embedded local Mooncake cluster (or use --master/--metadata), build real "
            "sglang host pools shaped like a compressed hybrid DSA model (MLA KV + DSA indexer + "
            "Mamba, 64-token host pages, 256-token storage pages, K=4), back up random requests, "
            "wipe the host pools, restore through batch_exists_v2 / batch_get_v1 / batch_get_v2 "
            "and verify every byte. Exits 1 if anything is missing or differs."
        ),
    )
    demo.add_argument(
        "--requests", type=_positive_int_arg, default=8, help="requests to back up (default 8)"
    )
    demo.add_argument(
        "--keys-per-request",
        type=_positive_int_arg,
        default=8,
        help="storage pages (256 tokens each) per request (default 8)",
    )
    demo.add_argument(
        "--layout",
        choices=("page_first", "page_first_direct", "layer_first"),
        default="page_first",
        help="host pool layout (default page_first)",
    )
    demo.add_argument(
        "--layers", type=_positive_int_arg, default=4, help="model layers (default 4)"
    )
    demo.add_argument(
        "--seed", type=int, default=0, help="random seed for tokens and page contents"
    )
    demo.add_argument(
        "--master",
        default=None,
        metavar="HOST:PORT",
        help="use this running Mooncake master instead of an embedded cluster (needs --metadata)",
    )
    demo.add_argument(
        "--metadata",
        default=None,
        metavar="URL",
        help="metadata server of that cluster, e.g. http://HOST:PORT/metadata",
    )
    demo.add_argument(
        "--storage-node-size",
        type=_size_arg,
        default="1gb",
        help="memory of the embedded cluster's storage node (default 1gb)",
    )
    demo.add_argument(
        "--order",
        choices=("fork-startup", "runtime-attach", "derived"),
        default="fork-startup",
        help="how the backend is handed the 256-token storage page: the span fork's startup "
        "(assigned on the live backend after registration; default), runtime attach (on the "
        "config when built) or derived (named by no one: the first transfer tells it)",
    )
    add_native_log_arg(demo)
    demo.set_defaults(func=run_demo_command)


def _quiet_sglang_cpu_warnings() -> None:
    # sglang warns at import that AWQ / GGUF need a GPU; on the CPU boxes these
    # commands target that is expected and says nothing about the run.
    warnings.filterwarnings("ignore", message="Only CUDA", category=UserWarning)


def run_demo_command(args: argparse.Namespace) -> int:
    _quiet_sglang_cpu_warnings()
    # sglang is imported only here, so `cluster up` works without it.
    from mooncake_span.ops.span_demo import DemoConfig, run_demo

    try:
        config = DemoConfig(
            requests=args.requests,
            keys_per_request=args.keys_per_request,
            layout=args.layout,
            layers=args.layers,
            seed=args.seed,
            master_server_address=args.master,
            metadata_server=args.metadata,
            storage_node_bytes=args.storage_node_size,
            order=args.order,
        )
    except ValueError as exc:
        print(f"mooncake-span demo-span: {exc}", file=sys.stderr)
        return 2
    native_log = resolve_native_log(args.native_log, "demo")
    with native_stderr_to(native_log):
        report = run_demo(config)
    print("demo OK" if report.ok else "demo FAILED", flush=True)
    if native_log is not None:
        print(f"native log: {native_log}", file=sys.stderr, flush=True)
    return 0 if report.ok else 1


# ---------------------------------------------------------------------------
# bench


@dataclass(frozen=True)
class BenchSection:
    """One ``bench --FLAG`` section: its help, and the function that runs it with
    these ``bench`` arguments, imported only when asked for."""

    help: str
    module: str
    function: str
    args: tuple[str, ...]


# The sections run alone (``bench --FLAG``); without one, ``bench`` runs the grid.
BENCH_SECTIONS = {
    "overhead": BenchSection(
        "only the adapter-overhead section: own Python per page/key on a do-nothing "
        "native store and on a real in-process one (mooncake_span.bench.overhead)",
        "mooncake_span.bench.overhead",
        "run_overhead_command",
        ("quick", "reps", "json"),
    ),
    "pressure": BenchSection(
        "only the full-cluster section: backups at 5x a small segment, with and without "
        "the put cool-down, under several eviction flags (mooncake_span.bench.pressure)",
        "mooncake_span.bench.pressure",
        "run_pressure_command",
        ("quick", "json"),
    ),
    "checksum": BenchSection(
        "only the checksum section: put and get pages/s with span_verify_checksums off and "
        "on, one process and TCP (mooncake_span.bench.checksum)",
        "mooncake_span.bench.checksum",
        "run_checksum_command",
        ("quick", "reps", "json"),
    ),
    "seal": BenchSection(
        "only the object-seal section: checksum candidates' GB/s, and put and get GB/s "
        "with span_object_checksums off and on, K=1 and K=4, one process and TCP "
        "(mooncake_span.bench.seal)",
        "mooncake_span.bench.seal",
        "run_seal_command",
        ("quick", "reps", "json"),
    ),
    "leases": BenchSection(
        "only the hit-query lease section: objects probed and leased per query and "
        "backups under a probe storm, vs upstream (mooncake_span.bench.leases)",
        "mooncake_span.bench.leases",
        "run_leases_command",
        ("json",),
    ),
    "serve": BenchSection(
        "only the serving section: real sglang servers on embedded clusters, recompute vs "
        "this backend vs sglang's MooncakeStore: a second server's TTFT from L3, multi-turn hit "
        "rate by tier and throughput, prefill/decode turn 2 (mooncake_span.bench.serve)",
        "mooncake_span.bench.serve",
        "run_serve_command",
        ("serve_models", "serve_lengths", "serve_rounds", "serve_workloads", "json", "plot"),
    ),
    "ssd": BenchSection(
        "only the SSD-tier section: reads from a storage node's SSD vs its DRAM (paired), "
        "and restore after a whole-cluster restart, vs a DRAM-only cluster "
        "(mooncake_span.bench.ssd)",
        "mooncake_span.bench.ssd",
        "run_ssd_command",
        ("quick", "json"),
    ),
    "placement": BenchSection(
        "only the placement section: restorable prompt tokens after one of 2 or 4 storage "
        "nodes is SIGKILLed, bytes per node and put/get pages/s, per-key vs prefix-chain "
        "placement vs sglang's MooncakeStore (mooncake_span.bench.placement)",
        "mooncake_span.bench.placement",
        "run_placement_command",
        ("quick", "json"),
    ),
    "eviction": BenchSection(
        "only the eviction section: 48 conversations backed up in 4 turns with prefix "
        "keys into a segment a third of their size, a quarter re-read between rounds; keys "
        "reachable as a prefix, dead bytes, returning users' hit tokens, refused and skipped "
        "backups, master RPCs, vs sglang's MooncakeStore (mooncake_span.bench.eviction)",
        "mooncake_span.bench.eviction",
        "run_eviction_command",
        ("quick", "json", "eviction_lease_ms", "eviction_round_s"),
    ),
    "long": BenchSection(
        "only the long-conversation section: GLM-5.3-Flash-shaped conversations of 4k to "
        "300k tokens backed up in 8,192-token chunks with prefix keys, restored whole by "
        "other processes (1, 4 and 8 at once) from 1 and 4 storage nodes; restore time "
        "per token, master RPCs, objects, GB/s, byte-exact, vs sglang's MooncakeStore "
        "(mooncake_span.bench.long_conversation)",
        "mooncake_span.bench.long_conversation",
        "run_long_command",
        ("quick", "json", "plot", "long_sizes"),
    ),
}


def _register_bench(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench",
        help="transfer benchmark: span mode vs upstream MooncakeStore, raw Mooncake and memcpy",
        description=(
            "Move the same host pages of real sglang host pools (compressed hybrid DSA, MLA, MHA; "
            "page_first and layer_first; 64 KiB and 2.5 MiB pages) with MooncakeSpanStore at "
            "K=1/2/4/8, sglang's own MooncakeStore, raw Mooncake batch calls and single-thread "
            "memcpy, in one process (local memcpy path) and over TCP to a storage node. Every get "
            "is verified byte for byte. Prints a table and the target ratios; exits 1 if a get "
            "was not byte-exact or an unexpected transfer failed. See docs/benchmarks.md."
        ),
    )
    bench.add_argument(
        "--quick", action="store_true", help="small sizes and few repetitions (< 1 minute)"
    )
    bench.add_argument(
        "--reps",
        type=_positive_int_arg,
        default=None,
        help="timed repetitions per contender (default 3, --quick 2), after one warm-up",
    )
    bench.add_argument(
        "--topology",
        default="same,tcp",
        metavar="LIST",
        help="comma list of same (one process, local segment) and tcp (client -> storage "
        "node) (default both)",
    )
    bench.add_argument(
        "--sections",
        default="grid,batch,coalesce,chunks,stock",
        metavar="LIST",
        help="comma list of grid, batch (batch-size sweep), coalesce (layer_first consecutive vs "
        "scattered), chunks (span_max_buffers_per_call sweep over TCP), stock (GLM-5.3-Flash as "
        "stock sglang 0.5.23 runs it, K=1 on 256-token pages, beside its span shape) "
        "(default all)",
    )
    bench.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    bench.add_argument("--plot", default=None, metavar="PATH", help="write a PNG summary plot")
    bench.add_argument("--markdown", default=None, metavar="PATH", help="write Markdown tables")
    bench.add_argument(
        "--protocol",
        choices=("tcp", "rdma"),
        default="tcp",
        help="transfer protocol; rdma needs --master/--metadata of a cluster whose storage "
        "nodes use RDMA",
    )
    bench.add_argument(
        "--device", default="", help="RDMA device name(s) for --protocol rdma, e.g. mlx5_0"
    )
    bench.add_argument(
        "--master",
        default=None,
        metavar="HOST:PORT",
        help="use this running master instead of embedded clusters (topology remote)",
    )
    bench.add_argument(
        "--metadata", default=None, metavar="URL", help="metadata server of that cluster"
    )
    bench.add_argument(
        "--segment-size",
        type=_size_arg,
        default="1536mb",
        help="global segment of the in-process client / the storage node (default 1536mb)",
    )
    bench.add_argument(
        "--seed", type=int, default=0, help="random seed for page placement and contents"
    )
    bench.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_native_log_arg(bench)
    for flag, section in BENCH_SECTIONS.items():
        bench.add_argument(f"--{flag}", action="store_true", help=section.help)
    bench.add_argument(
        "--serve-workloads",
        default=None,
        metavar="LIST",
        help="--serve: comma list of repeated, multiturn, pd, fresh, ssd and long (default the "
        "first four; multiturn, pd, fresh and ssd use the first of --serve-models; long: one "
        "prompt of the longest --serve-lengths, default 65536, under each prefetch policy)",
    )
    bench.add_argument(
        "--serve-models",
        default=None,
        metavar="LIST",
        help="--serve: comma list of llama (MHA), deepseek_v2 (MLA) and glm5_next "
        "(GLM-5.3-Flash: MLA + DSA indexer + KDA state) (default llama)",
    )
    bench.add_argument(
        "--serve-lengths",
        default=None,
        metavar="LIST",
        help="--serve: comma list of prompt lengths in tokens (default 2048,4096)",
    )
    bench.add_argument(
        "--serve-rounds",
        type=_positive_int_arg,
        default=None,
        help="--serve: timed rounds per prompt length (default 8) and of pd (default 6), "
        "after one warm-up round",
    )
    bench.add_argument(
        "--long-sizes",
        default=None,
        metavar="LIST",
        help="--long: comma list of conversation lengths in tokens, multiples of 256 "
        "(default 4096,32768,131072,300032; --quick 2048,12288)",
    )
    bench.add_argument(
        "--eviction-lease-ms",
        type=int,
        default=None,
        metavar="MS",
        help="--eviction: the master's lease TTL (default 500; 0: Mooncake's 10 s)",
    )
    bench.add_argument(
        "--eviction-round-s",
        type=float,
        default=None,
        metavar="S",
        help="--eviction: how long one round of backups is spread over (default 4)",
    )
    bench.set_defaults(func=run_bench_command)


def run_bench_command(args: argparse.Namespace) -> int:
    _quiet_sglang_cpu_warnings()
    import os

    # The native library reads its log level once, when it is loaded.
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    for flag, section in BENCH_SECTIONS.items():
        if getattr(args, flag):
            run = getattr(importlib.import_module(section.module), section.function)
            return run(*(getattr(args, name) for name in section.args))
    from mooncake_span.bench.runner import (
        BenchConfig,
        format_markdown,
        format_table,
        run_bench,
        write_plot,
    )

    def split(text: str) -> tuple[str, ...]:
        return tuple(part.strip() for part in text.split(",") if part.strip())

    try:
        config = BenchConfig(
            quick=args.quick,
            reps=args.reps or (2 if args.quick else 3),
            topologies=split(args.topology),
            sections=split(args.sections),
            protocol=args.protocol,
            device=args.device,
            master_server_address=args.master,
            metadata_server=args.metadata,
            segment_bytes=args.segment_size,
            seed=args.seed,
            progress=not args.no_progress,
        )
    except ValueError as exc:
        print(f"mooncake-span bench: {exc}", file=sys.stderr)
        return 2
    native_log = resolve_native_log(args.native_log, "bench")
    result = run_bench(config, native_log=native_log)
    print(format_table(result), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {args.json}", flush=True)
    if args.plot:
        write_plot(result, args.plot)
        print(f"wrote {args.plot}", flush=True)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as fh:
            fh.write(format_markdown(result))
        print(f"wrote {args.markdown}", flush=True)
    if native_log is not None:
        print(f"native log: {native_log}", file=sys.stderr, flush=True)
    ok = result["verified_byte_exact"] and result["all_complete_except_expected"]
    return 0 if ok else 1


# ---------------------------------------------------------------------------
# entry point


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mooncake-span",
        description="Tools for mooncake-span, the SGLang HiCache backend on Mooncake.",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="log more (-v: info, -vv: debug)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _register_cluster(subparsers)
    _register_serve_demo(subparsers)
    _register_demo(subparsers)
    _register_bench(subparsers)
    doctor.register(subparsers)
    inspect_cmd.register(subparsers)
    validate_cmd.register(subparsers)
    from mooncake_span.lab import soak  # no sglang until the command runs

    soak.register_parser(subparsers, _size_arg)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
