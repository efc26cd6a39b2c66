"""FailureLedger: each failure mark's rule, on an injected clock, without a cluster."""

from __future__ import annotations

import pytest

from mooncake_span.config import SpanOptions
from mooncake_span.store.router import FailureLedger, PutTarget
from tests.span_helpers import FakeClock

TTL_S = 10.0


def _ledger(clock: FakeClock) -> FailureLedger:
    options = SpanOptions(domain_bad_ttl_s=TTL_S, lost_key_ttl_s=30.0, lost_keys_max=100)
    return FailureLedger(options, clock=clock)


@pytest.mark.parametrize(
    ("answers", "whole_call", "others_bad", "verdict"),
    [
        (False, False, False, PutTarget.BAD),  # refuses a dial: dead, whatever else
        (False, True, True, PutTarget.BAD),
        (True, True, False, PutTarget.FULL),  # answers: it was full, Mooncake moved the rest
        (True, False, True, PutTarget.FULL),
        (None, True, False, PutTarget.BAD),  # cannot be dialled, failed a whole call alone
        (None, True, True, PutTarget.FULL),  # another bad segment explains the failure
        (None, False, True, PutTarget.FULL),
        (None, False, False, PutTarget.UNKNOWN),  # part stored, no dial: no mark
    ],
)
def test_the_put_target_rule(answers, whole_call, others_bad, verdict):
    ledger = _ledger(FakeClock())
    if others_bad:
        ledger.transfer_failed(["other"], "batch_get_into_multi_buffers")
    assert ledger.put_target_failed("s", answers, whole_call) is verdict


def test_a_put_target_is_marked_as_judged():
    clock = FakeClock()
    ledger = _ledger(clock)
    assert ledger.put_target_failed("s1", answers=True, whole_call=True) is PutTarget.FULL
    assert ledger.full_segments() == {"s1"} and ledger.bad_segments() == frozenset()
    assert ledger.put_target_failed("s2", answers=None, whole_call=False) is PutTarget.UNKNOWN
    assert ledger.put_target_failed("s3", answers=False, whole_call=False) is PutTarget.BAD
    assert ledger.bad_segments() == {"s3"} and ledger.full_segments() == {"s1"}
    # Now another segment is bad: an undialled whole failure is taken as full.
    assert ledger.put_target_failed("s4", answers=None, whole_call=True) is PutTarget.FULL
    clock.advance(TTL_S + 0.1)
    assert ledger.bad_segments() == frozenset() and ledger.full_segments() == frozenset()


def test_owners_down_ask_for_locations_until_the_mark_ends():
    clock = FakeClock()
    ledger = _ledger(clock)
    assert not ledger.owners_down_now
    assert ledger.owners_down(["s1"]) == ["s1"]
    assert ledger.owners_down_now and ledger.bad_segments() == {"s1"}
    assert not ledger.quiet
    clock.advance(TTL_S)
    assert not ledger.owners_down_now and ledger.bad_segments() == frozenset()
    assert ledger.times_marked == 1


def test_a_transfer_failure_marks_bad_once_per_episode():
    clock = FakeClock()
    ledger = _ledger(clock)
    assert ledger.quiet
    assert ledger.transfer_failed(["s1", "s2"], "get") == ["s1", "s2"]
    assert ledger.transfer_failed(["s2"], "get") == []
    assert not ledger.owners_down_now  # a dead transfer says nothing about SSD owners
    clock.advance(TTL_S + 1)
    assert ledger.transfer_failed(["s2"], "get") == ["s2"]
    assert ledger.times_marked == 3
