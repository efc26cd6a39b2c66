"""One registered host pool as it is stored in Mooncake, and one call's objects.

``StoredPool`` is the one place that writes down the object order: key-major,
component-minor (object ``i * C + c`` is component ``c`` of key ``i``); the
read and write paths only loop over pools. ``StagedPool`` moves flat key rows
through the staging arena (``stager.py``). The functions after the pools slice,
fold and select a call's flat object list over its batches, moving nothing.
What ``extra_info``'s prefix keys are: docs/reliability.md, "The rule".
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from mooncake_span.errors import InvalidRequestError
from mooncake_span.span.geometry import PoolKind, SpanGeometry, derive_slots_per_key
from mooncake_span.span.keys import ComponentSpec, KeySchema, check_page_keys
from mooncake_span.span.plan import (
    PageLayout,
    PlanBatch,
    pages_of_slots,
    plan_batch,
)
from mooncake_span.store.domains import ChainSpot

_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def chain_of(
    extra_info: Any,
    page_keys: list[str],
    schema: KeySchema,
    window_keys: int,
    stripe_keys: int = 0,
) -> ChainSpot | None:
    """The chain spot of ``page_keys`` (validated, non-empty), or None without prefix keys."""
    prefix = getattr(extra_info, "prefix_keys", None)
    if prefix is None:
        return None
    if not isinstance(prefix, (list, tuple)):
        raise InvalidRequestError(
            f"extra_info.prefix_keys must be a list of str, got {type(prefix).__name__}"
        )
    root = prefix[0] if prefix else page_keys[0]
    if not isinstance(root, str) or not root:
        raise InvalidRequestError(f"extra_info.prefix_keys[0] must be a non-empty str: {root!r}")
    # The root's own per-key domain: a chain and its first key share a segment.
    (domain,) = schema.domains([root], 1)
    return ChainSpot(domain, len(prefix), window_keys, stripe_keys)


def prefix_keys_of(extra_info: Any) -> list[str]:
    """The prefix keys sglang passed, validated; [] without them."""
    prefix = getattr(extra_info, "prefix_keys", None)
    if not prefix:
        return []
    try:
        return check_page_keys(prefix)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"extra_info.prefix_keys: {exc}") from None


def clamp_after_first_failure(flags: Sequence[bool]) -> list[bool]:
    """A pool's per-key results as sglang reads them, a prefix: never True after a
    False (truthy native codes come back as real bools)."""
    run = len(flags) if all(flags) else next(i for i, flag in enumerate(flags) if not flag)
    return [True] * run + [False] * (len(flags) - run)


def check_host_indices(pool_name: str, host_indices: Any) -> None:
    """Host indices must be an integer CPU tensor (sglang slices them from its host allocator)."""
    what = f"pool {pool_name!r}: host_indices"
    if host_indices is None:
        raise InvalidRequestError(f"{what} is None")
    if not isinstance(host_indices, torch.Tensor):
        raise InvalidRequestError(f"{what} must be a tensor, got {type(host_indices).__name__}")
    if host_indices.device.type != "cpu":
        raise InvalidRequestError(f"{what} must be on the CPU, got {host_indices.device}")
    if host_indices.dtype not in _INDEX_DTYPES:
        raise InvalidRequestError(f"{what} must be integers, got {host_indices.dtype}")


@dataclass
class PoolBatch:
    """One pool's part of one sglang call, validated and keyed."""

    pool: StoredPool
    page_keys: list[str]
    key_pages: np.ndarray  # (n_keys, host pages per key)
    object_keys: list[str] = field(default_factory=list)
    # Generic (non zero-copy) calls: one flat span tensor per key instead of host pages.
    flat_bases: list[int] | None = None
    # Where page_keys sit in their prefix chain (sglang passed prefix keys), or None.
    chain: ChainSpot | None = None
    # The chain's keys before page_keys whose leases a put or hit query renews
    # (span_refresh_prefix; empty without prefix keys, and for state pools).
    prefix_keys: list[str] = field(default_factory=list)

    @property
    def pages_per_key(self) -> int:
        return int(self.key_pages.shape[1])

    @property
    def staged(self) -> bool:
        return self.flat_bases is not None or self.pool.staged

    @property
    def row_bytes(self) -> int:
        """Bytes of one key's flat row (its K flat pages, every component)."""
        return self.pool.layout.flat_page_bytes * self.pages_per_key


@dataclass
class Transfer:
    """The objects of one batch that still have to move, with their plans."""

    object_indices: list[int] | None  # None: every object of the batch, in order
    plans: PlanBatch | None  # None: a staged batch (the stager plans each part)
    group_ids: list[str] | None
    # Per object, its placement key (KeySchema.domains, or the chain root's): a
    # put's always, a read's only when it knows the chain.
    domains: list[str] | None = None
    # Per object, its key's chain step (ChainSpot); None: placed per key.
    steps: list[int] | None = None


class StoredPool:
    """A host pool's storage model: object keys, plans, group ids, per-key fold."""

    staged = False

    def __init__(
        self,
        name: str,
        host_pool: Any,
        kind: PoolKind,
        page_tokens: int,
        components: tuple[ComponentSpec, ...],
        layout: PageLayout | None,
    ) -> None:
        self.name = name
        self.host_pool = host_pool
        self.kind = kind
        self.page_tokens = page_tokens
        self.components = components
        self.layout = layout  # None: a logical anchor that stores no bytes

    @property
    def is_logical(self) -> bool:
        return self.layout is None

    @property
    def num_components(self) -> int:
        return len(self.components)

    def host_pages(
        self, kind: PoolKind, num_keys: int, host_indices: Any, geometry: SpanGeometry
    ) -> np.ndarray:
        """``(num_keys, pages per key)`` host page numbers; the stride comes from the transfer."""
        check_host_indices(self.name, host_indices)
        # numpy on the tensor's memory: per-call torch ops cost more than the work.
        slots = host_indices.numpy().reshape(-1)
        if slots.dtype != np.int64:
            slots = slots.astype(np.int64)  # narrow types would wrap in the arithmetic
        per_key = derive_slots_per_key(
            pool_name=self.name,
            kind=kind,
            num_slots=int(slots.size),
            num_keys=num_keys,
            pool_page_tokens=self.page_tokens,
            storage_page_tokens=geometry.storage_page_tokens,
        )
        try:
            pages = pages_of_slots(slots, self.page_tokens)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"pool {self.name!r}: {exc}") from None
        pages = pages.reshape(num_keys, per_key // self.page_tokens)
        low, high = int(pages.min()), int(pages.max())
        if low < 0 or high >= self.layout.num_pages:
            raise InvalidRequestError(
                f"pool {self.name!r}: host page out of range [{low}, {high}] "
                f"(pool has {self.layout.num_pages} pages)"
            )
        return pages

    def object_keys(self, schema: KeySchema, page_keys: list[str]) -> list[str]:
        return [] if self.is_logical else schema.object_keys(page_keys, self.components)

    def fold(self, object_flags: Sequence[bool]) -> list[bool]:
        """Per key: are all of its component objects present (or moved)?"""
        ncomp = self.num_components
        if ncomp == 1:
            return list(object_flags)
        return [all(object_flags[i : i + ncomp]) for i in range(0, len(object_flags), ncomp)]

    def read_all(self, batch: PoolBatch) -> Transfer:
        """A get moves every object of ``batch``, in order."""
        plans = None if batch.staged else self.plans(batch, None)
        if batch.chain is None:
            return Transfer(None, plans, None)
        domains, steps = batch.chain.objects(range(len(batch.page_keys)), self.num_components)
        return Transfer(None, plans, None, domains, steps)

    def write_missing(
        self, batch: PoolBatch, stored: Sequence[bool], schema: KeySchema, group_ids: bool
    ) -> Transfer:
        """What a put of ``batch`` moves: the objects ``stored`` does not flag.
        ``group_ids``: tag them with their key's eviction group."""
        ncomp = self.num_components
        if not any(stored):
            # Nothing stored yet (most puts): all objects go, in order.
            groups = schema.group_ids(batch.page_keys, ncomp)
            plans = None if batch.staged else self.plans(batch, None)
            if batch.chain is not None:
                domains, steps = batch.chain.objects(range(len(batch.page_keys)), ncomp)
                return Transfer(None, plans, groups if group_ids else None, domains, steps)
            domains = schema.domains(batch.page_keys, ncomp, groups)
            return Transfer(None, plans, groups if group_ids else None, domains)
        rows = [i for i, whole in enumerate(self.fold(stored)) if not whole]
        row_plans = None
        if not batch.staged:
            row_plans = self.plans(batch, rows) if rows else PlanBatch([], [], [])
        objects: list[int] = []
        picked: list[int] = []
        for pos, row in enumerate(rows):
            for c in range(ncomp):
                if not stored[row * ncomp + c]:
                    objects.append(row * ncomp + c)
                    picked.append(pos * ncomp + c)
        groups = [schema.group_id(batch.page_keys[i // ncomp]) for i in objects]
        plans = None if row_plans is None else row_plans.take(picked)
        if batch.chain is not None:
            domains, steps = batch.chain.objects([i // ncomp for i in objects], 1)
            return Transfer(objects, plans, groups if group_ids else None, domains, steps)
        domains = [schema.domain_of(batch.object_keys[i]) for i in objects]
        return Transfer(objects, plans, groups if group_ids else None, domains)

    def plans(self, batch: PoolBatch, rows: list[int] | None) -> PlanBatch:
        """Plans for every component of keys ``rows`` (None: all keys), key-major,
        component-minor, in the host pool's own (registered) memory."""
        pages = batch.key_pages if rows is None else batch.key_pages[rows]
        # host_pages() already checked the page range.
        return plan_batch(self.layout, pages)

    def per_key_results(self, batch: PoolBatch, object_flags: Sequence[bool]) -> list[bool]:
        """Fold object results to keys; sglang reads a result list as a prefix."""
        if self.is_logical:
            return [True] * len(batch.page_keys)
        return clamp_after_first_failure(self.fold(object_flags))

    def stage_row(self, batch: PoolBatch, row: int, arena: torch.Tensor, offset: int) -> None:
        """Copy key ``row``'s flat row into ``arena`` at ``offset`` (before a put)."""
        ctypes.memmove(arena.data_ptr() + offset, batch.flat_bases[row], batch.row_bytes)

    def unstage_row(self, batch: PoolBatch, row: int, arena: torch.Tensor, offset: int) -> None:
        """Copy key ``row``'s flat row back from ``arena`` (after a get)."""
        ctypes.memmove(batch.flat_bases[row], arena.data_ptr() + offset, batch.row_bytes)

    def moved_bytes(self, batch: PoolBatch, per_key: Sequence[bool]) -> int:
        return 0 if self.is_logical else batch.row_bytes * per_key.count(True)


class StagedPool(StoredPool):
    """A pool without zero-copy pointers: its flat pages are copied to and from the arena."""

    staged = True

    def stage_row(self, batch: PoolBatch, row: int, arena: torch.Tensor, offset: int) -> None:
        if batch.flat_bases is not None:
            return super().stage_row(batch, row, arena, offset)
        flat_bytes = self.layout.flat_page_bytes
        for j, page in enumerate(batch.key_pages[row].tolist()):
            data = self.host_pool.get_data_page(page * self.page_tokens, flat=True)
            start = offset + j * flat_bytes
            arena[start : start + flat_bytes].copy_(data.contiguous().view(torch.uint8).reshape(-1))
        return None

    def unstage_row(self, batch: PoolBatch, row: int, arena: torch.Tensor, offset: int) -> None:
        if batch.flat_bases is not None:
            return super().unstage_row(batch, row, arena, offset)
        flat_bytes = self.layout.flat_page_bytes
        dtype = self.host_pool.get_dummy_flat_data_page().dtype
        for j, page in enumerate(batch.key_pages[row].tolist()):
            start = offset + j * flat_bytes
            self.host_pool.set_from_flat_data_page(
                page * self.page_tokens, arena[start : start + flat_bytes].view(dtype)
            )
        return None


# ---- the objects of one call, over its batches ------------------------------------

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


def move_selected(
    batches: Sequence[PoolBatch],
    todos: Sequence[Transfer],
    flags: list[bool],
    staged: Callable[[PoolBatch, Transfer], list[bool]],
    direct: Callable[[list[str], list[Transfer]], list[bool]],
) -> list[bool]:
    """Move the objects each ``todos[i]`` names: a staged batch's alone (through
    the arena), the zero-copy ones together in one ``direct`` call; each answer
    goes to its slot of ``flags`` (the call's flat object list, returned)."""
    direct_keys: list[str] = []
    direct_slots: list[int] = []
    direct_todos: list[Transfer] = []
    offset = 0
    for batch, todo in zip(batches, todos, strict=True):
        count = len(batch.object_keys)
        indices = range(count) if todo.object_indices is None else todo.object_indices
        slots = [offset + i for i in indices]
        offset += count
        if not slots:
            continue
        if batch.staged:
            _put_back(flags, slots, staged(batch, todo))
        else:
            direct_keys += [batch.object_keys[i] for i in indices]
            direct_slots += slots
            direct_todos.append(todo)
    if direct_keys:
        _put_back(flags, direct_slots, direct(direct_keys, direct_todos))
    return flags


def _put_back(out: list[bool], slots: Sequence[int], flags: Sequence[bool]) -> None:
    for slot, ok in zip(slots, flags, strict=True):
        out[slot] = ok
