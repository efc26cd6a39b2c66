"""The ordinary-model cells of the grid (issue #20): MHA K=1 / K=4 and DSA K=4
against upstream ``MooncakeStore``, one process and TCP, paired and byte-exact.

The full grid takes tens of minutes; these cells take a few. Run it from a
checkout by file path so that ``PYTHONPATH`` picks the code under test (the
workloads and the runner are the grid's own)::

    PYTHONPATH=$PWD:$PWD/tools nice -n 10 .venv/bin/python \\
        tools/mooncake_span_tools/bench/mha_cells.py --json /tmp/after.json

Prints, per cell, span / upstream pages/s (median of per-repetition ratios,
and best vs best) for puts and gets; exits 1 unless every get was byte-exact.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from mooncake_span_tools.bench.measure import RunRecord, throughput_ratio
from mooncake_span_tools.bench.runner import run_bench
from mooncake_span_tools.bench.workloads import LARGE, MODELS, SMALL, BenchConfig, Workload

# (family, page size, contenders). Floors: raw-K<k> is the native calls the
# span backend issues, raw-1buf the one-buffer-per-object calls under upstream.
CELLS = (
    ("mha", SMALL, ("span-K1", "span-K4", "raw-K1", "raw-K4", "raw-1buf", "upstream")),
    ("mha", LARGE, ("span-K1", "span-K4", "raw-K1", "upstream")),
    ("dsa", SMALL, ("span-K4", "span-K4-nogroup", "raw-K4", "upstream")),
)
_RUN_PAGES = {SMALL: (2048, 512), LARGE: (128, 64)}


def cell_workloads(topologies: tuple[str, ...]) -> list[Workload]:
    out = []
    for topology in topologies:
        for family, size, contenders in CELLS:
            run, call = _RUN_PAGES[size]
            out.append(
                Workload(
                    "grid", topology, MODELS[(family, size)], "page_first", run, call, contenders
                )
            )
    return out


def ratios(result: dict[str, Any]) -> list[dict[str, Any]]:
    """span-* / upstream put and get ratios of every cell."""
    rows = []
    for w in result["workloads"]:
        runs = {c["name"]: [RunRecord(**r) for r in c["runs"]] for c in w["contenders"]}
        for name, records in runs.items():
            if name == "upstream":
                continue
            row = {"workload": w["name"], "contender": name}
            for op in ("put", "get"):
                row[op] = throughput_ratio(records, runs["upstream"], f"{op}_s")
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="write the result document here")
    parser.add_argument("--reps", type=int, default=6, help="timed repetitions (default 6)")
    parser.add_argument("--topology", default="same,tcp", help="comma list of same, tcp")
    args = parser.parse_args(argv)
    topologies = tuple(args.topology.split(","))
    config = BenchConfig(reps=args.reps, topologies=topologies, progress=False)
    result = run_bench(config, workloads=cell_workloads(topologies))
    result["ratios_vs_upstream"] = ratios(result)
    with open(args.json, "w") as out:
        json.dump(result, out, indent=1)
    for row in result["ratios_vs_upstream"]:
        put, get = row["put"], row["get"]
        print(
            f"{row['workload']:32s} {row['contender']:16s} put {put['median']:.2f}x "
            f"(best {put['best']:.2f}x)  get {get['median']:.2f}x (best {get['best']:.2f}x)"
        )
    print("byte-exact:", result["verified_byte_exact"])
    return 0 if result["verified_byte_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
