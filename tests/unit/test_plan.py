"""Pointer planning (mooncake_span.span.plan) against naive, independently written references.

The references build every object buffer by hand with plain loops -- one
``(ptr, size)`` per (slot, page) in slot-major/page-minor order -- and merge
neighbours that touch in memory. Byte contents are checked on real memory: the
host pool is a numpy arena, ``ctypes.string_at`` gathers what a plan points to,
and the expectation is sliced out of the arena with ordinary indexing.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_span.errors import GeometryError, InvalidRequestError
from mooncake_span.span.plan import (
    ObjectPlan,
    PageLayout,
    PlanBatch,
    dedup_rounds,
    pages_of_slots,
    plan_batch,
    plan_objects_from_flat,
    split_calls,
)


def plan_objects(layout: PageLayout, key_pages: np.ndarray) -> list[ObjectPlan]:
    """``plan_batch`` as one ``ObjectPlan`` per object."""
    return plan_batch(layout, key_pages).plans()


# ---------------------------------------------------------------------------
# Host pools on real memory


@dataclass
class HostPool:
    """A PageLayout whose pointers land inside ``arena`` (kept alive here)."""

    arena: np.ndarray
    layout: PageLayout

    def offset(self, page: int, slot: int) -> int:
        """Arena offset of (page, slot), computed from the layout's own affine rule."""
        return (
            self.layout.base_ptrs[slot]
            - self.arena.ctypes.data
            + page * self.layout.page_stride_bytes[slot]
        )

    def slot_bytes(self, page: int, slot: int) -> bytes:
        start = self.offset(page, slot)
        return self.arena[start : start + self.layout.slot_bytes[slot]].tobytes()


def _random_arena(nbytes: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


def layer_first_pool(
    num_layers: int,
    num_pages: int,
    slot_size: int,
    *,
    components: tuple[tuple[int, ...], ...] | None = None,
    gap: int = 64,
    seed: int = 0,
) -> HostPool:
    """One region per layer; page stride == slot size, regions separated by ``gap``.

    The gap keeps the last page of layer b from touching the first page of
    layer b+1, so coalescing across slots cannot happen by accident.
    """
    region = num_pages * slot_size
    arena = _random_arena(num_layers * (region + gap) + gap, seed)
    base = arena.ctypes.data
    bases = tuple(base + gap + b * (region + gap) for b in range(num_layers))
    layout = PageLayout(
        base_ptrs=bases,
        page_stride_bytes=(slot_size,) * num_layers,
        slot_bytes=(slot_size,) * num_layers,
        components=components or (tuple(range(num_layers)),),
        num_pages=num_pages,
    )
    return HostPool(arena, layout)


def page_first_pool(
    slot_sizes: tuple[int, ...],
    num_pages: int,
    *,
    components: tuple[tuple[int, ...], ...] | None = None,
    seed: int = 0,
) -> HostPool:
    """All slots of a page side by side; page stride == sum of slot sizes."""
    page = sum(slot_sizes)
    arena = _random_arena(num_pages * page, seed)
    base = arena.ctypes.data
    offsets = np.concatenate(([0], np.cumsum(slot_sizes)[:-1])).tolist()
    layout = PageLayout(
        base_ptrs=tuple(base + int(o) for o in offsets),
        page_stride_bytes=(page,) * len(slot_sizes),
        slot_bytes=tuple(slot_sizes),
        components=components or (tuple(range(len(slot_sizes))),),
        num_pages=num_pages,
    )
    return HostPool(arena, layout)


# ---------------------------------------------------------------------------
# Naive references


def naive_buffers(layout: PageLayout, pages: list[int], component: int) -> list[tuple[int, int]]:
    """Uncoalesced (ptr, size) list of one object, slot-major then page-minor."""
    out = []
    for slot in layout.components[component]:
        for page in pages:
            ptr = layout.base_ptrs[slot] + page * layout.page_stride_bytes[slot]
            out.append((ptr, layout.slot_bytes[slot]))
    return out


def naive_merge(buffers: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge a buffer into its predecessor when it starts where the predecessor ends."""
    merged: list[list[int]] = []
    for ptr, size in buffers:
        if merged and merged[-1][0] + merged[-1][1] == ptr:
            merged[-1][1] += size
        else:
            merged.append([ptr, size])
    return [(p, s) for p, s in merged]


def naive_plans(layout: PageLayout, key_pages: list[list[int]]) -> list[list[tuple[int, int]]]:
    """Key-major, component-minor, like KeySchema.object_keys."""
    plans = []
    for pages in key_pages:
        for component in range(len(layout.components)):
            plans.append(naive_merge(naive_buffers(layout, pages, component)))
    return plans


def naive_object_bytes(pool: HostPool, pages: list[int], component: int) -> bytes:
    """What the object must contain, read slice by slice from the arena."""
    chunks = []
    for slot in pool.layout.components[component]:
        for page in pages:
            chunks.append(pool.slot_bytes(page, slot))
    return b"".join(chunks)


def gather(plan: ObjectPlan) -> bytes:
    return b"".join(ctypes.string_at(p, s) for p, s in zip(plan.ptrs, plan.sizes, strict=True))


def as_pairs(plan: ObjectPlan) -> list[tuple[int, int]]:
    return list(zip(plan.ptrs, plan.sizes, strict=True))


def assert_python_ints(plans: list[ObjectPlan]) -> None:
    # The native binding rejects numpy integers in its pointer/size lists.
    for plan in plans:
        assert type(plan.ptrs) is list and type(plan.sizes) is list
        for value in plan.ptrs + plan.sizes:
            assert type(value) is int, f"{value!r} is {type(value).__name__}, not int"


# ---------------------------------------------------------------------------
# Hypothesis strategy: arbitrary pools on real memory


@st.composite
def host_pools(draw) -> HostPool:
    num_slots = draw(st.integers(1, 5))
    num_pages = draw(st.integers(1, 12))
    sizes = tuple(draw(st.lists(st.integers(1, 24), min_size=num_slots, max_size=num_slots)))
    interleaved = draw(st.booleans())
    # Extra stride padding per slot makes consecutive pages non-adjacent.
    pads = draw(st.lists(st.sampled_from([0, 0, 3]), min_size=num_slots, max_size=num_slots))
    if interleaved:
        page = sum(sizes) + pads[0]
        arena_bytes = num_pages * page
        offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).tolist()
        strides = (page,) * num_slots
        bases_off = [int(o) for o in offsets]
    else:
        strides = tuple(s + p for s, p in zip(sizes, pads, strict=True))
        bases_off = []
        cursor = 0
        gap = draw(st.sampled_from([0, 5]))
        for b in range(num_slots):
            bases_off.append(cursor)
            cursor += num_pages * strides[b] + gap
        arena_bytes = cursor
    arena = _random_arena(max(arena_bytes, 1), draw(st.integers(0, 2**16)))
    slots = list(range(num_slots))
    order = draw(st.permutations(slots))
    cut = draw(st.integers(1, num_slots))
    # One or two components, each a (possibly reordered) subset of the slots.
    components = (tuple(order[:cut]),) + ((tuple(order[cut:]),) if cut < num_slots else ())
    layout = PageLayout(
        base_ptrs=tuple(arena.ctypes.data + o for o in bases_off),
        page_stride_bytes=strides,
        slot_bytes=sizes,
        components=components,
        num_pages=num_pages,
    )
    return HostPool(arena, layout)


@st.composite
def pools_and_pages(draw) -> tuple[HostPool, list[list[int]]]:
    pool = draw(host_pools())
    n_pages = pool.layout.num_pages
    k = draw(st.integers(1, 4))
    n_keys = draw(st.integers(1, 4))
    consecutive = draw(st.booleans())
    key_pages = []
    for _ in range(n_keys):
        if consecutive and k <= n_pages:
            start = draw(st.integers(0, n_pages - k))
            key_pages.append(list(range(start, start + k)))
        else:
            key_pages.append(draw(st.lists(st.integers(0, n_pages - 1), min_size=k, max_size=k)))
    return pool, key_pages


# ---------------------------------------------------------------------------
# plan_objects


@settings(max_examples=200, deadline=None)
@given(pools_and_pages())
def test_plan_objects_matches_naive_reference(case):
    pool, key_pages = case
    plans = plan_objects(pool.layout, np.asarray(key_pages, dtype=np.int64))
    expected = naive_plans(pool.layout, key_pages)
    assert [as_pairs(p) for p in plans] == expected


@settings(max_examples=100, deadline=None)
@given(pools_and_pages())
def test_plan_objects_gathers_canonical_bytes(case):
    pool, key_pages = case
    plans = plan_objects(pool.layout, np.asarray(key_pages, dtype=np.int64))
    n_comp = len(pool.layout.components)
    assert len(plans) == len(key_pages) * n_comp
    for i, pages in enumerate(key_pages):
        for c in range(n_comp):
            assert gather(plans[i * n_comp + c]) == naive_object_bytes(pool, pages, c)


@settings(max_examples=100, deadline=None)
@given(pools_and_pages())
def test_plan_batch_columns_match_the_naive_reference(case):
    pool, key_pages = case
    batch = plan_batch(pool.layout, np.asarray(key_pages, dtype=np.int64))
    expected = naive_plans(pool.layout, key_pages)
    assert len(batch) == len(batch.sizes) == len(batch.nbytes) == len(expected)
    assert [
        list(zip(p, s, strict=True)) for p, s in zip(batch.ptrs, batch.sizes, strict=True)
    ] == expected
    assert batch.nbytes == [sum(size for _, size in plan) for plan in expected]
    assert all(type(v) is int for row in batch.ptrs + batch.sizes for v in row)
    assert all(type(v) is int for v in batch.nbytes)


def test_plan_batch_take_concat_and_of_plans_round_trip():
    pool = page_first_pool((64, 32), 16, components=((0,), (1,)))
    batch = plan_batch(pool.layout, np.asarray([[3, 4], [9, 1], [0, 15]]))
    assert len(batch) == 6  # 3 keys x 2 components
    picked = batch.take([5, 0, 2])
    assert picked.ptrs == [batch.ptrs[5], batch.ptrs[0], batch.ptrs[2]]
    assert picked.nbytes == [batch.nbytes[5], batch.nbytes[0], batch.nbytes[2]]
    joined = PlanBatch.concat([picked, batch])
    assert joined.ptrs == picked.ptrs + batch.ptrs
    assert joined.sizes == picked.sizes + batch.sizes
    again = PlanBatch.of(batch.plans())
    assert (again.ptrs, again.sizes, again.nbytes) == (batch.ptrs, batch.sizes, batch.nbytes)


@settings(max_examples=100, deadline=None)
@given(pools_and_pages())
def test_coalescing_invariants(case):
    pool, key_pages = case
    layout = pool.layout
    plans = plan_objects(layout, np.asarray(key_pages, dtype=np.int64))
    n_comp = len(layout.components)
    k = len(key_pages[0])
    assert_python_ints(plans)
    for index, plan in enumerate(plans):
        slots = layout.components[index % n_comp]
        # Coalescing never changes how many bytes an object holds ...
        assert sum(plan.sizes) == k * sum(layout.slot_bytes[b] for b in slots)
        assert sum(plan.sizes) == k * layout.page_bytes(index % n_comp)
        # ... never adds pointers, and never leaves an empty buffer.
        assert 1 <= len(plan.ptrs) <= k * len(slots)
        assert all(size > 0 for size in plan.sizes)
        # Merging is maximal: no two surviving neighbours still touch.
        for (p0, s0), p1 in zip(as_pairs(plan), plan.ptrs[1:], strict=False):
            assert p0 + s0 != p1


def test_layer_first_consecutive_pages_coalesce_to_one_buffer_per_layer():
    layers, k, slot = 6, 4, 96
    pool = layer_first_pool(layers, num_pages=16, slot_size=slot)
    key_pages = [[4, 5, 6, 7], [12, 13, 14, 15], [0, 1, 2, 3]]
    plans = plan_objects(pool.layout, np.asarray(key_pages))
    assert len(plans) == 3
    for plan, pages in zip(plans, key_pages, strict=True):
        assert len(plan.ptrs) == layers
        assert plan.sizes == [k * slot] * layers
        assert plan.ptrs == [pool.layout.base_ptrs[b] + pages[0] * slot for b in range(layers)]
        assert gather(plan) == naive_object_bytes(pool, pages, 0)


def test_layer_first_mha_has_one_object_per_component_in_key_major_order():
    # 3 K layers (slots 0..2) and 3 V layers (slots 3..5).
    pool = layer_first_pool(6, num_pages=8, slot_size=32, components=((0, 1, 2), (3, 4, 5)))
    key_pages = [[2, 3], [6, 7]]
    plans = plan_objects(pool.layout, np.asarray(key_pages))
    assert len(plans) == 4
    for index, plan in enumerate(plans):
        pages, component = key_pages[index // 2], index % 2
        assert len(plan.ptrs) == 3
        assert gather(plan) == naive_object_bytes(pool, pages, component)


def test_layer_first_scattered_pages_do_not_merge():
    layers, slot = 3, 40
    pool = layer_first_pool(layers, num_pages=20, slot_size=slot)
    # Out of order and with gaps: no page follows its predecessor in memory.
    pages = [9, 2, 17, 5]
    (plan,) = plan_objects(pool.layout, np.asarray([pages]))
    assert len(plan.ptrs) == layers * len(pages)
    assert plan.sizes == [slot] * (layers * len(pages))
    assert gather(plan) == naive_object_bytes(pool, pages, 0)


def test_layer_first_descending_pages_do_not_merge():
    # Adjacent in memory but in reverse token order: merging would reorder bytes.
    pool = layer_first_pool(2, num_pages=8, slot_size=16)
    pages = [5, 4, 3]
    (plan,) = plan_objects(pool.layout, np.asarray([pages]))
    assert len(plan.ptrs) == 6
    assert gather(plan) == naive_object_bytes(pool, pages, 0)


def test_page_first_mla_consecutive_pages_are_one_buffer():
    page = 576 * 2
    pool = page_first_pool((page,), num_pages=10)
    (plan,) = plan_objects(pool.layout, np.asarray([[3, 4, 5, 6]]))
    assert plan.ptrs == [pool.layout.base_ptrs[0] + 3 * page]
    assert plan.sizes == [4 * page]
    assert gather(plan) == pool.arena[3 * page : 7 * page].tobytes()


def test_page_first_multi_slot_order_is_slot_major_not_memory_order():
    # Two slots side by side in each page: memory order is p0s0 p0s1 p1s0 p1s1,
    # the canonical order is p0s0 p1s0 p0s1 p1s1 -- nothing may merge.
    pool = page_first_pool((8, 8), num_pages=4)
    (plan,) = plan_objects(pool.layout, np.asarray([[1, 2]]))
    assert len(plan.ptrs) == 4
    assert gather(plan) == naive_object_bytes(pool, [1, 2], 0)


def test_single_page_key_single_slot():
    pool = page_first_pool((24,), num_pages=3)
    plans = plan_objects(pool.layout, np.asarray([[2], [0]]))
    assert [as_pairs(p) for p in plans] == [
        [(pool.layout.base_ptrs[0] + 48, 24)],
        [(pool.layout.base_ptrs[0], 24)],
    ]


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint16, np.intp])
def test_outputs_are_python_ints_for_any_index_dtype(dtype):
    pool = layer_first_pool(3, num_pages=8, slot_size=16)
    for pages in ([[0, 1, 2, 3]], [[7, 1, 4, 2]], [[5]]):
        plans = plan_objects(pool.layout, np.asarray(pages, dtype=dtype))
        assert_python_ints(plans)


def test_from_flat_outputs_are_python_ints_even_for_numpy_bases():
    pool = layer_first_pool(2, num_pages=4, slot_size=16)
    flat = np.zeros(4 * 2 * 16, dtype=np.uint8)
    bases = [np.int64(flat.ctypes.data), np.uint64(flat.ctypes.data + 64)]
    plans = plan_objects_from_flat(pool.layout, bases, pages_per_key=2)
    assert_python_ints(plans)


def test_no_keys_no_plans():
    pool = layer_first_pool(2, num_pages=8, slot_size=16)
    assert plan_objects(pool.layout, np.zeros((0, 4), dtype=np.int64)) == []


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(base_ptrs=(), page_stride_bytes=(), slot_bytes=(), components=(), num_pages=1),
        dict(
            base_ptrs=(0, 8),
            page_stride_bytes=(8,),
            slot_bytes=(8, 8),
            components=((0,),),
            num_pages=1,
        ),
        dict(
            base_ptrs=(0,), page_stride_bytes=(8,), slot_bytes=(8,), components=((),), num_pages=1
        ),
        dict(
            base_ptrs=(0,), page_stride_bytes=(8,), slot_bytes=(8,), components=((1,),), num_pages=1
        ),
        dict(
            base_ptrs=(0,),
            page_stride_bytes=(8,),
            slot_bytes=(8,),
            components=((-1,),),
            num_pages=1,
        ),
        # 0-byte slots must be left out: Mooncake rejects 0-byte buffers.
        dict(
            base_ptrs=(0, 8),
            page_stride_bytes=(8, 8),
            slot_bytes=(8, 0),
            components=((0, 1),),
            num_pages=1,
        ),
    ],
    ids=[
        "empty",
        "length-mismatch",
        "empty-component",
        "slot-too-big",
        "slot-negative",
        "zero-byte-slot",
    ],
)
def test_page_layout_rejects_bad_shapes(kwargs):
    with pytest.raises(GeometryError):
        PageLayout(**kwargs)


def test_zero_byte_slot_outside_components_is_allowed():
    layout = PageLayout(
        base_ptrs=(0, 8),
        page_stride_bytes=(8, 8),
        slot_bytes=(8, 0),
        components=((0,),),
        num_pages=1,
    )
    assert layout.page_bytes(0) == 8


# ---------------------------------------------------------------------------
# plan_objects_from_flat


def naive_flat_tensor(pool: HostPool, key_pages: list[list[int]]) -> np.ndarray:
    """sglang's flat page per host page (components in order, slots in pointer
    order), K of them per key, keys back to back."""
    chunks = []
    for pages in key_pages:
        for page in pages:
            for slots in pool.layout.components:
                for slot in slots:
                    chunks.append(pool.slot_bytes(page, slot))
    return np.frombuffer(b"".join(chunks), dtype=np.uint8).copy()


@settings(max_examples=100, deadline=None)
@given(pools_and_pages())
def test_from_flat_reads_the_same_object_bytes_as_the_host_pool(case):
    pool, key_pages = case
    k = len(key_pages[0])
    flat = naive_flat_tensor(pool, key_pages)
    flat_page = sum(pool.layout.page_bytes(c) for c in range(len(pool.layout.components)))
    assert flat.nbytes == len(key_pages) * k * flat_page
    bases = [flat.ctypes.data + i * k * flat_page for i in range(len(key_pages))]
    plans = plan_objects_from_flat(pool.layout, bases, k)
    n_comp = len(pool.layout.components)
    assert len(plans) == len(key_pages) * n_comp
    assert_python_ints(plans)
    for i, pages in enumerate(key_pages):
        for c in range(n_comp):
            plan = plans[i * n_comp + c]
            assert gather(plan) == naive_object_bytes(pool, pages, c)
            # Every pointer stays inside this key's K flat pages.
            lo, hi = bases[i], bases[i] + k * flat_page
            for p, s in as_pairs(plan):
                assert lo <= p and p + s <= hi


def test_from_flat_page_offsets_by_hand():
    layout = PageLayout(
        base_ptrs=(0, 0, 0, 0),
        page_stride_bytes=(1, 1, 1, 1),
        slot_bytes=(10, 20, 0, 5),
        components=((1, 0), (3,)),
        num_pages=1,
    )
    # component 0: slot 1 (20 bytes) then slot 0 (10); component 1: slot 3. Their
    # offsets in the 35-byte flat page, 0, 20 and 30, lead each slot's 2 pages.
    plans = plan_objects_from_flat(layout, [0], pages_per_key=2)
    assert [as_pairs(p) for p in plans] == [
        [(0, 20), (35, 20), (20, 10), (55, 10)],
        [(30, 5), (65, 5)],
    ]


def test_from_flat_single_slot_is_one_buffer_per_key():
    pool = page_first_pool((100,), num_pages=1)
    flat = np.arange(2 * 4 * 100, dtype=np.uint32).astype(np.uint8)
    plans = plan_objects_from_flat(pool.layout, [flat.ctypes.data, flat.ctypes.data + 400], 4)
    assert [as_pairs(p) for p in plans] == [
        [(flat.ctypes.data, 400)],
        [(flat.ctypes.data + 400, 400)],
    ]


# ---------------------------------------------------------------------------
# split_calls


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), max_size=40), st.integers(1, 64))
def test_split_calls_properties(counts, budget):
    calls = split_calls(counts, budget)
    # Order and coverage: the calls are consecutive, non-empty and cover 0..n-1.
    flattened = [i for call in calls for i in call]
    assert flattened == list(range(len(counts)))
    for call in calls:
        assert type(call) is range and call.step == 1 and len(call) >= 1
        total = sum(counts[i] for i in call)
        if total > budget:
            # Only an object that alone exceeds the budget may overrun it.
            assert len(call) == 1 and counts[call[0]] > budget
    # No wasted round trips: the next object would not have fit in the call.
    for call, following in zip(calls, calls[1:], strict=False):
        assert sum(counts[i] for i in call) + counts[following[0]] > budget


def test_split_calls_examples():
    assert split_calls([], 8) == []
    assert split_calls([4, 4, 4], 8) == [range(0, 2), range(2, 3)]
    assert split_calls([8, 1], 8) == [range(0, 1), range(1, 2)]
    assert split_calls([20, 1, 1], 8) == [range(0, 1), range(1, 3)]
    assert split_calls([1, 20, 1], 8) == [range(0, 1), range(1, 2), range(2, 3)]
    assert split_calls([2048] * 3, 2048) == [range(0, 1), range(1, 2), range(2, 3)]


# ---------------------------------------------------------------------------
# dedup_rounds


def naive_rounds(keys: list[str]) -> list[list[int]]:
    """Round r = positions holding the (r+1)-th occurrence of their key."""
    rounds: list[list[int]] = []
    for position, key in enumerate(keys):
        occurrence = sum(1 for earlier in keys[:position] if earlier == key)
        while len(rounds) <= occurrence:
            rounds.append([])
        rounds[occurrence].append(position)
    return rounds


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from("abcde"), max_size=30))
def test_dedup_rounds_properties(keys):
    rounds = dedup_rounds(keys)
    assert rounds == naive_rounds(keys)
    # Every position exactly once.
    assert sorted(i for r in rounds for i in r) == list(range(len(keys)))
    for r, positions in enumerate(rounds):
        assert positions, "empty rounds cost a native call for nothing"
        assert positions == sorted(positions)
        # No round names a key twice.
        names = [keys[i] for i in positions]
        assert len(names) == len(set(names))
        # Round r holds exactly the r-th (0-based) occurrences.
        for i in positions:
            assert keys[:i].count(keys[i]) == r
    # As few rounds as possible: the multiplicity of the most repeated key.
    assert len(rounds) == (max(keys.count(k) for k in keys) if keys else 0)


def test_dedup_rounds_examples():
    assert dedup_rounds([]) == []
    assert dedup_rounds(["a", "b", "c"]) == [[0, 1, 2]]
    assert dedup_rounds(["a", "a", "b", "a"]) == [[0, 2], [1], [3]]


def test_split_calls_never_joins_objects_past_the_budget_even_after_empty_ones():
    assert split_calls([0, 20, 1], 8) == [range(0, 1), range(1, 2), range(2, 3)]


# ---------------------------------------------------------------------------
# pages_of_slots: host_indices -> host pages


def naive_pages_of_slots(slots: list[int], page_tokens: int) -> list[int] | None:
    """Page numbers, or None when the slots are not whole aligned pages."""
    if not slots or len(slots) % page_tokens:
        return None
    pages = []
    for start in range(0, len(slots), page_tokens):
        run = slots[start : start + page_tokens]
        if run[0] % page_tokens or run != list(range(run[0], run[0] + page_tokens)):
            return None
        pages.append(run[0] // page_tokens)
    return pages


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([1, 2, 4, 64]),
    st.lists(st.integers(0, 50), min_size=1, max_size=12),
    st.integers(0, 3),
    st.sampled_from([np.int64, np.int32]),
)
def test_pages_of_slots_matches_the_naive_reference(page_tokens, pages, damage, dtype):
    slots = [p * page_tokens + t for p in pages for t in range(page_tokens)]
    if damage == 1:
        slots[len(slots) // 2] += 1  # a hole / duplicate inside the run
    elif damage == 2:
        slots = [s + 1 for s in slots]  # every page shifted off its boundary
    elif damage == 3 and len(slots) > 1:
        slots = slots[:-1]  # a partial last page
    expected = naive_pages_of_slots(slots, page_tokens)
    array = np.asarray(slots, dtype=dtype)
    if expected is None:
        with pytest.raises(InvalidRequestError, match="host page|host slots"):
            pages_of_slots(array, page_tokens)
    else:
        assert pages_of_slots(array, page_tokens).tolist() == expected


@pytest.mark.parametrize(
    "slots",
    [[], [0, 1, 2], [4, 5, 6, 8], [2, 3, 4, 5], [4, 5, 7, 6]],
)
def test_pages_of_slots_rejects_bad_runs(slots):
    with pytest.raises(InvalidRequestError):
        pages_of_slots(np.asarray(slots, dtype=np.int64), 4)
