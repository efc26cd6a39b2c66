"""The PNG summary plot of a result document (matplotlib, imported only here)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from mooncake_span_tools.bench.targets import contender_summary

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------
# reporting


def write_plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(16, 11))
    colors = {
        "memcpy": "#999999",
        "raw-1buf": "#bbbbdd",
        "raw-K4": "#7777bb",
        "upstream": "#d62728",
        "span-K1": "#c7e9c0",
        "span-K2": "#a1d99b",
        "span-K4": "#31a354",
        "span-K8": "#006d2c",
        "span-K4-nogroup": "#fdae6b",
    }
    for ax, topo in zip(axes[0], ("same", "tcp"), strict=True):
        grid = [
            w
            for w in result["workloads"]
            if w["section"] == "grid"
            and w["topology"] in (topo, "remote" if topo == "tcp" else topo)
        ]
        names = [n for n in colors if any(contender_summary(w, n) for w in grid)]
        width = 0.8 / max(1, len(names))
        for i, n in enumerate(names):
            xs, ys = [], []
            for j, w in enumerate(grid):
                s = contender_summary(w, n)
                ref = contender_summary(w, "upstream") or contender_summary(w, "raw-K4")
                if (
                    s
                    and ref
                    and s["get_pages_per_s"]["median"]
                    and ref["get_pages_per_s"]["median"]
                ):
                    both = (s["put_pages_per_s"]["median"] or 0) + s["get_pages_per_s"]["median"]
                    xs.append(j + i * width)
                    ys.append(
                        both
                        / (
                            (ref["put_pages_per_s"]["median"] or 0)
                            + ref["get_pages_per_s"]["median"]
                        )
                    )
            ax.bar(xs, ys, width, label=n, color=colors[n])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(grid))])
        ax.set_xticklabels(
            [f"{w['model']['family'] + '-' + w['model']['size']}\n{w['layout']}" for w in grid],
            fontsize=7,
        )
        ax.set_ylabel(
            "put+get pages/s relative to upstream MooncakeStore\n"
            "(median; raw-K4 where upstream n/a)"
        )
        ax.set_title(f"{topo}: throughput vs upstream (per-page objects)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, ncol=4)
    ax = axes[1][0]
    for topo, style in (("same", "-"), ("tcp", "--"), ("remote", "--")):
        batch = [
            w for w in result["workloads"] if w["section"] == "batch" and w["topology"] == topo
        ]
        for n in ("span-K4", "raw-K4", "upstream"):
            pts = [(w["pages_per_call"], contender_summary(w, n)) for w in batch]
            pts = [(p, s) for p, s in pts if s and s["get_gbps"]["median"]]
            if pts:
                ax.plot(
                    [p for p, _ in pts],
                    [s["get_gbps"]["median"] for _, s in pts],
                    style,
                    marker="o",
                    color=colors[n],
                    label=f"{topo} {n} get",
                )
                ax.plot(
                    [p for p, _ in pts],
                    [s["put_gbps"]["median"] or 0 for _, s in pts],
                    style,
                    marker="x",
                    color=colors[n],
                    alpha=0.5,
                    label=f"{topo} {n} put",
                )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("host pages per call (64 KiB pages; span keys/call = pages/4)")
    ax.set_ylabel("GB/s (median)")
    ax.set_title("batch size sweep, MLA 64 KiB page_first")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6, ncol=2)
    ax = axes[1][1]
    labels, puts, gets = [], [], []
    for w in result["workloads"]:
        if w["section"] in ("chunks", "coalesce"):
            for c in w["contenders"]:
                s = c["summary"]
                labels.append(
                    f"{w['section']}/{w['topology']}\n{c['name']}"
                    + ("" if s["complete"] else "\n(FAILED)")
                )
                # a failed row has no throughput: no bar (log scale)
                puts.append(s["put_gbps"]["median"] or np.nan)
                gets.append(s["get_gbps"]["median"] or np.nan)
    xs = np.arange(len(labels))
    ax.bar(xs - 0.2, puts, 0.4, label="put", color="#6baed6")
    ax.bar(xs + 0.2, gets, 0.4, label="get", color="#08519c")
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, fontsize=6, rotation=60, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("GB/s (median, log scale)")
    ax.set_title("layer_first 78 x 2 KiB buffers: coalescing and call splitting")
    ax.legend(fontsize=7)
    m = result["machine"]
    fig.suptitle(
        f"mooncake-span bench {result['date_utc']} - {m.get('nproc')} x {m.get('cpu_model', '?')}, "
        f"{m.get('mem_total_gib', '?')} GiB",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
