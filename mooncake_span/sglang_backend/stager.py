"""Staged transfers: batches whose memory is not registered move through the arena.

A staged batch (a ``StagedPool``'s host pages, or the generic path's per-call
flat tensors) moves in parts of whole key rows, one lease of the
``StagingArena`` and one native call each; ``span/byte_budget.py`` plans the
parts, this module leases and copies.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mooncake_span.errors import RegistrationError
from mooncake_span.sglang_backend.stored_pool import PoolBatch, Transfer
from mooncake_span.span.byte_budget import StagedPart, next_part, rows_left_bytes
from mooncake_span.span.plan import PlanBatch, plan_objects_from_flat
from mooncake_span.store.arena import StagingArena

logger = logging.getLogger(__name__)


class Stager:
    """Leases of ``arena`` for staged batches, and the row copies in and out."""

    def __init__(self, arena: StagingArena) -> None:
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

    def parts(self, batch: PoolBatch, todo: Transfer) -> Iterator[StagedRows]:
        """The objects ``todo`` names, in parts of whole key rows that fit one
        lease; each part's lease ends when the next part is asked for (or the
        generator is closed), so its native call goes between."""
        ncomp = batch.pool.num_components
        objects = todo.object_indices
        if objects is None:
            objects = list(range(len(batch.object_keys)))
        row_of = [o // ncomp for o in objects]
        row_bytes = batch.row_bytes
        start = 0
        while start < len(objects):
            want = rows_left_bytes(row_of, start, row_bytes)
            with self.arena.lease(want, row_bytes) as lease:
                part = next_part(row_of, start, lease.size_bytes, row_bytes)
                mine = [objects[i] for i in part.objects]
                yield StagedRows(batch, todo, part, lease.ptr, mine)
            start = part.objects.stop

    def stage(self, part: StagedRows) -> None:
        """Copy the part's rows into its lease (before its put)."""
        batch = part.batch
        for k, row in enumerate(part.rows):
            batch.pool.stage_row(batch, row, self._view, self._offset(part, k))

    def unstage(self, part: StagedRows, flags: Sequence[bool]) -> None:
        """Copy back out of the lease the rows whose objects all arrived (after its get)."""
        batch = part.batch
        ncomp = batch.pool.num_components
        arrived: dict[int, bool] = {}
        for o, ok in zip(part.mine, flags, strict=True):
            arrived[o // ncomp] = arrived.get(o // ncomp, True) and ok
        for k, row in enumerate(part.rows):
            if arrived.get(row):
                batch.pool.unstage_row(batch, row, self._view, self._offset(part, k))

    def _offset(self, part: StagedRows, k: int) -> int:
        return part.base_ptr - self.arena.base_ptr + k * part.batch.row_bytes


@dataclass(frozen=True)
class StagedRows:
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
        row_plans = PlanBatch.of(
            plan_objects_from_flat(batch.pool.layout, bases, batch.pages_per_key)
        )
        ncomp = batch.pool.num_components
        position = {row: k for k, row in enumerate(self.rows)}
        return row_plans.take([position[o // ncomp] * ncomp + o % ncomp for o in self.mine])
