"""The pure parts of ``mooncake-span bench --serve``: no servers start here."""

from __future__ import annotations

import collections
import itertools
from pathlib import Path

import pytest

from mooncake_span_tools.bench import serve, serve_arms
from mooncake_span_tools.bench import serve_stats as S
from mooncake_span_tools.testing.cpu_server.models import TinyModelSpec


def _record(index: int, ttft_s: dict[str, float], tokens=None, warmup: bool = False) -> dict:
    tokens = tokens or {}
    return {
        "model": "llama",
        "prompt_tokens": 4096,
        "round": index,
        "warmup": warmup,
        "arms": {
            arm: {
                "ttft_s": ttft_s[arm],
                "storage_tokens": 0 if arm == S.RECOMPUTE else 4032,
                "cached_tokens": 0 if arm == S.RECOMPUTE else 4032,
                "output_ids": tokens.get(arm, [1, 2, 3]),
            }
            for arm in S.ARMS
        },
        "writers": {
            arm: {"output_ids": tokens.get(f"{arm}-writer", [1, 2, 3])} for arm in S.L3_ARMS
        },
    }


def test_order_cycles_through_every_permutation():
    orders = [S.round_order(S.ARMS, i) for i in range(12)]
    assert orders[0] == S.ARMS
    assert len(set(orders[:6])) == 6
    assert orders[6:] == orders[:6]
    firsts = collections.Counter(order[0] for order in orders[:6])
    assert firsts == {arm: 2 for arm in S.ARMS}
    # every arm runs right behind every other arm equally often
    behind = collections.Counter(pair for order in orders[:6] for pair in itertools.pairwise(order))
    assert set(behind.values()) == {2}
    assert len(behind) == 6
    with pytest.raises(ValueError):
        S.round_order((), 0)


def test_percentile_interpolates_like_numpy():
    values = [4.0, 1.0, 3.0, 2.0]
    assert S.percentile(values, 50) == pytest.approx(2.5)
    assert S.percentile(values, 0) == 1.0
    assert S.percentile(values, 100) == 4.0
    assert S.percentile(values, 99) == pytest.approx(3.97)
    assert S.percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        S.percentile([], 50)
    with pytest.raises(ValueError):
        S.percentile(values, 101)


def test_paired_ratios_divide_within_each_round():
    rounds = [
        _record(0, {S.RECOMPUTE: 2.0, S.SPAN: 1.0, S.MOONCAKE: 0.5}),
        _record(1, {S.RECOMPUTE: 4.0, S.SPAN: 1.0, S.MOONCAKE: 2.0}),
    ]
    assert S.paired_ratios(rounds, S.SPAN, S.RECOMPUTE) == [0.5, 0.25]
    assert S.paired_ratios(rounds, S.SPAN, S.MOONCAKE) == [2.0, 0.5]


def test_cell_summary_leaves_out_the_warmup():
    rounds = [
        _record(0, {S.RECOMPUTE: 100.0, S.SPAN: 100.0, S.MOONCAKE: 1.0}, warmup=True),
        _record(1, {S.RECOMPUTE: 2.0, S.SPAN: 1.0, S.MOONCAKE: 1.0}),
        _record(2, {S.RECOMPUTE: 4.0, S.SPAN: 1.0, S.MOONCAKE: 2.0}),
    ]
    cell = S.summarize_cell(rounds)
    assert cell["rounds"] == 2
    assert cell["arms"][S.SPAN]["ttft_s"]["max"] == 1.0
    assert cell["arms"][S.RECOMPUTE]["ttft_s"]["p50"] == pytest.approx(3.0)
    assert cell["arms"][S.SPAN]["storage_tokens"] == [4032]
    ratio = cell["paired_ttft_ratio"]["span/recompute"]
    assert ratio["per_round"] == [0.5, 0.25]
    assert ratio["p50"] == pytest.approx(0.375)
    with pytest.raises(ValueError):
        S.summarize_cell(rounds[:1])


def test_agreement_passes_when_every_answer_matches():
    rounds = [_record(i, {arm: 1.0 for arm in S.ARMS}) for i in range(3)]
    S.check_agreement(rounds)
    assert S.disagreeing(S.round_outputs(rounds[0])) == []


@pytest.mark.parametrize("who", [S.SPAN, S.MOONCAKE, "span-writer", "mooncake-writer"])
def test_a_different_answer_fails_the_run(who):
    bad = _record(5, {arm: 1.0 for arm in S.ARMS}, tokens={who: [1, 2, 4]})
    assert S.disagreeing(S.round_outputs(bad)) == [who]
    with pytest.raises(S.DisagreementError, match=f"round 5: {who}"):
        S.check_agreement([_record(0, {arm: 1.0 for arm in S.ARMS}), bad])


def test_recompute_is_the_reference_answer():
    outputs = S.round_outputs(_record(0, {arm: 1.0 for arm in S.ARMS}, tokens={S.RECOMPUTE: [9]}))
    assert list(outputs)[0] == S.RECOMPUTE
    assert S.disagreeing(outputs) == [S.SPAN, S.MOONCAKE, "span-writer", "mooncake-writer"]


SCRAPE_BEFORE = """# HELP x
mooncake_span_operation_duration_seconds_sum{operation="batch_get_v1",outcome="ok"} 1.5
mooncake_span_operation_duration_seconds_sum{operation="batch_exists",outcome="ok"} 0.5
sglang:queue_time_seconds_sum{tp_rank="0"} 10.0
sglang:time_to_first_token_seconds_sum{is_streaming="true"} 20.0
other_metric 3
"""
SCRAPE_AFTER = """\
mooncake_span_operation_duration_seconds_sum{operation="batch_get_v1",outcome="ok"} 2.0
mooncake_span_operation_duration_seconds_sum{operation="batch_exists",outcome="ok"} 0.6
sglang:queue_time_seconds_sum{tp_rank="0"} 10.8
sglang:time_to_first_token_seconds_sum{is_streaming="true"} 21.0
mooncake_span_bytes_total{operation="get",pool="kv"} 4096
other_metric 9
"""


def test_metric_deltas_and_ttft_parts():
    before, after = S.parse_prometheus(SCRAPE_BEFORE), S.parse_prometheus(SCRAPE_AFTER)
    assert before["other_metric"] == 3.0
    delta = S.metric_delta(before, after, serve.METRIC_PREFIXES)
    assert "other_metric" not in delta
    assert delta['sglang:queue_time_seconds_sum{tp_rank="0"}'] == pytest.approx(0.8)
    mean = S.mean_deltas([delta, {}])
    parts = S.ttft_parts(mean, client_ttft_s=0.6)
    assert parts["server_ttft_s"] == pytest.approx(0.5)
    assert parts["queue_s"] == pytest.approx(0.4)
    assert parts["after_queue_s"] == pytest.approx(0.1)
    assert parts["http_and_stream_s"] == pytest.approx(0.1)
    assert parts["get_s"] == pytest.approx(0.25)
    assert parts["hit_query_s"] == pytest.approx(0.05)
    assert parts["queue_besides_backend_s"] == pytest.approx(0.1)
    assert parts["get_bytes"] == 2048
    assert "get_s" not in S.ttft_parts({}, 1.0)


def test_prompts_are_fresh_per_round_and_reproducible():
    first = serve_arms.round_prompt(0, "llama", 256, 0)
    assert first == serve_arms.round_prompt(0, "llama", 256, 0)
    assert len(first) == 256
    assert first[:64] != serve_arms.round_prompt(0, "llama", 256, 1)[:64]
    assert max(first) < serve_arms.PROMPT_VOCAB_TOKENS


def test_config_sizes_the_pools_and_checks_lengths():
    config = serve.ServeConfig(lengths_tokens=(2048, 4096), answer_tokens=8)
    assert config.max_total_tokens("llama") == 4096 + 3 * 64
    assert serve_arms.kv_bytes_per_token(config.model_spec("llama")) == 32 * 1024
    mla = TinyModelSpec(architecture="deepseek_v2", hidden_size=512, num_layers=8, num_heads=8)
    assert serve_arms.kv_bytes_per_token(mla) == 8 * 192 * 4
    with pytest.raises(ValueError, match="multiple of llama's page"):
        serve.ServeConfig(lengths_tokens=(1000,))


def test_glm_servers_get_their_page_flags_and_env():
    config = serve.ServeConfig(models=("llama", "glm5_next"), lengths_tokens=(2048,))
    assert config.page_tokens("glm5_next") == 256 and config.page_tokens("llama") == 64
    assert config.max_total_tokens("glm5_next") == 2048 + 3 * 256
    fields = config.model_fields("glm5_next", 2100)
    assert (fields["page_size_tokens"], fields["max_total_tokens"]) == (256, 2304)
    assert "--chunked-prefill-size" in fields["extra_args"]
    assert fields["env"] == {"SGLANG_MAMBA_CONV_DTYPE": "float32"}
    options = serve_arms.arm_options(serve.S.RECOMPUTE, Path("/m"), None, **fields)
    assert (
        options.extra_args[0] == "--enable-metrics"
        and "--max-mamba-cache-size" in options.extra_args
    )
    assert options.env == fields["env"]
    assert config.model_fields("llama", 2100)["max_total_tokens"] == 2112
    glm = config.model_spec("glm5_next")
    assert serve_arms.kv_bytes_per_token(glm) == 4 * (2 * 64 * 2 + 33)
    with pytest.raises(ValueError, match="multiple of glm5_next's page"):
        serve.ServeConfig(models=("glm5_next",), lengths_tokens=(2112,))
    with pytest.raises(ValueError):
        serve.ServeConfig(rounds=0)
    assert serve.parse_csv(None, (1, 2)) == (1, 2)
    assert serve.parse_csv("2048, 4096", (), int) == (2048, 4096)
