"""The pure parts of ``mooncake-span bench --leases`` (query shapes, the policy model)."""

from __future__ import annotations

import pytest

from mooncake_span.span.hit_rounds import ProbePolicy
from mooncake_span_tools.bench import leases as L


@pytest.mark.parametrize(
    ("shape", "miss"),
    [("first_miss", 0), ("early_miss", L.EARLY_MISS_KEY), ("middle_miss", L.MIDDLE_MISS_KEY)],
)
def test_miss_shapes_replace_exactly_one_key(shape, miss):
    keys = [f"k{i}" for i in range(L.QUERY_KEYS)]
    asked = L.query_keys(shape, keys, "t")
    assert len(asked) == len(keys)
    assert [i for i, (a, k) in enumerate(zip(asked, keys, strict=True)) if a != k] == [miss]
    assert asked[miss] not in keys
    assert L.query_keys("full_hit", keys, "t") == keys


@pytest.mark.parametrize("policy", [ProbePolicy(), *L.POLICIES])
@pytest.mark.parametrize("total", [1, 7, 24, 64])
def test_policy_model_counts_keys_probed_past_each_miss(policy, total):
    model = L.policy_model(policy, total, 3)
    chunks = [tuple(c) for c in model["chunks"]]
    assert chunks == policy.chunks(total, 3)
    # A miss at the first key of a chunk wastes the rest of it: the worst case.
    assert model["max_keys_past_miss"] == max(end - start - 1 for start, end in chunks)
    # Each chunk of n keys contributes 0 + 1 + ... + (n - 1) over its miss positions.
    waste = sum((end - start) * (end - start - 1) // 2 for start, end in chunks)
    assert model["mean_keys_past_miss"] == pytest.approx(waste / total)
    assert model["full_hit_kv_rounds"] == len(chunks)


def test_policy_labels_name_the_first_chunk_and_the_growth():
    assert L.policy_label(ProbePolicy()) == "span-first1-even"
    assert L.policy_label(ProbePolicy(4, growth=4)) == "span-first4-x4"
