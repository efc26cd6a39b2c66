"""Pointer planning: which host bytes make up each span object. Pure (numpy, no I/O).

One object per storage key and component, its K pages' buffers ("slots") in
**slot-major, page-minor** order (why: docs/span-format.md, "Rules")::

    object(key, c) = concat_{b in slots(c)} concat_{j < K} bytes(page_j, b)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache, cached_property

import numpy as np

from mooncake_span.errors import GeometryError, InvalidRequestError


@dataclass(frozen=True)
class PageLayout:
    """Affine address model of one host pool: ``ptr(page, b) = base[b] + page * stride[b]``.

    ``components``: per stored component, its slots in pointer order, never a
    zero-byte one (Mooncake rejects 0-byte buffers and objects).
    """

    base_ptrs: tuple[int, ...]
    page_stride_bytes: tuple[int, ...]
    slot_bytes: tuple[int, ...]
    components: tuple[tuple[int, ...], ...]
    num_pages: int

    def __post_init__(self) -> None:
        n = len(self.base_ptrs)
        if not (n == len(self.page_stride_bytes) == len(self.slot_bytes)) or n == 0:
            raise GeometryError("PageLayout needs the same number (>0) of bases, strides and sizes")
        for comp in self.components:
            if not comp:
                raise GeometryError("PageLayout component without slots")
            for slot in comp:
                if not 0 <= slot < n or self.slot_bytes[slot] <= 0:
                    raise GeometryError(f"PageLayout slot {slot} is out of range or empty")

    def page_bytes(self, component: int) -> int:
        return sum(self.slot_bytes[b] for b in self.components[component])

    @cached_property
    def flat_page_bytes(self) -> int:
        """Bytes of one host page over all stored components (sglang's flat page)."""
        return sum(self.page_bytes(c) for c in range(len(self.components)))

    @cached_property
    def tables(self) -> tuple[_ComponentTable, ...]:
        base = np.asarray(self.base_ptrs, dtype=np.int64)[:, None]
        stride = np.asarray(self.page_stride_bytes, dtype=np.int64)[:, None]
        sizes = np.asarray(self.slot_bytes, dtype=np.int64)
        picks = [list(slots) for slots in self.components]
        return tuple(_ComponentTable(base[p], stride[p], sizes[p]) for p in picks)


@dataclass(frozen=True)
class _ComponentTable:
    base: np.ndarray  # (Bc, 1) int64
    stride: np.ndarray  # (Bc, 1) int64
    slot_sizes: np.ndarray  # (Bc,) int64

    def rows(self, key_pages: np.ndarray) -> np.ndarray:
        """(n_keys, Bc*K) pointers in canonical slot-major, page-minor order."""
        n = key_pages.shape[0]
        return (self.base + key_pages[:, None, :] * self.stride).reshape(n, -1)

    def sizes(self, pages_per_key: int) -> _RowSizes:
        """Buffer sizes of one uncoalesced row for K pages per key, built once per K."""
        cache = self.__dict__.setdefault("_sizes", {})
        row = cache.get(pages_per_key)
        if row is None:
            array = np.repeat(self.slot_sizes, pages_per_key)
            row = cache[pages_per_key] = _RowSizes(array, array.tolist(), int(array.sum()))
        return row


@dataclass(frozen=True)
class _RowSizes:
    array: np.ndarray  # (m,) int64
    values: list[int]  # the same, shared by every uncoalesced row; never mutated
    total: int


@dataclass
class ObjectPlan:
    """Buffers of one object, in canonical order, after coalescing."""

    ptrs: list[int]
    sizes: list[int]


@dataclass
class PlanBatch:
    """Buffers of many objects, column-wise: the lists Mooncake's batch calls take.

    Rows of ``sizes`` may be one shared list object (many objects with the
    same buffer sizes); nothing mutates them.
    """

    ptrs: list[list[int]]
    sizes: list[list[int]]
    nbytes: list[int]

    def __len__(self) -> int:
        return len(self.ptrs)

    @classmethod
    def of(cls, plans: Sequence[ObjectPlan] | PlanBatch) -> PlanBatch:
        """The columns of ``plans``, without a copy when they already are a PlanBatch."""
        if isinstance(plans, PlanBatch):
            return plans
        return cls([p.ptrs for p in plans], [p.sizes for p in plans], [sum(p.sizes) for p in plans])

    @classmethod
    def concat(cls, batches: Sequence[PlanBatch]) -> PlanBatch:
        if len(batches) == 1:
            return batches[0]
        out = cls([], [], [])
        for batch in batches:
            out.ptrs += batch.ptrs
            out.sizes += batch.sizes
            out.nbytes += batch.nbytes
        return out

    def part(self, span: range) -> PlanBatch:
        """Objects ``span.start .. span.stop - 1``; the batch itself when that is all."""
        if span.start == 0 and span.stop == len(self.ptrs):
            return self
        cut = slice(span.start, span.stop)
        return PlanBatch(self.ptrs[cut], self.sizes[cut], self.nbytes[cut])

    def take(self, index: Sequence[int]) -> PlanBatch:
        ptrs, sizes, nbytes = self.ptrs, self.sizes, self.nbytes
        return PlanBatch(
            [ptrs[i] for i in index], [sizes[i] for i in index], [nbytes[i] for i in index]
        )

    def plans(self) -> list[ObjectPlan]:
        return [ObjectPlan(p, s) for p, s in zip(self.ptrs, self.sizes, strict=True)]


# Rows this short merge faster in a Python loop than through numpy calls.
_PY_MERGE_MAX_BUFFERS = 32


def _coalesce(rows: np.ndarray, sizes: _RowSizes) -> PlanBatch:
    """Merge buffers whose bytes are adjacent in memory, row by row: ``rows`` is (n, m)
    pointers, ``sizes`` the uncoalesced row's buffer sizes, shared by every row."""
    size_list = sizes.values
    total = sizes.total
    n, m = rows.shape
    joins = rows[:, :-1] + sizes.array[:-1] == rows[:, 1:] if m > 1 else None
    if joins is not None and joins.all():
        # every row is one contiguous run (consecutive host pages)
        return PlanBatch(rows[:, :1].tolist(), [[total]] * n, [total] * n)
    ptr_rows = rows.tolist()
    out = PlanBatch(ptr_rows, [size_list] * n, [total] * n)
    if joins is None or not joins.any():
        return out
    joined_rows = np.flatnonzero(joins.any(axis=1)).tolist()
    if m <= _PY_MERGE_MAX_BUFFERS:
        for index in joined_rows:
            out.ptrs[index], out.sizes[index] = _merge(ptr_rows[index], size_list)
        return out
    csum = np.concatenate(([0], np.cumsum(sizes.array)))
    for index in joined_rows:
        starts = np.flatnonzero(np.concatenate(([True], ~joins[index])))
        ends = np.concatenate((starts[1:], [m]))
        out.ptrs[index] = rows[index, starts].tolist()
        out.sizes[index] = (csum[ends] - csum[starts]).tolist()
    return out


def _merge(ptrs: list[int], sizes: list[int]) -> tuple[list[int], list[int]]:
    """One row's buffers with every buffer that starts where the previous ends merged in."""
    out_ptrs = [ptrs[0]]
    out_sizes = [sizes[0]]
    for ptr, size in zip(ptrs[1:], sizes[1:], strict=True):
        if out_ptrs[-1] + out_sizes[-1] == ptr:
            out_sizes[-1] += size
        else:
            out_ptrs.append(ptr)
            out_sizes.append(size)
    return out_ptrs, out_sizes


def pages_of_slots(slots: np.ndarray, page_tokens: int) -> np.ndarray:
    """Host page numbers of token ``slots`` that list whole pages, page after page, in a
    fixed number of array operations; InvalidRequestError unless every run of
    ``page_tokens`` slots is exactly ``page * page_tokens + 0 .. page_tokens - 1``."""
    if slots.ndim != 1 or slots.size == 0 or slots.size % page_tokens:
        raise InvalidRequestError(
            f"{slots.size} host slots are not whole {page_tokens}-slot host pages"
        )
    by_page = slots.reshape(-1, page_tokens)
    starts = by_page[:, 0]
    if page_tokens > 1 and not (by_page - starts[:, None] == _arange(page_tokens)).all():
        raise InvalidRequestError(f"host slots are not whole {page_tokens}-slot host pages")
    pages, misaligned = np.divmod(starts, page_tokens)
    if misaligned.any():
        raise InvalidRequestError(
            f"host slots are not whole {page_tokens}-slot host pages "
            "(a page starts off its boundary)"
        )
    return pages


@cache
def _arange(n: int) -> np.ndarray:
    return np.arange(n)


def plan_batch(layout: PageLayout, key_pages: np.ndarray) -> PlanBatch:
    """Object buffers for keys whose host pages are ``key_pages`` (shape (n_keys, K),
    every page inside the pool: the caller checks), key-major, component-minor like
    ``KeySchema.object_keys``, one broadcast per component."""
    n_keys, pages_per_key = key_pages.shape
    if n_keys == 0:
        return PlanBatch([], [], [])
    pages = key_pages.astype(np.int64, copy=False)
    parts = [_coalesce(table.rows(pages), table.sizes(pages_per_key)) for table in layout.tables]
    if len(parts) == 1:
        return parts[0]
    # interleave: key 0's components, then key 1's ...
    return PlanBatch(
        [row for rows in zip(*(p.ptrs for p in parts), strict=True) for row in rows],
        [row for rows in zip(*(p.sizes for p in parts), strict=True) for row in rows],
        [v for vals in zip(*(p.nbytes for p in parts), strict=True) for v in vals],
    )


def plan_objects_from_flat(
    layout: PageLayout, base_ptrs: Sequence[int], pages_per_key: int
) -> list[ObjectPlan]:
    """Object buffers inside flat tensors holding K consecutive flat pages per key. A flat
    page (sglang's ``get_data_page(flat=True)``) concatenates the components' slot bytes
    in order."""
    flat_page = layout.flat_page_bytes
    plans = []
    for base in map(int, base_ptrs):
        ptr = base  # where the next slot's bytes start in the key's first flat page
        for slots in layout.components:
            ptrs: list[int] = []
            sizes: list[int] = []
            for b in slots:
                ptrs += [ptr + j * flat_page for j in range(pages_per_key)]
                sizes += [layout.slot_bytes[b]] * pages_per_key
                ptr += layout.slot_bytes[b]
            plans.append(ObjectPlan(*_merge(ptrs, sizes)))
    return plans


def split_calls(buffer_counts: Sequence[int], max_buffers_per_call: int) -> list[range]:
    """Cut a list of objects into consecutive calls of at most ``max_buffers_per_call``
    buffers each (an object larger than the budget travels alone)."""
    calls = []
    start = 0
    running = 0
    for index, count in enumerate(buffer_counts):
        if index > start and running + count > max_buffers_per_call:
            calls.append(range(start, index))
            start = index
            running = 0
        running += count
    if start < len(buffer_counts):
        calls.append(range(start, len(buffer_counts)))
    return calls


def dedup_rounds(keys: Sequence[str]) -> list[list[int]]:
    """Positions grouped so that no round (one call) repeats a key: Mooncake's
    multi-buffer get leaves a buffer unwritten, yet reports success, when one batch
    names a key twice."""
    seen: dict[str, int] = {}
    rounds: list[list[int]] = []
    for index, key in enumerate(keys):
        occurrence = seen.get(key, 0)
        seen[key] = occurrence + 1
        if occurrence == len(rounds):
            rounds.append([])
        rounds[occurrence].append(index)
    return rounds
