"""Byte budgets of the registered staging arena. Pure (no I/O).

Which free gap of the arena a lease takes, and how many objects fit in the bytes
a lease got. Why memory moves through the arena: docs/operating.md, "Registered memory".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mooncake_span.errors import InvalidRequestError

# Leases start on this boundary (a cache line): neighbours never share one.
LEASE_ALIGN_BYTES = 64


def align_up(nbytes: int, align_bytes: int = LEASE_ALIGN_BYTES) -> int:
    return -(-nbytes // align_bytes) * align_bytes


def largest_gap(leased: Iterable[tuple[int, int]], capacity_bytes: int) -> tuple[int, int]:
    """(offset, size) of the largest free aligned gap between ``leased``
    (offset, size) regions of an arena of ``capacity_bytes``; size 0 if none."""
    best = (0, 0)
    cursor = 0
    for offset, size in sorted(leased) + [(capacity_bytes, 0)]:
        if offset - cursor > best[1]:
            best = (cursor, offset - cursor)
        cursor = max(cursor, align_up(offset + size))
    return best


@dataclass(frozen=True)
class StagedPart:
    """One native call of a staged transfer: ``objects`` (positions in the
    transfer's object list) and the key ``rows`` they belong to; row ``rows[k]``
    sits at ``k * row_bytes`` in the lease."""

    objects: range
    rows: list[int]


def rows_left_bytes(row_of: Sequence[int], start: int, row_bytes: int) -> int:
    """Bytes the key rows of objects ``start..`` take (what a lease would want)."""
    return len(set(row_of[start:])) * row_bytes


def next_part(row_of: Sequence[int], start: int, lease_bytes: int, row_bytes: int) -> StagedPart:
    """The objects from ``start`` on whose rows fit in ``lease_bytes``.

    ``row_of`` is each object's key row, non-decreasing (objects are key-major,
    so all objects of a row are neighbours). The part holds whole rows only;
    a lease smaller than one row is a caller error."""
    capacity_rows = lease_bytes // row_bytes
    if capacity_rows < 1:
        raise InvalidRequestError(
            f"a {lease_bytes}-byte lease cannot hold one {row_bytes}-byte key row"
        )
    rows: list[int] = []
    end = start
    while end < len(row_of):
        row = row_of[end]
        if not rows or rows[-1] != row:
            if len(rows) == capacity_rows:
                break
            rows.append(row)
        end += 1
    return StagedPart(range(start, end), rows)
