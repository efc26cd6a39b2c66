"""The objects of one call: a flat list over its batches, sliced back per batch.

A call's batches are laid end to end, each contributing its object keys in its
pool's order (``StoredPool``), so one existence query, put or get covers them
all. This module owns that layout: slicing a flat per-object list back into
per-batch parts, folding them to per-key results, and selecting a subset of
the objects to move (a put skipping what is stored, staged batches beside
zero-copy ones) with the slots their results are put back in. It moves
nothing itself: the read and write paths do, top-down.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from mooncake_span.sglang_backend.stored_pool import PoolBatch, Transfer
from mooncake_span.span.keys import KeySchema
from mooncake_span.span.plan import PlanBatch

Item = TypeVar("Item")


def object_keys(batches: Sequence[PoolBatch]) -> list[str]:
    if len(batches) == 1:
        return batches[0].object_keys
    return [key for batch in batches for key in batch.object_keys]


def prefix_objects(batches: Sequence[PoolBatch], schema: KeySchema) -> list[str]:
    """The objects of the batches' prefix keys (``PoolBatch.prefix_keys``), key by
    key from the chain's root, every batch's components of a key together, so
    that a cut keeps the oldest part of the prefix whole."""
    parts = [
        (b.pool.object_keys(schema, b.prefix_keys), b.pool.num_components)
        for b in batches
        if b.prefix_keys
    ]
    if len(parts) <= 1:
        return parts[0][0] if parts else []
    count = max(len(keys) // ncomp for keys, ncomp in parts)
    return [o for i in range(count) for keys, c in parts for o in keys[i * c : (i + 1) * c]]


def split(flat: Sequence[Item], counts: Sequence[int]) -> list[Sequence[Item]]:
    """``flat`` cut into consecutive parts of ``counts`` items."""
    parts, offset = [], 0
    for count in counts:
        parts.append(flat[offset : offset + count])
        offset += count
    return parts


def joined(todos: Sequence[Transfer]) -> Transfer:
    """``todos`` laid end to end: one native call's plans, group ids and placement.

    Group ids when any transfer has them (a put's batches decide them alike);
    steps only when every transfer has them (one call's batches share its
    chain, so they all do or none does); domains when any has them (a put's
    always do; a read's only with their chain)."""
    if len(todos) == 1 and todos[0].object_indices is None:
        return todos[0]
    plans = PlanBatch.concat([t.plans for t in todos])
    groups = None
    if any(t.group_ids is not None for t in todos):
        groups = [g for t in todos for g in t.group_ids or ()]
    steps = None
    if all(t.steps is not None for t in todos):
        steps = [s for t in todos for s in t.steps]
    domains = None
    if steps is not None or any(t.domains is not None for t in todos):
        domains = [d for t in todos for d in t.domains or ()]
    return Transfer(None, plans, groups, domains, steps)


def chain_placement(batches: Sequence[PoolBatch]) -> tuple[list[str] | None, list[int] | None]:
    """The domains and chain steps of every object of ``batches``, laid end to end,
    when the call named its prefix chain (None, None otherwise)."""
    if not batches or any(b.chain is None for b in batches):
        return None, None
    domains: list[str] = []
    steps: list[int] = []
    for batch in batches:
        more = batch.chain.objects(range(len(batch.page_keys)), batch.pool.num_components)
        domains += more[0]
        steps += more[1]
    return domains, steps


def per_batch(flat: Sequence[Item], batches: Sequence[PoolBatch]) -> list[Sequence[Item]]:
    return split(flat, [len(batch.object_keys) for batch in batches])


def per_key_results(batches: Sequence[PoolBatch], object_flags: Sequence[bool]) -> list[list[bool]]:
    """Per batch, per key: did every object of the key arrive (or is it stored)?"""
    if len(batches) == 1:  # a v1 or generic call: nothing to slice
        return [batches[0].pool.per_key_results(batches[0], object_flags)]
    parts = per_batch(object_flags, batches)
    return [
        batch.pool.per_key_results(batch, part) for batch, part in zip(batches, parts, strict=True)
    ]


@dataclass
class Selection:
    """The objects a call moves, by how they move (``select``)."""

    staged: list[tuple[PoolBatch, Transfer, list[int]]] = field(default_factory=list)
    direct_keys: list[str] = field(default_factory=list)
    direct_slots: list[int] = field(default_factory=list)
    direct_todos: list[Transfer] = field(default_factory=list)


def select(batches: Sequence[PoolBatch], todos: Sequence[Transfer]) -> Selection:
    """The objects each ``todos[i]`` names, with their slots in the call's flat
    object list: a staged batch's alone (it moves through the arena by itself),
    the zero-copy ones together (they move in one native call)."""
    chosen = Selection()
    offset = 0
    for batch, todo in zip(batches, todos, strict=True):
        count = len(batch.object_keys)
        indices = range(count) if todo.object_indices is None else todo.object_indices
        slots = [offset + i for i in indices]
        offset += count
        if not slots:
            continue
        if batch.staged:
            chosen.staged.append((batch, todo, slots))
        else:
            chosen.direct_keys += [batch.object_keys[i] for i in indices]
            chosen.direct_slots += slots
            chosen.direct_todos.append(todo)
    return chosen


def put_back(out: list[bool], slots: Sequence[int], flags: Sequence[bool]) -> None:
    """The flags of moved objects into their ``slots`` of the call's flat list."""
    for slot, ok in zip(slots, flags, strict=True):
        out[slot] = ok


def move_selected(
    batches: Sequence[PoolBatch],
    todos: Sequence[Transfer],
    flags: list[bool],
    staged: Callable[[PoolBatch, Transfer], list[bool]],
    direct: Callable[[list[str], list[Transfer]], list[bool]],
) -> list[bool]:
    """What the read and write paths do with a selection (``select``): each staged
    batch moved alone, the zero-copy objects in one ``direct`` call, every answer
    put in its slot of ``flags`` (the call's flat object list, returned)."""
    chosen = select(batches, todos)
    for batch, todo, slots in chosen.staged:
        put_back(flags, slots, staged(batch, todo))
    if chosen.direct_keys:
        put_back(flags, chosen.direct_slots, direct(chosen.direct_keys, chosen.direct_todos))
    return flags
