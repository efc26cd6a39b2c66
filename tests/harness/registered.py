"""A checking proxy around a native Mooncake store: RDMA's rule without RDMA.

``CheckedStore`` forwards every call to the store it wraps, records the
regions given to ``register_buffer`` (when the store accepted them), and
checks every pointer of every zero-copy call against them before forwarding.
A buffer outside every region is recorded in ``violations`` and the call
raises ``UnregisteredMemoryError`` instead of reaching the store, as the
transfer would fail over RDMA. A zero-copy method this proxy does not know
how to check raises too, so a new call cannot slip past unchecked.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from mooncake_span.store.native import NativeBinding
from mooncake_span_tools.testing.registered_ranges import ByteRanges


class UnregisteredMemoryError(AssertionError):
    """A zero-copy call named memory outside the registered regions."""


def _multi(args: tuple[Any, ...]) -> tuple[list[int], list[int]]:
    """(keys, all_ptrs, all_sizes, ...): every buffer of every object."""
    ptrs = [p for row in args[1] for p in row]
    sizes = [s for row in args[2] for s in row]
    return ptrs, sizes


def _batch(args: tuple[Any, ...]) -> tuple[list[int], list[int]]:
    """(keys, ptrs, sizes, ...): one buffer per object."""
    return list(args[1]), list(args[2])


def _single(args: tuple[Any, ...]) -> tuple[list[int], list[int]]:
    """(key, ptr, size, ...)."""
    return [args[1]], [args[2]]


_CHECKED: dict[str, Callable[[tuple[Any, ...]], tuple[list[int], list[int]]]] = {
    "batch_put_from_multi_buffers": _multi,
    "batch_get_into_multi_buffers": _multi,
    "batch_upsert_from_multi_buffers": _multi,
    "batch_put_from": _batch,
    "batch_get_into": _batch,
    "batch_upsert_from": _batch,
    "put_from": _single,
    "get_into": _single,
    "upsert_from": _single,
}
# Zero-copy calls whose argument shapes this proxy does not check: refused.
_UNCHECKED = ("multi_buffer_ranges", "get_into_ranges", "put_from_with_metadata")


class CheckedStore:
    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.registered = ByteRanges()
        self.violations: list[tuple[str, int, int]] = []
        self.checked_buffers = 0
        self.calls: collections.Counter[str] = collections.Counter()

    def register_buffer(self, ptr: int, size: int) -> int:
        rc = self._inner.register_buffer(ptr, size)
        if rc == 0:
            self.registered.add(ptr, size)
        return rc

    def _checked(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            ptrs, sizes = _CHECKED[name](args)
            self.calls[name] += 1
            self.checked_buffers += len(ptrs)
            outside = self.registered.uncovered(ptrs, sizes)
            if outside:
                self.violations += [(name, p, s) for p, s in outside]
                raise UnregisteredMemoryError(
                    f"{name}: {len(outside)} of {len(ptrs)} buffers outside registered memory, "
                    f"first {outside[0][0]:#x} ({outside[0][1]} bytes)"
                )
            return fn(*args, **kwargs)

        return call

    def __getattr__(self, name: str) -> Any:
        if any(part in name for part in _UNCHECKED):
            raise UnregisteredMemoryError(f"{name} is a zero-copy call CheckedStore cannot check")
        attr = getattr(self._inner, name)
        return self._checked(name, attr) if name in _CHECKED else attr


def checked_binding(base: NativeBinding, stores: list[CheckedStore]) -> NativeBinding:
    """``base`` whose stores are wrapped; every store made is appended to ``stores``."""

    def make() -> CheckedStore:
        store = CheckedStore(base.store_factory())
        stores.append(store)
        return store

    return NativeBinding(
        make, base.replicate_config_factory, base.list_segments, probe_endpoint=base.probe_endpoint
    )
