"""TimedProxy: the call timer shared by the benchmark's native client and the node worker."""

from __future__ import annotations

import time

import pytest

from mooncake_span_tools.bench.shared_native import NativeCounters, TimedNativeStore
from mooncake_span_tools.bench.timing import TimedProxy


class _Target:
    value = 7

    def slow(self, keys, delay_s=0.02):
        time.sleep(delay_s)
        return [0] * len(keys)

    def fails(self, *args):
        raise RuntimeError("native error")

    def untimed(self):
        return "plain"


def test_named_methods_are_timed_and_others_forwarded():
    records = []
    proxy = TimedProxy(_Target(), ("slow", "fails"), lambda *r: records.append(r))
    assert proxy.slow(["a", "b"]) == [0, 0]
    assert proxy.untimed() == "plain" and proxy.value == 7
    ((name, args, wall_s, seconds, error),) = records
    assert name == "slow" and args == (["a", "b"],) and error is None
    assert seconds >= 0.015 and abs(wall_s - time.time()) < 5
    with pytest.raises(AttributeError):
        _ = proxy.missing
    with pytest.raises(AttributeError):
        _ = proxy._private


def test_an_exception_is_reported_then_re_raised():
    records = []
    proxy = TimedProxy(_Target(), ("fails",), lambda *r: records.append(r))
    with pytest.raises(RuntimeError, match="native error"):
        proxy.fails(1, 2)
    assert records[0][0] == "fails" and isinstance(records[0][4], RuntimeError)


class _Native:
    def __init__(self):
        self.registered = []

    def register_buffer(self, ptr, size):
        self.registered.append((ptr, size))
        return 0

    def batch_put_from_multi_buffers(self, keys, ptrs, sizes):
        return [0] * len(keys)

    def batch_get_into(self, keys, ptrs, sizes):
        return [1] * len(keys)

    def batch_is_exist(self, keys):
        return [1] * len(keys)


def test_native_store_counts_objects_buffers_and_existence_calls():
    native = _Native()
    store = TimedNativeStore(native)
    before = store.snapshot()
    store.batch_put_from_multi_buffers(["k1", "k2"], [[1, 2, 3], [4]], [[1, 1, 1], [1]])
    store.batch_get_into(["k1", "k2", "k3"], [1, 2, 3], [1, 1, 1])
    store.batch_is_exist(["k1"])
    delta = store.snapshot().minus(before)
    assert (delta.io_calls, delta.io_objects, delta.io_buffers) == (2, 5, 7)
    assert (delta.exist_calls, delta.exist_keys) == (1, 1)
    assert delta.io_s >= 0 and isinstance(delta, NativeCounters)
    # setup/close belong to the harness; a buffer is registered once.
    assert store.setup("x") == 0 and store.close() == 0
    assert store.register_buffer(100, 10) == 0 and store.register_buffer(100, 10) == 0
    assert native.registered == [(100, 10)]
