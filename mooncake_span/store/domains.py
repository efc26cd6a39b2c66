"""Failure domains: where a storage key's objects go. Pure: no state, no I/O (the
caller supplies the segment list).

A failure domain is one Mooncake segment (one storage-node process). Segments are
ranked per domain key by rendezvous hashing; ``ChainSpot`` gives a prefix chain's
keys its root's domain and a step. Why: docs/reliability.md, "What the backend
does" (co-location) and "Placement by prefix chain". The marks: ``router.py``.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# Rendezvous weights: w(domain, segment) = mix(crc32(domain) * _GOLDEN ^ seed(segment)),
# with seed a 64-bit hash of the segment name and mix one xorshift-multiply
# round (odd multiplier: a bijection that carries every bit into the high
# ones, which decide the comparison). One C-level hash per domain and a few
# numpy passes over (domains x segments): ranking a 128-key put over 32
# segments with one keyed hash per pair cost 6.8 ms of Python.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX = np.uint64(0xBF58476D1CE4E5B9)
_SEEDS: dict[str, np.uint64] = {}
_MAX_SEEDS = 4096


def _seed(segment: str) -> np.uint64:
    seed = _SEEDS.get(segment)
    if seed is None:
        digest = hashlib.blake2b(segment.encode("utf-8", "surrogatepass"), digest_size=8)
        seed = np.uint64(int.from_bytes(digest.digest(), "big"))
        if len(_SEEDS) < _MAX_SEEDS:  # segment names are few; never grow without bound
            _SEEDS[segment] = seed
    return seed


def segment_weights(domain_keys: Sequence[str], segments: Sequence[str]) -> np.ndarray:
    """(len(domain_keys), len(segments)) uint64 weights; higher is preferred.

    Deterministic across processes: it depends only on the strings."""
    hashes = np.fromiter(
        (zlib.crc32(d.encode("utf-8", "surrogatepass")) for d in domain_keys),
        dtype=np.uint64,
        count=len(domain_keys),
    )
    seeds = np.array([_seed(s) for s in segments], dtype=np.uint64)
    x = (hashes * _GOLDEN)[:, None] ^ seeds[None, :]
    x ^= x >> np.uint64(31)
    x *= _MIX
    return x


def rankings(
    domain_keys: Sequence[str], segments: Sequence[str], steps: Sequence[int] | None = None
) -> np.ndarray:
    """Per domain, indices into ``segments`` from most to least preferred; with
    ``steps``, row i is rotated left by ``steps[i]`` (mod the segment count), so
    it starts at the segment its chain window sits on."""
    order = np.argsort(segment_weights(domain_keys, segments), axis=1, kind="stable")[:, ::-1]
    if steps is None or not len(order):
        return order
    shift = np.asarray(steps, dtype=np.int64) % len(segments)
    if not shift.any():
        return order
    columns = (np.arange(len(segments))[None, :] + shift[:, None]) % len(segments)
    return np.take_along_axis(order, columns, axis=1)


@dataclass(frozen=True)
class ChainSpot:
    """A run of consecutive keys of one prefix chain: its root's domain, the chain
    position of the run's first key, the window (keys the root's segment holds
    first) and the stripe (keys per step past it). All follow from the chain itself,
    so every caller computes the same step for a key."""

    domain: str
    start: int
    window_keys: int
    stripe_keys: int = 0  # 0: the window's (one step per window)

    def __post_init__(self) -> None:
        if self.start < 0:
            raise ValueError(f"a chain position is >= 0, got {self.start}")
        if self.window_keys < 1:
            raise ValueError(f"a chain window is >= 1 key, got {self.window_keys}")
        if self.stripe_keys < 0:
            raise ValueError(f"a chain stripe is >= 1 key (0: the window), got {self.stripe_keys}")

    def step_of(self, position: int) -> int:
        """The chain step of the key at ``position``: 0 in the first window, then one
        more every stripe."""
        window = self.window_keys
        if position < window:
            return 0
        return 1 + (position - window) // (self.stripe_keys or window)

    def objects(self, rows: Sequence[int], per_key: int) -> tuple[list[str], list[int]]:
        """Domains and steps of ``per_key`` objects for each key ``rows[i]`` of the run."""
        start, step_of = self.start, self.step_of
        if per_key == 1:
            steps = [step_of(start + row) for row in rows]
        else:
            steps = [step for row in rows for step in [step_of(start + row)] * per_key]
        return [self.domain] * len(steps), steps


# Copy r >= 1 of an object (span_replica_num > 1 with placement) is stored under
# its own key, so that a reader can pick the copy on a live segment.
COPY_SEPARATOR = "~c"


def copy_key(key: str, copy: int) -> str:
    return key if copy == 0 else f"{key}{COPY_SEPARATOR}{copy}"


def copy_candidates(
    keys: Sequence[str],
    domains: Sequence[str] | None,
    segments: Sequence[str],
    copies: int,
    steps: Sequence[int] | None = None,
) -> list[list[tuple[str, str]]]:
    """Per key, its copies as (object key, segment placement chose for it), in
    copy order ("" when there are fewer segments than copies).
    ``domains`` (default: the keys) is the placement key of each key, ``steps``
    (default: 0) its chain step."""
    if not segments:
        return [[(copy_key(key, r), "") for r in range(copies)] for key in keys]
    order = rankings(domains if domains else keys, segments, steps)[:, :copies].tolist()
    return [
        [(copy_key(key, r), segments[row[r]] if r < len(row) else "") for r in range(copies)]
        for key, row in zip(keys, order, strict=True)
    ]


def suspect_copies(rows: Sequence[Sequence[tuple[str, str]]], bad: frozenset[str]) -> list[str]:
    """Object keys placed on a bad segment, or placed by Mooncake (segment ""):
    while some segment is bad, where they really are must be asked."""
    return [obj for row in rows for obj, segment in row if not segment or segment in bad]


def live_copies(
    rows: Sequence[Sequence[tuple[str, str]]], bad: frozenset[str], located: Mapping[str, set[str]]
) -> list[list[str]]:
    """Per key, the copies worth a transfer, in copy order: those placed on a healthy
    segment, and suspect ones the master ``located`` on one (a fallback write, or
    Mooncake's placement). An empty row: every copy is in a bad failure domain."""
    return [
        [
            obj
            for obj, segment in row
            if (segment and segment not in bad) or any(s not in bad for s in located.get(obj, ()))
        ]
        for row in rows
    ]


def put_targets(
    keys: Sequence[str],
    domains: Sequence[str] | None,
    segments: Sequence[str],
    copies: int,
    bad: frozenset[str],
    steps: Sequence[int] | None = None,
) -> dict[str, list[tuple[int, str]]]:
    """Segment -> [(index into keys, object key)] to write there ("" = let Mooncake place).

    Copy r goes to the r-th ranked segment (counted from the key's chain step,
    ``steps``); a copy whose segment is bad moves to the next live segment no
    other copy of the key uses, so a node that died costs new writes nothing
    once it is known bad."""
    if not segments:
        # No segment directory: Mooncake places every copy, whatever the domain
        # (callers may pass no domains then: computing them costs per object).
        return {"": [(i, copy_key(k, r)) for i, k in enumerate(keys) for r in range(copies)]}
    order = rankings(domains if domains else keys, segments, steps).tolist()
    out: dict[str, list[tuple[int, str]]] = {}
    for i, (key, row) in enumerate(zip(keys, order, strict=True)):
        ranking = [segments[j] for j in row]
        chosen = ranking[:copies]
        spare = [s for s in ranking[copies:] if s not in bad]
        for r in range(copies):
            segment = chosen[r] if r < len(chosen) else ""
            if segment in bad:
                segment = spare.pop(0) if spare else ""
            out.setdefault(segment, []).append((i, copy_key(key, r)))
    return out
