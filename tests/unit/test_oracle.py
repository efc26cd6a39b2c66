"""The content oracle (``ops/oracle.py``) and the restore-fault hook of the serving
tests' negative controls (``testing/restore_faults.py``), without servers."""

from __future__ import annotations

import math

import pytest

from mooncake_span.ops import oracle
from mooncake_span_tools.lab.serve_demo import PoolReads, pool_reads, reads_between


def _top(*rows):
    return tuple(tuple(row) for row in rows)


def test_equal_answers_agree_and_report_a_zero_delta():
    top = _top([(5, -1.0), (7, -2.5)], [(3, -0.5), (9, -3.0)])
    verdict = oracle.compare((5, 3), top, (5, 3), top)
    assert verdict.agrees and verdict.max_logprob_delta == 0.0 and verdict.compared_tokens == 2


def test_a_small_shift_within_tolerance_agrees_and_a_larger_one_does_not():
    ref = _top([(5, -1.0), (7, -2.5)])
    near = _top([(5, -1.0 + 5e-5), (7, -2.5)])
    far = _top([(5, -1.0 + 2e-3), (7, -2.5)])
    assert oracle.compare((5,), near, (5,), ref).agrees
    verdict = oracle.compare((5,), far, (5,), ref)
    assert not verdict.agrees and verdict.max_logprob_delta == pytest.approx(2e-3)


def test_other_candidates_or_tokens_disagree():
    ref = _top([(5, -1.0), (7, -2.5)])
    assert math.isinf(
        oracle.compare((5,), _top([(5, -1.0), (8, -2.5)]), (5,), ref).max_logprob_delta
    )
    verdict = oracle.compare((6,), ref, (5,), ref)
    assert not verdict.tokens_equal and not verdict.agrees


def test_an_answer_without_logprobs_agrees_with_nothing():
    ref = _top([(5, -1.0)])
    verdict = oracle.compare((5,), (), (5,), ref)
    assert math.isnan(verdict.max_logprob_delta) and not verdict.agrees
    assert "none compared" in verdict.describe()


def test_only_the_first_tokens_are_compared():
    ref = _top([(5, -1.0)], [(6, -1.0)], [(7, -1.0)])
    late = _top([(5, -1.0)], [(6, -1.0)], [(7, -9.0)])
    assert oracle.compare((5, 6, 7), late, (5, 6, 7), ref, tokens=2).agrees
    assert not oracle.compare((5, 6, 7), late, (5, 6, 7), ref, tokens=3).agrees


def test_pool_reads_parse_a_scrape_and_subtract():
    text = "\n".join(
        [
            "# HELP mooncake_span_keys_total keys",
            'mooncake_span_keys_total{operation="get",pool="kv",result="ok"} 9.0',
            'mooncake_span_keys_total{operation="get",pool="kv",result="fail"} 4.0',
            'mooncake_span_keys_total{operation="set",pool="mamba",result="ok"} 2.0',
            'mooncake_span_bytes_total{operation="get",pool="kv"} 1024.0',
        ]
    )
    before = pool_reads("", ("kv", "mamba"))
    after = pool_reads(text, ("kv", "mamba"))
    assert after == {"kv": PoolReads(9.0, 1024.0), "mamba": PoolReads(0.0, 0.0)}
    assert reads_between(before, after)["kv"].keys == 9.0
