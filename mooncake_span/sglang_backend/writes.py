"""The write path: sglang's puts, top-down from its call to the native put.

Walked through step by step in docs/architecture.md, "One ``batch_set_v1``". A
put's own objects keep the chain's order (a call the cluster refuses part of
keeps its reachable head).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mooncake_span.errors import InvalidRequestError, MooncakeSpanError
from mooncake_span.sglang_backend.guard import (
    miss_flag,
    miss_per_key,
    miss_per_transfer,
    never_raise,
)
from mooncake_span.sglang_backend.recording import SET, CallRecorder, recorded
from mooncake_span.sglang_backend.registration import Registration
from mooncake_span.sglang_backend.stager import Stager
from mooncake_span.sglang_backend.stored_pool import (
    PoolBatch,
    Transfer,
    chain_placement,
    joined,
    move_selected,
    object_keys,
    per_batch,
    per_key_results,
    prefix_objects,
)
from mooncake_span.span.chains import chain_record_key, chain_sampled, record_bytes
from mooncake_span.span.geometry import KV_POOL, PoolKind
from mooncake_span.span.keys import KeySchema
from mooncake_span.span.plan import ObjectPlan
from mooncake_span.store.arena import StagingArena
from mooncake_span.store.client import MooncakeClient
from mooncake_span.store.domains import ChainSpot
from mooncake_span.store.gate import Puts
from mooncake_span.store.router import STORED, UNREACHABLE

logger = logging.getLogger(__name__)

PASS_PREFIX_KEYS = "hicache_storage_pass_prefix_keys"


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


# ---- before a put: stored already? --------------------------------------------------


@dataclass(frozen=True)
class StoredAnswer:
    stored: list[bool]  # per object of the call
    prefix_head_stored: bool  # the prefix objects the query carried (True: none)


# Longer than the sidecar put that separates the two calls, short against eviction.
FRESH_S = 1.0


class KvAhead:
    """One answer per thread, taken by the next KV call of that thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._local = threading.local()
        self._clock = clock

    def keep(self, objects: list[str], answer: StoredAnswer) -> None:
        self._local.kept = (objects, answer, self._clock())

    def take(self, objects: list[str]) -> StoredAnswer | None:
        """The kept answer if about exactly ``objects`` and fresh (used up either way)."""
        kept_objects, answer, at_s = getattr(self._local, "kept", None) or ((), None, 0.0)
        self._local.kept = None
        return answer if self._clock() - at_s <= FRESH_S and kept_objects == objects else None


class StoredCheck:
    """Before a put: which of its objects are stored already, and is the chain's prefix?

    What ``StoredAnswer``'s two fields mean, and why the query renews the
    prefix's leases: docs/architecture.md, "One ``batch_set_v1``", step 3, and
    docs/operating.md, "Eviction". A sidecar backup (``batch_set_v2`` with a
    KV-derived pool, DSA's indexer among them, whose keys are the KV keys) also
    asks about the KV objects of its keys and keeps the answer (``KvAhead``)
    for the ``batch_set_v1`` sglang sends next on the same backup thread: one
    master RPC less per backup. A kept answer serves once, the thread that
    asked, exactly the same objects, within ``FRESH_S``; otherwise the KV call
    asks as always.
    """

    def __init__(
        self, client: MooncakeClient, registration: Registration, skip_unreachable: bool
    ) -> None:
        self._client = client
        self._pressure = client.pressure
        self._registration = registration
        self._skip_unreachable = skip_unreachable
        self._kv_ahead = KvAhead()  # a sidecar backup's answers for the KV call after it

    def ask(self, physical: list[PoolBatch], keys: list[str]) -> StoredAnswer:
        """For ``keys``, the object keys of ``physical`` (its stored pools) in order."""
        if not keys:
            return StoredAnswer([], True)
        answer = self._kv_ahead.take(keys) or self._query(physical, keys)
        if True in answer.stored:
            self._pressure.count(STORED, answer.stored.count(True))
        if not answer.prefix_head_stored:
            self._pressure.count(UNREACHABLE, answer.stored.count(False))
        return answer

    def _query(self, physical: list[PoolBatch], keys: list[str]) -> StoredAnswer:
        """One existence query: the call's, the next KV call's and the chain prefix's objects."""
        placed, ahead, ahead_prefix = (None, None), [], []
        if self._client.untroubled:
            ahead, ahead_prefix = self._kv_of_sidecars(physical)
        else:
            # A segment bad or a key lost: where objects sit matters (a pass per object).
            placed = chain_placement(physical)
        touch = [*prefix_objects(physical, self._registration.key_schema), *ahead_prefix]
        existence = self._client.exists_and_touch([*keys, *ahead], touch, *placed)
        head_stored = not self._skip_unreachable or all(existence.touched_head)
        if ahead:
            self._kv_ahead.keep(ahead, StoredAnswer(existence.found[len(keys) :], head_stored))
        return StoredAnswer(existence.found[: len(keys)], head_stored)

    def _kv_of_sidecars(self, physical: list[PoolBatch]) -> tuple[list[str], list[str]]:
        """For a sidecar call (no KV batch in it): the KV objects of its KV-derived
        batch's keys and of their chain prefix, asked now for the KV call after it."""
        kv = self._registration.pools.get(KV_POOL)
        derived = next((b for b in physical if b.pool.kind is PoolKind.KV_DERIVED), None)
        if derived is None or kv is None or kv.is_logical or any(b.pool is kv for b in physical):
            return [], []
        schema, objects = self._registration.key_schema, kv.object_keys
        return objects(schema, derived.page_keys), objects(schema, derived.prefix_keys)


class PerKeyNotice:
    """One log line, at the first backup that arrives without prefix keys."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._said = False

    def backup(self, chain: ChainSpot | None) -> None:
        if chain is not None or self._said:
            return
        with self._lock:
            said, self._said = self._said, True
        if not said:
            logger.info(
                "mooncake-span: backups arrive without prefix keys, so each storage key is placed "
                "on its own segment; set %s: true in the storage extra-config to keep a "
                "conversation's keys on one node (losing 1 of N nodes then costs about 1/N of the "
                "cached prefixes, not nearly all of them)",
                PASS_PREFIX_KEYS,
            )


class ChainRecords:
    """After a KV backup that stored every key, a sampled chain gets a record of
    its page keys for ``inspect``'s reachable estimate (span/chains.py).

    The record is an ordinary object (no pin, evicted like the rest) costing
    one put per backup of a sampled chain; one that cannot be written is left
    out (the client counts a refusal) and the backup's own answer stands.
    """

    def __init__(self, client: MooncakeClient, arena: StagingArena, every: int) -> None:
        self._client = client
        self._arena = arena
        self._every = every

    def after_backup(self, schema: KeySchema, batch: PoolBatch, results: list[bool]) -> None:
        if batch.chain is None or not results or not all(results):
            return
        chain = [*batch.prefix_keys, *batch.page_keys]
        if len(chain) == len(batch.page_keys) and batch.chain.start:
            return  # the prefix keys were not kept (span_refresh_prefix off)
        if not chain_sampled(chain[0], self._every):
            return
        data = record_bytes(chain)
        key = chain_record_key(schema.prefix, chain[0], len(chain))
        try:
            with self._arena.lease(len(data), len(data)) as lease:
                ctypes.memmove(lease.ptr, data, len(data))
                # Unsealed: inspect reads a record as text.
                self._client.put([key], [ObjectPlan([lease.ptr], [len(data)])], sealed=False)
        except MooncakeSpanError as exc:
            # A refusal is counted by the client; the backup's own answer stands.
            logger.debug("mooncake-span: chain record %s not written: %s", key, exc)
