"""Circuit breaker state machine (mooncake_span.store.gate)."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_span.store.gate import BreakerSnapshot, BreakerState, CircuitBreaker


def test_starts_closed():
    breaker = CircuitBreaker(3)
    assert not breaker.is_open
    assert breaker.snapshot() == BreakerSnapshot(BreakerState.CLOSED, 0, 0)


@pytest.mark.parametrize("threshold", [1, 2, 3, 7])
def test_opens_after_exactly_n_consecutive_failures(threshold):
    breaker = CircuitBreaker(threshold)
    for _ in range(threshold - 1):
        assert breaker.record_failure() is False
        assert not breaker.is_open
    assert breaker.record_failure() is True
    assert breaker.is_open
    assert breaker.snapshot() == BreakerSnapshot(BreakerState.OPEN, threshold, 1)


def test_failures_while_open_do_not_reopen_it():
    breaker = CircuitBreaker(2)
    breaker.record_failure()
    assert breaker.record_failure() is True
    assert breaker.record_failure() is False
    assert breaker.record_failure() is False
    snap = breaker.snapshot()
    assert snap == BreakerSnapshot(BreakerState.OPEN, 4, 1)


def test_success_resets_the_failure_count():
    breaker = CircuitBreaker(3)
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.record_success() is False  # it was closed
    assert breaker.snapshot().consecutive_failures == 0
    # Two more failures are not enough: the count started over.
    breaker.record_failure()
    breaker.record_failure()
    assert not breaker.is_open
    assert breaker.record_failure() is True


def test_success_closes_an_open_breaker_once():
    breaker = CircuitBreaker(1)
    assert breaker.record_failure() is True
    assert breaker.record_success() is True
    assert breaker.record_success() is False
    assert breaker.snapshot() == BreakerSnapshot(BreakerState.CLOSED, 0, 1)


def test_times_opened_counts_every_opening():
    breaker = CircuitBreaker(2)
    for cycle in range(1, 4):
        breaker.record_failure()
        breaker.record_failure()
        assert breaker.snapshot().times_opened == cycle
        breaker.record_success()
    assert breaker.snapshot().times_opened == 3


@pytest.mark.parametrize("threshold", [0, -1])
def test_threshold_must_be_positive(threshold):
    with pytest.raises(ValueError, match=str(threshold)):
        CircuitBreaker(threshold)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 5), st.lists(st.booleans(), max_size=40))
def test_matches_a_reference_model(threshold, outcomes):
    # True = success, False = failure; the model is the docstring's rule.
    breaker = CircuitBreaker(threshold)
    failures, opened, state = 0, 0, BreakerState.CLOSED
    for ok in outcomes:
        if ok:
            closed_now = breaker.record_success()
            assert closed_now == (state is BreakerState.OPEN)
            failures, state = 0, BreakerState.CLOSED
        else:
            opened_now = breaker.record_failure()
            failures += 1
            expect_open = state is BreakerState.CLOSED and failures >= threshold
            assert opened_now == expect_open
            if expect_open:
                state, opened = BreakerState.OPEN, opened + 1
        snap = breaker.snapshot()
        assert (snap.state, snap.consecutive_failures, snap.times_opened) == (
            state,
            failures,
            opened,
        )
        assert breaker.is_open == (state is BreakerState.OPEN)


def test_concurrent_failures_open_it_exactly_once():
    breaker = CircuitBreaker(5)
    opened = []
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        for _ in range(100):
            if breaker.record_failure():
                opened.append(1)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(opened) == 1
    assert breaker.snapshot().consecutive_failures == 800
    assert breaker.snapshot().times_opened == 1
