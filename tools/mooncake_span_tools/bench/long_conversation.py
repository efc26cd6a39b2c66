"""``mooncake-span bench --long``: long conversations in the GLM-5.3-Flash shape, backed up
by one rank and restored whole by a second server's ranks (issue #46).

No sglang server runs: every rank is a process of ``long_worker`` holding real sglang
host pools (MLA KV + DSA indexer + KDA state) and a backend built as its build builds
it (``long_worker.ARMS``: the span fork at K=4 in its startup order, stock 0.5.23 at
K=1, sglang's ``MooncakeStore`` on the stock pools). So the section runs wherever the
store layer runs, a GPU host included.

A ``LocalCluster`` per storage-node count is up for the whole run, and every cell is
taken on each of them in turn (the order rotating by repetition), so the node counts'
figures are paired in time on a shared box. For each arm and conversation size:

* the writer backs the conversation up as sglang's ``HybridCacheController`` does, one
  8,192-token chunked-prefill chunk per write operation, with prefix keys;
* a reader (another process: a second server) asks the hit query for the whole
  conversation, restores every hit key, and returns a digest of every host page it
  restored; the driver compares them with the writer's (byte-exact), and with the
  digests of a decoy conversation the writer filled into the same pages, which must
  all differ (the negative control: a checker that passes it is broken);
* per phase, the master's own data-request counters (``bench.eviction.master_requests``)
  and the native calls each process made.

At the longest size, 1, 4 and 8 reader processes then restore the same conversation at
once, as the TP ranks of one MLA server do (every rank reads the whole KV), started
together on the wall clock: aggregate GB/s over the union of their restores, and each
rank's own. The placement model of ``bench.placement`` gives, beside it, the share of
whole short conversations that survive one node's loss under today's placement rule,
and the writer reports where the master put this conversation's objects (the share
of its tokens still restorable if each node alone died).

Figures on a 2-core box over loopback TCP say little about a GPU host's bandwidth; the
ratios between node counts and sizes are what the targets read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from mooncake_span_tools.bench.long_worker import ARMS, CHUNK_TOKENS, REPLY_PREFIX

logger = logging.getLogger(__name__)

SCHEMA = "mooncake-span-long/1"
FULL_SIZES = (4096, 32768, 131072, 300032)  # 300,032 = 1,172 keys of 256 tokens
QUICK_SIZES = (2048, 12288)
KEY_TOKENS = 256
# An upper bound of the arms' bytes per token (stock: 3 x 256 B of MLA latent, its index
# rows, the KDA states; long_worker._shapes), for sizing the storage nodes before any
# pool exists.
BYTES_PER_TOKEN_BOUND = 1000
SEGMENT_HEADROOM = 1.5
WORKER_START_TIMEOUT_S = 300.0
COMMAND_TIMEOUT_S = 600.0
START_LEAD_S = 1.0
# issue #46's targets
RESTORE_PER_TOKEN_RATIO_MAX = 1.5
PUT_FOUR_NODES_MIN = 0.9
EIGHT_READERS_FOUR_NODES_MIN = 2.5
SHARE_TODAY = {2: 0.500, 4: 0.70}


@dataclass(frozen=True)
class LongConfig:
    sizes_tokens: tuple[int, ...] = FULL_SIZES
    arms: tuple[str, ...] = ARMS
    node_counts: tuple[int, ...] = (1, 4)
    readers: tuple[int, ...] = (1, 4, 8)
    # arms whose longest conversation is also read by several readers at once
    bandwidth_arms: tuple[str, ...] = ARMS
    seed: int = 46
    # repetitions of every cell (a fresh write each for the per-size cells)
    reps: int = 3
    bandwidth_reps: int = 2
    log_dir: str | None = None

    def __post_init__(self) -> None:
        if not self.sizes_tokens or any(s <= 0 or s % KEY_TOKENS for s in self.sizes_tokens):
            raise ValueError(
                f"conversation sizes must be positive multiples of {KEY_TOKENS} tokens, "
                f"got {self.sizes_tokens}"
            )
        unknown = (set(self.arms) | set(self.bandwidth_arms)) - set(ARMS)
        if unknown:
            raise ValueError(f"unknown arm(s) {sorted(unknown)}; known: {ARMS}")
        if not self.node_counts or min(self.node_counts) < 1:
            raise ValueError(f"node counts must be >= 1, got {self.node_counts}")
        if self.reps < 1 or self.bandwidth_reps < 1:
            raise ValueError(f"reps must be >= 1, got {self.reps} and {self.bandwidth_reps}")
        if not self.readers or min(self.readers) < 1:
            raise ValueError(f"reader counts must be >= 1, got {self.readers}")

    @property
    def max_tokens(self) -> int:
        return max(self.sizes_tokens)

    def segment_bytes(self) -> int:
        """Per storage node: one conversation of the longest size (one is stored at a time)."""
        need = int(self.max_tokens * BYTES_PER_TOKEN_BOUND * SEGMENT_HEADROOM)
        return max(64 << 20, -(-need // (1 << 20)) << 20)


QUICK = LongConfig(
    sizes_tokens=QUICK_SIZES, node_counts=(1, 2), readers=(1, 2), reps=1, bandwidth_reps=1
)


# ---- the worker processes ------------------------------------------------------------------


class WorkerError(RuntimeError):
    pass


class Worker:
    """A ``long_worker`` process: one JSON command per line in, one reply line out."""

    def __init__(self, name: str, spec: dict[str, Any], log_path: Path) -> None:
        self.name = name
        self._log: IO[str] = open(log_path, "w", encoding="utf-8")  # noqa: SIM115
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        env.setdefault("MC_LOG_LEVEL", "WARNING")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mooncake_span_tools.bench.long_worker", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        self._replies: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(REPLY_PREFIX):
                self._replies.put(line[len(REPLY_PREFIX) :])
        self._replies.put(None)

    def send(self, command: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout_s: float = COMMAND_TIMEOUT_S) -> dict[str, Any]:
        try:
            line = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise WorkerError(f"{self.name}: no reply in {timeout_s:.0f}s") from None
        if line is None:
            raise WorkerError(f"{self.name} exited ({self.proc.poll()}); see {self._log.name}")
        answer = json.loads(line)
        if not answer.get("ok"):
            raise WorkerError(f"{self.name}: {answer.get('error')}; see {self._log.name}")
        return answer

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        self.send(command)
        return self.reply()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.send({"op": "exit"})
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


def call_all(workers: list[Worker], command: dict[str, Any]) -> list[dict[str, Any]]:
    """The same command to every worker at once; their replies in order."""
    for w in workers:
        w.send(command)
    return [w.reply() for w in workers]


# ---- checks and figures --------------------------------------------------------------------


def mismatched_pages(got: dict[str, list[str]], expected: dict[str, list[str]]) -> int:
    """Host pages (and the state) whose digest differs, or that are missing, per pool summed."""
    bad = 0
    for pool, digests in expected.items():
        mine = got.get(pool, [])
        bad += sum(a != b for a, b in zip(mine, digests, strict=False))
        bad += abs(len(digests) - len(mine))
    return bad


def _master_total(delta: dict[str, int]) -> int:
    return sum(delta.values())


def _gbps(nbytes: int, seconds: float) -> float | None:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else None


class Phases:
    """Master data-request counters between the phases of one run."""

    def __init__(self, metrics_url: str) -> None:
        from mooncake_span_tools.bench.eviction import master_requests

        self._read = lambda: master_requests(metrics_url)
        self._last = self._read()

    def step(self) -> dict[str, int]:
        now = self._read()
        delta = {k: now[k] - self._last[k] for k in now if now[k] != self._last[k]}
        self._last = now
        return delta


@dataclass
class Site:
    """One cluster of the run, its workers' slot and its master's counters."""

    nodes: int
    client_config: dict[str, Any]
    phases: Phases
    segments: list[str]

    @property
    def slot(self) -> str:
        return f"{self.nodes}-nodes"


def _rotated(sites: list[Site], index: int) -> list[Site]:
    shift = index % len(sites)
    return sites[shift:] + sites[:shift]


def one_run(writer: Worker, reader: Worker, site: Site, conv: dict[str, Any], decoy: int):
    """Write the conversation afresh on one cluster; one reader queries and restores it."""
    slot = site.slot
    writer.call({"op": "clear", "slot": slot})
    site.phases.step()
    w = writer.call({"op": "write", "slot": slot, "conv": conv, "decoy_seed": decoy})
    backup_rpcs = site.phases.step()
    # Where the objects are (one replica-list RPC), outside the phases' counts.
    w["placement"] = writer.call({"op": "locate", "slot": slot})
    del w["placement"]["ok"]
    site.phases.step()
    q = reader.call({"op": "query", "slot": slot, "conv": conv})
    query_rpcs = site.phases.step()
    f = reader.call(
        {
            "op": "fetch",
            "slot": slot,
            "conv": conv,
            "hit_keys": q["hit_keys"],
            "start_at": time.time(),
        }
    )
    fetch_rpcs = site.phases.step()
    return w, q, f, {"backup": backup_rpcs, "hit_query": query_rpcs, "restore": fetch_rpcs}


def one_size(
    writer: Worker,
    reader: Worker,
    sites: list[Site],
    arm: str,
    tokens: int,
    seed: int,
    reps: int,
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, list[str]]]:
    """``reps`` times, on every cluster in turn (the order rotating): write one
    conversation afresh, then one reader queries and restores it whole. A row per
    cluster (times as medians over the repetitions, master RPCs and checks of each),
    the conversation and the writer's digests."""
    conv = {"tokens": tokens, "seed": seed}
    runs: dict[int, list[Any]] = {site.nodes: [] for site in sites}
    for rep in range(reps):
        for site in _rotated(sites, rep):
            runs[site.nodes].append(one_run(writer, reader, site, conv, seed + 1))
    rows = [{"nodes": n, **_row(arm, tokens, cell)} for n, cell in runs.items()]
    return rows, conv, runs[sites[0].nodes][0][0]["digests"]


def _row(arm: str, tokens: int, runs: list[Any]) -> dict[str, Any]:
    w, q, f, rpcs = runs[0]
    reps = len(runs)
    pages = len(w["digests"]["kv"])
    wrong = [mismatched_pages(f["digests"], w["digests"]) for w, _, f, _ in runs]
    decoy = [mismatched_pages(f["digests"], w["decoy_digests"]) for w, _, f, _ in runs]
    put_s = statistics.median(w["put_s"] for w, _, _, _ in runs)
    query_s = statistics.median(q["query_s"] for _, q, _, _ in runs)
    fetch_s = statistics.median(f["fetch_s"] for _, _, f, _ in runs)
    restore_s = [q["query_s"] + f["fetch_s"] for _, q, f, _ in runs]
    row = {
        "arm": arm,
        "tokens": tokens,
        "reps": reps,
        "keys": w["keys"],
        "chunks": w["chunks"],
        "bytes": w["bytes"],
        "state_bytes": w["state_bytes"],
        "objects": w["objects"],
        "objects_per_ktoken": round(1000 * w["objects"] / tokens, 2),
        "failed_objects": sum(w["failed_objects"] for w, _, _, _ in runs),
        "put_s": round(put_s, 4),
        "put_gbps": _gbps(w["bytes"], put_s),
        "put_gbps_each": [_gbps(w["bytes"], w["put_s"]) for w, _, _, _ in runs],
        "hit_keys": min(q["hit_keys"] for _, q, _, _ in runs),
        "restored_keys": min(f["restored_keys"] for _, _, f, _ in runs),
        "state_restored": all(f["state_restored"] for _, _, f, _ in runs),
        "query_s": round(query_s, 5),
        "fetch_s": round(fetch_s, 4),
        "restore_ms_per_ktoken": round(1e6 * statistics.median(restore_s) / tokens, 3),
        "restore_ms_per_ktoken_each": [round(1e6 * s / tokens, 3) for s in restore_s],
        "get_gbps": _gbps(f["bytes"], fetch_s),
        "bytes_restored": f["bytes"],
        "mismatched_pages": max(wrong),
        "negative_control_mismatched_pages": min(decoy),
        "master_rpcs": {
            **{phase: _master_total(delta) for phase, delta in rpcs.items()},
            "each": [{phase: _master_total(delta) for phase, delta in r[3].items()} for r in runs],
            "by_request": rpcs,
        },
        "native": {"backup": w["native"], "hit_query": q["native"], "restore": f["native"]},
        "backend_hit_query_rpcs": q.get("backend_hit_query_rpcs"),
        "placement": w["placement"],
    }
    row["byte_exact"] = (
        row["mismatched_pages"] == 0 and row["restored_keys"] == w["keys"] and row["state_restored"]
    )
    # Every page of the decoy differs, in every repetition: else the check is blind.
    row["negative_control_caught"] = min(decoy) >= pages > 0
    return row


def readers_at_once(
    readers: list[Worker], slot: str, conv: dict[str, Any], expected: dict[str, Any]
) -> dict[str, Any]:
    """Every reader queries, then all restore the same conversation from one start time."""
    queries = call_all(readers, {"op": "query", "slot": slot, "conv": conv})
    start_at = time.time() + START_LEAD_S
    for r, q in zip(readers, queries, strict=True):
        r.send(
            {
                "op": "fetch",
                "slot": slot,
                "conv": conv,
                "hit_keys": q["hit_keys"],
                "start_at": start_at,
            }
        )
    fetched = [r.reply() for r in readers]
    total = sum(f["bytes"] for f in fetched)
    span_s = max(f["wall_end"] for f in fetched) - min(f["wall_start"] for f in fetched)
    per_rank = [_gbps(f["bytes"], f["fetch_s"]) for f in fetched]
    return {
        "readers": len(readers),
        "bytes_per_reader": fetched[0]["bytes"],
        "aggregate_gbps": _gbps(total, span_s),
        "per_rank_gbps": per_rank,
        "per_rank_gbps_median": statistics.median(p for p in per_rank if p is not None),
        "start_spread_s": round(
            max(f["wall_start"] for f in fetched) - min(f["wall_start"] for f in fetched), 4
        ),
        "byte_exact": all(
            mismatched_pages(f["digests"], expected) == 0 and f["state_restored"] for f in fetched
        ),
        "restored_keys": [f["restored_keys"] for f in fetched],
    }


def _median(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """The repetition with the median aggregate GB/s, with every repetition's figures."""
    ordered = sorted(cells, key=lambda c: c["aggregate_gbps"] or 0.0)
    out = dict(ordered[len(ordered) // 2])
    out["aggregate_gbps_each"] = [c["aggregate_gbps"] for c in cells]
    out["byte_exact"] = all(c["byte_exact"] for c in cells)
    return out


# ---- the run -------------------------------------------------------------------------------


@dataclass
class _Workers:
    writer: Worker
    readers: list[Worker] = field(default_factory=list)

    def all(self) -> list[Worker]:
        return [self.writer, *self.readers]

    def close(self) -> None:
        for w in self.all():
            w.close()


def _start_workers(config: LongConfig, log_dir: Path, nonce: str) -> _Workers:
    spec = {"max_tokens": config.max_tokens, "nonce": nonce}
    writer = Worker("writer", spec, log_dir / "writer.log")
    workers = _Workers(writer)
    try:
        for i in range(max(config.readers)):
            workers.readers.append(Worker(f"reader{i}", spec, log_dir / f"reader{i}.log"))
        for w in workers.all():
            w.reply(WORKER_START_TIMEOUT_S)
    except BaseException:
        workers.close()
        raise
    return workers


def run_arm(config: LongConfig, arm: str, workers: _Workers, sites: list[Site]) -> dict[str, Any]:
    """Every size, then the bandwidth cells, of one arm on every cluster."""
    out: dict[str, Any] = {"sizes": [], "bandwidth": []}
    first = [workers.writer, workers.readers[0]]
    for site in sites:
        call_all(
            first,
            {"op": "open", "slot": site.slot, "arm": arm, "client_config": site.client_config},
        )
    try:
        for tokens in config.sizes_tokens:
            logger.info("long: %s, %d tokens", arm, tokens)
            seed = config.seed * 1_000_003 + tokens
            rows, conv, expected = one_size(
                workers.writer, workers.readers[0], sites, arm, tokens, seed, config.reps
            )
            out["sizes"] += rows
        if arm in config.bandwidth_arms:
            # The longest conversation is the one still stored on every cluster.
            out["bandwidth"] += _bandwidth(config, workers, sites, arm, conv, expected)
    finally:
        for site in sites:
            call_all(first, {"op": "close", "slot": site.slot})
    return out


def _bandwidth(
    config: LongConfig,
    workers: _Workers,
    sites: list[Site],
    arm: str,
    conv: dict[str, Any],
    expected: dict[str, list[str]],
) -> list[dict[str, Any]]:
    """The reader counts' cells, the clusters alternating within each repetition; the
    extra readers hold the arm's pools only meanwhile."""
    extra = workers.readers[1 : max(config.readers)]
    for site in sites:
        call_all(
            extra,
            {"op": "open", "slot": site.slot, "arm": arm, "client_config": site.client_config},
        )
    rows = []
    try:
        for count in config.readers:
            logger.info("long: %s, %d readers", arm, count)
            cells: dict[int, list[dict[str, Any]]] = {site.nodes: [] for site in sites}
            for rep in range(config.bandwidth_reps):
                for site in _rotated(sites, rep):
                    cells[site.nodes].append(
                        readers_at_once(workers.readers[:count], site.slot, conv, expected)
                    )
            for nodes, cell in cells.items():
                rows.append({"nodes": nodes, "arm": arm, "tokens": conv["tokens"], **_median(cell)})
    finally:
        for site in sites:
            call_all(extra, {"op": "close", "slot": site.slot})
    return rows


@contextlib.contextmanager
def started_sites(config: LongConfig, log_dir: Path):
    """A cluster per node count, all up for the whole run."""
    from mooncake_span.ops.cluster import ClusterSpec, LocalCluster
    from mooncake_span_tools.bench.placement import wait_for_segments

    with contextlib.ExitStack() as stack:
        sites = []
        for nodes in config.node_counts:
            spec = ClusterSpec(
                storage_nodes=nodes,
                storage_node_segment_bytes=config.segment_bytes(),
                log_dir=log_dir / f"cluster-{nodes}",
            )
            cluster = stack.enter_context(LocalCluster(spec))
            sites.append(
                Site(
                    nodes,
                    {**cluster.client_config(), "span_master_admin_url": cluster.metrics_url},
                    Phases(cluster.metrics_url),
                    wait_for_segments(cluster.metrics_url, nodes),
                )
            )
        yield sites


def run_long(config: LongConfig) -> dict[str, Any]:
    from mooncake_span.config import SpanOptions
    from mooncake_span_tools.bench.placement import conversations, window_model
    from mooncake_span_tools.bench.runner import _machine, _versions

    started = time.time()
    nonce = str(time.time_ns())
    log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="mooncake-span-long-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "machine": _machine(),
        "versions": _versions(),
        "config": asdict(config),
        "chunk_tokens": CHUNK_TOKENS,
        "segment_bytes_per_node": config.segment_bytes(),
        "log_dir": str(log_dir),
        "sizes": [],
        "bandwidth": [],
    }
    workers = _start_workers(config, log_dir, nonce)
    try:
        with started_sites(config, log_dir) as sites:
            result["segments"] = {str(site.nodes): site.segments for site in sites}
            for arm in config.arms:
                part = run_arm(config, arm, workers, sites)
                result["sizes"] += part["sizes"]
                result["bandwidth"] += part["bandwidth"]
    finally:
        workers.close()

    def key(row: dict[str, Any]) -> tuple[int, int]:
        return config.node_counts.index(row["nodes"]), config.arms.index(row["arm"])

    result["sizes"].sort(key=key)
    result["bandwidth"].sort(key=key)
    window_keys = SpanOptions().chain_window_tokens // 64
    convs = conversations(config.seed)
    result["placement_model"] = {
        "window_tokens": SpanOptions().chain_window_tokens,
        "share_after_one_node_lost": {
            str(n): window_model(convs, n, window_keys)["mean_share"] for n in (2, 4)
        },
        "today": {str(n): v for n, v in SHARE_TODAY.items()},
    }
    result["targets"] = evaluate(result, config)
    result["byte_exact"] = all(r["byte_exact"] for r in result["sizes"]) and all(
        b["byte_exact"] for b in result["bandwidth"]
    )
    result["negative_controls_caught"] = all(r["negative_control_caught"] for r in result["sizes"])
    with contextlib.suppress(OSError):
        result["machine"]["loadavg_end"] = os.getloadavg()
    result["elapsed_s"] = round(time.time() - started, 1)
    return result


# ---- targets and reports -------------------------------------------------------------------


def _cell(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def evaluate(result: dict[str, Any], config: LongConfig) -> list[dict[str, Any]]:
    sizes, bw = result["sizes"], result["bandwidth"]
    small, large = min(config.sizes_tokens), config.max_tokens
    most, fewest = max(config.node_counts), min(config.node_counts)
    out = []
    for arm in config.arms:
        for nodes in config.node_counts:
            a = _cell(sizes, arm=arm, nodes=nodes, tokens=small)
            b = _cell(sizes, arm=arm, nodes=nodes, tokens=large)
            if a and b:
                ratio = b["restore_ms_per_ktoken"] / a["restore_ms_per_ktoken"]
                out.append(
                    _target(
                        "restore_per_token_longest_vs_shortest",
                        arm,
                        nodes,
                        ratio,
                        RESTORE_PER_TOKEN_RATIO_MAX,
                        at_most=True,
                    )
                )
            whole = b is not None and b["hit_keys"] == b["keys"] and b["byte_exact"]
            if b is not None:
                out.append(_target("longest_restored_whole", arm, nodes, float(whole), 1.0))
        one, many = (_cell(sizes, arm=arm, nodes=n, tokens=large) for n in (fewest, most))
        if one and many and most > fewest:
            ratio = many["put_gbps"] / one["put_gbps"]
            out.append(
                _target(f"put_{most}_nodes_vs_{fewest}", arm, most, ratio, PUT_FOUR_NODES_MIN)
            )
        readers = max(config.readers)
        one, many = (_cell(bw, arm=arm, nodes=n, readers=readers) for n in (fewest, most))
        if one and many and most > fewest:
            ratio = many["aggregate_gbps"] / one["aggregate_gbps"]
            out.append(
                _target(
                    f"{readers}_readers_{most}_nodes_vs_{fewest}",
                    arm,
                    most,
                    ratio,
                    EIGHT_READERS_FOUR_NODES_MIN,
                )
            )
    return out


def _target(
    name: str, arm: str, nodes: int, value: float, goal: float, *, at_most: bool = False
) -> dict[str, Any]:
    passed = value <= goal if at_most else value >= goal
    return {
        "id": name,
        "arm": arm,
        "nodes": nodes,
        "value": round(value, 3),
        "goal": f"{'<=' if at_most else '>='} {goal}",
        "passed": passed,
    }


def _f(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def format_long(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"mooncake-span bench --long {result['date_utc']}  {m.get('nproc')} CPUs, "
        f"{m.get('mem_total_gib')} GiB; one run per cell, loopback TCP; GB = 1e9 B",
        "",
        "per conversation (one writer, one reader in another process):",
        f"  {'nodes':>5} {'arm':<14}{'tokens':>8}{'keys':>6}{'MiB':>7}{'obj/ktok':>9}"
        f"{'put GB/s':>9}{'query ms':>9}{'get GB/s':>9}{'ms/ktok':>8}"
        f"{'RPCs b/q/r':>14}  exact ctrl",
    ]
    for r in result["sizes"]:
        rpcs = r["master_rpcs"]
        lines.append(
            f"  {r['nodes']:>5} {r['arm']:<14}{r['tokens']:>8}{r['keys']:>6}"
            f"{r['bytes'] / (1 << 20):>7.0f}{r['objects_per_ktoken']:>9.2f}"
            f"{_f(r['put_gbps']):>9}{1e3 * r['query_s']:>9.1f}{_f(r['get_gbps']):>9}"
            f"{r['restore_ms_per_ktoken']:>8.2f}"
            f"{str(rpcs['backup']) + '/' + str(rpcs['hit_query']) + '/' + str(rpcs['restore']):>14}"
            f"  {'yes' if r['byte_exact'] else 'NO':<5} "
            f"{'caught' if r['negative_control_caught'] else 'MISSED'}"
        )
    lines += ["", "readers restoring the longest conversation at once:"]
    for b in result["bandwidth"]:
        lines.append(
            f"  {b['nodes']} nodes {b['arm']:<14}{b['readers']:>2} readers: aggregate "
            f"{_f(b['aggregate_gbps'])} GB/s, per rank median {_f(b['per_rank_gbps_median'])} "
            f"(start spread {1e3 * b['start_spread_s']:.0f} ms), exact {b['byte_exact']}"
        )
    model = result["placement_model"]
    lines += [
        "",
        "share of short conversations whole after one node is lost (placement model, "
        f"window {model['window_tokens']} tokens): "
        + ", ".join(
            f"{n} nodes {v:.3f} (today {model['today'][n]})"
            for n, v in model["share_after_one_node_lost"].items()
        ),
        "",
        "targets:",
    ]
    for t in result["targets"]:
        verdict = "PASS" if t["passed"] else "MISS"
        lines.append(
            f"  {verdict} {t['id']:<40} {t['arm']:<14} {t['nodes']} nodes: "
            f"{t['value']:.3f} (goal {t['goal']})"
        )
    lines.append(
        f"byte-exact: {result['byte_exact']}; negative controls caught: "
        f"{result['negative_controls_caught']}; elapsed {result['elapsed_s']} s"
    )
    return "\n".join(lines)


def format_markdown(result: dict[str, Any]) -> str:
    out = [
        "| nodes | arm | tokens | keys | MiB | objects / 1k tokens | put GB/s | hit query ms "
        "| get GB/s | restore ms / 1k tokens | master RPCs backup / query / restore | exact |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["sizes"]:
        rpcs = r["master_rpcs"]
        out.append(
            f"| {r['nodes']} | {r['arm']} | {r['tokens']:,} | {r['keys']:,} | "
            f"{r['bytes'] / (1 << 20):.0f} | {r['objects_per_ktoken']:.2f} | "
            f"{_f(r['put_gbps'])} | {1e3 * r['query_s']:.1f} | {_f(r['get_gbps'])} | "
            f"{r['restore_ms_per_ktoken']:.2f} | {rpcs['backup']} / {rpcs['hit_query']} / "
            f"{rpcs['restore']} | {'yes' if r['byte_exact'] else '**no**'} |"
        )
    out += [
        "",
        "| nodes | arm | readers | aggregate GB/s | per rank GB/s (median, min-max) | exact |",
        "|---:|---|---:|---:|---:|---|",
    ]
    for b in result["bandwidth"]:
        ranks = [p for p in b["per_rank_gbps"] if p is not None]
        out.append(
            f"| {b['nodes']} | {b['arm']} | {b['readers']} | {_f(b['aggregate_gbps'])} | "
            f"{_f(b['per_rank_gbps_median'])} ({_f(min(ranks))}-{_f(max(ranks))}) | "
            f"{'yes' if b['byte_exact'] else '**no**'} |"
        )
    out += ["", "| target | arm | nodes | value | goal | verdict |", "|---|---|---:|---:|---|---|"]
    for t in result["targets"]:
        out.append(
            f"| {t['id']} | {t['arm']} | {t['nodes']} | {t['value']:.3f} | {t['goal']} | "
            f"{'met' if t['passed'] else '**missed**'} |"
        )
    return "\n".join(out) + "\n"


def write_plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for arm in result["config"]["arms"]:
        for nodes in result["config"]["node_counts"]:
            rows = [r for r in result["sizes"] if r["arm"] == arm and r["nodes"] == nodes]
            if rows:
                left.plot(
                    [r["tokens"] for r in rows],
                    [r["restore_ms_per_ktoken"] for r in rows],
                    marker="o",
                    linestyle="-" if nodes == 1 else "--",
                    label=f"{arm}, {nodes} node(s)",
                )
            bw = [b for b in result["bandwidth"] if b["arm"] == arm and b["nodes"] == nodes]
            if bw:
                right.plot(
                    [b["readers"] for b in bw],
                    [b["aggregate_gbps"] for b in bw],
                    marker="o",
                    linestyle="-" if nodes == 1 else "--",
                    label=f"{arm}, {nodes} node(s)",
                )
    left.set_xscale("log", base=2)
    left.set_xlabel("conversation tokens")
    left.set_ylabel("hit query + restore, ms per 1,000 tokens")
    left.set_title("restore time per token (one reader)")
    left.legend(fontsize=7)
    right.set_xlabel("reader processes restoring the longest conversation at once")
    right.set_ylabel("aggregate GB/s")
    right.set_title("restore bandwidth by storage nodes")
    right.legend(fontsize=7)
    m = result["machine"]
    fig.suptitle(
        f"mooncake-span bench --long {result['date_utc']}: {m.get('nproc')} CPUs, loopback TCP",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_long_command(
    quick: bool, json_path: str | None, plot_path: str | None, sizes: str | None
) -> int:
    base = QUICK if quick else LongConfig()
    try:
        if sizes:
            parsed = tuple(int(s) for s in sizes.split(",") if s.strip())
            base = replace(base, sizes_tokens=parsed)
    except ValueError as exc:
        print(f"mooncake-span bench --long: {exc}", file=sys.stderr)
        return 2
    result = run_long(base)
    print(format_long(result), flush=True)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {json_path}", flush=True)
    if plot_path:
        write_plot(result, plot_path)
        print(f"wrote {plot_path}", flush=True)
    ok = result["byte_exact"] and result["negative_controls_caught"]
    return 0 if ok else 1
