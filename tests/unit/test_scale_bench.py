"""The pure parts of ``mooncake-span bench --scale``: its configuration and quantiles."""

from __future__ import annotations

import pytest

from mooncake_span_tools.bench import scale as S


@pytest.mark.parametrize("steps", [(), (0, 10), (10, 5), (10, 10)])
def test_steps_must_be_increasing_positive_counts(steps):
    with pytest.raises(ValueError, match="steps"):
        S.ScaleConfig(steps=steps)


def test_conversation_is_whole_storage_pages():
    with pytest.raises(ValueError, match="conversation_tokens"):
        S.ScaleConfig(conversation_tokens=300_000)
    assert S.ScaleConfig().conversation_keys == 1172


def test_segment_holds_every_object_by_the_allocator_count():
    config = S.ScaleConfig(steps=(10, 10_000_000))
    room = config.segment_bytes() // S.ALLOCATOR_BYTES_PER_OBJECT
    assert room >= 10_000_000 + 2 * config.conversation_keys
    assert config.segment_bytes() % (1 << 30) == 0


def test_quantiles_are_nearest_rank():
    seconds = [i / 1000 for i in range(1, 101)]
    q = S.quantiles_ms(seconds)
    assert q == {"p50_ms": 50.5, "p99_ms": 99.0, "samples": 100}
    assert S.quantiles_ms([0.002])["p99_ms"] == 2.0
