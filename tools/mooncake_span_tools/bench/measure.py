"""Timing one contender run and summarising repetitions into paired ratios."""

from __future__ import annotations

import gc
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from mooncake_span_tools.bench.contenders import WorkloadRunner
from mooncake_span_tools.bench.shared_native import NativeCounters, TimedNativeStore
from mooncake_span_tools.bench.workloads import ContenderSpec, Workload

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------
# measurement


@dataclass
class RunRecord:
    rep: int
    warmup: bool
    put_s: float
    get_s: float
    exists_s: float | None
    exists_all_s: float | None
    put_native: dict[str, float]
    get_native: dict[str, float]
    exists_native: dict[str, float] | None
    keys_ok_put: int
    keys_ok_get: int
    keys: int
    exists_hits: int | None
    verified: bool
    complete: bool
    pages_compared: int


def _timed(
    calls: Sequence[Callable[[], Any]], store: TimedNativeStore
) -> tuple[float, list[Any], NativeCounters]:
    before = store.snapshot()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        started = time.perf_counter()
        results = [fn() for fn in calls]
        elapsed = time.perf_counter() - started
    finally:
        if gc_was_enabled:
            gc.enable()
    return elapsed, results, store.snapshot().minus(before)


def run_contender(runner: WorkloadRunner, name: str, rep: int, warmup: bool) -> RunRecord:
    run = runner.prepare(name, rep)
    runner.wipe(run)
    put_s, put_res, put_native = _timed(run.put, runner.store)
    put_ok = np.array([f for call in put_res for f in call], dtype=bool)
    exists_s = exists_native = hits = None
    if run.exists:
        exists_s, hit_list, ex_native = _timed(run.exists, runner.store)
        hits, exists_native = int(sum(hit_list)), asdict(ex_native)
    exists_all_s = None
    if run.exists_all is not None:
        # best of 3: a single short call is at the mercy of the scheduler
        tries = [_timed([run.exists_all], runner.store) for _ in range(3)]
        exists_all_s = min(t[0] for t in tries)
        if any(t[1][0] != run.keys for t in tries):
            hits = -1
    get_s, get_res, get_native = _timed(run.get, runner.store)
    get_ok = np.array([f for call in get_res for f in call], dtype=bool)
    key_ok = get_ok & put_ok if len(get_ok) == len(put_ok) else np.zeros(run.keys, dtype=bool)
    verified, compared = runner.verify(run, key_ok)
    runner.remove_all()
    return RunRecord(
        rep=rep,
        warmup=warmup,
        put_s=put_s,
        get_s=get_s,
        exists_s=exists_s,
        exists_all_s=exists_all_s,
        put_native=asdict(put_native),
        get_native=asdict(get_native),
        exists_native=exists_native,
        keys_ok_put=int(put_ok.sum()),
        keys_ok_get=int(get_ok.sum()),
        keys=run.keys,
        exists_hits=hits,
        verified=verified,
        complete=bool(key_ok.all()) and len(key_ok) == run.keys,
        pages_compared=compared,
    )


def _stats(values: Sequence[float]) -> dict[str, float | None]:
    vals = [v for v in values if v is not None and v > 0]
    if not vals:
        return {"best": None, "median": None}
    return {"best": max(vals), "median": statistics.median(vals)}


def _lat_stats(values: Sequence[float]) -> dict[str, float | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"min": None, "median": None}
    return {"min": min(vals), "median": statistics.median(vals)}


def summarize(
    workload: Workload, runner_info: dict[str, Any], name: str, records: list[RunRecord]
) -> dict[str, Any]:
    spec = ContenderSpec.parse(name)
    timed = [r for r in records if not r.warmup]
    bytes_per_run = runner_info["bytes_per_run"]
    pages = workload.pages_per_run
    keys = pages // spec.pages_per_key
    calls = workload.pages_per_run // workload.pages_per_call
    tokens = pages * workload.model.page_tokens
    out: dict[str, Any] = {
        "pages_per_key": spec.pages_per_key,
        "keys_per_run": keys,
        "keys_per_call": workload.pages_per_call // spec.pages_per_key,
        "placement": spec.placement,
        "put_gbps": _stats([bytes_per_run / r.put_s / 1e9 for r in timed if r.complete]),
        "get_gbps": _stats([bytes_per_run / r.get_s / 1e9 for r in timed if r.complete]),
        "put_pages_per_s": _stats([pages / r.put_s for r in timed if r.complete]),
        "get_pages_per_s": _stats([pages / r.get_s for r in timed if r.complete]),
        "put_keys_per_s": _stats([keys / r.put_s for r in timed if r.complete]),
        "get_keys_per_s": _stats([keys / r.get_s for r in timed if r.complete]),
        # wall time minus time inside native Mooncake calls (memcpy has none)
        "put_python_ms_per_call": _lat_stats(
            [
                (r.put_s - r.put_native["io_s"] - r.put_native["exist_s"]) / calls * 1e3
                for r in timed
                if spec.kind != "memcpy"
            ]
        ),
        "get_python_ms_per_call": _lat_stats(
            [
                (r.get_s - r.get_native["io_s"] - r.get_native["exist_s"]) / calls * 1e3
                for r in timed
                if spec.kind != "memcpy"
            ]
        ),
        "put_native_ms_per_call": _lat_stats(
            [
                (r.put_native["io_s"] + r.put_native["exist_s"]) / calls * 1e3
                for r in timed
                if spec.kind != "memcpy"
            ]
        ),
        "get_native_ms_per_call": _lat_stats(
            [
                (r.get_native["io_s"] + r.get_native["exist_s"]) / calls * 1e3
                for r in timed
                if spec.kind != "memcpy"
            ]
        ),
        "exists_python_ms_per_call": _lat_stats(
            [(r.exists_s - r.exists_native["exist_s"]) / calls * 1e3 for r in timed if r.exists_s]
        ),
        "native_calls_per_run": {
            "put": timed[0].put_native["io_calls"],
            "get": timed[0].get_native["io_calls"],
        }
        if timed
        else None,
        "buffers_per_native_call": (
            timed[0].put_native["io_buffers"] / max(1, timed[0].put_native["io_calls"])
        )
        if timed
        else None,
        "pointers_per_key": runner_info["pointers_per_key"].get(name),
        "plan_us_per_call": (runner_info["plan_s"].get(name) or 0) * 1e6
        if runner_info["plan_s"].get(name)
        else None,
        "exists_us_per_ktoken": _lat_stats(
            [r.exists_s / tokens * 1e3 * 1e6 for r in timed if r.exists_s]
        ),
        "exists_ms_per_call": _lat_stats([r.exists_s / calls * 1e3 for r in timed if r.exists_s]),
        # one query over all keys of the run (pages_per_run pages)
        "exists_all_us_per_ktoken": _lat_stats(
            [r.exists_all_s / tokens * 1e9 for r in timed if r.exists_all_s]
        ),
        "exists_all_ms": _lat_stats([r.exists_all_s * 1e3 for r in timed if r.exists_all_s]),
        "verified_byte_exact": all(r.verified for r in records),
        "complete": all(r.complete for r in records),
        "failed_keys_max": max((r.keys - min(r.keys_ok_put, r.keys_ok_get)) for r in records)
        if records
        else 0,
        "expected_failure": name in workload.expected_failures,
    }
    return out


def throughput_ratio(a: list[RunRecord], b: list[RunRecord], attr: str) -> dict[str, float | None]:
    """Throughput of a / throughput of b on the same bytes (a faster -> > 1).

    ``median``: median over timed repetitions of the per-repetition ratio
    (a and b ran back to back in that repetition); ``best``: best run of a
    against best run of b.
    """
    times_b = {r.rep: getattr(r, attr) for r in b if not r.warmup and r.complete}
    pairs = [
        times_b[r.rep] / getattr(r, attr)
        for r in a
        if not r.warmup and r.complete and r.rep in times_b
    ]
    best_a = min((getattr(r, attr) for r in a if not r.warmup and r.complete), default=None)
    best_b = min(times_b.values(), default=None)
    return {
        "median": statistics.median(pairs) if pairs else None,
        "best": (best_b / best_a) if best_a and best_b else None,
        "n": len(pairs),
    }
