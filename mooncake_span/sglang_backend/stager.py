"""Staged transfers: batches whose memory is not registered move through the arena.

A staged batch (a ``StagedPool``'s host pages, or the generic path's flat
tensors, which sglang allocates per call) is cut into parts of whole key rows
that fit one lease of the registered ``StagingArena``; each part is one put
(rows copied in first) or one get (rows whose objects all arrived copied out
after), and its lease ends with its native call. ``span/byte_budget.py`` plans the
parts; this module copies and calls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mooncake_span.errors import RegistrationError
from mooncake_span.sglang_backend.stored_pool import PoolBatch, Transfer
from mooncake_span.span.byte_budget import StagedPart, next_part, rows_left_bytes
from mooncake_span.span.plan import PlanBatch, plan_objects_from_flat
from mooncake_span.store.arena import StagingArena
from mooncake_span.store.client import MooncakeClient

logger = logging.getLogger(__name__)


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

    def get_batch(self, batch: PoolBatch, todo: Transfer) -> list[bool]:
        """Get the objects ``todo`` names, per object; rows whose objects all
        arrived are copied out of the arena."""
        return self._in_parts(batch, todo, self._get_part)

    def put_batch(self, batch: PoolBatch, todo: Transfer) -> list[bool]:
        """Put the objects ``todo`` names, per object; rows are copied in first."""
        return self._in_parts(batch, todo, self._put_part)

    def _in_parts(self, batch: PoolBatch, todo: Transfer, move_part: PartMove) -> list[bool]:
        """``move_part`` over lease-sized parts of the objects ``todo`` names."""
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
                mine = [objects[i] for i in part.objects]
                out += move_part(_Part(batch, todo, part, lease.ptr, mine))
        return out

    def _offset(self, part: _Part, k: int) -> int:
        """Arena offset of the part's ``k``-th row."""
        return part.base_ptr - self.arena.base_ptr + k * part.batch.row_bytes

    def _put_part(self, part: _Part) -> list[bool]:
        batch = part.batch
        for k, row in enumerate(part.rows):
            batch.pool.stage_row(batch, row, self._view, self._offset(part, k))
        groups, domains, steps = part.cut(part.todo.group_ids, part.todo.domains, part.todo.steps)
        return self.client.put(part.keys(), part.plans(), groups, domains=domains, steps=steps)

    def _get_part(self, part: _Part) -> list[bool]:
        batch = part.batch
        ncomp = batch.pool.num_components
        domains, steps = part.cut(part.todo.domains, part.todo.steps)
        flags = self.client.get(part.keys(), part.plans(), domains, steps)
        arrived: dict[int, bool] = {}
        for o, ok in zip(part.mine, flags, strict=True):
            arrived[o // ncomp] = arrived.get(o // ncomp, True) and ok
        for k, row in enumerate(part.rows):
            if arrived.get(row):
                batch.pool.unstage_row(batch, row, self._view, self._offset(part, k))
        return flags


@dataclass(frozen=True)
class _Part:
    """One lease's worth of a staged batch: whole key rows at ``base_ptr``."""

    batch: PoolBatch
    todo: Transfer
    span: StagedPart  # which of the transfer's objects, and their rows, it covers
    base_ptr: int
    mine: list[int]  # those objects, as indices into the batch's object keys

    @property
    def rows(self) -> Sequence[int]:
        return self.span.rows

    def keys(self) -> list[str]:
        return [self.batch.object_keys[o] for o in self.mine]

    def cut(self, *per_object: list[Any] | None) -> tuple[list[Any] | None, ...]:
        """This part's share of per-object lists of the transfer (None stays None)."""
        cut = slice(self.span.objects.start, self.span.objects.stop)
        return tuple(None if values is None else values[cut] for values in per_object)

    def plans(self) -> PlanBatch:
        """Plans of this part's objects in the leased arena rows."""
        batch = self.batch
        row_bytes = batch.row_bytes
        bases = [self.base_ptr + k * row_bytes for k in range(len(self.rows))]
        row_plans = PlanBatch.from_plans(
            plan_objects_from_flat(batch.pool.layout, bases, batch.pages_per_key)
        )
        ncomp = batch.pool.num_components
        position = {row: k for k, row in enumerate(self.rows)}
        return row_plans.take([position[o // ncomp] * ncomp + o % ncomp for o in self.mine])


# One part's native call (and its copies in or out); per-object flags.
PartMove = Callable[[_Part], list[bool]]
