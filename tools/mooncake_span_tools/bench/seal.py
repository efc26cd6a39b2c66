"""``mooncake-span bench --seal``: what ``span_object_checksums`` costs, and why XXH3-64.

Two parts:

* ``hashes``: GB/s of each candidate checksum over one in-memory buffer (256 KiB,
  a K=1 MLA object's order of size, and 64 MiB, beyond the caches), read in
  place as the seal reads host pages: XXH3-64 (``xxhash``, the one used),
  CRC32C (``google-crc32c`` and ``crc32c``, when installed) and zlib's CRC-32;
* ``cells``: MooncakeSpanStore puts and gets (MLA KV, page_first, 64 KiB host
  pages, K=1 and K=4; every get compared byte for byte) with the option off and
  on, in one process (the client owns the only segment: Mooncake's memcpy
  path, where a CPU pass shows most) and over loopback TCP (a storage node
  process). Both settings run in the same process (the seal is the backend's,
  not Mooncake's per-process setting), alternating per round, paired per round.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import statistics
import time
import zlib
from collections.abc import Callable
from typing import Any

CELLS = (("same", 1), ("same", 4), ("tcp", 1), ("tcp", 4))
PAGES_PER_CALL = 512
SEGMENT_BYTES = 1536 << 20
HASH_BUFFERS = (256 << 10, 64 << 20)
HASH_BYTES_PER_RUN = 512 << 20


def _candidates() -> dict[str, Callable[[Any], object]]:
    import xxhash

    found: dict[str, Callable[[Any], object]] = {
        "xxh3-64 (xxhash)": xxhash.xxh3_64_intdigest,
        "crc32 (zlib)": zlib.crc32,
    }
    try:
        import google_crc32c

        found["crc32c (google-crc32c)"] = google_crc32c.value
    except ImportError:
        pass
    try:
        import crc32c

        found["crc32c (crc32c)"] = crc32c.crc32c
    except ImportError:
        pass
    return found


def measure_hashes(reps: int) -> dict[str, dict[str, float]]:
    """Best GB/s of ``reps`` runs per candidate and buffer size."""
    memory = mmap.mmap(-1, max(HASH_BUFFERS))
    memory.write(os.urandom(max(HASH_BUFFERS)))
    base = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    out: dict[str, dict[str, float]] = {}
    for name, digest in _candidates().items():
        row = {}
        for size in HASH_BUFFERS:
            view = (ctypes.c_char * size).from_address(base)
            calls = max(1, HASH_BYTES_PER_RUN // size)
            best_s = float("inf")
            for _ in range(reps):
                started = time.perf_counter()
                for _ in range(calls):
                    digest(view)
                best_s = min(best_s, time.perf_counter() - started)
            row[f"{size >> 10}KiB"] = round(calls * size / best_s / 1e9, 2)
        out[name] = row
    del view
    return out


def _store(cluster: Any, topology: str, pages_per_key: int, sealed: bool, parts: Any) -> Any:
    from mooncake_span_tools.bench.pages import host_pools
    from mooncake_span_tools.bench.workloads import HOST_PAGE_TOKENS
    from mooncake_span_tools.testing.backends import span_backend, storage_config

    extra = {
        **cluster.client_config(SEGMENT_BYTES if topology == "same" else 0),
        "span_layout_guard": "off",
        "storage_page_size": HOST_PAGE_TOKENS * pages_per_key,
        "span_object_checksums": sealed,
    }
    name = f"seal-{topology}-{pages_per_key}-{int(sealed)}"
    return span_backend(storage_config(extra, name, is_mla=True), host_pools(parts))


def _measure(store: Any, pool: Any, tag: str, reps: int, pages_per_key: int) -> dict[str, Any]:
    from mooncake_span_tools.bench.checksum import time_round_trips

    put_s, get_s = time_round_trips(store, pool, PAGES_PER_CALL, pages_per_key, tag, tag, reps)
    return {"put_s": put_s, "get_s": get_s}


def measure_cells(rounds: int, reps: int) -> dict[str, Any]:
    from mooncake_span.ops.cluster import ClusterSpec, LocalCluster
    from mooncake_span_tools.bench.pages import build_parts
    from mooncake_span_tools.bench.workloads import HOST_PAGE_TOKENS, MODELS
    from mooncake_span_tools.testing import page_io

    model = MODELS[("mla", "64KiB")]
    out: dict[str, Any] = {}
    for topology in ("same", "tcp"):
        spec = ClusterSpec(
            storage_nodes=0 if topology == "same" else 1, storage_node_segment_bytes=SEGMENT_BYTES
        )
        with LocalCluster(spec) as cluster:
            os.environ.update(cluster.client_env())
            for cell_topology, pages_per_key in CELLS:
                if cell_topology != topology:
                    continue
                parts = build_parts(model, "page_first", 2 * PAGES_PER_CALL, 2)
                pool = parts[0].pool
                starts = [p * HOST_PAGE_TOKENS for p in range(PAGES_PER_CALL)]
                page_io.fill_random_pages(pool, starts, seed=1)
                stores = {s: _store(cluster, topology, pages_per_key, s, parts) for s in (0, 1)}
                runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
                try:
                    for r in range(rounds):
                        for sealed in (0, 1) if r % 2 == 0 else (1, 0):
                            tag = f"{topology}/{pages_per_key}/{sealed}/{r}"
                            runs["on" if sealed else "off"].append(
                                _measure(stores[sealed], pool, tag, reps, pages_per_key)
                            )
                finally:
                    for store in stores.values():
                        store.close()
                page_bytes = parts[0].layout.flat_page_bytes
                out[f"{topology}/K={pages_per_key}"] = _summarize(runs, page_bytes)
    return out


def _summarize(runs: dict[str, list[dict[str, Any]]], page_bytes: int) -> dict[str, Any]:
    row: dict[str, Any] = {"page_bytes": page_bytes}
    call_bytes = PAGES_PER_CALL * page_bytes
    for op in ("put", "get"):
        off = [call_bytes / s / 1e9 for r in runs["off"] for s in r[f"{op}_s"]]
        on = [call_bytes / s / 1e9 for r in runs["on"] for s in r[f"{op}_s"]]
        paired = [
            statistics.median(a[f"{op}_s"]) / statistics.median(b[f"{op}_s"])
            for a, b in zip(runs["off"], runs["on"], strict=True)
        ]
        row[op] = {
            "off_gb_per_s": round(statistics.median(off), 3),
            "on_gb_per_s": round(statistics.median(on), 3),
            "on_over_off_median": round(statistics.median(paired), 3),
            "on_over_off_rounds": [round(x, 3) for x in paired],
        }
    return row


def run_seal(quick: bool, reps: int | None) -> dict[str, Any]:
    rounds = 2 if quick else 4
    reps_per_round = reps or (2 if quick else 3)
    return {
        "schema": "mooncake-span-bench-seal/1",
        "pages_per_call": PAGES_PER_CALL,
        "rounds": rounds,
        "reps_per_round": reps_per_round,
        "hashes_gb_per_s": measure_hashes(5),
        "cells": measure_cells(rounds, reps_per_round),
    }


def format_seal(result: dict[str, Any]) -> str:
    lines = ["checksum               " + "  ".join(f"{k:>8}" for k in ("256KiB", "65536KiB"))]
    for name, row in result["hashes_gb_per_s"].items():
        lines.append(f"{name:<22} " + "  ".join(f"{v:>8.2f}" for v in row.values()))
    lines.append("cell        op   off GB/s   on GB/s   on/off (median; rounds)")
    for name, row in result["cells"].items():
        for op in ("put", "get"):
            r = row[op]
            rounds = ", ".join(f"{x:.2f}" for x in r["on_over_off_rounds"])
            lines.append(
                f"{name:<11} {op:<4} {r['off_gb_per_s']:>8.3f} {r['on_gb_per_s']:>9.3f}   "
                f"{r['on_over_off_median']:.2f} ({rounds})"
            )
    return "\n".join(lines)


def run_seal_command(quick: bool, reps: int | None, json_path: str | None) -> int:
    result = run_seal(quick, reps)
    print(format_seal(result), flush=True)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {json_path}", flush=True)
    return 0
