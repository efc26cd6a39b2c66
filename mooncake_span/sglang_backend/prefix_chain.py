"""Where a call's keys sit in their prefix chain, from sglang's ``extra_info``.

With ``hicache_storage_pass_prefix_keys: true`` in the storage extra-config,
sglang 0.5.23's controllers pop the knob (it never reaches the backend's
config) and hand every backup, hit query and prefetch batch an
``HiCacheStorageExtraInfo`` whose ``prefix_keys`` are the page hashes from
the start of the sequence up to the call's first key: ``prefix_keys + keys``
is one chain, whichever batch of the conversation the call carries. The chain
root (the first prefix key, or the call's first key when there is none) and
the position ``len(prefix_keys)`` are all placement needs
(``store/domains.ChainSpot``). ``prefix_keys`` None: the knob is off, and
placement stays per storage key. The prefix keys themselves
(``prefix_keys_of``) are the objects whose leases a backup or a hit query
renews (``span_refresh_prefix``), so that eviction takes the chain's tail first.

Chain records (``ChainRecords``) serve ``inspect``'s reachable estimate: after a
KV backup that named its prefix chain (``span_refresh_prefix`` keeps the prefix
keys) and stored every key, a chain whose root is sampled
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
import threading
from typing import Any

from mooncake_span.errors import InvalidRequestError, MooncakeSpanError
from mooncake_span.sglang_backend.stored_pool import PoolBatch
from mooncake_span.span.chains import chain_record_key, chain_sampled, record_bytes
from mooncake_span.span.keys import KeySchema, check_page_keys
from mooncake_span.span.plan import ObjectPlan
from mooncake_span.store.arena import StagingArena
from mooncake_span.store.client import MooncakeClient
from mooncake_span.store.domains import ChainSpot

logger = logging.getLogger(__name__)

PASS_PREFIX_KEYS = "hicache_storage_pass_prefix_keys"


def chain_of(
    extra_info: Any,
    page_keys: list[str],
    schema: KeySchema,
    window_keys: int,
    stripe_keys: int = 0,
) -> ChainSpot | None:
    """The chain spot of ``page_keys`` (validated, non-empty), or None without prefix keys."""
    prefix = getattr(extra_info, "prefix_keys", None)
    if prefix is None:
        return None
    if not isinstance(prefix, (list, tuple)):
        raise InvalidRequestError(
            f"extra_info.prefix_keys must be a list of str, got {type(prefix).__name__}"
        )
    root = prefix[0] if prefix else page_keys[0]
    if not isinstance(root, str) or not root:
        raise InvalidRequestError(f"extra_info.prefix_keys[0] must be a non-empty str: {root!r}")
    # The root's own per-key domain: a chain and its first key share a segment.
    (domain,) = schema.domains([root], 1)
    return ChainSpot(domain, len(prefix), window_keys, stripe_keys)


def prefix_keys_of(extra_info: Any) -> list[str]:
    """The prefix keys sglang passed, validated; [] without them."""
    prefix = getattr(extra_info, "prefix_keys", None)
    if not prefix:
        return []
    try:
        return check_page_keys(prefix)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"extra_info.prefix_keys: {exc}") from None


class PerKeyNotice:
    """One log line, at the first backup that arrives without prefix keys."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._said = False

    def backup(self, chain: ChainSpot | None) -> None:
        if chain is not None or self._said:
            return
        with self._lock:
            if self._said:
                return
            self._said = True
        logger.info(
            "mooncake-span: backups arrive without prefix keys, so each storage key is placed "
            "on its own segment; set %s: true in the storage extra-config to keep a "
            "conversation's keys on one node (losing 1 of N nodes then costs about 1/N of the "
            "cached prefixes, not nearly all of them)",
            PASS_PREFIX_KEYS,
        )


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
