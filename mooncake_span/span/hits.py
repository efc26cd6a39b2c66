"""Hit-prefix math for ``batch_exists_v2``. Pure.

Pages here are storage pages (keys); sglang multiplies by ``storage_page_size``
itself. The policies (the first two as in sglang 0.5.23's MooncakeStore):
docs/architecture.md, "Hit queries".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from mooncake_span.errors import InvalidRequestError
from mooncake_span.span.geometry import KV_POOL

ALL_PAGES = "all_pages"
TRAILING_PAGES = "trailing_pages"
BLOCK_GROUPS = "block_groups"


def leading_run(flags: Sequence[bool]) -> int:
    """Number of leading True values."""
    if all(flags):  # the common case, in one C-level pass
        return len(flags)
    return next(index for index, flag in enumerate(flags) if not flag)


@dataclass(frozen=True)
class PoolHitQuery:
    """One pool's existence flags for pages ``0..kv_pages-1`` plus its policy."""

    name: str
    policy: str
    page_exists: Sequence[bool]
    window_pages: int = 1
    block_pages: int = 0
    group_pages: int = 0

    def __post_init__(self) -> None:
        if self.policy not in (ALL_PAGES, TRAILING_PAGES, BLOCK_GROUPS):
            raise InvalidRequestError(f"pool {self.name!r}: unsupported hit policy {self.policy!r}")


@dataclass(frozen=True)
class HitResult:
    kv_hit_pages: int
    pool_hit_pages: dict[str, int]
    restorable_prefix_pages: list[int]


def trailing_restorable(page_exists: Sequence[bool], window_pages: int) -> list[int]:
    """Stop points L (1-based) whose window ``[L-n, L)`` exists entirely."""
    window = max(1, window_pages)
    # missing[i]: missing pages before page i, so each window is checked in O(1)
    missing = [0, *accumulate(0 if exists else 1 for exists in page_exists)]
    return [
        stop
        for stop in range(1, len(page_exists) + 1)
        if missing[stop] == missing[max(0, stop - window)]
    ]


def block_group_pages(page_exists: Sequence[bool], block_pages: int, group_pages: int) -> int:
    """Pages covered by the leading complete groups.

    Groups of ``group_pages`` keys start at every block boundary (a block is
    ``block_pages`` pages; 0 means no block boundaries) and a block's last group
    may be shorter. A group cut short by the end of the query is not whole and
    does not count.
    """
    total = len(page_exists)
    group = max(1, group_pages)
    block = block_pages if block_pages > 0 else total + group
    covered = 0
    for block_start in range(0, total, block):
        block_end = block_start + block
        for start in range(block_start, block_end, group):
            end = min(start + group, block_end)
            if end > total or not all(page_exists[start:end]):
                return covered
            covered = end
    return covered


def compute_hits(kv_pages: int, pools: Sequence[PoolHitQuery]) -> HitResult:
    hits: dict[str, int] = {KV_POOL: kv_pages} if kv_pages else {}
    restorable = list(range(1, kv_pages + 1))
    for pool in pools:
        if not restorable:
            break
        exists = list(pool.page_exists[:kv_pages])
        exists += [False] * (kv_pages - len(exists))
        if pool.policy == ALL_PAGES:
            boundary = leading_run(exists)
            allowed = set(range(1, boundary + 1))
        elif pool.policy == TRAILING_PAGES:
            stops = trailing_restorable(exists, pool.window_pages)
            boundary = stops[-1] if stops else 0
            allowed = set(stops)
        else:
            boundary = block_group_pages(exists, pool.block_pages, pool.group_pages)
            allowed = None
        if boundary:
            hits[pool.name] = boundary
        if allowed is not None:
            restorable = [stop for stop in restorable if stop in allowed]
    return HitResult(
        kv_hit_pages=restorable[-1] if restorable else 0,
        pool_hit_pages=hits,
        restorable_prefix_pages=restorable,
    )
