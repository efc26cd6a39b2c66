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
   It first asks ``StoredCheck`` which objects are stored already and whether
   the chain's prefix is (``stored_check.py``: one existence query, which
   renews the prefix's leases so eviction takes the tail first); behind a hole
   in the chain nothing is written (``span_skip_unreachable``). Otherwise it
   puts only the missing objects (``StoredPool.write_missing``) with their
   eviction group ids and failure-domain placement keys: the zero-copy
   batches in one ``MooncakeClient.put`` (segments cut by the buffer budget and
   the grouped-put cap, each part through ``NativeGate.invoke``), each staged
   batch through the arena in lease-sized parts, its rows copied in first;
4. folds the per-object flags (stored, or written now) to per-key results.

A put's own objects keep the chain's order (a call the cluster refuses part
of keeps its reachable head).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from mooncake_span.errors import InvalidRequestError
from mooncake_span.sglang_backend.chain_records import ChainRecords
from mooncake_span.sglang_backend.guard import (
    miss_flag,
    miss_per_key,
    miss_per_transfer,
    never_raise,
)
from mooncake_span.sglang_backend.objects import (
    joined,
    move_selected,
    object_keys,
    per_batch,
    per_key_results,
)
from mooncake_span.sglang_backend.prefix_chain import PerKeyNotice
from mooncake_span.sglang_backend.recording import SET, CallRecorder, recorded
from mooncake_span.sglang_backend.registration import Registration
from mooncake_span.sglang_backend.stager import Stager
from mooncake_span.sglang_backend.stored_check import StoredCheck
from mooncake_span.sglang_backend.stored_pool import PoolBatch, Transfer
from mooncake_span.span.geometry import KV_POOL
from mooncake_span.store.client import MooncakeClient
from mooncake_span.store.domain_calls import Puts


class WritePath:
    """The put methods of ``MooncakeSpanStore``, on the collaborators ``backend.py`` builds."""

    registration: Registration
    stored_check: StoredCheck
    client: MooncakeClient
    stager: Stager
    recorder: CallRecorder
    chain_records: ChainRecords
    per_key_notice: PerKeyNotice

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
        answer = self.stored_check.ask(physical, keys)
        if not answer.prefix_head_stored:
            # Behind a hole in its chain: what is stored reads True, nothing is written.
            return per_key_results(batches, answer.stored)
        schema, group_ids = self.registration.key_schema, self.registration.group_ids
        todos = [
            batch.pool.write_missing(batch, part, schema, group_ids)
            for batch, part in zip(physical, per_batch(answer.stored, physical), strict=True)
        ]
        if not any(b.staged for b in physical) and all(t.object_indices is None for t in todos):
            # Every object moves, in order: no per-object bookkeeping.
            return per_key_results(batches, self._put_direct(keys, todos) if keys else [])
        flags = list(answer.stored)
        move_selected(physical, todos, flags, self._put_staged, self._put_direct)
        return per_key_results(batches, flags)

    def _put_direct(self, keys: list[str], todos: list[Transfer]) -> list[bool]:
        """One native put of zero-copy batches, from the host pools' (registered) memory."""
        todo = joined(todos)
        puts = Puts(keys, todo.plans, todo.group_ids, domains=todo.domains, steps=todo.steps)
        return self.client.put_objects(puts)

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
