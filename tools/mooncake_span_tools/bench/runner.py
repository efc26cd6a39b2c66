"""``mooncake-span bench``: span mode against upstream MooncakeStore, raw Mooncake and memcpy.

Every contender moves the *same host pages* of the *same real sglang host
pools* in the same run:

* ``span-K<k>``: ``MooncakeSpanStore`` with ``storage_page_size = 64*k`` on the
  storage config, as a span-aware sglang build hands it over (K=1: none, as on
  stock 0.5.23; the stock GLM-5.3-Flash cell is K=1 on 256-token pages)
  (``batch_set_v1``/``batch_get_v1``, plus ``batch_set_v2``/``batch_get_v2``
  for the DSA indexer and Mamba sidecars, the way sglang's controller calls it);
* ``upstream``: sglang 0.5.23's own ``MooncakeStore`` on the same pools, one
  object per 64-token host page (its ``batch_set_v1``/``batch_get_v1``/
  ``batch_exists_v2``), the per-page baseline;
* ``raw-K<k>``: the native ``batch_put_from_multi_buffers`` /
  ``batch_get_into_multi_buffers`` calls the span backend issues, with keys
  and pointer lists built before the clock starts (the floor for the backend);
* ``raw-1buf``: ``batch_put_from`` / ``batch_get_into`` with one buffer per
  page object (page_first only), the floor for the upstream baseline;
* ``memcpy``: single-thread ``numpy.copyto`` of the same page slices, one copy
  per page buffer, into a pre-faulted staging area (the physical limit of the
  same-process path, which is one memcpy worker thread in Mooncake).

Fairness rules (see docs/benchmarks.md):

* one native Mooncake client per topology, shared by every contender through
  ``TimedNativeStore`` (so the same-process topology really has one global segment
  and nothing else mounted, and every native call is timed the same way);
* host pages are the same for every contender of a workload; keys are unique
  per contender and repetition, and every object is removed after each run,
  so Mooncake's keep-the-old-value ``put`` never turns a put into a no-op;
* contenders alternate inside each repetition (the order rotates), the first
  repetition is a warm-up, ratios are paired per repetition, and we report the
  best and the median;
* every get goes into wiped destination pages and every byte is compared with
  the source pages afterwards.

Topologies: ``same`` (the client owns a global segment and no other segment is
mounted, so Mooncake takes its local memcpy path) and ``tcp`` (a client with
``global_segment_size=0`` and one storage node process, over TCP loopback).
With ``--master``/``--metadata`` the client joins an existing cluster instead
(topology ``remote``), which is how ``--protocol rdma --device ...`` is run.

Modules: ``workloads`` (what to run), ``native`` (the shared timed client and
the topologies), ``pages`` (page views of the host pools), ``contenders`` (how
each contender moves pages), ``measure`` (timing and summaries), ``targets``,
``report`` and ``plot``; this module drives them (``run_bench``).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import logging
import os
import platform
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from mooncake_span_tools.bench.contenders import WorkloadRunner
from mooncake_span_tools.bench.measure import RunRecord, run_contender, summarize
from mooncake_span_tools.bench.plot import write_plot
from mooncake_span_tools.bench.report import format_markdown, format_table
from mooncake_span_tools.bench.shared_native import Topology
from mooncake_span_tools.bench.targets import evaluate_targets
from mooncake_span_tools.bench.workloads import (
    LARGE,
    MODELS,
    SCHEMA,
    SMALL,
    STOCK,
    TINY_LAYERS,
    BenchConfig,
    ContenderSpec,
    Workload,
    plan_workloads,
)
from mooncake_span_tools.native_stderr import native_stderr_to

logger = logging.getLogger(__name__)

# The driver, plus the names the CLI and tests use, importable from here as before the split.
__all__ = [
    "LARGE",
    "MODELS",
    "SCHEMA",
    "SMALL",
    "STOCK",
    "TINY_LAYERS",
    "BenchConfig",
    "ContenderSpec",
    "RunRecord",
    "Workload",
    "evaluate_targets",
    "format_markdown",
    "format_table",
    "native_stderr_to",
    "plan_workloads",
    "run_bench",
    "summarize",
    "write_plot",
]

# ---------------------------------------------------------------------------
# driver


def _machine() -> dict[str, Any]:
    info: dict[str, Any] = {"nproc": os.cpu_count(), "platform": platform.platform()}
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError):
        for line in open("/proc/meminfo", encoding="utf-8"):
            if line.startswith("MemTotal"):
                info["mem_total_gib"] = round(int(line.split()[1]) / (1 << 20), 1)
    with contextlib.suppress(OSError):
        info["loadavg_start"] = os.getloadavg()
    return info


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in (
        "torch",
        "numpy",
        "sglang",
        "mooncake-transfer-engine-non-cuda",
        "mooncake-transfer-engine",
    ):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    with contextlib.suppress(Exception):
        out["git_commit"] = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                timeout=5,
                cwd=os.path.dirname(__file__),
            ).stdout.strip()
            or None
        )
    return out


class _Progress:
    def __init__(self, total: int, enabled: bool, stream: Any) -> None:
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(
                    total=total, file=stream, unit="run", dynamic_ncols=True, leave=True
                )
            except ImportError:
                self._bar = None
        self._stream = stream if enabled else None
        self._done, self._total = 0, total

    def step(self, label: str) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.set_description_str(label[:48], refresh=False)
            self._bar.update(1)
        elif self._stream is not None:
            self._stream.write(f"\r[{self._done}/{self._total}] {label[:60]:<60}")
            self._stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._stream is not None:
            self._stream.write("\n")


def run_bench(
    config: BenchConfig,
    *,
    native_log: str | None = None,
    workloads: Sequence[Workload] | None = None,
) -> dict[str, Any]:
    """Run every workload of ``config`` (or ``workloads``); return the result document."""
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    started = time.time()
    workloads = list(workloads) if workloads is not None else plan_workloads(config)
    total = sum(len(w.contenders) * _reps(w, config)[1] for w in workloads)
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "machine": _machine(),
        "versions": _versions(),
        "env": {
            k: os.environ.get(k)
            for k in (
                "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER",
                "MC_TCP_STATUS_TIMEOUT_SEC",
                "MC_TCP_BIND_ADDRESS",
                "MC_STORE_MEMCPY",
            )
        },
        "config": {k: v for k, v in asdict(config).items() if k != "progress"},
        "workloads": [],
    }
    by_topology: dict[str, list[Workload]] = {}
    for w in workloads:
        by_topology.setdefault(w.topology, []).append(w)
    with native_stderr_to(native_log) as err:
        progress = _Progress(total, config.progress, err)
        try:
            for topo_name, items in by_topology.items():
                with Topology(topo_name, config) as topology:
                    ordered = [w for w in items if not w.isolated] + [
                        w for w in items if w.isolated
                    ]
                    for index, workload in enumerate(ordered):
                        with contextlib.ExitStack() as stack:
                            client = (
                                stack.enter_context(topology.own_client())
                                if workload.isolated
                                else topology
                            )
                            result["workloads"].append(
                                _run_workload(
                                    workload, client, config, config.seed + index, progress
                                )
                            )
                        gc.collect()
        finally:
            progress.close()
    result["targets"] = evaluate_targets(result)
    result["verified_byte_exact"] = all(
        c["summary"]["verified_byte_exact"] for w in result["workloads"] for c in w["contenders"]
    )
    result["all_complete_except_expected"] = all(
        c["summary"]["complete"] or c["summary"]["expected_failure"]
        for w in result["workloads"]
        for c in w["contenders"]
    )
    with contextlib.suppress(OSError):
        result["machine"]["loadavg_end"] = os.getloadavg()
    result["elapsed_s"] = round(time.time() - started, 1)
    return result


def _reps(workload: Workload, config: BenchConfig) -> tuple[int, int]:
    """(warm-up repetitions, all repetitions) of a workload."""
    warmup = config.warmup if workload.warmup is None else workload.warmup
    reps = config.reps if workload.reps is None else workload.reps
    return warmup, warmup + reps


def _run_workload(
    workload: Workload, topology: Topology, config: BenchConfig, seed: int, progress: _Progress
) -> dict[str, Any]:
    runner = WorkloadRunner(workload, topology, seed)
    try:
        names = list(workload.contenders)
        bytes_per_run = workload.pages_per_run * sum(
            p.page_bytes for p in runner.parts if p.per_key
        )
        bytes_per_run += runner.calls * sum(p.page_bytes for p in runner.parts if not p.per_key)
        info = {
            "bytes_per_run": bytes_per_run,
            "pointers_per_key": {n: runner.pointers_per_key(n) for n in names},
            "plan_s": {n: runner.plan_seconds(n) for n in names},
        }
        records: dict[str, list[RunRecord]] = {n: [] for n in names}
        runner.remove_all()
        warmup, total_reps = _reps(workload, config)
        started = time.perf_counter()
        for rep in range(total_reps):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                records[name].append(run_contender(runner, name, rep, warmup=rep < warmup))
                progress.step(
                    f"{workload.topology} {workload.model.label} {workload.layout[:5]} {name}"
                )
        return {
            "name": workload.name,
            "section": workload.section,
            "topology": workload.topology,
            "model": asdict(workload.model),
            "layout": workload.layout,
            "pages_per_run": workload.pages_per_run,
            "pages_per_call": workload.pages_per_call,
            "kv_page_bytes": runner.parts[0].page_bytes,
            "page_bytes_all_pools": sum(p.page_bytes for p in runner.parts if p.per_key),
            "layers": workload.model.layers,
            "bytes_per_run": bytes_per_run,
            "upstream_pages_per_native_call": runner.upstream_pages_per_call()
            if "upstream" in names
            else None,
            "isolated_client": workload.isolated,
            "elapsed_s": round(time.perf_counter() - started, 2),
            "contenders": [
                {
                    "name": n,
                    "summary": summarize(workload, info, n, records[n]),
                    "runs": [asdict(r) for r in records[n]],
                }
                for n in names
            ],
        }
    finally:
        runner.close()
