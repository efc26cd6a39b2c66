"""The staging arena: one registered buffer that memory sglang owns moves through
(zero-copy Mooncake calls may only name registered memory, RDMA's rule).

A lease is a free gap of ``min_bytes`` (one object or key row) to ``want_bytes``
(the whole call); a lease never outlives one native call, so every wait ends.
Why and sizing: docs/operating.md, "Registered memory".
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from mooncake_span.errors import InvalidRequestError, MooncakeSpanError
from mooncake_span.span.byte_budget import align_up, largest_gap

logger = logging.getLogger(__name__)


class StagingBusyError(MooncakeSpanError, TimeoutError):
    """No lease of the staging arena became free in time."""


@dataclass(frozen=True)
class Lease:
    ptr: int
    offset: int
    size_bytes: int


class StagingArena:
    """``size_bytes`` of anonymous memory, registered once through ``register``."""

    def __init__(
        self, size_bytes: int, register: Callable[[int, int], None], timeout_s: float
    ) -> None:
        # mmap: page-aligned (what NIC registration pins) and committed on first touch.
        self.memory = memoryview(mmap.mmap(-1, size_bytes))
        self.base_ptr = ctypes.addressof(ctypes.c_char.from_buffer(self.memory))
        self.size_bytes = size_bytes
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._leased: dict[int, int] = {}  # offset -> bytes
        register(self.base_ptr, size_bytes)

    def _grant(self, want_bytes: int, min_bytes: int) -> Lease | None:
        offset, free = largest_gap(self._leased.items(), self.size_bytes)
        if free < min_bytes:
            return None
        size = min(free, align_up(want_bytes))
        self._leased[offset] = size
        return Lease(self.base_ptr + offset, offset, size)

    @contextmanager
    def lease(self, want_bytes: int, min_bytes: int) -> Iterator[Lease]:
        if min_bytes > self.size_bytes:
            raise InvalidRequestError(
                f"{min_bytes} bytes cannot be staged: the staging arena holds {self.size_bytes} "
                "bytes (raise span_staging_buffer_size)"
            )
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            granted = self._grant(want_bytes, min_bytes)
            while granted is None:
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    raise StagingBusyError(
                        f"no {min_bytes}-byte lease of the {self.size_bytes}-byte staging arena "
                        f"freed within {self.timeout_s}s ({len(self._leased)} leases held)"
                    )
                self._cond.wait(timeout=left_s)
                granted = self._grant(want_bytes, min_bytes)
        try:
            yield granted
        finally:
            with self._cond:
                del self._leased[granted.offset]
                self._cond.notify_all()
