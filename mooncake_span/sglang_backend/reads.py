"""The read path: a get of prepared batches, from their plans to per-key results.

``Reads.get`` moves every object of every batch: the zero-copy batches in
one native get (``MooncakeClient.get``, which cuts it into buffer-budget
segments), each staged batch through the arena (``Stager.get_batch``, which
copies complete rows back into the host pool). The per-object flags are then
folded to per-key results, clamped after the first missing key, as sglang
reads a result list as a prefix. A call that names its prefix chain tells the
client where its keys were placed, for reads while a segment is bad.
"""

from __future__ import annotations

from mooncake_span.sglang_backend.objects import (
    move_selected,
    object_keys,
    per_key_results,
    placement,
)
from mooncake_span.sglang_backend.stager import Stager
from mooncake_span.sglang_backend.stored_pool import PoolBatch, Transfer
from mooncake_span.span.plan import PlanBatch
from mooncake_span.store.client import MooncakeClient


class Reads:
    def __init__(self, client: MooncakeClient, stager: Stager) -> None:
        self._client = client
        self._stager = stager

    def get(self, batches: list[PoolBatch]) -> list[list[bool]]:
        """Per batch, per key: did every object of the key arrive?"""
        physical = [b for b in batches if not b.pool.is_logical]
        keys = object_keys(physical)
        todos = [b.pool.read_all(b) for b in physical]
        if any(b.staged for b in physical):
            flags = move_selected(
                physical, todos, [False] * len(keys), self._stager.get_batch, self._direct
            )
        else:
            flags = self._direct(keys, todos) if keys else []
        return per_key_results(batches, flags)

    def _direct(self, keys: list[str], todos: list[Transfer]) -> list[bool]:
        """One native get into the host pools' (registered) memory."""
        domains, steps = placement(todos)
        plans = PlanBatch.concat([t.plans for t in todos])
        return self._client.get(keys, plans, domains, steps)
