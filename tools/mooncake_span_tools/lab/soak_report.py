"""Verdict, table, JSON and PNG of a ``mooncake-span soak`` report (see ``lab/soak.py``)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

OPS = ("batch_set_v2", "batch_set_v1", "batch_exists_v2", "batch_get_v1", "batch_get_v2")


def analyse(samples: list[dict[str, Any]], config: Any) -> dict[str, Any]:
    """Growth after warm-up: slopes per 100k calls, thread/fd ranges, the verdict."""
    after = [s for s in samples if s["t_s"] >= config.warmup_s]
    if len(after) < 3:
        raise ValueError(f"only {len(after)} samples after the warm-up; run longer")
    calls = np.array([s["calls"] for s in after])
    span_calls = float(calls[-1] - calls[0])

    def slope(column: str) -> float | None:
        ys = np.array([s[column] if s[column] is not None else np.nan for s in after])
        if np.isnan(ys).any() or span_calls <= 0:
            return None
        return float(np.polyfit(calls, ys, 1)[0] * 1e5)

    threads = [int(s["threads"]) for s in after]
    fds = [int(s["fds"]) for s in after]
    summary = {
        "calls_total": int(samples[-1]["calls"]),
        "calls_after_warmup": int(span_calls),
        "seconds_after_warmup": float(after[-1]["t_s"] - after[0]["t_s"]),
        "rss_mb_after_warmup": float(after[0]["rss_mb"]),
        "rss_mb_end": float(after[-1]["rss_mb"]),
        "rss_mb_per_100k_calls": slope("rss_mb"),
        "heap_blocks_per_100k_calls": slope("heap_blocks"),
        "traced_mb_per_100k_calls": slope("traced_mb"),
        "threads_min": min(threads),
        "threads_max": max(threads),
        "threads_growth": threads[-1] - threads[0],
        "fds_min": min(fds),
        "fds_max": max(fds),
        "fds_growth": fds[-1] - fds[0],
        "budget_mb_per_100k_calls": config.budget_mb_per_100k_calls,
    }
    failures = []
    rss_slope = summary["rss_mb_per_100k_calls"]
    if rss_slope is None or rss_slope > config.budget_mb_per_100k_calls:
        failures.append(
            f"RSS grows {rss_slope} MB per 100k calls (budget {config.budget_mb_per_100k_calls})"
        )
    if summary["threads_growth"] > config.thread_budget:
        failures.append(f"threads grew by {summary['threads_growth']}")
    if summary["fds_growth"] > config.fd_budget:
        failures.append(f"open descriptors grew by {summary['fds_growth']}")
    summary["failures"] = failures
    summary["ok"] = not failures
    return summary


def format_table(report: dict[str, Any]) -> str:
    lines = [
        f"{'minute':>6} {'calls':>8} "
        + " ".join(f"{op.removeprefix('batch_'):>15}" for op in OPS)
        + "   (p50 / p99 ms)"
    ]
    for row in report["minutes"]:
        cells = []
        for op in OPS:
            p50, p99 = row[f"{op}_p50_ms"], row[f"{op}_p99_ms"]
            cells.append("-" if p50 is None else f"{p50:.2f}/{p99:.1f}")
        lines.append(f"{row['minute']:>6} {row['calls']:>8} " + " ".join(f"{c:>15}" for c in cells))
    s = report["summary"]
    lines += [
        "",
        f"calls: {s['calls_total']} ({s['calls_after_warmup']} after warm-up)",
        f"RSS: {s['rss_mb_after_warmup']:.1f} -> {s['rss_mb_end']:.1f} MB; "
        f"slope {s['rss_mb_per_100k_calls']:.4f} MB per 100k calls "
        f"(budget {s['budget_mb_per_100k_calls']})",
        f"Python heap: {s['heap_blocks_per_100k_calls']:.0f} blocks per 100k calls"
        + (
            f"; tracemalloc {s['traced_mb_per_100k_calls']:.4f} MB per 100k calls"
            if s["traced_mb_per_100k_calls"] is not None
            else ""
        ),
        f"threads {s['threads_min']}..{s['threads_max']} (growth {s['threads_growth']}), "
        f"fds {s['fds_min']}..{s['fds_max']} (growth {s['fds_growth']})",
        f"backend: {report.get('backend')}",
        "verdict: " + ("within budget" if s["ok"] else "; ".join(s["failures"])),
    ]
    for entry in report.get("tracemalloc_top_growth", [])[:8]:
        lines.append(f"  +{entry['size_diff_bytes']:>9} B {entry['where']}")
    return "\n".join(lines)


def write_plot(report: dict[str, Any], path: str, dpi: int = 100) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["samples"]
    minutes = [s["t_s"] / 60 for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(11, 11), sharex=True)
    axes[0].plot(minutes, [s["rss_mb"] for s in samples], label="RSS (MB)")
    heap = axes[0].twinx()
    heap.plot(minutes, [s["heap_blocks"] for s in samples], color="tab:orange", label="heap")
    heap.set_ylabel("Python heap blocks", color="tab:orange")
    axes[0].set_ylabel("RSS (MB)")
    axes[0].axvline(report["config"]["warmup_s"] / 60, color="grey", ls=":", label="warm-up end")
    for restart in report["restarts"]:
        axes[0].axvline(restart["t_s"] / 60, color="red", ls="--", lw=0.8)
    axes[0].legend(loc="upper left")
    s = report["summary"]
    metrics = "on" if report["config"]["storage_metrics"] else "off"
    axes[0].set_title(
        f"soak: {s['calls_total']} calls, RSS slope {s['rss_mb_per_100k_calls']:.4f} MB/100k "
        f"calls after warm-up; storage metrics {metrics}"
    )
    for op in OPS:
        xs = [r["minute"] + 0.5 for r in report["minutes"] if r[f"{op}_p99_ms"] is not None]
        ys = [r[f"{op}_p99_ms"] for r in report["minutes"] if r[f"{op}_p99_ms"] is not None]
        axes[1].plot(xs, ys, marker="o", ms=3, label=f"{op} p99")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("p99 per minute (ms)")
    axes[1].legend(fontsize=8, ncol=2)
    axes[2].plot(minutes, [s["threads"] for s in samples], label="threads")
    axes[2].plot(minutes, [s["fds"] for s in samples], label="open fds")
    used = [s["segment_used_mb"] for s in samples]
    cap = [s["segment_capacity_mb"] for s in samples]
    axes[2].plot(
        minutes,
        [u / c * 100 if u is not None and c else None for u, c in zip(used, cap, strict=True)],
        label="segment use (%)",
    )
    axes[2].set_xlabel("minutes")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def write_outputs(report: dict[str, Any], out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "soak.json")
    with open(json_path, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1)
    written = [json_path]
    try:
        png_path = os.path.join(out_dir, "soak.png")
        write_plot(report, png_path)
        written.append(png_path)
    except ImportError:
        logger.warning("matplotlib is not installed: no PNG (pip install 'mooncake-span[bench]')")
    return written
