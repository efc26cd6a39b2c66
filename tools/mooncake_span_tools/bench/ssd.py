"""``mooncake-span bench --ssd``: the SSD tier through the backend, no servers.

On a local cluster with one storage node and an SSD tier (``--ssd-dir``), the
backend writes ``keys`` span keys of real host pages (MLA, K=4, 1 MiB per
key), waits until every object is on the node's SSD, and drops the DRAM copy
of half of them (``batch_replica_clear`` on the node's segment: the objects
then live on disk only, as after eviction). Then:

* **SSD vs DRAM reads**, paired and interleaved: each round reads one batch
  of DRAM keys and one of SSD-only keys in alternating order, into wiped host
  pages, checking every byte; the figure is the per-round ratio of the two;
* **restore after a whole-cluster restart**: the backend, the storage node and
  the master stop, a new cluster starts on new ports over the same directory
  and a new backend reads every key: restorable share and wrong bytes. A
  DRAM-only cluster goes through the same restart beside it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mooncake_span.ops.cluster import LocalCluster
from mooncake_span.ops.cluster_spec import ClusterSpec
from mooncake_span.ops.master_http import iter_lines
from mooncake_span_tools.bench.serve_stats import distribution
from mooncake_span_tools.testing import backends as B
from mooncake_span_tools.testing import pools as P

logger = logging.getLogger(__name__)

PAGE_TOKENS = 64
PAGES_PER_KEY = 4
# MLA page: layers * 64 tokens * (kv_lora_rank + rope) * 2 bytes = 256 KiB; a key 1 MiB.
MLA = {"layers": 8, "kv_lora_rank": 240, "rope_dim": 16}
OFFLOAD_TIMEOUT_S = 60.0
WRITE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class SsdBenchConfig:
    keys: int = 96
    batch_keys: int = 16
    rounds: int = 20
    segment_bytes: int = 256 << 20
    work_dir: Path = field(default_factory=lambda: Path("/tmp/mooncake-span-bench-ssd"))

    def __post_init__(self) -> None:
        if self.keys < 4 * self.batch_keys or self.batch_keys < 1 or self.rounds < 1:
            raise ValueError("need keys >= 4 * batch_keys, batch_keys >= 1 and rounds >= 1")


class Pages:
    """``count`` span keys of random bytes in one MLA host pool, and what they must read back."""

    def __init__(self, count: int, namespace: str) -> None:
        self.kv = P.build_mla_host("page_first", host_pages=count * PAGES_PER_KEY, **MLA)
        self.names = [f"{namespace}-{i:05d}" for i in range(count)]
        self.starts = [p * PAGE_TOKENS for p in range(count * PAGES_PER_KEY)]
        P.fill_random_pages(self.kv, self.starts, seed=5)
        self.expected = [P.page_bytes(self.kv, s) for s in self.starts]
        self.key_bytes = len(self.expected[0]) * PAGES_PER_KEY

    def slots(self, rows: Sequence[int]) -> Any:
        import torch

        pages = [r * PAGES_PER_KEY + p for r in rows for p in range(PAGES_PER_KEY)]
        return torch.tensor([p * PAGE_TOKENS + t for p in pages for t in range(PAGE_TOKENS)])

    def pages_of(self, rows: Sequence[int]) -> list[int]:
        return [r * PAGES_PER_KEY + p for r in rows for p in range(PAGES_PER_KEY)]

    def read(self, store: Any, rows: Sequence[int]) -> tuple[float, int, int]:
        """(seconds, keys restored, keys restored with wrong bytes) of one get."""
        pages = self.pages_of(rows)
        P.wipe_pages(self.kv, [self.starts[p] for p in pages])
        started = time.perf_counter()
        flags = store.batch_get_v1([self.names[r] for r in rows], self.slots(rows))
        elapsed_s = time.perf_counter() - started
        wrong = 0
        for r, ok in zip(rows, flags, strict=True):
            exact = all(
                P.page_bytes(self.kv, self.starts[p]) == self.expected[p]
                for p in self.pages_of([r])
            )
            wrong += bool(ok and not exact)
        return elapsed_s, sum(flags), wrong


def _backend(cluster: LocalCluster, namespace: str, pages: Pages, native: Any = None) -> Any:
    extra = {**cluster.client_config(), "storage_page_size": PAGE_TOKENS * PAGES_PER_KEY}
    config = B.storage_config(extra, namespace)
    return B.span_backend(config, {P.PoolName.KV: pages.kv}, native)


def _write_all(store: Any, pages: Pages) -> int:
    """Every key, again while offload back-pressure refuses some; returns the refusals."""
    pending, refused = list(range(len(pages.names))), 0
    deadline = time.monotonic() + WRITE_TIMEOUT_S
    while pending and time.monotonic() < deadline:
        batch, pending = pending[:16], pending[16:]
        flags = store.batch_set_v1([pages.names[r] for r in batch], pages.slots(batch))
        failed = [r for r, ok in zip(batch, flags, strict=True) if not ok]
        refused += len(failed)
        pending += failed
        if failed:
            time.sleep(0.5)
    if pending:
        raise RuntimeError(f"{len(pending)} keys were never stored")
    return refused


class NativeView:
    """The backend's native client, owned here for what the backend does not do: replica
    kinds, and dropping DRAM copies (the master lets only the writing client clear
    them). The backend closes it."""

    def __init__(self, cluster: LocalCluster) -> None:
        from mooncake_span_tools.bench.shared_native import raw_client

        self.cluster = cluster
        self.store = raw_client(cluster.client_config())

    def objects(self, names: Sequence[str]) -> list[str]:
        wanted = tuple(f"_{n}__" for n in names)
        keys = iter_lines(f"{self.cluster.metrics_url}/get_all_keys", timeout_s=10.0)
        return [k for k in keys if any(w in k for w in wanted)]

    def kinds(self, objects: Sequence[str]) -> dict[str, int]:
        found = self.store.batch_get_replica_desc(list(objects))
        memory = sum(any(r.is_memory_replica() for r in reps) for reps in found.values())
        disk = sum(any(r.is_local_disk_replica() for r in reps) for reps in found.values())
        return {"objects": len(found), "in_dram": memory, "on_ssd": disk}

    def wait_on_disk(self, objects: Sequence[str]) -> float:
        started = time.monotonic()
        while self.kinds(objects)["on_ssd"] < len(objects):
            if time.monotonic() - started > OFFLOAD_TIMEOUT_S:
                raise RuntimeError("objects never reached the SSD")
            time.sleep(0.25)
        return time.monotonic() - started

    def drop_dram_copies(self, objects: Sequence[str], segment: str) -> None:
        left = list(objects)
        deadline = time.monotonic() + 30.0
        while left and time.monotonic() < deadline:
            time.sleep(0.6)  # the master clears only replicas without a lease
            cleared = set(self.store.batch_replica_clear(left, segment))
            left = [o for o in left if o not in cleared]
        if left:
            raise RuntimeError(f"{len(left)} DRAM copies were not dropped")


def _paired_reads(store: Any, pages: Pages, config: SsdBenchConfig) -> dict[str, Any]:
    half = len(pages.names) // 2
    dram, ssd = list(range(half)), list(range(half, len(pages.names)))
    times: dict[str, list[float]] = {"dram": [], "ssd": []}
    restored = {"dram": 0, "ssd": 0}
    wrong = 0
    for r in range(config.rounds + 1):
        order = ("ssd", "dram") if r % 2 else ("dram", "ssd")
        for tier in order:
            rows_all = dram if tier == "dram" else ssd
            start = (r * config.batch_keys) % (len(rows_all) - config.batch_keys + 1)
            elapsed_s, ok, bad = pages.read(store, rows_all[start : start + config.batch_keys])
            wrong += bad
            if r:  # round 0 warms both paths up
                times[tier].append(elapsed_s)
                restored[tier] += ok
    ratios = [s / d for s, d in zip(times["ssd"], times["dram"], strict=True)]
    batch_mb = config.batch_keys * pages.key_bytes / 1e6
    return {
        "batch_keys": config.batch_keys,
        "batch_bytes": config.batch_keys * pages.key_bytes,
        "get_s": {tier: distribution(values) for tier, values in times.items()},
        "mb_per_s_p50": {t: batch_mb / distribution(v)["p50"] for t, v in times.items()},
        "ssd_over_dram": {**distribution(ratios), "per_round": ratios},
        "keys_restored": restored,
        "keys_read": config.rounds * config.batch_keys,
        "wrong_keys": wrong,
    }


def _restart(spec: ClusterSpec, pages: Pages, namespace: str) -> dict[str, Any]:
    started = time.monotonic()
    with LocalCluster(spec) as cluster:
        ready_s = time.monotonic() - started
        store = _backend(cluster, namespace, pages)
        try:
            restored = wrong = 0
            rows = list(range(len(pages.names)))
            for i in range(0, len(rows), 16):
                _, ok, bad = pages.read(store, rows[i : i + 16])
                restored += ok
                wrong += bad
        finally:
            store.close()
    return {
        "keys": len(rows),
        "restored_keys": restored,
        "restorable_share": restored / len(rows),
        "wrong_keys": wrong,
        "new_cluster_ready_s": ready_s,
    }


def _spec(config: SsdBenchConfig, name: str, ssd_dir: Path | None) -> ClusterSpec:
    return ClusterSpec(
        storage_nodes=1,
        storage_node_segment_bytes=config.segment_bytes,
        ssd_dir=ssd_dir,
        log_dir=config.work_dir / "logs" / name,
    )


def _tier(config: SsdBenchConfig, name: str, ssd_dir: Path | None) -> dict[str, Any]:
    """Write, (with an SSD tier) time SSD vs DRAM reads, then restart the whole cluster."""
    pages = Pages(config.keys, f"bench-ssd-{name}")
    spec = _spec(config, name, ssd_dir)
    out: dict[str, Any] = {"ssd_dir": str(ssd_dir) if ssd_dir else None}
    with LocalCluster(spec) as cluster:
        view = NativeView(cluster)
        store = _backend(cluster, pages.names[0].rsplit("-", 1)[0], pages, view.store)
        try:
            started = time.monotonic()
            out["put_refusals"] = _write_all(store, pages)
            out["write_s"] = time.monotonic() - started
            if ssd_dir is not None:
                objects = view.objects(pages.names)
                out["offload_wait_s"] = view.wait_on_disk(objects)
                segment = cluster.node_ready_fields(0)["segment"]
                view.drop_dram_copies(view.objects(pages.names[len(pages.names) // 2 :]), segment)
                out["before_reads"] = view.kinds(objects)
                out["reads"] = _paired_reads(store, pages, config)
        finally:
            store.close()
    out["restart"] = _restart(spec, pages, pages.names[0].rsplit("-", 1)[0])
    return out


def run_ssd_bench(config: SsdBenchConfig) -> dict[str, Any]:
    started = time.monotonic()
    ssd_dir = config.work_dir / "ssd"
    shutil.rmtree(ssd_dir, ignore_errors=True)
    ssd_dir.mkdir(parents=True)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    result = {
        "bench": "ssd",
        "config": {**asdict(config), "work_dir": str(config.work_dir)},
        "key_bytes": PAGES_PER_KEY * MLA["layers"] * PAGE_TOKENS * 256 * 2,
        "ssd": _tier(config, "ssd", ssd_dir),
        "dram_only": _tier(config, "dram", None),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    result["wall_s"] = time.monotonic() - started
    return result


def format_ssd_bench(result: dict[str, Any]) -> str:
    ssd = result["ssd"]
    reads = ssd["reads"]
    lines = [
        f"SSD tier, {result['config']['keys']} keys of {result['key_bytes']} bytes, "
        f"{ssd['put_refusals']} puts refused under offload back-pressure and written again",
        f"  get of {reads['batch_keys']} keys: DRAM p50 "
        f"{reads['get_s']['dram']['p50'] * 1e3:.1f} ms, "
        f"SSD only p50 {reads['get_s']['ssd']['p50'] * 1e3:.1f} ms; paired SSD/DRAM p50 "
        f"{reads['ssd_over_dram']['p50']:.2f}x (p99 {reads['ssd_over_dram']['p99']:.2f}x); "
        f"{reads['wrong_keys']} wrong",
    ]
    for name in ("ssd", "dram_only"):
        restart = result[name]["restart"]
        lines.append(
            f"  whole-cluster restart, {name}: {restart['restored_keys']}/{restart['keys']} "
            f"keys restorable ({restart['restorable_share']:.1%}), {restart['wrong_keys']} wrong"
        )
    return "\n".join(lines)


def run_ssd_command(quick: bool, json_path: str | None) -> int:
    config = SsdBenchConfig(keys=48, batch_keys=8, rounds=6) if quick else SsdBenchConfig()
    result = run_ssd_bench(config)
    print(format_ssd_bench(result), flush=True)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {json_path}", flush=True)
    wrong = result["ssd"]["reads"]["wrong_keys"] + result["ssd"]["restart"]["wrong_keys"]
    return 1 if wrong else 0
