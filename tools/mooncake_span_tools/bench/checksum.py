"""``mooncake-span bench --checksum``: what ``span_verify_checksums`` costs.

Puts and gets of MooncakeSpanStore (K=4, MLA KV pages of 64 KiB and 2.5 MiB,
page_first, real sglang host pools) with Mooncake's CRC-64 off and on, in one
process (the client owns the only segment: Mooncake's local memcpy path) and
over TCP (a storage node process holds the segment). Mooncake reads
MOONCAKE_STORE_CHECKSUM once per process, so each setting runs in a child
process of its own; the children alternate (off/on, then on/off, ...) so a
slow spell of a shared machine hits both, and each round's on/off ratio is
paired. Every get is compared byte for byte with the pages put. A ``raw``
cell per topology moves one 64 MiB object with the native calls alone
(``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``), so the
cost of Mooncake's CRC shows without the backend around it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

CELLS = (
    ("same", "64KiB", 512),
    ("same", "2.5MiB", 64),
    ("tcp", "64KiB", 512),
    ("tcp", "2.5MiB", 64),
)
PAGES_PER_KEY = 4
RAW_OBJECT_BYTES = 64 << 20
SEGMENT_BYTES = 1536 << 20
_CHILD_TIMEOUT_S = 600


def _cell_store(cluster: Any, topology: str, size: str, pages: int, verify: bool) -> Any:
    from mooncake_span_tools.bench.pages import build_parts, host_pools
    from mooncake_span_tools.bench.workloads import HOST_PAGE_TOKENS, MODELS
    from mooncake_span_tools.testing.backends import span_backend, storage_config

    model = MODELS[("mla", size)]
    parts = build_parts(model, "page_first", 2 * pages, 2)
    extra = {
        **cluster.client_config(SEGMENT_BYTES if topology == "same" else 0),
        "span_layout_guard": "off",
        "storage_page_size": HOST_PAGE_TOKENS * PAGES_PER_KEY,
        "span_verify_checksums": verify,
    }
    config = storage_config(extra, f"ck-{topology}-{size}", is_mla=model.is_mla)
    return span_backend(config, host_pools(parts)), parts


def _measure_cell(cluster: Any, cell: tuple[str, str, int], verify: bool, reps: int) -> dict:
    from mooncake_span_tools.bench.workloads import HOST_PAGE_TOKENS
    from mooncake_span_tools.testing import page_io

    topology, size, pages = cell
    store, parts = _cell_store(cluster, topology, size, pages, verify)
    pool = parts[0].pool
    page_io.fill_random_pages(pool, [p * HOST_PAGE_TOKENS for p in range(pages)], seed=1)
    try:
        put_s, get_s = time_round_trips(
            store, pool, pages, PAGES_PER_KEY, f"ck/{verify}", str(cell), reps
        )
    finally:
        store.close()
    return {
        "page_bytes": parts[0].layout.flat_page_bytes,
        "put_pages_per_s": [pages / s for s in put_s],
        "get_pages_per_s": [pages / s for s in get_s],
    }


def time_round_trips(
    store: Any, pool: Any, pages: int, pages_per_key: int, tag: str, label: str, reps: int
) -> tuple[list[float], list[float]]:
    """Seconds of each timed ``batch_set_v1`` of host pages ``[0, pages)`` and
    ``batch_get_v1`` into ``[pages, 2 * pages)`` (rep 0 warms up), every get checked
    byte for byte and the cluster emptied after each rep."""
    import numpy as np

    from mooncake_span_tools.bench import contenders as C
    from mooncake_span_tools.bench.workloads import HOST_PAGE_TOKENS
    from mooncake_span_tools.testing import page_io

    src, dst = np.arange(pages), np.arange(pages, 2 * pages)
    want = [page_io.page_bytes(pool, int(p) * HOST_PAGE_TOKENS) for p in src]
    put_s, get_s = [], []
    for rep in range(reps + 1):
        keys = C.page_keys(f"{tag}/{rep}", pages // pages_per_key)
        page_io.wipe_pages(pool, [int(p) * HOST_PAGE_TOKENS for p in dst])
        started = time.perf_counter()
        put_ok = store.batch_set_v1(keys, C.page_slots(src))
        mid = time.perf_counter()
        get_ok = store.batch_get_v1(keys, C.page_slots(dst))
        done = time.perf_counter()
        got = [page_io.page_bytes(pool, int(p) * HOST_PAGE_TOKENS) for p in dst]
        if not (all(put_ok) and all(get_ok) and got == want):
            raise RuntimeError(f"{label}: a put or get failed or was not byte-exact")
        store.client.remove_all()
        if rep:
            put_s.append(mid - started)
            get_s.append(done - mid)
    return put_s, get_s


def _measure_raw(cluster: Any, topology: str, reps: int) -> dict[str, Any]:
    """One RAW_OBJECT_BYTES object per call through the native client alone."""
    import numpy as np
    from mooncake.store import ReplicateConfig

    from mooncake_span_tools.bench.shared_native import raw_client

    segment_bytes = SEGMENT_BYTES if topology == "same" else 0
    native = raw_client(cluster.client_config(segment_bytes), segment_bytes)
    n = RAW_OBJECT_BYTES
    src = np.random.default_rng(2).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, dtype=np.uint8)
    put_s, get_s = [], []
    try:
        native.register_buffer(src.ctypes.data, n)
        native.register_buffer(dst.ctypes.data, n)
        for rep in range(reps + 1):  # rep 0 warms up
            key, dst[:] = f"ck-raw-{rep}", 0
            started = time.perf_counter()
            put = native.batch_put_from_multi_buffers(
                [key], [[src.ctypes.data]], [[n]], ReplicateConfig()
            )
            mid = time.perf_counter()
            got = native.batch_get_into_multi_buffers([key], [[dst.ctypes.data]], [[n]])
            done = time.perf_counter()
            if put != [0] or got != [n] or not np.array_equal(src, dst):
                raise RuntimeError(f"raw {topology}: put {put}, get {got} or bytes differ")
            native.remove(key, True)
            if rep:
                put_s.append(mid - started)
                get_s.append(done - mid)
    finally:
        native.close()
    return {
        "page_bytes": n,
        "put_pages_per_s": [1 / s for s in put_s],
        "get_pages_per_s": [1 / s for s in get_s],
    }


def run_child(verify: bool, reps: int) -> dict[str, Any]:
    """Every cell once, with checksums ``verify``, in this process."""
    from mooncake_span.ops.cluster import ClusterSpec, LocalCluster

    out: dict[str, Any] = {}
    for topology in ("same", "tcp"):
        nodes = 0 if topology == "same" else 1
        spec = ClusterSpec(storage_nodes=nodes, storage_node_segment_bytes=SEGMENT_BYTES)
        with LocalCluster(spec) as cluster:
            os.environ.update(cluster.client_env())
            for cell in CELLS:
                if cell[0] == topology:
                    out[f"{cell[0]}/{cell[1]}"] = _measure_cell(cluster, cell, verify, reps)
            out[f"{topology}/raw-64MiB"] = _measure_raw(cluster, topology, reps)
    return out


def _spawn(verify: bool, reps: int) -> dict[str, Any]:
    argv = [
        sys.executable,
        "-m",
        "mooncake_span_tools.bench.checksum",
        "1" if verify else "0",
        str(reps),
    ]
    env = {k: v for k, v in os.environ.items() if k != "MOONCAKE_STORE_CHECKSUM"}
    done = subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=_CHILD_TIMEOUT_S, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"checksum bench child failed ({done.returncode}): {done.stderr[-3000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per cell and op: median pages/s off and on, and the paired on/off ratios per round."""
    cells: dict[str, Any] = {}
    for name in rounds[0]["off"]:
        row: dict[str, Any] = {}
        for op in ("put", "get"):
            field = f"{op}_pages_per_s"
            off = [v for r in rounds for v in r["off"][name][field]]
            on = [v for r in rounds for v in r["on"][name][field]]
            paired = [
                statistics.median(r["on"][name][field]) / statistics.median(r["off"][name][field])
                for r in rounds
            ]
            page_bytes = rounds[0]["off"][name]["page_bytes"]
            row[op] = {
                "off_pages_per_s": round(statistics.median(off), 1),
                "on_pages_per_s": round(statistics.median(on), 1),
                "off_gb_per_s": round(statistics.median(off) * page_bytes / 1e9, 3),
                "on_gb_per_s": round(statistics.median(on) * page_bytes / 1e9, 3),
                "on_over_off_median": round(statistics.median(paired), 3),
                "on_over_off_rounds": [round(x, 3) for x in paired],
            }
        cells[name] = row
    return cells


def run_checksum(quick: bool, reps: int | None) -> dict[str, Any]:
    rounds_n = 2 if quick else 3
    reps_per_child = reps or (2 if quick else 3)
    rounds = []
    for i in range(rounds_n):
        order = (False, True) if i % 2 == 0 else (True, False)
        rounds.append({("on" if v else "off"): _spawn(v, reps_per_child) for v in order})
    return {
        "schema": "mooncake-span-bench-checksum/1",
        "pages_per_key": PAGES_PER_KEY,
        "rounds": rounds_n,
        "reps_per_child": reps_per_child,
        "cells": {f"{t}/{s}": {"pages_per_call": p} for t, s, p in CELLS},
        "raw_object_bytes": RAW_OBJECT_BYTES,
        "results": summarize(rounds),
        "raw": rounds,
    }


def format_checksum(result: dict[str, Any]) -> str:
    lines = [
        "cell            op   off pages/s (GB/s)   on pages/s (GB/s)   on/off (median; rounds)"
    ]
    for name, row in result["results"].items():
        for op, r in row.items():
            rounds = ", ".join(f"{x:.2f}" for x in r["on_over_off_rounds"])
            off = f"{r['off_pages_per_s']:.0f} ({r['off_gb_per_s']:.2f})"
            on = f"{r['on_pages_per_s']:.0f} ({r['on_gb_per_s']:.3f})"
            lines.append(
                f"{name:<15} {op:<4} {off:>19} {on:>19}   {r['on_over_off_median']:.2f} ({rounds})"
            )
    return "\n".join(lines)


def run_checksum_command(quick: bool, reps: int | None, json_path: str | None) -> int:
    result = run_checksum(quick, reps)
    print(format_checksum(result), flush=True)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {json_path}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    print(json.dumps(run_child(sys.argv[1] == "1", int(sys.argv[2]))))
