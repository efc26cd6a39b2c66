"""RDMA's registered-memory rule without RDMA, for the stand-ins of Mooncake.

Over RDMA every buffer of a zero-copy Mooncake call must lie inside a region
given to ``register_buffer``. The fake store and the tests' checking proxy
(``tests/harness/registered.py``) hold the regions here and refuse what
``covers`` does not; the serving runtime never needs the rule itself (it
registers, and Mooncake checks).
"""

from __future__ import annotations

from collections.abc import Iterable


class ByteRanges:
    """Registered ``[ptr, ptr + size)`` regions; ``covers`` is RDMA's check."""

    def __init__(self) -> None:
        self._ranges: list[tuple[int, int]] = []

    def add(self, ptr: int, size_bytes: int) -> None:
        self._ranges.append((int(ptr), int(ptr) + int(size_bytes)))

    def covers(self, ptr: int, size_bytes: int) -> bool:
        """Is ``[ptr, ptr + size_bytes)`` inside one registered region?"""
        end = ptr + size_bytes
        return any(start <= ptr and end <= stop for start, stop in self._ranges)

    def uncovered(self, ptrs: Iterable[int], sizes: Iterable[int]) -> list[tuple[int, int]]:
        """The (ptr, size) buffers outside every registered region."""
        return [(p, s) for p, s in zip(ptrs, sizes, strict=True) if not self.covers(p, s)]

    def __len__(self) -> int:
        return len(self._ranges)
