"""``mooncake-span soak``: sglang-shaped traffic for a long time, with growth budgets.

One ``MooncakeSpanStore`` (compressed hybrid DSA: MLA KV + DSA indexer +
Mamba, K=4 host pages per key) on real sglang host pools talks to a real
``LocalCluster`` whose segments hold less than the working set, so Mooncake
evicts all the time. Three threads drive it the way sglang's controller does:

* backup: ``batch_set_v2`` (indexer + the request's Mamba checkpoint), then
  ``batch_set_v1`` (KV);
* prefetch: ``batch_exists_v2``, then ``batch_get_v1`` + ``batch_get_v2``
  (indexer) for the hit prefix and ``batch_get_v2`` (Mamba) on a full hit;
* hit queries: ``batch_exists_v2`` alone, as the scheduler's lookups.

Storage metrics are off by default (sglang's default), so nothing calls
``get_stats()``: exactly the case where per-call records used to pile up.

The main thread samples RSS, the Python heap (allocated blocks; tracemalloc
on request), threads, open descriptors and the segments' usage, and can
restart storage nodes on a schedule. Everything the harness itself keeps is
allocated before the clock starts (fixed-size arrays), so its own state does
not show up as growth. Growth is the least-squares slope of RSS against calls
after the warm-up, in MB per 100k calls; the command exits 1 when it exceeds
the budget or when threads / descriptors grow.
"""

from __future__ import annotations

import argparse
import bisect
import logging
import math
import os
import random
import re
import sys
import threading
import time
import tracemalloc
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from mooncake_span.ops.cli_common import size_arg
from mooncake_span_tools.lab.soak_report import OPS, analyse, format_table, write_outputs

logger = logging.getLogger(__name__)

COLUMNS = (
    "t_s",
    "calls",
    "rss_mb",
    "heap_blocks",
    "traced_mb",
    "threads",
    "python_threads",
    "fds",
    "segment_used_mb",
    "segment_capacity_mb",
    "stored_keys",
)
_HOST_PAGE_TOKENS = 64
_INDEX_KPOOL = 4  # host pages per storage key (K)
_MODEL = "soak/glm-5.3-flash-like"
# Latency histogram: 10 us .. 100 s, 20 bins per decade; percentiles are bin upper edges.
_EDGES_S = [float(x) for x in np.logspace(-5, 2, 141)]
_MASTER_GAUGES = {
    "master_allocated_bytes": "segment_used_mb",
    "master_total_capacity_bytes": "segment_capacity_mb",
    "master_key_count": "stored_keys",
}


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 1800.0
    warmup_s: float = 60.0
    sample_interval_s: float = 5.0
    storage_nodes: int = 2
    segment_bytes: int = 64 << 20
    # working set bytes / total segment bytes; > 1 keeps eviction running
    working_set_ratio: float = 3.0
    keys_per_request: int = 8
    # Every hit query and read leases what it touches for the master's lease
    # time (Mooncake's 10 s default); with queries running all the time the
    # whole working set would stay leased and nothing could be evicted.
    lease_ttl_ms: int = 500
    layers: int = 2
    kv_lora_rank: int = 256
    rope_dim: int = 64
    restart_every_s: float = 0.0  # 0: no storage-node restarts
    storage_metrics: bool = False  # sglang's default: get_stats() is never called
    tracemalloc: bool = False
    budget_mb_per_100k_calls: float = 0.05
    thread_budget: int = 0  # allowed growth of the thread count after warm-up
    fd_budget: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.duration_s > self.warmup_s >= 0:
            raise ValueError(
                f"duration ({self.duration_s}s) must exceed the warm-up ({self.warmup_s}s)"
            )
        if self.duration_s - self.warmup_s < 4 * self.sample_interval_s:
            raise ValueError(
                "the run after warm-up must hold at least 4 samples "
                f"(duration - warmup >= 4 x sample interval {self.sample_interval_s}s)"
            )
        if self.sample_interval_s <= 0:
            raise ValueError(f"sample interval must be > 0, got {self.sample_interval_s}")
        for name in (
            "storage_nodes",
            "keys_per_request",
            "layers",
            "kv_lora_rank",
            "rope_dim",
            "lease_ttl_ms",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.segment_bytes < 8 << 20:
            raise ValueError(f"segment size must be >= 8 MiB, got {self.segment_bytes} bytes")
        if self.working_set_ratio <= 1:
            raise ValueError(
                f"working_set_ratio must be > 1 so eviction runs, got {self.working_set_ratio}"
            )
        if self.restart_every_s < 0 or self.budget_mb_per_100k_calls < 0:
            raise ValueError("restart interval and budget must be >= 0")


def percentile_s(counts: np.ndarray, q: float) -> float | None:
    """The q-quantile (0..1) of a latency histogram as its bin's upper edge."""
    total = int(counts.sum())
    if total == 0:
        return None
    index = int(np.searchsorted(np.cumsum(counts), q * total, side="left"))
    return _EDGES_S[min(index, len(_EDGES_S) - 1)]


class LatencyBook:
    """Per-minute, per-operation latency histograms in one preallocated array."""

    def __init__(self, minutes: int) -> None:
        self.counts = np.zeros((minutes, len(OPS), len(_EDGES_S) + 1), dtype=np.int64)
        self.started_s = time.monotonic()

    def record(self, op: int, elapsed_s: float) -> None:
        minute = min(int((time.monotonic() - self.started_s) // 60), self.counts.shape[0] - 1)
        self.counts[minute, op, bisect.bisect_left(_EDGES_S, elapsed_s)] += 1

    def calls(self) -> int:
        return int(self.counts.sum())

    def minute_rows(self, duration_s: float) -> list[dict[str, Any]]:
        """p50/p99 per operation for each minute that started before ``duration_s``."""
        rows = []
        for minute in range(min(self.counts.shape[0], math.ceil(duration_s / 60))):
            block = self.counts[minute]
            if not block.any():
                continue
            row: dict[str, Any] = {"minute": minute, "calls": int(block.sum())}
            for i, op in enumerate(OPS):
                for label, q in (("p50", 0.5), ("p99", 0.99)):
                    value = percentile_s(block[i], q)
                    row[f"{op}_{label}_ms"] = None if value is None else value * 1e3
            rows.append(row)
        return rows


def _proc_status() -> tuple[float, int]:
    """(RSS in MB, OS threads) of this process, from /proc."""
    rss_kb, threads = 0, 0
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                rss_kb = int(line.split()[1])
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    return rss_kb / 1024, threads


def _master_gauges(metrics_url: str) -> dict[str, float]:
    try:
        with urllib.request.urlopen(metrics_url + "/metrics", timeout=2) as response:  # noqa: S310
            text = response.read().decode(errors="replace")
    except OSError:
        return {}
    out = {}
    for name, column in _MASTER_GAUGES.items():
        match = re.search(rf"^{name} ([0-9.eE+]+)$", text, re.M)
        if match:
            scale = 1 if column == "stored_keys" else 1 / (1 << 20)
            out[column] = float(match.group(1)) * scale
    return out


class Traffic:
    """The backend, its host pools and the working set; one method per sglang thread.

    ``backup_once`` / ``prefetch_once`` / ``hit_once`` each serve one random
    request of the working set and record every backend call in ``book``.
    Host pages are split per role, so the roles never share a page.
    """

    def __init__(
        self, config: SoakConfig, client_config: dict[str, Any], book: LatencyBook
    ) -> None:
        import torch

        from mooncake_span_tools.testing import controller as sg
        from mooncake_span_tools.testing import pools as P
        from mooncake_span_tools.testing.backends import span_backend, storage_config

        self._sg = sg
        self.book = book
        kpr = config.keys_per_request
        pages = kpr * _INDEX_KPOOL
        self.pools = P.build_compressed_hybrid_dsa(
            "page_first",
            layers=config.layers,
            host_pages=2 * pages,
            mamba_slots=2,
            kv_lora_rank=config.kv_lora_rank,
            rope_dim=config.rope_dim,
            index_kpool=_INDEX_KPOOL,
        )
        extra = {**client_config, "storage_page_size": self.pools.storage_page_tokens}
        self.store = span_backend(
            storage_config(extra, _MODEL, metrics=config.storage_metrics), self.pools.pools
        )

        def slots(first_page: int) -> torch.Tensor:
            start = first_page * _HOST_PAGE_TOKENS
            return torch.arange(start, start + pages * _HOST_PAGE_TOKENS, dtype=torch.int64)

        self._backup_slots, self._prefetch_slots = slots(0), slots(pages)
        # Built once: the harness must not allocate per call what it could keep.
        self._state_slots = (torch.tensor([0]), torch.tensor([1]))
        self.bytes_per_key = _INDEX_KPOOL * sum(
            self.pools[n].get_dummy_flat_data_page().nbytes for n in (sg.KV, sg.INDEXER)
        )
        total_bytes = config.working_set_ratio * config.storage_nodes * config.segment_bytes
        n_requests = max(2, int(total_bytes // (self.bytes_per_key * kpr)))
        self.requests = [sg.chained_keys(f"{config.seed}:{r}", kpr) for r in range(n_requests)]

    def _timed(self, op: int, fn: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        result = fn()
        self.book.record(op, time.perf_counter() - started)
        return result

    def _mamba(self, key: str, slot: int) -> Any:
        return self._sg.state([key], self._state_slots[slot])

    def backup_once(self, rng: random.Random) -> None:
        keys = rng.choice(self.requests)
        slots = self._backup_slots
        sidecars = [self._sg.indexer(keys, slots), self._mamba(keys[-1], 0)]
        self._timed(0, lambda: self.store.batch_set_v2(sidecars))
        self._timed(1, lambda: self.store.batch_set_v1(keys, slots))

    def _hit_query(self, keys: list[str]) -> Any:
        queries = self._sg.hit_query()
        return self._timed(2, lambda: self.store.batch_exists_v2(keys, queries))

    def prefetch_once(self, rng: random.Random) -> None:
        keys = rng.choice(self.requests)
        hit = self._hit_query(keys).kv_hit_pages
        if hit == 0:
            return
        batch, slots = keys[:hit], self._prefetch_slots[: hit * _INDEX_KPOOL * _HOST_PAGE_TOKENS]
        got = self._timed(3, lambda: self.store.batch_get_v1(batch, slots))
        side = [self._sg.indexer(batch, slots, follows_kv=False)]
        self._timed(4, lambda: self.store.batch_get_v2(side))
        if hit == len(keys) and all(got):
            self._timed(4, lambda: self.store.batch_get_v2([self._mamba(keys[-1], 1)]))

    def hit_once(self, rng: random.Random) -> None:
        self._hit_query(rng.choice(self.requests))

    def close(self) -> None:
        self.store.close()


def _role_loop(step: Callable[[random.Random], None], seed: int, stop: threading.Event) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        try:
            step(rng)
        except Exception:  # a harness bug must end the run visibly, not hang it
            logger.exception("soak traffic thread failed")
            stop.set()
            raise


class _Samples:
    """Preallocated sample table (rows x COLUMNS)."""

    def __init__(self, rows: int) -> None:
        self.data = np.full((rows, len(COLUMNS)), np.nan)
        self.count = 0

    def add(self, values: dict[str, float]) -> None:
        if self.count < self.data.shape[0]:
            self.data[self.count] = [values.get(c, np.nan) for c in COLUMNS]
            self.count += 1

    def rows(self) -> list[dict[str, float | None]]:
        return [
            {c: (None if np.isnan(v) else float(v)) for c, v in zip(COLUMNS, row, strict=True)}
            for row in self.data[: self.count]
        ]


def _sample(book: LatencyBook, metrics_url: str, tracing: bool) -> dict[str, float]:
    rss_mb, threads = _proc_status()
    values = {
        "t_s": time.monotonic() - book.started_s,
        "calls": float(book.calls()),
        "rss_mb": rss_mb,
        "heap_blocks": float(sys.getallocatedblocks()),
        "threads": float(threads),
        "python_threads": float(threading.active_count()),
        "fds": float(len(os.listdir("/proc/self/fd"))),
        **_master_gauges(metrics_url),
    }
    if tracing:
        values["traced_mb"] = tracemalloc.get_traced_memory()[0] / (1 << 20)
    return values


def run_soak(config: SoakConfig, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Start a cluster, drive traffic for ``config.duration_s``, return the report dict."""
    from mooncake_span.ops.cluster import ClusterSpec, LocalCluster

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    spec = ClusterSpec(
        storage_nodes=config.storage_nodes,
        storage_node_segment_bytes=config.segment_bytes,
        lease_ttl_ms=config.lease_ttl_ms,
    )
    if config.tracemalloc:
        tracemalloc.start(8)
    with LocalCluster(spec) as cluster:
        say(f"cluster: master {cluster.master_address}, {config.storage_nodes} storage node(s)")
        book = LatencyBook(int(config.duration_s // 60) + 2)
        traffic = Traffic(config, cluster.client_config(), book)
        try:
            keys = len(traffic.requests) * config.keys_per_request
            say(
                f"working set {keys} keys x {traffic.bytes_per_key / 2**20:.2f} MiB = "
                f"{keys * traffic.bytes_per_key / 2**20:.0f} MiB over "
                f"{config.storage_nodes * config.segment_bytes / 2**20:.0f} MiB of segments"
            )
            report = _drive(config, cluster, traffic, book, say)
            stats = traffic.store.get_stats()
            report["backend"] = {
                "error_counts": stats.error_counts,
                "rejected_calls": stats.rejected_calls,
                "breaker_times_opened": stats.breaker_times_opened,
                "dropped_metric_records": getattr(stats, "dropped_metric_records", None),
            }
        finally:
            traffic.close()
    report["config"] = asdict(config)
    report["minutes"] = book.minute_rows(config.duration_s)
    report["summary"] = analyse(report["samples"], config)
    return report


def _drive(config, cluster, traffic, book, say) -> dict[str, Any]:  # noqa: ANN001
    samples = _Samples(int(config.duration_s // config.sample_interval_s) + 8)
    restarts: list[dict[str, float]] = []
    stop = threading.Event()
    roles = (traffic.backup_once, traffic.prefetch_once, traffic.hit_once)
    threads = [
        threading.Thread(
            target=_role_loop, args=(step, config.seed + i, stop), name=f"soak-{i}", daemon=True
        )
        for i, step in enumerate(roles)
    ]
    book.started_s = time.monotonic()
    for thread in threads:
        thread.start()
    warm_snapshot = None
    next_restart = config.restart_every_s or float("inf")
    next_sample = 0.0
    while not stop.is_set():
        now = time.monotonic() - book.started_s
        if now >= config.duration_s:
            break
        if now >= next_sample:
            row = _sample(book, cluster.metrics_url, config.tracemalloc)
            samples.add(row)
            say(
                f"  t={now:6.0f}s calls={int(row['calls']):>9} rss={row['rss_mb']:7.1f} MB "
                f"threads={int(row['threads'])} ({int(row['python_threads'])} Python) "
                f"fds={int(row['fds'])} segments={row.get('segment_used_mb', 0):.0f}/"
                f"{row.get('segment_capacity_mb', 0):.0f} MB"
            )
            next_sample += config.sample_interval_s
        if warm_snapshot is None and config.tracemalloc and now >= config.warmup_s:
            warm_snapshot = tracemalloc.take_snapshot()
        if now >= next_restart:
            node = len(restarts) % config.storage_nodes
            started = time.monotonic()
            cluster.restart_storage_node(node)
            restarts.append({"t_s": now, "node": node, "took_s": time.monotonic() - started})
            say(f"  restarted storage node {node} in {restarts[-1]['took_s']:.1f}s")
            next_restart += config.restart_every_s
        stop.wait(min(0.5, max(0.0, next_sample - now)))
    failed = stop.is_set()
    samples.add(_sample(book, cluster.metrics_url, config.tracemalloc))
    stop.set()
    for thread in threads:
        thread.join(timeout=60)
    if failed:
        raise RuntimeError("a soak traffic thread failed (see the log above)")
    report: dict[str, Any] = {"samples": samples.rows(), "restarts": restarts}
    if warm_snapshot is not None:
        growth = tracemalloc.take_snapshot().compare_to(warm_snapshot, "lineno")[:15]
        report["tracemalloc_top_growth"] = [
            {"where": str(s.traceback), "size_diff_bytes": s.size_diff, "count_diff": s.count_diff}
            for s in growth
        ]
    return report


# ---------------------------------------------------------------------------
# command line (registered by ops/cli.py; sglang is only imported when it runs)


def _duration_arg(text: str) -> float:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|m|h)?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(
            f"expected a duration such as 90s, 30m or 1h, got {text!r}"
        )
    return float(match.group(1)) * {"s": 1, "m": 60, "h": 3600}[match.group(2) or "s"]


def register_parser(subparsers: argparse._SubParsersAction) -> None:
    soak = subparsers.add_parser(
        "soak",
        help="sustained sglang-shaped traffic; fails when memory, threads or fds grow",
        description=(
            "Drive one MooncakeSpanStore (MLA KV + DSA indexer + Mamba, K=4) on a local cluster "
            "whose segments hold less than the working set, from a backup, a prefetch and a "
            "hit-query thread, for --duration. Samples RSS, Python heap, threads, open fds and "
            "segment use; prints per-minute p50/p99 latency; writes soak.json and soak.png under "
            "--out. Exits 1 when RSS grows faster than --budget MB per 100k calls after the "
            "warm-up, or threads / fds grow. See docs/reliability.md."
        ),
    )
    default = SoakConfig()
    soak.add_argument("--duration", type=_duration_arg, default="30m", help="default 30m")
    soak.add_argument("--warmup", type=_duration_arg, default="1m", help="default 1m")
    soak.add_argument(
        "--sample-every", type=_duration_arg, default="5s", help="sampling interval (default 5s)"
    )
    soak.add_argument(
        "--storage-nodes", type=int, default=default.storage_nodes, help="default %(default)s"
    )
    soak.add_argument(
        "--segment-size", type=size_arg, default="64mb", help="per storage node (default 64mb)"
    )
    soak.add_argument(
        "--working-set-ratio",
        type=float,
        default=default.working_set_ratio,
        help="working set / total segment bytes, > 1 so eviction runs (default %(default)s)",
    )
    soak.add_argument(
        "--restart-every",
        type=_duration_arg,
        default="0",
        help="restart one storage node (round robin) this often; 0 = never (default)",
    )
    soak.add_argument(
        "--lease-ms",
        type=int,
        default=default.lease_ttl_ms,
        help="the master's object lease; every hit query leases what it finds, so a long lease "
        "pins the working set and stops eviction (default %(default)s)",
    )
    soak.add_argument(
        "--storage-metrics",
        action="store_true",
        help="enable_storage_metrics=True (sglang's default is off: get_stats() never called)",
    )
    soak.add_argument(
        "--tracemalloc",
        action="store_true",
        help="trace Python allocations and print the top growth after warm-up (slower)",
    )
    soak.add_argument(
        "--budget",
        type=float,
        default=default.budget_mb_per_100k_calls,
        help="allowed RSS growth in MB per 100k calls after warm-up (default %(default)s)",
    )
    soak.add_argument(
        "--thread-budget",
        type=int,
        default=0,
        help="allowed growth of the OS thread count after warm-up (default 0)",
    )
    soak.add_argument(
        "--fd-budget", type=int, default=0, help="allowed growth of open fds (default 0)"
    )
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--out", default="runs/soak", help="folder for soak.json and soak.png")
    soak.set_defaults(func=run_soak_command)


def run_soak_command(args: argparse.Namespace) -> int:
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:
        config = SoakConfig(
            duration_s=args.duration,
            warmup_s=args.warmup,
            sample_interval_s=args.sample_every,
            storage_nodes=args.storage_nodes,
            lease_ttl_ms=args.lease_ms,
            segment_bytes=args.segment_size,
            working_set_ratio=args.working_set_ratio,
            restart_every_s=args.restart_every,
            storage_metrics=args.storage_metrics,
            tracemalloc=args.tracemalloc,
            budget_mb_per_100k_calls=args.budget,
            thread_budget=args.thread_budget,
            fd_budget=args.fd_budget,
            seed=args.seed,
        )
    except ValueError as exc:
        print(f"mooncake-span soak: {exc}", file=sys.stderr)
        return 2
    from mooncake_span_tools.native_stderr import native_stderr_to

    os.makedirs(args.out, exist_ok=True)
    native_log = os.path.join(args.out, "native.log")
    print(f"Mooncake's own log lines go to {native_log}", flush=True)
    with native_stderr_to(native_log):
        report = run_soak(config, say=lambda line: print(line, flush=True))
    print(format_table(report), flush=True)
    for path in write_outputs(report, args.out):
        print(f"wrote {path}", flush=True)
    return 0 if report["summary"]["ok"] else 1
