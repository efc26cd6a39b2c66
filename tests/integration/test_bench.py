"""``mooncake-span bench``: a tiny configuration end to end, plus its pure parts.

The end-to-end test runs every contender kind (memcpy, raw-1buf, raw-K4,
span-K1/K4, span with a small ``span_max_buffers_per_call``, upstream
MooncakeStore) on real sglang host pools in both topologies (the stock
GLM-5.3-Flash pool set among them), and checks the
result document: its schema, that every get was verified byte for byte, that
every transfer completed, and that the target table is filled in.
"""

from __future__ import annotations

import json

import pytest

from mooncake_span.ops.cli import build_parser

_SUMMARY_KEYS = {
    "put_gbps",
    "get_gbps",
    "put_pages_per_s",
    "get_pages_per_s",
    "put_keys_per_s",
    "get_keys_per_s",
    "put_python_ms_per_call",
    "get_python_ms_per_call",
    "pointers_per_key",
    "exists_us_per_ktoken",
    "verified_byte_exact",
    "complete",
    "expected_failure",
}
_TARGET_IDS = {
    "backend_overhead",
    "k4_vs_upstream_small_local",
    "k4_vs_upstream_large_local",
    "k4_vs_upstream_tcp",
    "mha_k1_vs_upstream_local",
    "mha_k1_vs_upstream_tcp",
    "memcpy_fraction",
    "exists_per_token",
    "coalescing",
    "chunked_calls",
}


def test_cli_parses_bench_options() -> None:
    args = build_parser().parse_args(
        [
            "bench",
            "--quick",
            "--json",
            "out.json",
            "--plot",
            "out.png",
            "--topology",
            "same",
            "--reps",
            "3",
        ]
    )
    assert args.quick and args.json == "out.json" and args.plot == "out.png" and args.reps == 3
    assert args.func.__name__ == "run_bench_command"


def test_contender_names_and_plans() -> None:
    from mooncake_span_tools.bench.runner import BenchConfig, ContenderSpec, plan_workloads

    spec = ContenderSpec.parse("span-K4-mb512@consec")
    assert (spec.kind, spec.pages_per_key, spec.max_buffers_per_call, spec.placement) == (
        "span",
        4,
        512,
        "consecutive",
    )
    assert ContenderSpec.parse("raw-1buf").kind == "raw-1buf"
    with pytest.raises(ValueError):
        ContenderSpec.parse("span-4")
    quick = plan_workloads(BenchConfig(quick=True, reps=1))
    assert {w.section for w in quick} == {"grid", "batch", "coalesce", "chunks", "stock"}
    # the stock GLM-5.3-Flash cell (K=1, 256-token pages) beside its span shape,
    # with equal tokens per call
    stock = [w for w in quick if w.section == "stock" and w.topology == "same"]
    assert [(w.model.label, w.model.page_tokens) for w in stock] == [
        ("dsa-stock-320KiB", 256),
        ("dsa-64KiB", 64),
    ]
    assert stock[0].pages_per_call * 256 == stock[1].pages_per_call * 64
    assert "span-K1" in stock[0].contenders and "span-K4" in stock[1].contenders
    assert all("memcpy" not in w.contenders for w in quick if w.topology != "same")
    # the >2048-buffer probe breaks the client: full runs only, isolated, last
    full = plan_workloads(BenchConfig(reps=1))
    probes = [w for w in full if w.isolated]
    assert [w.contenders for w in probes] == [("span-K4-mb4096",)]
    with pytest.raises(ValueError):
        BenchConfig(protocol="rdma")


@pytest.mark.integration
@pytest.mark.slow
def test_tiny_bench_end_to_end(tmp_path) -> None:
    from mooncake_span_tools.bench import runner as B

    small = B.MODELS[("dsa", B.SMALL)]
    mla = B.MODELS[("mla", B.SMALL)]
    tiny = B.MODELS[("mla", B.TINY_LAYERS)]
    stock = B.MODELS[("dsa-stock", B.STOCK)]
    workloads = [
        # GLM-5.3-Flash as stock 0.5.23 builds it: K=1 on 256-token pages
        B.Workload(
            "stock",
            "same",
            stock,
            "page_first",
            8,
            4,
            ("memcpy", "raw-1buf", "raw-K1", "span-K1", "upstream"),
        ),
        B.Workload(
            "grid",
            "same",
            small,
            "page_first",
            32,
            16,
            ("memcpy", "raw-1buf", "raw-K4", "span-K4", "upstream"),
        ),
        B.Workload(
            "grid",
            "same",
            mla,
            "layer_first",
            32,
            16,
            ("memcpy", "raw-K4", "span-K1", "span-K4", "upstream"),
        ),
        B.Workload(
            "coalesce",
            "same",
            tiny,
            "layer_first",
            16,
            16,
            ("span-K4", "span-K4@consec", "raw-K4@consec", "upstream"),
        ),
        B.Workload(
            "grid", "tcp", mla, "page_first", 32, 16, ("raw-1buf", "raw-K4", "span-K2", "upstream")
        ),
        # MHA: one kv object per key for the backend, k and v apart for raw-1buf
        B.Workload(
            "grid",
            "same",
            B.MODELS[("mha", B.SMALL)],
            "page_first",
            32,
            16,
            ("raw-1buf", "raw-K1", "span-K1", "span-K4", "upstream"),
        ),
        # 4 keys x 312 buffers, split at 512 and at the default 2048
        B.Workload(
            "chunks",
            "tcp",
            tiny,
            "layer_first",
            16,
            16,
            ("span-K4-mb512", "span-K4-mb2048"),
            warmup=0,
            reps=1,
        ),
    ]
    config = B.BenchConfig(reps=1, warmup=1, segment_bytes=256 << 20, progress=False)
    result = B.run_bench(config, native_log=str(tmp_path / "native.log"), workloads=workloads)

    text = json.dumps(result)  # JSON-ready, no numpy scalars
    assert json.loads(text)["schema"] == B.SCHEMA
    assert {
        "date_utc",
        "machine",
        "versions",
        "env",
        "config",
        "workloads",
        "targets",
    } <= result.keys()
    assert result["machine"]["nproc"] >= 1
    assert len(result["workloads"]) == len(workloads)
    for w in result["workloads"]:
        for c in w["contenders"]:
            s = c["summary"]
            assert _SUMMARY_KEYS <= s.keys(), c["name"]
            assert s["verified_byte_exact"], f"{w['name']} {c['name']}: a get was not byte-exact"
            assert s["complete"], f"{w['name']} {c['name']}: a transfer failed"
            assert s["put_gbps"]["median"] > 0 and s["get_gbps"]["median"] > 0
            for run in c["runs"]:
                # every page of every run was compared
                assert run["pages_compared"] == w["pages_per_run"]
    assert result["verified_byte_exact"] and result["all_complete_except_expected"]
    assert {t["id"] for t in result["targets"]} == _TARGET_IDS
    mha_k1 = next(t for t in result["targets"] if t["id"] == "mha_k1_vs_upstream_local")
    assert [r["workload"] for r in mha_k1["rows"]] == ["grid/same/mha-64KiB/page_first/P16"]
    coalesce = next(t for t in result["targets"] if t["id"] == "coalescing")
    assert coalesce["passed"] is True  # consecutive pages: L pointers per key, not K*L
    assert coalesce["rows"][0]["pointers_per_key_consecutive"] == tiny.layers

    table = B.format_table(result)
    assert "grid/same/dsa-64KiB/page_first/P16" in table and "targets" in table
    assert "stock/same/dsa-stock-320KiB/page_first/P4" in table
    stock_row = result["workloads"][0]
    # KV + indexer per page, each with the packed draft layer: (4+1) layers x
    # 256 tokens x 128 B of KV, (4+1) x 64 rows x 132 B of index keys
    assert stock_row["kv_page_bytes"] == 5 * 256 * 128 * 2
    assert stock_row["page_bytes_all_pools"] == 5 * 256 * 128 * 2 + 5 * 64 * 132
    png = tmp_path / "bench.png"
    B.write_plot(result, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
