"""Circuit breaker state machine (mooncake_span.store.gate)."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_span.store.gate import CircuitBreaker


def _stats(state: str, failures: int, times_opened: int) -> dict[str, object]:
    return {
        "breaker_state": state,
        "breaker_consecutive_failures": failures,
        "breaker_times_opened": times_opened,
    }


def test_starts_closed():
    breaker = CircuitBreaker(3)
    assert not breaker.is_open
    assert breaker.stats() == _stats("closed", 0, 0)


@pytest.mark.parametrize("threshold", [1, 2, 3, 7])
def test_opens_after_exactly_n_consecutive_failures(threshold):
    breaker = CircuitBreaker(threshold)
    for _ in range(threshold - 1):
        assert breaker.record_failure() is False
        assert not breaker.is_open
    assert breaker.record_failure() is True
    assert breaker.is_open
    assert breaker.stats() == _stats("open", threshold, 1)


def test_failures_while_open_do_not_reopen_it():
    breaker = CircuitBreaker(2)
    breaker.record_failure()
    assert breaker.record_failure() is True
    assert breaker.record_failure() is False
    assert breaker.record_failure() is False
    assert breaker.stats() == _stats("open", 4, 1)


def test_success_resets_the_failure_count():
    breaker = CircuitBreaker(3)
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.record_success() is False  # it was closed
    assert breaker.stats()["breaker_consecutive_failures"] == 0
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
    assert breaker.stats() == _stats("closed", 0, 1)


def test_times_opened_counts_every_opening():
    breaker = CircuitBreaker(2)
    for cycle in range(1, 4):
        breaker.record_failure()
        breaker.record_failure()
        assert breaker.stats()["breaker_times_opened"] == cycle
        breaker.record_success()
    assert breaker.stats()["breaker_times_opened"] == 3


@pytest.mark.parametrize("threshold", [0, -1])
def test_threshold_must_be_positive(threshold):
    with pytest.raises(ValueError, match=str(threshold)):
        CircuitBreaker(threshold)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 5), st.lists(st.booleans(), max_size=40))
def test_matches_a_reference_model(threshold, outcomes):
    # True = success, False = failure; the model is the docstring's rule.
    breaker = CircuitBreaker(threshold)
    failures, opened, is_open = 0, 0, False
    for ok in outcomes:
        if ok:
            closed_now = breaker.record_success()
            assert closed_now == is_open
            failures, is_open = 0, False
        else:
            opened_now = breaker.record_failure()
            failures += 1
            expect_open = not is_open and failures >= threshold
            assert opened_now == expect_open
            if expect_open:
                is_open, opened = True, opened + 1
        state = "open" if is_open else "closed"
        assert breaker.stats() == _stats(state, failures, opened)
        assert breaker.is_open == is_open


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
    assert breaker.stats()["breaker_consecutive_failures"] == 800
    assert breaker.stats()["breaker_times_opened"] == 1
