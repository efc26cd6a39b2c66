"""An in-memory stand-in for ``mooncake.store.MooncakeDistributedStore``.

It implements the subset of the native API that ``client.MooncakeClient`` uses,
with the native return-code conventions (0 / bytes read on success, negative
``ErrorCode`` values on failure) and the behaviours we rely on: a put of an
existing key keeps the old value and reports success, a get must name buffers
whose sizes sum exactly to the object size, empty keys and 0-byte objects are
rejected. ``tests/contract`` runs the same suite against this class and the
real client, which is what entitles unit tests to use it.

Several ``FakeStore`` instances built on one ``FakeCluster`` share objects,
like clients of one Mooncake cluster. ``FakeCluster.inject`` makes the next
calls of an operation fail with a given code, for fault tests.

With ``segments``, objects live on named segments as on real storage nodes
(measured on 0.3.13.post1 with two nodes): a put honours
``preferred_segment``; ``kill_segment`` makes a node's objects answer
TRANSFER_FAIL to gets while ``batch_is_exist`` still says 1 and the master
still lists the segment (the ``client_ttl`` window), and puts preferring it
fail the same way; ``expire_dead`` ends that window (the segment and its
objects disappear).

RDMA's rule holds here: a buffer of a zero-copy call that lies outside every
region given to ``register_buffer`` on this ``FakeStore`` fails its object
with TRANSFER_FAIL (what the RDMA transport answers when it finds no memory
registration), is logged, and is counted in
``FakeCluster.unregistered_buffers``; nothing is read or written there. So
every test on the fake checks that only registered memory is sent.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from mooncake_span.errors import ErrorCode
from mooncake_span_tools.testing.registered_ranges import ByteRanges

logger = logging.getLogger(__name__)


@dataclass
class FakeReplicateConfig:
    replica_num: int = 1
    group_ids: list[str] = field(default_factory=list)
    with_hard_pin: bool = False
    preferred_segment: str = ""


@dataclass(frozen=True)
class _FakeBufferDescriptor:
    transport_endpoint: str
    size: int


@dataclass(frozen=True)
class _FakeMemoryDescriptor:
    buffer_descriptor: _FakeBufferDescriptor


@dataclass(frozen=True)
class FakeReplica:
    segment: str
    size: int
    # Only on its owner's SSD (a LOCAL_DISK replica, which names no segment).
    on_disk: bool = False

    def is_memory_replica(self) -> bool:
        return not self.on_disk

    def is_local_disk_replica(self) -> bool:
        return self.on_disk

    def get_memory_descriptor(self) -> _FakeMemoryDescriptor:
        return _FakeMemoryDescriptor(_FakeBufferDescriptor(self.segment, self.size))


class FakeCluster:
    def __init__(self, capacity_bytes: int = 1 << 40, segments: tuple[str, ...] = ()) -> None:
        self.capacity_bytes = capacity_bytes
        self.segments = list(segments)
        self.dead: set[str] = set()
        self.placement: dict[str, str] = {}
        self.objects: dict[str, bytes] = {}
        self.groups: dict[str, str] = {}
        self.lock = threading.Lock()
        self._faults: dict[str, list[int]] = {}
        self.calls: list[tuple[str, int]] = []
        self.unregistered_buffers = 0
        # The SSD tier, as measured on the real one (store/serving_ssd.py): objects
        # whose DRAM copy is gone and that only their owner's disk holds. A read of
        # one whose owner is dead fails at the RPC layer; one owner's share of a
        # get larger than its read buffer overflows.
        self.on_disk: set[str] = set()
        self.disk_read_buffer_bytes = 1 << 40
        self.disk_reads = 0

    def inject(self, op: str, code: int, times: int = 1) -> None:
        """The next ``times`` calls of ``op`` answer ``code`` for every key."""
        self._faults.setdefault(op, []).extend([code] * times)

    def _take_fault(self, op: str) -> int | None:
        queue = self._faults.get(op)
        return queue.pop(0) if queue else None

    def used_bytes(self) -> int:
        return sum(len(v) for v in self.objects.values())

    def live_segments(self) -> list[str]:
        """What the master's /get_all_segments lists (dead ones until ``expire_dead``)."""
        return list(self.segments)

    def kill_segment(self, segment: str) -> None:
        self.dead.add(segment)

    def expire_dead(self) -> None:
        with self.lock:
            for key in [k for k, s in self.placement.items() if s in self.dead]:
                self.objects.pop(key, None)
                self.placement.pop(key, None)
                self.on_disk.discard(key)
            self.segments = [s for s in self.segments if s not in self.dead]
            self.dead.clear()

    def evict_to_disk(self, keys: Iterable[str]) -> None:
        """These objects' DRAM copies are evicted; their owner's SSD still holds them."""
        with self.lock:
            self.on_disk.update(k for k in keys if k in self.objects)

    def disk_owners(self, keys: Sequence[str]) -> dict[str, set[str]]:
        """What the master's admin server says (``segments.fetch_disk_owners``): per
        disk-only object, the segment of the client whose SSD holds it."""
        with self.lock:
            return {k: {self.placement.get(k, "")} for k in keys if k in self.on_disk}

    def _disk_codes(self, keys: Sequence[str]) -> dict[str, int]:
        """The codes an SSD tier answers for the disk-only objects of one get."""
        share: collections.Counter[str] = collections.Counter()
        for key in keys:
            if key in self.on_disk and key in self.objects:
                share[self.placement.get(key, "")] += len(self.objects[key])
        codes = {}
        for key in keys:
            owner = self.placement.get(key, "")
            if key not in self.on_disk or key not in self.objects:
                continue
            if owner in self.dead:
                codes[key] = int(ErrorCode.RPC_FAIL)
            elif share[owner] > self.disk_read_buffer_bytes:
                codes[key] = int(ErrorCode.BUFFER_OVERFLOW)
        self.disk_reads += len({self.placement.get(k, "") for k in keys if k in self.on_disk})
        return codes

    def add_segment(self, segment: str) -> None:
        self.segments.append(segment)

    def _place(self, key: str, preferred: str) -> str | None:
        """The segment a new object goes to; None when that segment is dead."""
        if not self.segments:
            return ""
        if preferred in self.segments:
            return None if preferred in self.dead else preferred
        # No (or an unknown) preference: Mooncake picks a segment itself.
        return self.segments[hash(key) % len(self.segments)]

    def drop(self, key: str) -> bool:
        """Forget one object, as eviction would."""
        with self.lock:
            self.placement.pop(key, None)
            self.on_disk.discard(key)
            return self.objects.pop(key, None) is not None


class FakeStore:
    def __init__(self, cluster: FakeCluster | None = None) -> None:
        self._cluster = cluster or FakeCluster()
        self._closed = False
        self.registered = ByteRanges()

    def _check(self) -> None:
        if self._closed:
            # The real client segfaults here; the fake makes the misuse visible.
            raise RuntimeError("FakeStore used after close()")

    def setup(self, *args: object, **kwargs: object) -> int:
        self._check()
        return 0

    def register_buffer(self, ptr: int, size: int) -> int:
        self._check()
        fault = self._cluster._take_fault("register_buffer")
        if fault is not None:
            return fault
        if size <= 0:
            return int(ErrorCode.INVALID_PARAMS)
        self.registered.add(ptr, size)
        return 0

    def close(self) -> int:
        self._closed = True
        return 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self._check()
        c = self._cluster
        c.calls.append(("batch_is_exist", len(keys)))
        fault = c._take_fault("batch_is_exist")
        if fault is not None:
            return [fault] * len(keys)
        with c.lock:
            return [1 if k in c.objects else 0 for k in keys]

    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[FakeReplica]]:
        self._check()
        c = self._cluster
        with c.lock:
            return {
                k: [FakeReplica(c.placement.get(k, ""), len(c.objects[k]), k in c.on_disk)]
                for k in keys
                if k in c.objects
            }

    def _enter(self, op: str, keys: list[str], all_ptrs: list[list[int]]) -> list[int] | None:
        """Record a data call; an injected fault for ``op`` answers every key with it."""
        self._check()
        self._cluster.calls.append((op, sum(len(p) for p in all_ptrs)))
        fault = self._cluster._take_fault(op)
        return None if fault is None else [fault] * len(keys)

    def _unregistered(self, op: str, key: str, ptrs: list[int], sizes: list[int]) -> bool:
        """Does the object name memory outside the registered regions (an RDMA failure)?"""
        outside = self.registered.uncovered(ptrs, sizes)
        if outside:
            self._cluster.unregistered_buffers += len(outside)
            logger.warning(
                "FakeStore %s %r: %d buffer(s) outside registered memory, first %#x (%d bytes)",
                op,
                key,
                len(outside),
                outside[0][0],
                outside[0][1],
            )
        return bool(outside)

    def batch_put_from_multi_buffers(
        self,
        keys: list[str],
        all_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        config: FakeReplicateConfig | None = None,
    ) -> list[int]:
        groups = list(getattr(config, "group_ids", None) or [])
        preferred = getattr(config, "preferred_segment", "") or ""
        faulted = self._enter("batch_put_from_multi_buffers", keys, all_ptrs)
        if faulted is not None:
            return faulted
        c = self._cluster
        out = []
        with c.lock:
            for index, (key, ptrs, sizes) in enumerate(
                zip(keys, all_ptrs, all_sizes, strict=False)
            ):
                total = sum(sizes)
                if not key or total <= 0 or any(s <= 0 for s in sizes):
                    out.append(int(ErrorCode.INVALID_PARAMS))
                    continue
                if self._unregistered("put", key, ptrs, sizes):
                    out.append(int(ErrorCode.TRANSFER_FAIL))
                    continue
                if key in c.objects:
                    out.append(0)
                    continue
                if c.used_bytes() + total > c.capacity_bytes:
                    out.append(int(ErrorCode.NO_AVAILABLE_HANDLE))
                    continue
                segment = c._place(key, preferred)
                if segment is None:
                    out.append(int(ErrorCode.TRANSFER_FAIL))
                    continue
                c.placement[key] = segment
                c.objects[key] = b"".join(
                    ctypes.string_at(p, s) for p, s in zip(ptrs, sizes, strict=False)
                )
                if index < len(groups):
                    c.groups[key] = groups[index]
                out.append(0)
        return out

    def batch_get_into_multi_buffers(
        self, keys: list[str], all_ptrs: list[list[int]], all_sizes: list[list[int]]
    ) -> list[int]:
        faulted = self._enter("batch_get_into_multi_buffers", keys, all_ptrs)
        if faulted is not None:
            return faulted
        out: list[int] = []
        c = self._cluster
        with c.lock:
            disk_codes = c._disk_codes(keys)
            for key, ptrs, sizes in zip(keys, all_ptrs, all_sizes, strict=False):
                value = c.objects.get(key)
                if value is None:
                    out.append(int(ErrorCode.OBJECT_NOT_FOUND))
                    continue
                if key in disk_codes:
                    out.append(disk_codes[key])
                    continue
                if c.placement.get(key) in c.dead:
                    out.append(int(ErrorCode.TRANSFER_FAIL))
                    continue
                # Measured on the real client: buffers too small for the
                # object are INVALID_PARAMS, too large a TRANSFER_FAIL.
                if sum(sizes) < len(value):
                    out.append(int(ErrorCode.INVALID_PARAMS))
                    continue
                if sum(sizes) > len(value) or self._unregistered("get", key, ptrs, sizes):
                    out.append(int(ErrorCode.TRANSFER_FAIL))
                    continue
                offset = 0
                for ptr, size in zip(ptrs, sizes, strict=False):
                    ctypes.memmove(ptr, value[offset : offset + size], size)
                    offset += size
                out.append(len(value))
        return out

    def remove(self, key: str, force: bool = False) -> int:
        self._check()
        fault = self._cluster._take_fault("remove")
        if fault is not None:
            return fault
        return 0 if self._cluster.drop(key) else int(ErrorCode.OBJECT_NOT_FOUND)

    def remove_all(self, force: bool = False) -> int:
        self._check()
        with self._cluster.lock:
            count = len(self._cluster.objects)
            self._cluster.objects.clear()
        return count

    def remove_by_regex(self, pattern: str, force: bool = False) -> int:
        self._check()
        regex = re.compile(pattern)
        with self._cluster.lock:
            doomed = [k for k in self._cluster.objects if regex.search(k)]
            for key in doomed:
                del self._cluster.objects[key]
        return len(doomed)

    def get_offload_rpc_read_count(self) -> int:
        return self._cluster.disk_reads

    def unmount_local_disk_segment(self, grace_period_seconds: int = 0) -> int:
        self._check()
        return 0

    def get_size(self, key: str) -> int:
        self._check()
        fault = self._cluster._take_fault("get_size")
        if fault is not None:
            return fault
        value = self._cluster.objects.get(key)
        return len(value) if value is not None else int(ErrorCode.OBJECT_NOT_FOUND)
