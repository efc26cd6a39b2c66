"""Pointer planning: which host bytes make up each span object. Pure (numpy, no I/O).

A host pool exposes, per host page, ``B`` buffers ("slots": one per layer for
layer_first, one per component for page_first, ...). Each storage key covers K
pages and is stored as one object per component. The canonical byte order of
an object is **slot-major, page-minor**: for every slot of the component (in
sglang's pointer order), the K pages of the key in token order::

    object(key, c) = concat_{b in slots(c)} concat_{j < K} bytes(page_j, b)

With one slot per page (page_first MLA, the DSA indexer, each MHA/Mamba
component) this is exactly "the K host pages concatenated in token order". With
layer_first it puts each layer's K pages next to each other, so K consecutive
host pages coalesce into one buffer per layer: at most L pointers per key
instead of K*L. The order depends only on the pool's layout (which is part of
the key prefix), never on where the pages sit in host memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mooncake_span.errors import GeometryError


@dataclass(frozen=True)
class PageLayout:
    """Affine address model of one host pool: ``ptr(page, b) = base[b] + page * stride[b]``.

    ``components`` lists, per stored component, the slots that belong to it in
    pointer order. Zero-byte slots are left out of every component (Mooncake
    rejects 0-byte buffers and objects).
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

    @property
    def flat_page_bytes(self) -> int:
        """Bytes of one host page over all stored components (sglang's flat page)."""
        return sum(self.page_bytes(c) for c in range(len(self.components)))

    def pointer_matrix(self, pages: np.ndarray) -> np.ndarray:
        """int64 pointers, shape ``pages.shape + (B,)``."""
        base = np.asarray(self.base_ptrs, dtype=np.int64)
        stride = np.asarray(self.page_stride_bytes, dtype=np.int64)
        return base + pages[..., None].astype(np.int64) * stride


@dataclass
class ObjectPlan:
    """Buffers of one object, in canonical order, after coalescing."""

    ptrs: list[int]
    sizes: list[int]

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


def _coalesce_rows(ptrs: np.ndarray, sizes: np.ndarray) -> list[ObjectPlan]:
    """Merge buffers whose bytes are adjacent in memory, row by row.

    ``ptrs`` is (rows, m); ``sizes`` is (m,) and shared by every row. Plans
    share one sizes list where they can: nothing mutates them.
    """
    size_list = sizes.tolist()
    if ptrs.shape[1] == 1:
        return [ObjectPlan([p], size_list) for p in ptrs[:, 0].tolist()]
    joins = ptrs[:, :-1] + sizes[:-1] == ptrs[:, 1:]
    row_joins = joins.any(axis=1)
    if not row_joins.any():
        return [ObjectPlan(row, size_list) for row in ptrs.tolist()]
    if joins.all():
        # every row is one contiguous run (consecutive host pages)
        total = [int(sizes.sum())]
        return [ObjectPlan([p], total) for p in ptrs[:, 0].tolist()]
    csum = np.concatenate(([0], np.cumsum(sizes)))
    plans = []
    for index, (row, has_join) in enumerate(zip(ptrs.tolist(), row_joins.tolist(), strict=False)):
        if not has_join:
            plans.append(ObjectPlan(row, size_list))
            continue
        starts = np.flatnonzero(np.concatenate(([True], ~joins[index])))
        ends = np.concatenate((starts[1:], [len(sizes)]))
        plans.append(ObjectPlan(ptrs[index, starts].tolist(), (csum[ends] - csum[starts]).tolist()))
    return plans


def plan_objects(layout: PageLayout, key_pages: np.ndarray) -> list[ObjectPlan]:
    """Object buffers for keys whose host pages are ``key_pages`` (shape (n_keys, K)).

    Returns key-major, component-minor plans, matching ``KeySchema.object_keys``.
    """
    if key_pages.ndim != 2 or key_pages.shape[1] < 1:
        raise GeometryError(f"key_pages must be (n_keys, K>=1), got shape {key_pages.shape}")
    n_keys, pages_per_key = key_pages.shape
    if n_keys == 0:
        return []
    if key_pages.min() < 0 or key_pages.max() >= layout.num_pages:
        raise GeometryError(
            f"host page index out of range: got [{int(key_pages.min())}, "
            f"{int(key_pages.max())}], pool has {layout.num_pages} pages"
        )
    matrix = layout.pointer_matrix(key_pages)  # (n, K, B)
    slot_bytes = np.asarray(layout.slot_bytes, dtype=np.int64)
    per_component = []
    for slots in layout.components:
        sub = matrix[:, :, list(slots)]  # (n, K, Bc)
        rows = np.ascontiguousarray(sub.transpose(0, 2, 1)).reshape(n_keys, -1)
        sizes = np.repeat(slot_bytes[list(slots)], pages_per_key)
        per_component.append(_coalesce_rows(rows, sizes))
    return [per_component[c][i] for i in range(n_keys) for c in range(len(layout.components))]


def flat_page_offsets(layout: PageLayout) -> list[list[int]]:
    """Byte offset of every component slot inside sglang's flat page.

    sglang's ``get_data_page(flat=True)`` is the concatenation, component by
    component, of that component's slot bytes in pointer order; the generic
    (non zero-copy) path uses these offsets to address a flat K-page tensor.
    """
    offsets = []
    cursor = 0
    for slots in layout.components:
        comp = []
        for b in slots:
            comp.append(cursor)
            cursor += layout.slot_bytes[b]
        offsets.append(comp)
    return offsets


def plan_objects_from_flat(
    layout: PageLayout, base_ptrs: Sequence[int], pages_per_key: int
) -> list[ObjectPlan]:
    """Object buffers inside flat tensors holding K consecutive flat pages per key."""
    offsets = flat_page_offsets(layout)
    flat_page = layout.flat_page_bytes
    plans = []
    for base in base_ptrs:
        for c, slots in enumerate(layout.components):
            ptrs = [base + j * flat_page + off for off in offsets[c] for j in range(pages_per_key)]
            sizes = [layout.slot_bytes[b] for b in slots for _ in range(pages_per_key)]
            plans.append(_coalesce_rows(np.asarray([ptrs], dtype=np.int64), np.asarray(sizes))[0])
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
            start, running = index, 0
        running += count
    if start < len(buffer_counts):
        calls.append(range(start, len(buffer_counts)))
    return calls


def dedup_rounds(keys: Sequence[str]) -> list[list[int]]:
    """Positions grouped so that no round repeats a key.

    Mooncake's multi-buffer get leaves a buffer unwritten (while reporting
    success) when one batch names a key twice; each round is one call.
    """
    seen: dict[str, int] = {}
    rounds: list[list[int]] = []
    for index, key in enumerate(keys):
        occurrence = seen.get(key, 0)
        seen[key] = occurrence + 1
        if occurrence == len(rounds):
            rounds.append([])
        rounds[occurrence].append(index)
    return rounds
