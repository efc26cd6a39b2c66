"""Text and Markdown tables of a result document."""

from __future__ import annotations

import json
import logging
from typing import Any

from mooncake_span_tools.bench.targets import contender_summary
from mooncake_span_tools.bench.workloads import MiB

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------
# reporting


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def format_table(result: dict[str, Any]) -> str:
    lines = []
    m = result["machine"]
    lines.append(
        f"mooncake-span bench {result['date_utc']}  {m.get('nproc')} CPUs "
        f"({m.get('cpu_model', '?')}), {m.get('mem_total_gib', '?')} GiB; timed reps "
        f"{result['config']['reps']} (+{result['config']['warmup']} warm-up); "
        "GB/s = 1e9 B/s, best/median"
    )
    header = (
        f"  {'contender':<16}{'keys/call':>9}{'ptrs/key':>9}{'put GB/s':>14}{'get GB/s':>14}"
        f"{'put kpg/s':>10}{'get kpg/s':>10}{'py ms/call':>12}{'exist us/ktok':>14}  ok"
    )
    for w in result["workloads"]:
        lines.append("")
        lines.append(
            f"[{w['name']}] {w['model']['layers']} layers, KV page "
            f"{w['kv_page_bytes'] / 1024:.0f} KiB (all pools "
            f"{w['page_bytes_all_pools'] / 1024:.0f} KiB/page), {w['pages_per_run']} pages = "
            f"{w['bytes_per_run'] / MiB:.0f} MiB per run, {w['pages_per_call']} pages/call"
            + (
                f", upstream {w['upstream_pages_per_native_call']} pages/native call"
                if w.get("upstream_pages_per_native_call") not in (None, w["pages_per_call"])
                else ""
            )
        )
        lines.append(header)
        for c in w["contenders"]:
            s = c["summary"]
            ok = ("yes" if s["verified_byte_exact"] else "NO") + (
                ""
                if s["complete"]
                else (" (expected fail)" if s["expected_failure"] else " INCOMPLETE")
            )
            py_put = _fmt(s["put_python_ms_per_call"]["median"])
            py = f"{py_put}/{_fmt(s['get_python_ms_per_call']['median'])}"
            lines.append(
                f"  {c['name']:<16}{s['keys_per_call']:>9}{_fmt(s['pointers_per_key'], '.1f'):>9}"
                f"{_fmt(s['put_gbps']['best']) + '/' + _fmt(s['put_gbps']['median']):>14}"
                f"{_fmt(s['get_gbps']['best']) + '/' + _fmt(s['get_gbps']['median']):>14}"
                f"{_fmt((s['put_pages_per_s']['median'] or 0) / 1e3 or None, '.1f'):>10}"
                f"{_fmt((s['get_pages_per_s']['median'] or 0) / 1e3 or None, '.1f'):>10}"
                f"{py:>12}{_fmt(s['exists_us_per_ktoken']['median'], '.1f'):>14}  {ok}"
            )
    lines.append("")
    lines.append(
        "targets (paired per-repetition ratios; worst workload, median of pairs / best-vs-best):"
    )
    for t in result["targets"]:
        verdict = {True: "PASS", False: "MISS", None: "n/a"}[t["passed"]]
        lines.append(
            f"  {verdict:<5}{t['id']:<28} target {t['target']}: worst median "
            f"{_fmt(t.get('achieved_worst_median'))}"
            f", worst best {_fmt(t.get('achieved_worst_best'))}"
        )
        for row in t["rows"]:
            lines.append("         " + _row_text(row))
    lines.append("")
    lines.append(
        f"every get verified byte-exact: {result['verified_byte_exact']}; "
        f"complete (except expected failures): {result['all_complete_except_expected']}; "
        f"elapsed {result['elapsed_s']} s"
    )
    return "\n".join(lines)


def _row_text(row: dict[str, Any]) -> str:
    if "put" in row and isinstance(row["put"], dict):
        return (
            f"{row['workload']}: put {_fmt(row['put']['median'])} ({_fmt(row['put']['best'])}), "
            f"get {_fmt(row['get']['median'])} ({_fmt(row['get']['best'])})"
        )
    if "speedup_median" in row:
        whole = row.get("whole_run_speedup_median")
        return (
            f"{row['workload']}: span {row['span_us_per_ktoken']:.1f} vs upstream "
            f"{row['upstream_us_per_ktoken']:.1f} us/ktoken -> {row['speedup_median']:.2f}x per "
            f"{row['tokens_per_query']}-token call"
            + (f"; {whole:.2f}x for one {row['whole_run_tokens']}-token query" if whole else "")
        )
    if "pointers_per_key_consecutive" in row:
        g = row.get("gain") or {}
        return (
            f"{row['workload']}: ptrs/key consecutive "
            f"{_fmt(row['pointers_per_key_consecutive'], '.0f')} "
            f"vs scattered {_fmt(row['pointers_per_key_scattered'], '.0f')} (L={row['layers']}); "
            f"consecutive/scattered put {_fmt((g.get('put') or {}).get('median'))}, "
            f"get {_fmt((g.get('get') or {}).get('median'))}"
        )
    if "per_chunk" in row:
        parts = [
            f"{n.rsplit('-', 1)[-1]}: "
            f"{'ok' if s['complete'] else 'FAIL(' + str(s['failed_keys_max']) + ' keys)'} "
            f"{_fmt(s['put_gbps']['median'], '.3f')}/{_fmt(s['get_gbps']['median'], '.3f')}"
            for n, s in row["per_chunk"].items()
        ]
        return f"{row['workload']}: " + "; ".join(parts)
    return json.dumps(row)


_GRID_COLUMNS = (
    "memcpy",
    "raw-1buf",
    "raw-K4",
    "span-K1",
    "span-K2",
    "span-K4",
    "span-K8",
    "span-K4-nogroup",
    "upstream",
)


def format_markdown(result: dict[str, Any]) -> str:
    """Markdown tables of a result document (for docs/benchmarks.md)."""
    out: list[str] = []
    grid = [w for w in result["workloads"] if w["section"] == "grid"]
    if grid:
        out.append("| topology | model | layout | KV page | " + " | ".join(_GRID_COLUMNS) + " |")
        out.append("|---|---|---|---:|" + "---:|" * len(_GRID_COLUMNS))
        for w in grid:
            cells = []
            for name in _GRID_COLUMNS:
                s = contender_summary(w, name)
                cells.append(
                    ""
                    if s is None
                    else f"{_fmt(s['put_gbps']['median'])} / {_fmt(s['get_gbps']['median'])}"
                )
            out.append(
                f"| {w['topology']} | {w['model']['family']}-{w['model']['size']} | "
                f"{w['layout']} | "
                f"{w['kv_page_bytes'] / 1024:.0f} KiB | " + " | ".join(cells) + " |"
            )
        out.append("")
    details = [w for w in result["workloads"] if w["section"] != "grid"]
    if details:
        out.append(
            "| workload | contender | keys/call | ptrs/key | put GB/s best / med "
            "| get GB/s best / med "
            "| put / get kpages/s (med) | Python ms/call put / get | exists µs/ktoken | verified |"
        )
        out.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
        for w in details:
            for c in w["contenders"]:
                s = c["summary"]
                status = "yes" if s["verified_byte_exact"] else "NO"
                if not s["complete"]:
                    status += f", FAILED ({s['failed_keys_max']} keys)"
                out.append(
                    f"| {w['name']} | {c['name']} | {s['keys_per_call']} | "
                    f"{_fmt(s['pointers_per_key'], '.0f')} | "
                    f"{_fmt(s['put_gbps']['best'])} / {_fmt(s['put_gbps']['median'])} | "
                    f"{_fmt(s['get_gbps']['best'])} / {_fmt(s['get_gbps']['median'])} | "
                    f"{_fmt((s['put_pages_per_s']['median'] or 0) / 1e3 or None, '.1f')} / "
                    f"{_fmt((s['get_pages_per_s']['median'] or 0) / 1e3 or None, '.1f')} | "
                    f"{_fmt(s['put_python_ms_per_call']['median'])} / "
                    f"{_fmt(s['get_python_ms_per_call']['median'])} | "
                    f"{_fmt(s['exists_us_per_ktoken']['median'], '.1f')} | {status} |"
                )
        out.append("")
    out.append(
        "| target | goal | worst workload: median of paired ratios (best vs best) | verdict |"
    )
    out.append("|---|---:|---:|---|")
    for t in result["targets"]:
        verdict = {True: "met", False: "**missed**", None: "n/a"}[t["passed"]]
        out.append(
            f"| {t['id']} | {t['target']} | {_fmt(t.get('achieved_worst_median'))} "
            f"({_fmt(t.get('achieved_worst_best'))}) | {verdict} |"
        )
    return "\n".join(out) + "\n"
