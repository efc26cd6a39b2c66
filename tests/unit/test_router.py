"""DomainRouter: when a call goes to Mooncake as built, and where objects go.

The client's one-call path rests on ``direct``: it must say no whenever the
call needs per-object handling (copies, a bad segment, a repeated key, more
buffers than one call may carry), because the direct path skips all of it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mooncake_span.config import SpanOptions
from mooncake_span.span.plan import PlanBatch
from mooncake_span.store.router import DomainRouter, FailureLedger
from tests.span_helpers import FakeClock, rank_segments


def _batch(buffers_per_object: list[int]) -> PlanBatch:
    ptrs = [[4096 * (i + 1) + j for j in range(n)] for i, n in enumerate(buffers_per_object)]
    sizes = [[1] * n for n in buffers_per_object]
    return PlanBatch(ptrs, sizes, [n for n in buffers_per_object])


def _router(segments: tuple[str, ...] = (), **options) -> DomainRouter:
    spans = SpanOptions(**options)
    router = DomainRouter(spans, FailureLedger(spans))
    router.directory = SimpleNamespace(segments=segments)
    return router


def test_a_healthy_call_goes_as_built_in_one_call_when_it_fits():
    router = _router(max_buffers_per_call=8)
    assert router.direct(["a", "b", "c"])
    assert router.calls(_batch([2, 3, 3])) == [range(3)]


def test_a_repeated_key_is_not_direct():
    assert not _router().direct(["a", "b", "a"])


@pytest.mark.parametrize(
    ("buffers", "expected"),
    [
        ([5, 4], [range(0, 1), range(1, 2)]),
        ([3, 3, 3, 3], [range(0, 2), range(2, 4)]),
        ([9, 1], [range(0, 1), range(1, 2)]),  # too large for the budget: alone
    ],
)
def test_a_batch_over_the_budget_goes_in_consecutive_slices(buffers, expected):
    router = _router(max_buffers_per_call=8)
    calls = router.calls(_batch(buffers))
    assert calls == expected
    assert [i for span in calls for i in span] == list(range(len(buffers)))


def test_copies_and_bad_segments_are_not_direct():
    copies = _router(("s1", "s2"), replica_num=2, placement=True)
    assert not copies.direct(["a"])
    router = _router(("s1", "s2"))
    router.ledger.transfer_failed(["s2"], "get")
    assert not router.direct(["a"])


def test_direct_groups_follow_the_segment_list():
    assert _router(()).direct_groups(["a", "b"]) == [("", None)]
    assert _router(("s1",)).direct_groups(["a", "b"]) == [("s1", None)]


def test_direct_groups_put_each_key_on_its_first_ranked_segment():
    segments = ("s1", "s2", "s3", "s4")
    router = _router(segments)
    router.place_by(lambda key: key.split("/")[0])
    keys = [f"k{i}/{c}" for i in range(40) for c in ("kv", "idx")]
    groups = router.direct_groups(keys)
    positions = sorted(i for _, rows in groups for i in rows)
    assert positions == list(range(len(keys)))  # every object once
    assert len({segment for segment, _ in groups}) == len(groups) > 1
    for segment, rows in groups:
        assert rows == sorted(rows)  # the caller's order within a segment
        for i in rows:
            assert rank_segments(keys[i].split("/")[0], segments)[0] == segment


def test_put_groups_place_every_component_of_a_key_together():
    router = _router(("s1", "s2", "s3"))
    router.place_by(lambda key: key.split("/")[0])
    keys = [f"k{i}/{c}" for i in range(20) for c in ("kv", "idx")]
    groups = router.put_groups(keys)
    where = {obj: seg for seg, entries in groups.items() for _, obj in entries}
    assert sorted(where) == sorted(keys)
    for i in range(20):
        expected = rank_segments(f"k{i}", ("s1", "s2", "s3"))[0]
        assert where[f"k{i}/kv"] == where[f"k{i}/idx"] == expected


def test_read_rows_ask_the_master_only_about_suspect_copies():
    router = _router(("s1", "s2"))
    asked: list[list[str]] = []

    def locate(objects: list[str]) -> dict[str, set[str]]:
        asked.append(objects)
        return {}

    keys = [f"k{i}" for i in range(10)]
    assert router.read_rows(keys, locate) == [[k] for k in keys]
    assert asked == []
    router.ledger.transfer_failed(["s2"], "get")
    rows = router.read_rows(keys, locate)
    on_bad = {k for k in keys if rank_segments(k, ("s1", "s2"))[0] == "s2"}
    assert asked == [sorted(on_bad, key=keys.index)]
    assert rows == [[] if k in on_bad else [k] for k in keys]


def test_given_domains_replace_domain_of_and_must_match_the_keys():
    router = _router(("s1", "s2", "s3"))
    router.place_by(lambda key: pytest.fail("domain_of called although domains were given"))
    keys = [f"obj{i}" for i in range(12)]
    domains = [f"d{i // 3}" for i in range(12)]
    groups = router.direct_groups(keys, domains)
    where = {i: segment for segment, rows in groups for i in rows}
    for i in range(12):
        assert where[i] == rank_segments(domains[i], ("s1", "s2", "s3"))[0]
    with pytest.raises(ValueError, match="11 placement domains for 12 keys"):
        router.direct_groups(keys, domains[:-1])


def test_an_object_cap_cuts_every_call_further():
    router = _router(max_buffers_per_call=8)
    assert router.calls(_batch([1] * 10), max_objects=4) == [range(0, 4), range(4, 8), range(8, 10)]
    # the buffer budget first ([0..8) and [8..10)), then at most 3 objects per call
    assert router.calls(_batch([1] * 10), max_objects=3) == [
        range(0, 3),
        range(3, 6),
        range(6, 8),
        range(8, 10),
    ]
    assert router.calls(_batch([1] * 4), max_objects=4) == [range(4)]


def test_marks_and_lost_keys_expire_on_the_routers_clock():
    clock = FakeClock()
    options = SpanOptions(domain_bad_ttl_s=10.0, lost_key_ttl_s=30.0)
    ledger = FailureLedger(options, clock)
    router = DomainRouter(options, ledger)
    router.directory = SimpleNamespace(segments=("s1", "s2"))
    assert router.untroubled
    assert ledger.transfer_failed(["s2"], "get") == ["s2"]
    assert ledger.transfer_failed(["s2"], "get") == []  # already bad: not fresh
    ledger.remember_lost(["a", "b"])
    assert not router.untroubled
    assert ledger.lost_mask(["a", "b", "c"]) == [True, True, False]
    ledger.forget_lost(["b"])  # written again
    assert ledger.lost_mask(["a", "b"]) == [True, False]
    clock.advance(10.5)
    assert ledger.bad_segments() == frozenset()
    assert router.direct(["a"])
    assert ledger.lost_mask(["a"]) == [True]
    clock.advance(20.0)
    assert ledger.lost_mask(["a"]) == [False]
    assert (ledger.lost_count, ledger.times_marked) == (0, 1)
    assert router.untroubled
