"""Object seals: a checksum stored with each object's bytes (``span_object_checksums``).

Mooncake's CRC-64 lives only in the master's memory and is gone after a restart;
a seal is part of the object, so any reader can check it after any restart.
Format and arena: docs/span-format.md, "Sealed objects"; why: docs/reliability.md,
"Integrity across restarts".
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partialmethod

from mooncake_span.errors import ErrorCode, InvalidRequestError
from mooncake_span.span.plan import PlanBatch
from mooncake_span.store.arena import StagingArena

try:
    import xxhash
except ImportError:  # reported when the option is used (TrailerArena)
    xxhash = None

SEAL_FORMAT = "xxh3-64-trailer-v1"
# The layout guard's name for objects without a trailer.
PLAIN_FORMAT = "plain"
TRAILER_MAGIC = b"msSEAL01"
TRAILER_BYTES = 16
# Per object in the arena: the trailer (or receiving slot), then the key seed.
_SLOT_BYTES = 32
_TRAILER = struct.Struct("<8sQ")
_READ_SLOT = struct.Struct("<8sQQ")
# A put's slot (the trailer, padding) and a get's (a zeroed trailer, since Mooncake can
# report success for a buffer it never wrote; the key seed; padding).
_PUT_SLOT = struct.Struct("<8sQ16x")
_GET_SLOT = struct.Struct("<16xQ8x")
DEFAULT_ARENA_BYTES = 8 << 20
# What a get whose bytes failed their seal reads as (store/integrity.py removes it).
MISMATCH = int(ErrorCode.SEAL_MISMATCH)


def key_seed(key: str) -> int:
    return xxhash.xxh3_64_intdigest(key.encode("utf-8", "surrogatepass"))


def payload_digest(seed: int, ptrs: Sequence[int], sizes: Sequence[int]) -> int:
    """XXH3-64 of the bytes at ``ptrs``/``sizes`` in order, read in place."""
    if len(ptrs) == 1:
        return xxhash.xxh3_64_intdigest((ctypes.c_char * sizes[0]).from_address(ptrs[0]), seed)
    state = xxhash.xxh3_64(seed=seed)
    for ptr, size in zip(ptrs, sizes, strict=True):
        state.update((ctypes.c_char * size).from_address(ptr))
    return state.intdigest()


def trailer_bytes(key: str, payload: bytes) -> bytes:
    """The trailer of ``payload`` stored under ``key`` (for tools and tests)."""
    digest = xxhash.xxh3_64_intdigest(payload, key_seed(key))
    return _TRAILER.pack(TRAILER_MAGIC, digest)


def check_stored(key: str, stored: bytes) -> bool | None:
    """Whether a stored object's bytes (payload + trailer) match their seal; None
    when they carry none (an unsealed object, or one whose magic was hit)."""
    if len(stored) < TRAILER_BYTES or stored[-TRAILER_BYTES:-8] != TRAILER_MAGIC:
        return None
    return stored[-TRAILER_BYTES:] == trailer_bytes(key, stored[:-TRAILER_BYTES])


def _with_trailers(batch: PlanBatch, base_ptr: int) -> PlanBatch:
    ptrs = [[*row, base_ptr + i * _SLOT_BYTES] for i, row in enumerate(batch.ptrs)]
    # Rows that share one size list (plan_batch's) share the extended one too.
    extended: dict[int, list[int]] = {}
    sizes = [
        extended.get(id(row)) or extended.setdefault(id(row), [*row, TRAILER_BYTES])
        for row in batch.sizes
    ]
    return PlanBatch(ptrs, sizes, [n + TRAILER_BYTES for n in batch.nbytes])


class TrailerArena:
    """Registered slots for the trailers of the calls in flight, and the seal itself."""

    def __init__(self, register: Callable[[int, int], None], timeout_s: float) -> None:
        if xxhash is None:
            raise InvalidRequestError(
                "span_object_checksums needs the xxhash package: pip install xxhash "
                "(or mooncake-span[cpu] / [cuda], which include it)"
            )
        self._arena = StagingArena(DEFAULT_ARENA_BYTES, register, timeout_s)
        self._base = self._arena.base_ptr
        self._end = self._base + DEFAULT_ARENA_BYTES

    @contextmanager
    def _with_slots(self, keys: Sequence[str], batch: PlanBatch, put: bool) -> Iterator[PlanBatch]:
        """``batch`` with each object's trailer appended, for one put (``writing``), or
        with a receiving slot per object, for one get that ``verify`` checks (``reading``)."""
        need = len(batch) * _SLOT_BYTES
        if not need:
            yield batch
            return
        # The slots built in one pass: writing each into the arena on its own cost more
        # than hashing its 64 KiB.
        seeds = map(key_seed, keys)
        if put:
            digests = map(payload_digest, seeds, batch.ptrs, batch.sizes)
            slots = b"".join(_PUT_SLOT.pack(TRAILER_MAGIC, d) for d in digests)
        else:
            slots = b"".join(map(_GET_SLOT.pack, seeds))
        with self._arena.lease(need, need) as lease:
            ctypes.memmove(lease.ptr, slots, need)
            yield _with_trailers(batch, lease.ptr)

    writing = partialmethod(_with_slots, put=True)
    reading = partialmethod(_with_slots, put=False)

    def verify(self, batch: PlanBatch, codes: list[int]) -> list[int]:
        """``codes`` of one native get of ``batch``, with every complete read whose
        bytes fail their seal turned into ``MISMATCH``. Rows without a slot of this
        arena (an unsealed call) are left as they are."""
        out = codes
        memory = self._arena.memory
        for i, (ptrs, sizes, nbytes) in enumerate(
            zip(batch.ptrs, batch.sizes, batch.nbytes, strict=True)
        ):
            slot = ptrs[-1]
            if codes[i] != nbytes or not self._base <= slot < self._end:
                continue
            magic, stored, seed = _READ_SLOT.unpack_from(memory, slot - self._base)
            if magic != TRAILER_MAGIC or stored != payload_digest(seed, ptrs[:-1], sizes[:-1]):
                if out is codes:
                    out = list(codes)
                out[i] = MISMATCH
        return out
