"""The read path: sglang's gets, top-down from its call to the native get.

Walked through step by step in docs/architecture.md, "One ``batch_get_v1``".
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from mooncake_span.sglang_backend.guard import (
    miss_none_per_key,
    miss_per_key,
    miss_per_transfer,
    never_raise,
)
from mooncake_span.sglang_backend.recording import GET, CallRecorder, recorded
from mooncake_span.sglang_backend.registration import Registration
from mooncake_span.sglang_backend.stager import Stager
from mooncake_span.sglang_backend.stored_pool import (
    PoolBatch,
    Transfer,
    joined,
    move_selected,
    object_keys,
    per_key_results,
)
from mooncake_span.span.geometry import KV_POOL
from mooncake_span.store.client import MooncakeClient


class ReadPath:
    """The get methods of ``MooncakeSpanStore``, on the collaborators ``backend.py`` builds."""

    registration: Registration
    client: MooncakeClient
    stager: Stager
    recorder: CallRecorder

    @never_raise(miss_per_key)
    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info=None) -> list[bool]:
        batch = self.registration.pool_batch(KV_POOL, keys, host_indices, extra_info=extra_info)
        return self._get([batch], kv_call=True)[0]

    @never_raise(miss_per_transfer)
    def batch_get_v2(self, transfers: list[Any], extra_info=None) -> dict[Any, list[bool]]:
        request = self.registration.transfer_batches(transfers, extra_info)
        for refused in request.refused:
            self.recorder.reject("batch_get_v2", refused)
        if request.batches:
            request.answer(self._get(request.batches))
        return request.results

    @never_raise(miss_none_per_key)
    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        if target_locations is not None:
            targets = list(target_locations)
        else:
            self.registration.begin_io()  # the flat value's size follows K
            span_bytes = self.registration.span_bytes
            targets = [torch.empty(span_bytes, dtype=torch.uint8) for _ in keys]
        batch = self.registration.flat_batch(keys, targets)
        (ok,) = self._get([batch], kv_call=True)
        return [t if good else None for t, good in zip(targets, ok, strict=True)]

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    @recorded(GET)
    def _get(self, batches: list[PoolBatch]) -> list[list[bool]]:
        """Per batch, per key: did every object of the key arrive?"""
        physical = [b for b in batches if not b.pool.is_logical]
        todos = [b.pool.read_all(b) for b in physical]
        if not any(b.staged for b in physical):  # nearly every call: one native get
            keys = object_keys(physical)
            return per_key_results(batches, self._get_direct(keys, todos) if keys else [])
        flags = [False] * sum(len(b.object_keys) for b in physical)
        move_selected(physical, todos, flags, self._get_staged, self._get_direct)
        return per_key_results(batches, flags)

    def _get_direct(self, keys: list[str], todos: list[Transfer]) -> list[bool]:
        """One native get of zero-copy batches, into the host pools' (registered) memory."""
        todo = joined(todos)
        return self.client.get(keys, todo.plans, todo.domains, todo.steps)

    def _get_staged(self, batch: PoolBatch, todo: Transfer) -> list[bool]:
        """A staged batch's objects, one native get per lease of the arena."""
        flags: list[bool] = []
        with contextlib.closing(self.stager.parts(batch, todo)) as parts:
            for part in parts:
                domains, steps = part.cut(todo.domains, todo.steps)
                got = self.client.get(part.keys(), part.plans(), domains, steps)
                self.stager.unstage(part, got)
                flags += got
        return flags
