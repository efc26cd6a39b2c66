"""The write path: a put of prepared batches, from the existence check to per-key results.

``Writes.put`` first asks which objects are already stored (another rank or
node wrote them; skipped while the store's put cool-down runs, since then no
put is sent at all), then puts only the missing ones with their eviction
group ids and failure-domain placement keys: the zero-copy batches in one
native put (``MooncakeClient.put``: segments cut by the buffer budget and the
grouped-put cap), each staged batch through the arena (``Stager.put_batch``).
Per-object flags (stored or written) fold to per-key results.
"""

from __future__ import annotations

from mooncake_span.sglang_backend.objects import (
    chain_placement,
    move_selected,
    object_keys,
    per_batch,
    per_key_results,
    placement,
)
from mooncake_span.sglang_backend.registration import Registration
from mooncake_span.sglang_backend.stager import Stager
from mooncake_span.sglang_backend.stored_pool import PoolBatch, Transfer
from mooncake_span.span.plan import PlanBatch
from mooncake_span.store.client import MooncakeClient


class Writes:
    def __init__(self, client: MooncakeClient, stager: Stager, reg: Registration) -> None:
        self._client = client
        self._stager = stager
        self._reg = reg

    def put(self, batches: list[PoolBatch]) -> list[list[bool]]:
        """Per batch, per key: is every object of the key stored now?"""
        physical = [b for b in batches if not b.pool.is_logical]
        keys = object_keys(physical)
        if keys and not self._client.puts_paused():
            # A key already stored (by another rank or node) is not written twice.
            # Where a chain's objects sit matters to the check only while the
            # router is troubled (a bad segment); it costs a pass per object.
            placed = (None, None)
            if not self._client.router.untroubled:
                placed = chain_placement(physical)
            stored = self._client.exists(keys, *placed)
        else:
            stored = [False] * len(keys)
        schema = self._reg.key_schema
        group_ids = self._reg.group_ids
        todos = [
            batch.pool.write_missing(batch, part, schema, group_ids)
            for batch, part in zip(physical, per_batch(stored, physical), strict=True)
        ]
        if not any(b.staged for b in physical) and all(t.object_indices is None for t in todos):
            # Every object moves, in order: no per-object bookkeeping.
            flags = self._direct(keys, todos) if keys else []
        else:
            flags = move_selected(physical, todos, stored, self._stager.put_batch, self._direct)
        return per_key_results(batches, flags)

    def _direct(self, keys: list[str], todos: list[Transfer]) -> list[bool]:
        """One native put from the host pools' (registered) memory."""
        plans = PlanBatch.concat([t.plans for t in todos])
        groups = None
        if any(t.group_ids is not None for t in todos):
            groups = [g for t in todos for g in t.group_ids or ()]
        domains, steps = placement(todos)
        return self._client.put(keys, plans, groups, domains=domains, steps=steps)
