"""The write path: sglang's puts, top-down from its call to the native put.

A backup calls ``batch_set_v2`` (sidecar pools, one ``PoolTransfer`` each)
and then ``batch_set_v1`` (the KV pool) or, without ``interface_v1``, the
generic ``batch_set`` (flat page tensors). Each method:

1. is wrapped in ``guard.never_raise``: whatever happens below, sglang gets
   per-key results (a refusal or a failure is a logged miss);
2. turns its arguments into ``PoolBatch`` es (``Registration.pool_batch``,
   ``transfer_batches``, ``flat_batch``), and says once if backups arrive
   without prefix keys (``PerKeyNotice``);
3. runs ``_put``, wrapped in ``recording.recorded``, which records what moved.
   It first asks which objects are already stored (another rank or node wrote
   them; asked in a put cool-down too, so a stored key reads True at every
   moment), renewing in the same query the leases of the chain's prefix
   (``PoolBatch.prefix_keys``), and, in a sidecar call, asking for the KV call
   that follows about its KV objects (``kv_ahead.KvAhead``: that call then sends
   no query); when that prefix is not wholly stored, the
   new keys could never be reached and nothing is written
   (``span_skip_unreachable``); otherwise it puts only the missing ones
   (``StoredPool.write_missing``) with their eviction group ids and
   failure-domain placement keys: the zero-copy
   batches in one ``MooncakeClient.put`` (segments cut by the buffer budget and
   the grouped-put cap, each part through ``NativeGate.invoke``), each staged
   batch through the arena in lease-sized parts, its rows copied in first;
4. folds the per-object flags (stored, or written now) to per-key results.

Why the prefix's leases: Mooncake evicts the objects with the oldest lease
timestamp first; a put stamps an object with the time it lands, and a lookup
stamps what it finds with now + the lease TTL. Renewed just before the tail
is put, a conversation's prefix is newer than its tail by about the TTL, so
eviction takes the tail first and a stored key stays reachable from the
chain's root (docs/operating.md, "Eviction"). A put's own objects keep the
chain's order (a call the cluster refuses part of keeps its reachable head).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from mooncake_span.errors import InvalidRequestError
from mooncake_span.sglang_backend.guard import (
    miss_flag,
    miss_per_key,
    miss_per_transfer,
    never_raise,
)
from mooncake_span.sglang_backend.objects import (
    chain_placement,
    object_keys,
    per_batch,
    per_key_results,
    placement,
    prefix_objects,
    put_back,
    select,
)
from mooncake_span.sglang_backend.recording import SET, recorded
from mooncake_span.sglang_backend.stored_pool import PoolBatch, Transfer
from mooncake_span.span.geometry import KV_POOL, PoolKind
from mooncake_span.span.plan import PlanBatch
from mooncake_span.store.put_cooldown import STORED, UNREACHABLE


class WritePath:
    """The put methods of ``MooncakeSpanStore``, on what ``backend.py`` builds:
    its ``options``, ``registration``, ``client``, ``stager``, ``recorder``,
    ``kv_ahead``, ``chain_records`` and ``per_key_notice``."""

    @never_raise(miss_per_key)
    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info=None) -> list[bool]:
        batch = self.registration.pool_batch(KV_POOL, keys, host_indices, extra_info=extra_info)
        self.per_key_notice.backup(batch.chain)
        results = self._put([batch], kv_call=True)[0]
        self.chain_records.after_backup(self.registration.key_schema, batch, results)
        return results

    @never_raise(miss_per_transfer)
    def batch_set_v2(self, transfers: list[Any], extra_info=None) -> dict[Any, list[bool]]:
        request = self.registration.transfer_batches(transfers, extra_info)
        for refused in request.refused:
            self.recorder.reject("batch_set_v2", refused)
        if request.batches:
            self.per_key_notice.backup(request.batches[0].chain)
            request.answer(self._put(request.batches))
        return request.results

    @never_raise(miss_flag)
    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        if values is None:
            raise InvalidRequestError("batch_set needs values (flat page tensors)")
        values = [v.contiguous() if isinstance(v, torch.Tensor) else v for v in values]
        batch = self.registration.flat_batch(keys, values)
        (ok,) = self._put([batch], kv_call=True)
        return bool(ok) and all(ok)

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], None if value is None else [value])

    @recorded(SET)
    def _put(self, batches: list[PoolBatch]) -> list[list[bool]]:
        """Per batch, per key: is every object of the key stored now?"""
        physical = [b for b in batches if not b.pool.is_logical]
        keys = object_keys(physical)
        schema, group_ids = self.registration.key_schema, self.registration.group_ids
        stored, reachable = self._stored(physical, keys)
        if not reachable:
            # Behind a hole in its chain: what is stored reads True, nothing is written.
            self.client.pressure.count(UNREACHABLE, stored.count(False))
            return per_key_results(batches, stored)
        todos = [
            batch.pool.write_missing(batch, part, schema, group_ids)
            for batch, part in zip(physical, per_batch(stored, physical), strict=True)
        ]
        if not any(b.staged for b in physical) and all(t.object_indices is None for t in todos):
            # Every object moves, in order: no per-object bookkeeping.
            return per_key_results(batches, self._put_direct(keys, todos) if keys else [])
        chosen = select(physical, todos)
        flags = list(stored)
        for batch, todo, slots in chosen.staged:
            put_back(flags, slots, self._put_staged(batch, todo))
        if chosen.direct_keys:
            direct = self._put_direct(chosen.direct_keys, chosen.direct_todos)
            put_back(flags, chosen.direct_slots, direct)
        return per_key_results(batches, flags)

    def _stored(self, physical: list[PoolBatch], keys: list[str]) -> tuple[list[bool], bool]:
        """Which objects are stored already (another rank or node wrote them; asked
        in a put cool-down too), and whether the chain's prefix is wholly in the
        cluster (True when unknown or not checked). A KV call right after its
        sidecar call takes the answers that call asked for it (``KvAhead``)."""
        if not keys:
            return [], True
        kept = self.kv_ahead.take(keys)
        stored, reachable = (kept.stored, kept.reachable) if kept else self._ask(physical, keys)
        if True in stored:
            self.client.pressure.count(STORED, stored.count(True))
        return stored, reachable

    def _ask(self, physical: list[PoolBatch], keys: list[str]) -> tuple[list[bool], bool]:
        """One existence query: the call's objects, the KV objects a sidecar call asks
        for the KV call that follows, and the chain prefix's objects, whose leases
        it renews."""
        placed, ahead, ahead_prefix = (None, None), [], []
        if self.client.router.untroubled:
            ahead, ahead_prefix = self._kv_of_sidecars(physical)
        else:
            # Where a chain's objects sit matters to the check only while the router
            # is troubled (a bad segment); it costs a pass per object.
            placed = chain_placement(physical)
        touch = [*prefix_objects(physical, self.registration.key_schema), *ahead_prefix]
        answers = self.client.exists([*keys, *ahead], *placed, touch=touch)
        n, m = len(keys), len(ahead)
        reachable = not self.options.skip_unreachable or False not in answers[n + m :]
        if ahead:
            self.kv_ahead.keep(ahead, answers[n : n + m], reachable)
        return answers[:n], reachable

    def _kv_of_sidecars(self, physical: list[PoolBatch]) -> tuple[list[str], list[str]]:
        """For a sidecar call (no KV batch in it): the KV objects of its KV-derived
        batch's keys and of their chain prefix, asked now for the KV call after it."""
        kv = self.registration.pools.get(KV_POOL)
        if kv is None or kv.is_logical or any(b.pool is kv for b in physical):
            return [], []
        derived = next((b for b in physical if b.pool.kind is PoolKind.KV_DERIVED), None)
        if derived is None:
            return [], []
        schema = self.registration.key_schema
        objects = kv.object_keys(schema, derived.page_keys)
        return objects, kv.object_keys(schema, derived.prefix_keys)

    def _put_direct(self, keys: list[str], todos: list[Transfer]) -> list[bool]:
        """One native put of zero-copy batches, from the host pools' (registered) memory."""
        plans = PlanBatch.concat([t.plans for t in todos])
        groups = None
        if any(t.group_ids is not None for t in todos):
            groups = [g for t in todos for g in t.group_ids or ()]
        domains, steps = placement(todos)
        return self.client.put(keys, plans, groups, domains=domains, steps=steps)

    def _put_staged(self, batch: PoolBatch, todo: Transfer) -> list[bool]:
        """A staged batch's objects, one native put per lease of the arena."""
        flags: list[bool] = []
        with contextlib.closing(self.stager.parts(batch, todo)) as parts:
            for part in parts:
                self.stager.stage(part)
                groups, domains, steps = part.cut(todo.group_ids, todo.domains, todo.steps)
                flags += self.client.put(
                    part.keys(), part.plans(), groups, domains=domains, steps=steps
                )
        return flags
