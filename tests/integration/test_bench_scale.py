"""``mooncake-span bench --scale`` at tiny sizes: the document's structure and that its
counts agree with each other (timings are the benchmark's, never asserted here)."""

from __future__ import annotations

import pytest

from mooncake_span_tools.bench import scale as S
from mooncake_span_tools.bench import scale_objects as O

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_tiny_fill_counts_every_object_and_restores_the_conversation() -> None:
    config = S.ScaleConfig(steps=(300, 900), conversation_tokens=2048, hit_reps=2, get_reps=2)
    result = S.run_fill(config, progress=False)
    keys = config.conversation_keys
    assert result["conversation_keys"] == keys == 8
    assert result["stopped_early"] is None
    # One object per K=4 MLA key before the fill, then exactly what the filler put.
    assert result["master_keys_after_conversation"] == keys
    steps = result["steps"]
    assert [r["target_objects"] for r in steps] == [300, 900]
    for row in steps:
        assert row["filled_objects"] == row["target_objects"]
        assert row["master_keys"] == keys + row["filled_objects"]
        assert row["hit_keys"] == row["restored_keys"] == keys
        assert row["byte_exact"] is True
        for name in ("hit_query", "get"):
            assert row[name]["samples"] == 2
            assert 0 < row[name]["p50_ms"] <= row[name]["p99_ms"]
        # sglang asks and reads per 128 keys: 8 keys are one call per rep.
        assert row["hit_call"]["samples"] == row["get_call"]["samples"] == 2
    assert steps[0]["hit_ratio_to_first"] == steps[0]["get_ratio_to_first"] == 1.0
    assert result["master_rss_per_object_marginal_bytes"] is not None


@pytest.mark.parametrize("model", O.MODELS)
def test_objects_per_token_match_the_pool_layout(model: str) -> None:
    tokens = 2048
    figures = O.count_objects(model, tokens)
    rows = figures["contenders"]
    calls = figures["backup_calls"]
    assert calls == 1
    for label, row in rows.items():
        assert row["objects"] == row["objects_listed"], label
        assert row["storage_keys"] == tokens // (64 * row["pages_per_key"])
        assert row["objects_per_1000_tokens"] == pytest.approx(
            1000 * row["objects"] / tokens, abs=1e-3
        )
    if model == "mha":
        # One kv object per span key here; k and v apart in sglang's store.
        assert rows["span-K4"]["objects"] == rows["span-K4"]["storage_keys"] == 8
        assert rows["span-K1"]["objects"] == 32
        assert rows["upstream"]["objects"] == 2 * 32
    else:
        # KV and indexer per key, and one state (conv + temporal) per backup call.
        for label in rows:
            assert rows[label]["objects"] == 2 * rows[label]["storage_keys"] + 2 * calls, label
    per_token = O.bytes_per_token({model: figures}, 800.0)
    assert per_token[model]["span-K4"] < per_token[model]["upstream"]
