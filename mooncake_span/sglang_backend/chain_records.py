"""Chain records of a sample of conversations, for ``inspect``'s reachable estimate.

After a KV backup that named its prefix chain (``span_refresh_prefix`` keeps
the prefix keys) and stored every key, a chain whose root is sampled
(``span_chain_sample_every``, ``span.chains.chain_sampled``) gets a record of
its page keys so far, one small object put through the staging arena. The
record is an ordinary object: no pin, evicted like the rest. It costs one put
(two master RPCs) per backup of a sampled chain; a record that cannot be
written is left out (the client counts a refusal) and the backup's own answer
stands.
"""

from __future__ import annotations

import ctypes
import logging

from mooncake_span.errors import MooncakeSpanError
from mooncake_span.sglang_backend.stored_pool import PoolBatch
from mooncake_span.span.chains import chain_record_key, chain_sampled, record_bytes
from mooncake_span.span.keys import KeySchema
from mooncake_span.span.plan import ObjectPlan
from mooncake_span.store.arena import StagingArena
from mooncake_span.store.client import MooncakeClient

logger = logging.getLogger(__name__)


class ChainRecords:
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
