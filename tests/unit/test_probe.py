"""RecoveryProbe: the thread that closes an open breaker once the cluster answers."""

from __future__ import annotations

import threading
import time

from mooncake_span.store.gate import CircuitBreaker, RecoveryProbe


def _wait(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


def _open_breaker() -> CircuitBreaker:
    breaker = CircuitBreaker(1)
    assert breaker.record_failure()
    assert breaker.is_open
    return breaker


def test_the_first_answer_closes_the_breaker_and_ends_the_thread():
    breaker = _open_breaker()
    answers = iter([False, False, True])
    asked = []

    def probe() -> bool:
        asked.append(1)
        return next(answers)

    prober = RecoveryProbe(breaker, 0.001, probe)
    prober.start()
    assert _wait(lambda: not breaker.is_open)
    prober._thread.join(5)
    assert not prober._thread.is_alive()
    assert len(asked) == 3


def test_a_closed_client_stops_the_probe_with_the_breaker_still_open():
    breaker = _open_breaker()
    prober = RecoveryProbe(breaker, 0.001, lambda: None)
    prober.start()
    prober._thread.join(5)
    assert not prober._thread.is_alive()
    assert breaker.is_open


def test_start_is_idempotent_while_a_probe_runs():
    breaker = _open_breaker()
    release = threading.Event()
    calls = []

    def probe() -> bool:
        calls.append(1)
        release.wait(5)
        return True

    prober = RecoveryProbe(breaker, 0.001, probe)
    prober.start()
    assert _wait(lambda: len(calls) == 1)
    prober.start()
    prober.start()
    release.set()
    assert _wait(lambda: not breaker.is_open)
    assert len(calls) == 1
