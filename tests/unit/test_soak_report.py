"""The soak command's pure parts: config checks, percentiles, growth verdict, table, CLI."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from mooncake_span_tools.lab.soak import SoakConfig, _duration_arg, percentile_s
from mooncake_span_tools.lab.soak_report import analyse, format_table


def _samples(rss_per_100k_mb: float, *, threads=(35,), n: int = 40) -> list[dict]:
    rows = []
    for i in range(n):
        calls = i * 10_000.0
        rows.append(
            {
                "t_s": i * 5.0,
                "calls": calls,
                "rss_mb": 600.0 + rss_per_100k_mb * calls / 1e5,
                "heap_blocks": 1e6,
                "traced_mb": None,
                "threads": float(threads[min(i, len(threads) - 1)]),
                "fds": 40.0,
            }
        )
    return rows


CONFIG = SoakConfig(duration_s=200, warmup_s=20, sample_interval_s=5)


def test_flat_memory_is_within_budget():
    summary = analyse(_samples(0.0), CONFIG)
    assert summary["ok"], summary["failures"]
    assert abs(summary["rss_mb_per_100k_calls"]) < 1e-9


def test_growth_above_the_budget_fails_and_says_by_how_much():
    summary = analyse(_samples(1.9), CONFIG)
    assert not summary["ok"]
    assert summary["rss_mb_per_100k_calls"] == pytest.approx(1.9)
    assert "MB per 100k calls" in summary["failures"][0]


def test_thread_growth_fails_unless_budgeted():
    rows = _samples(0.0, threads=[35] * 20 + [36])
    assert analyse(rows, CONFIG)["failures"] == ["threads grew by 1"]
    budgeted = SoakConfig(duration_s=200, warmup_s=20, sample_interval_s=5, thread_budget=1)
    assert analyse(rows, budgeted)["ok"]


def test_too_few_samples_after_warm_up_is_an_error():
    with pytest.raises(ValueError, match="after the warm-up"):
        analyse(_samples(0.0, n=5), CONFIG)


def test_percentile_is_the_upper_edge_of_the_quantile_bin():
    counts = np.zeros(142, dtype=np.int64)
    counts[40] = 99  # 10 us * 10**(40/20) = 1 ms
    counts[80] = 1  # 100 ms
    assert percentile_s(counts, 0.5) == pytest.approx(1e-3)
    assert percentile_s(counts, 0.999) == pytest.approx(0.1)
    assert percentile_s(np.zeros(142, dtype=np.int64), 0.5) is None


@pytest.mark.parametrize(
    ("text", "seconds"), [("90", 90), ("90s", 90), ("30m", 1800), ("1.5h", 5400)]
)
def test_durations(text, seconds):
    assert _duration_arg(text) == seconds


def test_bad_duration_names_the_value():
    with pytest.raises(argparse.ArgumentTypeError, match="'ten minutes'"):
        _duration_arg("ten minutes")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"warmup_s": 2000.0}, "must exceed the warm-up"),
        ({"working_set_ratio": 1.0}, "so eviction runs"),
        ({"segment_bytes": 1 << 20}, ">= 8 MiB"),
        ({"lease_ttl_ms": 0}, "lease_ttl_ms"),
    ],
)
def test_config_refuses_what_would_not_measure_anything(change, message):
    with pytest.raises(ValueError, match=message):
        SoakConfig(**change)


def test_table_has_a_row_per_minute_and_the_verdict():
    report = {
        "minutes": [
            {
                "minute": 0,
                "calls": 10,
                **{f"{op}_{q}_ms": 1.0 for op in ("batch_set_v2",) for q in ("p50", "p99")},
                **{
                    f"{op}_{q}_ms": None
                    for op in ("batch_set_v1", "batch_exists_v2", "batch_get_v1", "batch_get_v2")
                    for q in ("p50", "p99")
                },
            }
        ],
        "summary": analyse(_samples(1.9), CONFIG),
    }
    table = format_table(report)
    assert "1.00/1.0" in table
    assert "verdict: RSS grows" in table
