"""The tooling's ``mooncake-span`` commands: ``demo``, ``demo-span`` and ``bench``
(``soak`` registers itself from :mod:`mooncake_span_tools.lab.soak`).

The serving CLI (:mod:`mooncake_span.ops.cli`) finds each ``register_*`` function
through this distribution's ``mooncake_span.commands`` entry points; nothing here
is imported until a command runs, so sglang and torch load only then.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import warnings
from dataclasses import dataclass

from mooncake_span.ops.cli_common import add_native_log_arg, resolve_native_log
from mooncake_span.ops.cli_common import positive_int_arg as _positive_int_arg
from mooncake_span.ops.cli_common import size_arg as _size_arg
from mooncake_span_tools.native_stderr import native_stderr_to


def register_demo(subparsers: argparse._SubParsersAction) -> None:
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
    from mooncake_span_tools.lab.serve_demo import ServeDemoConfig, run_serve_demo

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


def register_demo_span(subparsers: argparse._SubParsersAction) -> None:
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
    from mooncake_span_tools.lab.span_demo import DemoConfig, run_demo

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
        "native store and on a real in-process one (mooncake_span_tools.bench.overhead)",
        "mooncake_span_tools.bench.overhead",
        "run_overhead_command",
        ("quick", "reps", "json"),
    ),
    "pressure": BenchSection(
        "only the full-cluster section: backups at 5x a small segment, with and without "
        "the put cool-down, under several eviction flags (mooncake_span_tools.bench.pressure)",
        "mooncake_span_tools.bench.pressure",
        "run_pressure_command",
        ("quick", "json"),
    ),
    "checksum": BenchSection(
        "only the checksum section: put and get pages/s with span_verify_checksums off and "
        "on, one process and TCP (mooncake_span_tools.bench.checksum)",
        "mooncake_span_tools.bench.checksum",
        "run_checksum_command",
        ("quick", "reps", "json"),
    ),
    "seal": BenchSection(
        "only the object-seal section: checksum candidates' GB/s, and put and get GB/s "
        "with span_object_checksums off and on, K=1 and K=4, one process and TCP "
        "(mooncake_span_tools.bench.seal)",
        "mooncake_span_tools.bench.seal",
        "run_seal_command",
        ("quick", "reps", "json"),
    ),
    "leases": BenchSection(
        "only the hit-query lease section: objects probed and leased per query and "
        "backups under a probe storm, vs upstream (mooncake_span_tools.bench.leases)",
        "mooncake_span_tools.bench.leases",
        "run_leases_command",
        ("json",),
    ),
    "serve": BenchSection(
        "only the serving section: real sglang servers on embedded clusters, recompute vs "
        "this backend vs sglang's MooncakeStore: a second server's TTFT from L3, multi-turn hit "
        "rate by tier and throughput, prefill/decode turn 2 (mooncake_span_tools.bench.serve)",
        "mooncake_span_tools.bench.serve",
        "run_serve_command",
        ("serve_models", "serve_lengths", "serve_rounds", "serve_workloads", "json", "plot"),
    ),
    "ssd": BenchSection(
        "only the SSD-tier section: reads from a storage node's SSD vs its DRAM (paired), "
        "and restore after a whole-cluster restart, vs a DRAM-only cluster "
        "(mooncake_span_tools.bench.ssd)",
        "mooncake_span_tools.bench.ssd",
        "run_ssd_command",
        ("quick", "json"),
    ),
    "ssd-scale": BenchSection(
        "only the SSD-scale section: a tier of 20 GB and a million objects filled in two "
        "steps; offload rate, files per object, cold listing, and restart seconds per GB "
        "for each --ssd-check mode with the page cache dropped (root; deletes the tier "
        "after) (mooncake_span_tools.bench.ssd_scale)",
        "mooncake_span_tools.bench.ssd_scale",
        "run_ssd_scale_command",
        ("quick", "json"),
    ),
    "placement": BenchSection(
        "only the placement section: restorable prompt tokens after one of 2 or 4 storage "
        "nodes is SIGKILLed, bytes per node and put/get pages/s, per-key vs prefix-chain "
        "placement vs sglang's MooncakeStore (mooncake_span_tools.bench.placement)",
        "mooncake_span_tools.bench.placement",
        "run_placement_command",
        ("quick", "json"),
    ),
    "scale": BenchSection(
        "only the scale section: a master filled in steps to 10M small objects, this "
        "backend's hit query and get of a 300k-token conversation at each step, the master's "
        "RSS per object, and objects per stored token vs sglang's MooncakeStore "
        "(mooncake_span_tools.bench.scale)",
        "mooncake_span_tools.bench.scale",
        "run_scale_command",
        ("quick", "json", "plot"),
    ),
    "eviction": BenchSection(
        "only the eviction section: 48 conversations backed up in 4 turns with prefix "
        "keys into a segment a third of their size, a quarter re-read between rounds; keys "
        "reachable as a prefix, dead bytes, returning users' hit tokens, refused and skipped "
        "backups, master RPCs, vs sglang's MooncakeStore (mooncake_span_tools.bench.eviction)",
        "mooncake_span_tools.bench.eviction",
        "run_eviction_command",
        ("quick", "json", "eviction_lease_ms", "eviction_round_s"),
    ),
    "long": BenchSection(
        "only the long-conversation section: GLM-5.3-Flash-shaped conversations of 4k to "
        "300k tokens backed up in 8,192-token chunks with prefix keys, restored whole by "
        "other processes (1, 4 and 8 at once) from 1 and 4 storage nodes; restore time "
        "per token, master RPCs, objects, GB/s, byte-exact, vs sglang's MooncakeStore "
        "(mooncake_span_tools.bench.long_conversation)",
        "mooncake_span_tools.bench.long_conversation",
        "run_long_command",
        ("quick", "json", "plot", "long_sizes"),
    ),
}


def register_bench(subparsers: argparse._SubParsersAction) -> None:
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
    # The native library reads its log level once, when it is loaded.
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    for flag, section in BENCH_SECTIONS.items():
        if getattr(args, flag.replace("-", "_")):
            run = getattr(importlib.import_module(section.module), section.function)
            return run(*(getattr(args, name) for name in section.args))
    from mooncake_span_tools.bench.runner import (
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
