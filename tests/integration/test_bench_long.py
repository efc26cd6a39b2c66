"""``mooncake-span bench --long``: a tiny run end to end, and its pure parts.

The end-to-end test runs every arm (span fork K=4, stock K=1, sglang's MooncakeStore)
with a writer and two reader processes against 1 and 2 storage nodes, and checks the
result document's structure and consistency: every restore byte-exact and whole, every
negative control caught, master RPCs counted per phase, the targets filled in. No timing
is asserted.
"""

from __future__ import annotations

import json

import pytest

from mooncake_span.ops.cli import build_parser
from mooncake_span_tools.bench import long_conversation as L


def test_cli_parses_the_long_section() -> None:
    args = build_parser().parse_args(
        ["bench", "--long", "--quick", "--long-sizes", "4096,8192", "--json", "x.json"]
    )
    assert args.long and args.quick and args.long_sizes == "4096,8192"


def test_config_refuses_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="multiples of 256"):
        L.LongConfig(sizes_tokens=(1000,))
    with pytest.raises(ValueError, match="unknown arm"):
        L.LongConfig(arms=("span-K8",))
    with pytest.raises(ValueError, match="reps"):
        L.LongConfig(reps=0)
    assert L.LongConfig().max_tokens == 300_032
    # one conversation of the longest size per node, with room to spare
    assert L.LongConfig().segment_bytes() >= 300_032 * 867


def test_mismatched_pages_counts_every_difference() -> None:
    written = {"kv": ["a", "b", "c"], "state": ["s"]}
    assert L.mismatched_pages({"kv": ["a", "b", "c"], "state": ["s"]}, written) == 0
    assert L.mismatched_pages({"kv": ["a", "x", "c"], "state": ["s"]}, written) == 1
    # a page not restored is a mismatch, and so is a missing pool
    assert L.mismatched_pages({"kv": ["a"], "state": ["s"]}, written) == 2
    assert L.mismatched_pages({"kv": ["a", "b", "c"]}, written) == 1


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(900)  # about 85 s idle, 270-300 s under the suite's load
def test_tiny_long_run_end_to_end(tmp_path) -> None:
    config = L.LongConfig(
        sizes_tokens=(8704,),  # two 8,192-token chunks
        node_counts=(1, 2),
        readers=(1, 2),
        reps=1,
        bandwidth_reps=1,
        log_dir=str(tmp_path / "logs"),
    )
    result = L.run_long(config)
    assert json.loads(json.dumps(result))["schema"] == L.SCHEMA
    assert len(result["sizes"]) == 2 * 3 * 1  # node counts x arms x sizes
    assert len(result["bandwidth"]) == 2 * 3 * 2  # node counts x arms x reader counts
    for row in result["sizes"]:
        where = f"{row['nodes']} nodes {row['arm']} {row['tokens']}"
        assert row["byte_exact"] and row["mismatched_pages"] == 0, where
        assert row["hit_keys"] == row["restored_keys"] == row["keys"] == row["tokens"] // 256
        assert row["chunks"] == -(-row["tokens"] // 8192)
        assert row["negative_control_caught"], where
        # the state of every chunk is stored beside the KV and indexer objects
        assert row["objects"] >= 2 * row["keys"] + row["chunks"], where
        assert row["failed_objects"] == 0
        rpcs = row["master_rpcs"]
        assert rpcs["backup"] > 0 and rpcs["hit_query"] > 0 and rpcs["restore"] > 0, where
        # a restore reads the KV and indexer of every key and the last chunk's state
        assert row["bytes_restored"] == row["bytes"] - (row["chunks"] - 1) * row["state_bytes"]
        shares = row["placement"]["share_if_lost"]
        assert shares and all(0.0 <= s <= 1.0 for s in shares.values())
        assert len(shares) <= row["nodes"]
    for cell in result["bandwidth"]:
        assert cell["byte_exact"] and cell["restored_keys"] == [8704 // 256] * cell["readers"]
        assert len(cell["per_rank_gbps"]) == cell["readers"]
    assert result["byte_exact"] and result["negative_controls_caught"]
    ids = {(t["id"], t["arm"]) for t in result["targets"]}
    for arm in config.arms:
        assert ("restore_per_token_longest_vs_shortest", arm) in ids
        assert ("put_2_nodes_vs_1", arm) in ids and ("2_readers_2_nodes_vs_1", arm) in ids
    assert set(result["placement_model"]["share_after_one_node_lost"]) == {"2", "4"}
    assert "targets:" in L.format_long(result)
    assert "| target |" in L.format_markdown(result)
    png = tmp_path / "long.png"
    L.write_plot(result, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
