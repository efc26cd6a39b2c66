"""The benchmark's targets: ratios that a result document is checked against."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from mooncake_span_tools.bench.measure import RunRecord, throughput_ratio
from mooncake_span_tools.bench.workloads import HOST_PAGE_TOKENS, LARGE, SMALL, TCP_BUFFERS_PER_CALL

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------
# targets


def _records(w: dict[str, Any], name: str) -> list[RunRecord] | None:
    for c in w["contenders"]:
        if c["name"] == name:
            return [RunRecord(**r) for r in c["runs"]]
    return None


def contender_summary(w: dict[str, Any], name: str) -> dict[str, Any] | None:
    """Contender ``name``'s summary in workload ``w`` of a result; None where it did not run."""
    """The summary of contender ``name`` in workload ``w`` of a result (None: not run)."""
    for c in w["contenders"]:
        if c["name"] == name:
            return c["summary"]
    return None


def _ratio_rows(
    result: dict[str, Any], section: str, a: str, b: str, where: Callable[[dict[str, Any]], bool]
) -> list[dict[str, Any]]:
    """a/b throughput ratios (a faster -> > 1) for every matching workload."""
    rows = []
    for w in result["workloads"]:
        if w["section"] != section or not where(w):
            continue
        ra, rb = _records(w, a), _records(w, b)
        if ra is None or rb is None:
            continue
        rows.append(
            {
                "workload": w["name"],
                "put": throughput_ratio(ra, rb, "put_s"),
                "get": throughput_ratio(ra, rb, "get_s"),
            }
        )
    return rows


def _worst(rows: list[dict[str, Any]], key: str = "median") -> float | None:
    vals = [r[d][key] for r in rows for d in ("put", "get") if r[d][key] is not None]
    return min(vals) if vals else None


def evaluate_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    targets: list[dict[str, Any]] = []

    def add(
        tid: str,
        text: str,
        goal: float,
        rows: list[dict[str, Any]],
        extra: dict[str, Any] | None = None,
        achieved: float | None = None,
    ) -> None:
        value = achieved if achieved is not None else _worst(rows)
        targets.append(
            {
                "id": tid,
                "description": text,
                "target": goal,
                "achieved_worst_median": value,
                "achieved_worst_best": _worst(rows, "best") if rows else None,
                "passed": None if value is None else value >= goal,
                "rows": rows,
                **(extra or {}),
            }
        )

    local = lambda w: w["topology"] == "same"  # noqa: E731
    remote = lambda w: w["topology"] != "same"  # noqa: E731
    add(
        "backend_overhead",
        "span-K4 throughput / raw Mooncake calls on the same objects (K=4)",
        0.90,
        _ratio_rows(result, "grid", "span-K4", "raw-K4", lambda w: True),
    )
    add(
        "k4_vs_upstream_small_local",
        "span-K4 / upstream MooncakeStore pages/s, 64 KiB pages, one process",
        1.6,
        _ratio_rows(
            result,
            "grid",
            "span-K4",
            "upstream",
            lambda w: local(w) and w["model"]["size"] == SMALL,
        ),
    )
    add(
        "k4_vs_upstream_large_local",
        "span-K4 / upstream pages/s, 2.5 MiB pages, one process",
        1.0,
        _ratio_rows(
            result,
            "grid",
            "span-K4",
            "upstream",
            lambda w: local(w) and w["model"]["size"] == LARGE,
        ),
    )
    add(
        "k4_vs_upstream_tcp",
        "span-K4 / upstream pages/s over TCP (all page sizes)",
        1.0,
        _ratio_rows(result, "grid", "span-K4", "upstream", remote),
    )
    mha = lambda w: w["model"]["family"] == "mha"  # noqa: E731
    add(
        "mha_k1_vs_upstream_local",
        "MHA span-K1 / upstream pages/s, one process (issue #20)",
        1.2,
        _ratio_rows(result, "grid", "span-K1", "upstream", lambda w: mha(w) and local(w)),
    )
    add(
        "mha_k1_vs_upstream_tcp",
        "MHA span-K1 / upstream pages/s over TCP (issue #20)",
        1.0,
        _ratio_rows(result, "grid", "span-K1", "upstream", lambda w: mha(w) and remote(w)),
    )
    add(
        "memcpy_fraction",
        "span-K4 throughput / chunked single-thread memcpy, one process",
        0.80,
        _ratio_rows(result, "grid", "span-K4", "memcpy", local),
    )

    # exists: per-token latency upstream / span, per call (sglang-sized batches)
    # and for one query over the whole run
    ex_rows = []
    for w in result["workloads"]:
        if w["section"] not in ("grid", "batch"):
            continue
        s, u = contender_summary(w, "span-K4"), contender_summary(w, "upstream")
        if not (
            s and u and s["exists_us_per_ktoken"]["median"] and u["exists_us_per_ktoken"]["median"]
        ):
            continue
        row = {
            "workload": w["name"],
            "span_us_per_ktoken": s["exists_us_per_ktoken"]["median"],
            "upstream_us_per_ktoken": u["exists_us_per_ktoken"]["median"],
            "speedup_median": u["exists_us_per_ktoken"]["median"]
            / s["exists_us_per_ktoken"]["median"],
            "speedup_best": u["exists_us_per_ktoken"]["min"] / s["exists_us_per_ktoken"]["min"],
            "tokens_per_query": w["pages_per_call"] * HOST_PAGE_TOKENS,
        }
        if s["exists_all_us_per_ktoken"]["median"] and u["exists_all_us_per_ktoken"]["median"]:
            row["whole_run_speedup_median"] = (
                u["exists_all_us_per_ktoken"]["median"] / s["exists_all_us_per_ktoken"]["median"]
            )
            row["whole_run_tokens"] = w["pages_per_run"] * HOST_PAGE_TOKENS
        ex_rows.append(row)
    per_call = [r["speedup_median"] for r in ex_rows if r["workload"].startswith("grid/")]
    whole = [r["whole_run_speedup_median"] for r in ex_rows if "whole_run_speedup_median" in r]
    targets.append(
        {
            "id": "exists_per_token",
            "description": "batch_exists_v2 latency per token, upstream / span-K4 (per call at "
            "the workload's "
            "batch; whole_run = one query over every key of the run)",
            "target": 3.0,
            "achieved_worst_median": min(per_call, default=None),
            "achieved_worst_best": min(
                (r["speedup_best"] for r in ex_rows if r["workload"].startswith("grid/")),
                default=None,
            ),
            "whole_run_worst_median": min(whole, default=None),
            "passed": None if not per_call else min(per_call) >= 3.0,
            "rows": ex_rows,
        }
    )

    # coalescing: pointers per key <= L with consecutive pages, and the gain
    co_rows = []
    for w in result["workloads"]:
        if w["section"] != "coalesce":
            continue
        cons, scat = contender_summary(w, "span-K4@consec"), contender_summary(w, "span-K4")
        ratio = _ratio_rows(
            result, "coalesce", "span-K4@consec", "span-K4", lambda x, n=w["name"]: x["name"] == n
        )
        co_rows.append(
            {
                "workload": w["name"],
                "layers": w["layers"],
                "pointers_per_key_consecutive": cons["pointers_per_key"] if cons else None,
                "pointers_per_key_scattered": scat["pointers_per_key"] if scat else None,
                "gain": ratio[0] if ratio else None,
            }
        )
    ok_ptrs = (
        all(
            r["pointers_per_key_consecutive"] is not None
            and r["pointers_per_key_consecutive"] <= r["layers"]
            for r in co_rows
        )
        if co_rows
        else None
    )
    tcp_gain = [r["gain"] for r in co_rows if "/same/" not in r["workload"] and r["gain"]]
    targets.append(
        {
            "id": "coalescing",
            "description": "layer_first, consecutive pages: pointers/key <= L; gain vs scattered",
            "target": "ptrs/key <= L",
            "passed": ok_ptrs,
            "achieved_worst_median": _worst(tcp_gain) if tcp_gain else None,
            "achieved_worst_best": _worst(tcp_gain, "best") if tcp_gain else None,
            "rows": co_rows,
        }
    )

    # chunk sweep: the default (2048) succeeds and is within 10% of the best
    ch_rows = []
    for w in result["workloads"]:
        if w["section"] != "chunks":
            continue
        sums = {c["name"]: c["summary"] for c in w["contenders"]}
        default = f"span-K4-mb{TCP_BUFFERS_PER_CALL}"
        ok = {n: s for n, s in sums.items() if s["complete"] and s["put_gbps"]["median"]}
        row: dict[str, Any] = {
            "workload": w["name"],
            "default_complete": sums.get(default, {}).get("complete"),
            "per_chunk": {
                n: {
                    "complete": s["complete"],
                    "failed_keys_max": s["failed_keys_max"],
                    "put_gbps": s["put_gbps"],
                    "get_gbps": s["get_gbps"],
                }
                for n, s in sums.items()
            },
        }
        if default in ok:
            for d in ("put", "get"):
                best = max(s[f"{d}_gbps"]["median"] for s in ok.values())
                row[f"{d}_fraction_of_best"] = ok[default][f"{d}_gbps"]["median"] / best
        ch_rows.append(row)
    fractions = [r.get(f"{d}_fraction_of_best") for r in ch_rows for d in ("put", "get")]
    fractions = [f for f in fractions if f is not None]
    sweeps = [r for r in ch_rows if r["default_complete"] is not None]
    targets.append(
        {
            "id": "chunked_calls",
            "description": "N keys x 312 buffers over TCP: the default split (2048) succeeds "
            "and is within 10% "
            "of the best span_max_buffers_per_call",
            "target": 0.90,
            "achieved_worst_median": min(fractions) if fractions else None,
            "passed": (all(r["default_complete"] for r in sweeps) and min(fractions) >= 0.90)
            if fractions
            else None,
            "rows": ch_rows,
        }
    )
    return targets
