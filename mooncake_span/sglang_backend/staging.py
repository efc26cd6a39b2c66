"""Staged transfers: batches whose memory is not registered move through the arena.

A staged batch (a ``StagedPool``'s host pages, or the generic path's flat
tensors, which sglang allocates per call) is cut into parts of whole key rows
that fit one lease of the registered ``StagingArena``; each part is one put
(rows copied in first) or one get (rows whose objects all arrived copied out
after), and its lease ends with its native call. ``span/staging.py`` plans the
parts; this module copies and calls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from mooncake_span.errors import RegistrationError
from mooncake_span.sglang_backend.stored_pool import PoolBatch, Transfer
from mooncake_span.span.plan import PlanBatch, plan_objects_from_flat
from mooncake_span.span.staging import StagedPart, next_part, rows_left_bytes
from mooncake_span.store.client import MooncakeClient
from mooncake_span.store.staging import StagingArena

logger = logging.getLogger(__name__)

# (object keys, their transfers, is_set) -> per-object flags: the backend's zero-copy I/O.
DirectIO = Callable[[list[str], list[Transfer], bool], list[bool]]


class Stager:
    """Moves staged batches through ``arena`` with ``client``."""

    def __init__(self, client: MooncakeClient, arena: StagingArena) -> None:
        self.client = client
        self.arena = arena
        self._view = torch.frombuffer(arena.memory, dtype=torch.uint8)

    def check_row(self, pool_name: str, row_bytes: int, staged: bool) -> None:
        """A key row that cannot fit the arena: a staged pool would miss every
        call (refused at startup); the KV pool only on the generic path (warned)."""
        if row_bytes <= self.arena.size_bytes:
            return
        what = (
            f"pool {pool_name!r}: one storage key is {row_bytes} bytes, more than the "
            f"{self.arena.size_bytes}-byte staging arena; raise span_staging_buffer_size"
        )
        if staged:
            raise RegistrationError(f"{what} (every transfer of this pool stages through it)")
        logger.warning("mooncake-span: %s, or the generic path (interface_v1 off) misses", what)

    def move(
        self,
        batches: Sequence[PoolBatch],
        todos: Sequence[Transfer],
        stored: list[bool],
        is_set: bool,
        direct_io: DirectIO,
    ) -> list[bool]:
        """Per-object results over all ``batches``: zero-copy batches in one
        direct call, each staged batch in arena-sized parts."""
        done = list(stored)
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
                for slot, ok in zip(slots, self.move_batch(batch, todo, is_set), strict=True):
                    done[slot] = ok
            else:
                direct_keys += [batch.object_keys[i] for i in indices]
                direct_slots += slots
                direct_todos.append(todo)
        if direct_keys:
            flags = direct_io(direct_keys, direct_todos, is_set)
            for slot, ok in zip(direct_slots, flags, strict=True):
                done[slot] = ok
        return done

    def move_batch(self, batch: PoolBatch, todo: Transfer, is_set: bool) -> list[bool]:
        """The objects ``todo`` names, per object, in lease-sized parts."""
        ncomp = batch.pool.num_components
        objects = todo.object_indices
        if objects is None:
            objects = list(range(len(batch.object_keys)))
        row_of = [o // ncomp for o in objects]
        row_bytes = batch.row_bytes
        out: list[bool] = []
        while len(out) < len(objects):
            start = len(out)
            want = rows_left_bytes(row_of, start, row_bytes)
            with self.arena.lease(want, row_bytes) as lease:
                part = next_part(row_of, start, lease.size_bytes, row_bytes)
                out += self._part(batch, todo, objects, part, lease.ptr, is_set)
        return out

    def _part(
        self,
        batch: PoolBatch,
        todo: Transfer,
        objects: list[int],
        part: StagedPart,
        base_ptr: int,
        is_set: bool,
    ) -> list[bool]:
        pool, row_bytes = batch.pool, batch.row_bytes
        lease_offset = base_ptr - self.arena.base_ptr
        position = {row: k for k, row in enumerate(part.rows)}
        if is_set:
            for k, row in enumerate(part.rows):
                pool.stage_row(batch, row, self._view, lease_offset + k * row_bytes)
        bases = [base_ptr + k * row_bytes for k in range(len(part.rows))]
        row_plans = PlanBatch.from_plans(
            plan_objects_from_flat(pool.layout, bases, batch.pages_per_key)
        )
        ncomp = pool.num_components
        mine = [objects[i] for i in part.objects]
        plans = row_plans.take([position[o // ncomp] * ncomp + o % ncomp for o in mine])
        keys = [batch.object_keys[o] for o in mine]
        if is_set:
            cut = slice(part.objects.start, part.objects.stop)
            groups = todo.group_ids[cut] if todo.group_ids is not None else None
            domains = todo.domains[cut] if todo.domains is not None else None
            return self.client.put(keys, plans, groups, domains=domains)
        flags = self.client.get(keys, plans)
        arrived: dict[int, bool] = {}
        for o, ok in zip(mine, flags, strict=True):
            arrived[o // ncomp] = arrived.get(o // ncomp, True) and ok
        for k, row in enumerate(part.rows):
            if arrived.get(row):
                pool.unstage_row(batch, row, self._view, lease_offset + k * row_bytes)
        return flags
