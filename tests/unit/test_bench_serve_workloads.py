"""The pure parts of the multi-turn and prefill/decode serving workloads: no servers start."""

from __future__ import annotations

import pytest

from mooncake_span_tools.bench import serve
from mooncake_span_tools.bench import serve_fresh as FR
from mooncake_span_tools.bench import serve_multiturn as MT
from mooncake_span_tools.bench import serve_pd as PD
from mooncake_span_tools.bench import serve_stats as S


def _request(prompt_tokens, ttft_s, device=0, host=0, storage=0, output=(1, 2)):
    return {
        "prompt_tokens": prompt_tokens,
        "ttft_s": ttft_s,
        "e2e_s": ttft_s + 0.1,
        "tiers": {"device": device, "host": host, "storage": storage},
        "output_ids": list(output),
    }


def _turn(index, arms):
    return {"turn": index, "order": list(S.ARMS), "arms": arms}


def test_multiturn_config_needs_a_working_set_beyond_device_and_host() -> None:
    config = MT.MultiTurnConfig()
    assert config.longest_request_tokens == 768 + 5 * (8 + 192) + 8
    assert config.working_set_tokens == 12 * config.longest_request_tokens
    assert config.working_set_tokens > config.device_tokens + config.host_tokens
    # What the requests in flight prefetch fits the host tier.
    assert config.parallel * config.longest_request_tokens <= config.host_tokens
    with pytest.raises(ValueError, match="L3 would serve nothing"):
        MT.MultiTurnConfig(clients=6)
    with pytest.raises(ValueError, match="skip prefetches for want of host memory"):
        MT.MultiTurnConfig(parallel=5)
    with pytest.raises(ValueError, match="parallel <= clients"):
        MT.MultiTurnConfig(clients=2, parallel=3)
    with pytest.raises(ValueError, match="cannot hold the longest request"):
        MT.MultiTurnConfig(device_tokens=1024)
    with pytest.raises(ValueError, match="turns >= 2"):
        MT.MultiTurnConfig(turns=1)


def test_new_text_is_fresh_per_client_and_turn_and_repeatable() -> None:
    first = MT.new_text(0, 0, 0, 128)
    assert first == MT.new_text(0, 0, 0, 128)
    assert first[:64] != MT.new_text(0, 1, 0, 128)[:64]
    assert first[:64] != MT.new_text(0, 0, 1, 128)[:64]


def test_tier_tokens_reads_sglang_cached_tokens_details() -> None:
    meta = {"cached_tokens_details": {"device": 64, "host": 128, "storage": 576}}
    assert MT.tier_tokens(meta) == {"device": 64, "host": 128, "storage": 576}
    # sglang sends None when nothing was cached, and no storage key without an L3.
    assert MT.tier_tokens({"cached_tokens_details": None}) == dict.fromkeys(MT.TIERS, 0)
    assert MT.tier_tokens({"cached_tokens_details": {"device": 64, "host": 0}})["storage"] == 0


def test_summarize_arm_splits_hits_by_tier_and_leaves_out_the_first_turn() -> None:
    turns = [
        _turn(0, {"span": {"wall_s": 2.0, "requests": [_request(1000, 1.0)]}}),
        _turn(
            1,
            {
                "span": {
                    "wall_s": 1.0,
                    "requests": [_request(1000, 0.5, device=100, storage=600)],
                }
            },
        ),
    ]
    summary = MT.summarize_arm(turns, "span")
    later = summary["later_turns"]
    assert later["requests"] == 1
    assert later["hit_rate"] == {"device": 0.1, "host": 0.0, "storage": 0.6}
    assert later["input_tokens_per_s"] == 1000.0
    every = summary["all_turns"]
    assert every["hit_rate"]["storage"] == 0.3
    assert every["input_tokens_per_s"] == pytest.approx(2000 / 3.0)
    assert every["ttft_s"]["max"] == 1.0


def test_paired_turn_ratios_are_per_later_turn() -> None:
    def arms(span_wall, span_ttft, mc_wall, mc_ttft):
        return {
            "span": {"wall_s": span_wall, "requests": [_request(10, span_ttft)]},
            "mooncake": {"wall_s": mc_wall, "requests": [_request(10, mc_ttft)]},
        }

    turns = [_turn(0, arms(9.0, 9.0, 1.0, 1.0)), _turn(1, arms(2.0, 1.0, 4.0, 2.0))]
    ratios = MT.paired_turn_ratios(turns, "span", "mooncake")
    # Turn 0 is left out; span took half mooncake's wall time: twice the throughput.
    assert ratios["input_throughput"]["per_turn"] == [2.0]
    assert ratios["slowest_ttft"]["per_turn"] == [0.5]


def test_multiturn_disagreement_names_turn_client_and_arm() -> None:
    same = {arm: {"wall_s": 1.0, "requests": [_request(10, 1.0)] * 2} for arm in S.ARMS}
    differ = {**same, "mooncake": {"wall_s": 1.0, "requests": [_request(10, 1.0)] * 2}}
    differ["mooncake"]["requests"] = [_request(10, 1.0), _request(10, 1.0, output=(9,))]
    assert MT.disagreements([_turn(0, same)]) == []
    assert MT.disagreements([_turn(0, same), _turn(1, differ)]) == ["turn 1 client 1: mooncake"]


def test_pd_config_counts_what_turn_two_can_restore() -> None:
    config = PD.PdConfig()
    # Prefill writes the prompt's 32 pages; decode the page its 96 answers fill.
    assert config.turn1_l3_pages == (2048 + 95) // 64 == 33
    assert config.turn2_tokens == 2048 + 96 + 64
    assert config.restorable_tokens == 33 * 64
    short = PD.PdConfig(prompt_tokens=256, answer_tokens=2, new_tokens=1)
    # Turn 2 is 259 tokens: a match covers at most 258, so 4 whole pages.
    assert short.restorable_tokens == 4 * 64
    with pytest.raises(ValueError, match="multiple of the page"):
        PD.PdConfig(prompt_tokens=1000)
    with pytest.raises(ValueError, match="answer_tokens"):
        PD.PdConfig(answer_tokens=1)


def test_check_pd_reports_rounds_with_a_differing_turn() -> None:
    result = {"rounds": [{"round": 0, "disagreeing": []}, {"round": 1, "disagreeing": ["span"]}]}
    assert PD.check_pd(result) == ["pd round 1: span"]


def test_run_workloads_refuses_unknown_names_before_starting_anything() -> None:
    with pytest.raises(ValueError, match="workloads must be some of"):
        serve.run_workloads(
            ["repeated", "chat"], serve.ServeConfig(), MT.MultiTurnConfig(), PD.PdConfig()
        )
    assert serve.run_serve_command(None, None, None, "chat", None, None) == 2


def test_disagreements_gathers_every_workload() -> None:
    result = {
        "multiturn": {"disagreeing": ["turn 2 client 0: span"]},
        "pd": {"rounds": [{"round": 3, "disagreeing": ["mooncake-turn1"]}]},
    }
    assert serve.disagreements(result) == [
        "multiturn turn 2 client 0: span",
        "pd round 3: mooncake-turn1",
    ]
    assert serve.disagreements({"multiturn": {"disagreeing": []}}) == []


def test_write_plot_draws_every_measured_workload(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    ttft = {"p50": 1.0, "p99": 1.5}
    later = {"hit_rate": {"device": 0.1, "host": 0.2, "storage": 0.5}}
    result = {
        "repeated": {
            "models": {
                "llama": {"cells": {"2048": {"arms": {arm: {"ttft_s": ttft} for arm in S.ARMS}}}}
            }
        },
        "multiturn": {
            "config": {"model": "llama"},
            "arms": {arm: {"later_turns": later} for arm in S.ARMS},
        },
        "pd": {
            "config": {"model": "llama"},
            "cell": {"arms": {a: {"ttft_s": ttft} for a in S.ARMS}},
        },
    }
    path = tmp_path / "serve.png"
    serve.write_plot(result, str(path))
    assert path.stat().st_size > 1000
    with pytest.raises(ValueError, match="nothing measured"):
        serve.write_plot({"multiturn": {"turns": []}}, str(tmp_path / "empty.png"))


def test_pd_device_pool_admits_turn_two_on_decode() -> None:
    config = PD.PdConfig()
    # A decode server admits a request only with its reserve free beside it.
    needed = config.turn2_tokens + config.answer_tokens + PD.DECODE_RESERVED_TOKENS
    assert config.max_total_tokens >= needed
    assert config.max_total_tokens % config.page_size_tokens == 0


def _first(storage_tokens, ttft_s, agrees=True):
    return {"storage_tokens": storage_tokens, "ttft_s": ttft_s, "startup_s": 30.0, "agrees": agrees}


def test_fresh_workload_counts_first_requests_that_restored_everything() -> None:
    config = FR.FreshConfig()
    assert config.prefetch_policy == "timeout"  # what an operator gets by default
    assert config.restorable_tokens == 2048 - 64
    with pytest.raises(ValueError, match="at least 5 pages"):
        FR.FreshConfig(prompt_tokens=256)
    with pytest.raises(ValueError, match="rounds"):
        FR.FreshConfig(rounds=0)
    built = {S.SPAN: _first(1984, 0.4), S.MOONCAKE: _first(1984, 0.5)}
    rounds = [
        {"round": 0, "reads": {"built": built, "empty": {S.SPAN: _first(1984, 0.4)}}},
        {
            "round": 1,
            "reads": {
                "built": built,
                "empty": {S.MOONCAKE: _first(0, 1.9), S.SPAN: _first(1984, 0.3, False)},
            },
        },
    ]
    summary = FR.summarize_fresh(rounds, 1984)
    assert summary["built"][S.MOONCAKE]["restored_all"] == 2
    empty = summary["empty"]
    assert empty[S.SPAN]["restored_all"] == 2 and empty[S.MOONCAKE]["restored_all"] == 0
    assert empty[S.MOONCAKE]["storage_tokens"] == [0]
    assert empty[S.SPAN]["ttft_s"] == {"p50": pytest.approx(0.35), "max": 0.4}
    assert empty[S.SPAN]["disagreeing"] == 1
    result = {"config": config.described(), "rounds": rounds, "summary": summary}
    assert FR.check_fresh(result) == [f"fresh round 1 empty {S.SPAN}"]
    text = FR.format_fresh(result)
    assert "empty mooncake   restored all in 0 of 1 first requests, storage tokens [0]" in text
    assert "fresh" in serve.WORKLOADS and serve.disagreements({"fresh": result})
