"""Placement (mooncake_span.store.domains) and the failure marks' state
(TimedMarks in mooncake_span.store.router), pure."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_span.store.domains import (
    copy_candidates,
    copy_key,
    live_copies,
    put_targets,
    suspect_copies,
)
from mooncake_span.store.router import TimedMarks
from tests.span_helpers import rank_segments

SEGMENTS = [f"10.0.0.{i}:1{i:04d}" for i in range(1, 5)]


@given(st.text(min_size=1, max_size=40), st.lists(st.text(min_size=1), unique=True, max_size=6))
@settings(max_examples=200, deadline=None)
def test_ranking_is_a_permutation_and_ignores_list_order(key, segments):
    ranked = rank_segments(key, segments)
    assert sorted(ranked) == sorted(segments)
    assert rank_segments(key, list(reversed(segments))) == ranked


@given(st.text(min_size=1, max_size=40), st.sampled_from(SEGMENTS))
@settings(max_examples=200, deadline=None)
def test_removing_a_segment_keeps_the_order_of_the_others(key, gone):
    # The rendezvous property: only keys that ranked the removed segment first move.
    full = rank_segments(key, SEGMENTS)
    assert rank_segments(key, [s for s in SEGMENTS if s != gone]) == [s for s in full if s != gone]


def test_bad_segments_go_last_in_rank_order():
    ranked = rank_segments("k", SEGMENTS)
    assert rank_segments("k", SEGMENTS, frozenset({ranked[0]})) == ranked[1:] + ranked[:1]


def test_keys_spread_evenly_and_a_new_segment_takes_only_its_share():
    keys = [f"ms1_model_h64x4_pf_bf16_{i:064x}" for i in range(8000)]
    first = collections.Counter(rank_segments(k, SEGMENTS[:3])[0] for k in keys)
    assert all(2400 < n < 2933 for n in first.values()), first  # 1/3 each, +-10 %
    after = [rank_segments(k, SEGMENTS)[0] for k in keys]
    moved = sum(a != rank_segments(k, SEGMENTS[:3])[0] for k, a in zip(keys, after, strict=True))
    # Scale-out: the new node gets about 1/4 of the keys, not all new ones.
    assert after.count(SEGMENTS[3]) == moved
    assert 1800 < moved < 2200


def test_copies_use_distinct_segments_in_rank_order():
    ranked = rank_segments("dom", SEGMENTS)
    rows = copy_candidates(["a", "b"], ["dom", "dom"], SEGMENTS, 2)
    assert rows[0] == [("a", ranked[0]), (copy_key("a", 1), ranked[1])]
    assert [s for _, s in rows[1]] == ranked[:2]


def test_copies_on_bad_segments_are_dropped_unless_located_elsewhere():
    ranked = rank_segments("dom", SEGMENTS)
    rows = copy_candidates(["a", "b"], ["dom", "dom"], SEGMENTS, 2)
    bad = frozenset({ranked[0]})
    assert suspect_copies(rows, bad) == ["a", "b"]
    # "a" was written to a fallback segment; "b" sits on the bad one; "a~c1"
    # and "b~c1" were placed on a healthy segment and need no lookup.
    located = {"a": {ranked[2]}, "b": {ranked[0]}}
    assert live_copies(rows, bad, located) == [["a", copy_key("a", 1)], [copy_key("b", 1)]]
    one = copy_candidates(["b"], ["dom"], SEGMENTS, 1)
    assert live_copies(one, bad, {}) == [[]]
    # Placed by Mooncake (no segment list): asked too, kept where located healthy.
    unplaced = copy_candidates(["c", "d"], None, [], 1)
    assert suspect_copies(unplaced, bad) == ["c", "d"]
    assert live_copies(unplaced, bad, {"c": {ranked[1]}, "d": {ranked[0]}}) == [["c"], []]


def test_candidates_without_segments_let_mooncake_place():
    assert copy_candidates(["a"], None, [], 2) == [[("a", ""), (copy_key("a", 1), "")]]


def test_put_targets_group_a_domain_on_one_segment_and_skip_bad_ones():
    keys = ["k_0_kv", "k_0_indexer", "k_0_conv"]
    targets = put_targets(keys, ["k"] * 3, SEGMENTS, 1, frozenset())
    ranked = rank_segments("k", SEGMENTS)
    assert targets == {ranked[0]: [(0, keys[0]), (1, keys[1]), (2, keys[2])]}
    moved = put_targets(keys, ["k"] * 3, SEGMENTS, 2, frozenset({ranked[0]}))
    # Copy 0 leaves the bad segment for a spare one; copy 1 keeps its own.
    assert set(moved) == {ranked[2], ranked[1]}
    assert [k for _, k in moved[ranked[1]]] == [copy_key(k, 1) for k in keys]


def test_health_marks_expire_and_report_fresh_marks_once():
    health = TimedMarks(ttl_s=10.0)
    assert health.mark(["a"], now_s=0.0) == ["a"]
    assert health.mark(["a", "b"], now_s=5.0) == ["b"]
    assert health.marked(14.9) == {"a", "b"}  # a's mark was renewed at 5.0
    assert health.marked(15.0) == frozenset()
    assert health.mark(["a"], now_s=20.0) == ["a"]
    assert health.marked(30.0) == frozenset()
    assert health.times_marked == 3


def test_health_is_bounded():
    health = TimedMarks(ttl_s=10.0, max_entries=3)
    health.mark([f"s{i}" for i in range(10)], now_s=0.0)
    assert health.marked(1.0) == {"s7", "s8", "s9"}


def test_lost_keys_until_rewritten_or_ttl():
    lost = TimedMarks(ttl_s=30.0, max_entries=10)
    assert lost.mask(["a"], 0.0) == [False]
    lost.mark(["a", "b"], now_s=0.0)
    assert lost.mask(["a", "b", "c"], 29.0) == [True, True, False]
    lost.discard(["a"])
    assert lost.mask(["a", "b"], 29.0) == [False, True]
    assert lost.mask(["b"], 30.0) == [False]
    assert len(lost) == 0


def test_lost_keys_are_bounded_oldest_first():
    lost = TimedMarks(ttl_s=30.0, max_entries=3)
    lost.mark([f"k{i}" for i in range(5)], now_s=0.0)
    assert len(lost) == 3
    assert lost.mask(["k0", "k1", "k2", "k4"], 1.0) == [False, False, True, True]


@pytest.mark.parametrize(("cls", "args"), [(TimedMarks, (0.0,)), (TimedMarks, (1.0, 0))])
def test_bad_bounds_are_refused(cls, args):
    with pytest.raises(ValueError):
        cls(*args)


@given(
    st.lists(
        st.text(alphabet="0123456789abcdef_-.", min_size=1, max_size=20), min_size=2, unique=True
    )
)
@settings(max_examples=100, deadline=None)
def test_every_object_of_a_storage_key_shares_one_domain(page_keys):
    from mooncake_span.span.keys import ComponentSpec, KeySchema, RankScope, RankTags

    components = (
        ComponentSpec("k", RankScope.REPLICATED),
        ComponentSpec("indexer", RankScope.REPLICATED),
        ComponentSpec("conv_0", RankScope.SHARDED),
    )
    domains = []
    for page_key in page_keys:
        seen = set()
        for tp in (0, 3):
            schema = KeySchema("m_x", 64, 4, "page_first", "bf16", RankTags.from_ranks(tp_rank=tp))
            seen |= {schema.domain_of(k) for k in schema.object_keys([page_key], components)}
        assert len(seen) == 1
        domains.append(seen.pop())
    # Distinct page keys without "_" get distinct domains.
    plain = [d for d, k in zip(domains, page_keys, strict=True) if "_" not in k]
    assert len(set(plain)) == len(plain)
    assert schema.domain_of("mooncake-span-layout-guard") == "mooncake-span-layout-guard"


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("master_admin_url", "10.0.0.1:9003", "span_master_admin_url"),
        ("master_admin_url", "http://host:9003/metrics", "span_master_admin_url"),
        ("segment_refresh_s", 0.0, "span_segment_refresh_s"),
        ("domain_bad_ttl_s", -1.0, "span_domain_bad_ttl_s"),
        ("lost_key_ttl_s", 1e9, "span_lost_key_ttl_s"),
        ("lost_keys_max", 0, "span_lost_keys_max"),
    ],
)
def test_domain_options_are_validated(field, value, named):
    from mooncake_span.config import SpanOptions
    from mooncake_span.errors import ConfigError

    with pytest.raises(ConfigError, match=named):
        SpanOptions(**{field: value})


def test_domain_options_load_from_extra_config_and_env():
    from mooncake_span.config import load_span_options

    options = load_span_options(
        {"span_placement": "false", "span_master_admin_url": "http://10.0.0.1:9003"},
        {"MOONCAKE_SPAN_DOMAIN_BAD_TTL_S": "3.5"},
    )
    assert (options.placement, options.master_admin_url, options.domain_bad_ttl_s) == (
        False,
        "http://10.0.0.1:9003",
        3.5,
    )
