"""What sglang 0.5.23's HybridCacheController hands a storage backend, without its scheduler.

Tools that drive a backend as the controller does (the pool-level demo, the
soak, the benchmarks) build their calls here: the pool names, the batch size,
page hashes and the ``PoolTransfer`` of each sidecar pool. The DSA indexer
follows the KV pool's host indices on a backup and a hit query, and names its
own on a restore; a request's Mamba state belongs to its last page
(``TRAILING_PAGES``). Keeping these in one place keeps sglang's types out of
the tooling packages (``lab/``, ``ops/``), which only load this lazily.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.utils import get_hash_str

__all__ = [
    "INDEXER",
    "KV",
    "MAMBA",
    "STORAGE_BATCH_SIZE",
    "chained_keys",
    "hit_query",
    "indexer",
    "page_hashes",
    "slots_of_pages",
    "state",
]

KV, INDEXER, MAMBA = PoolName.KV, PoolName.INDEXER, PoolName.MAMBA


def page_hashes(tokens: Sequence[int], page_tokens: int) -> list[str]:
    """sglang's storage keys of ``tokens``, one per ``page_tokens`` (a prefix chain)."""
    return list(get_hash_str(list(tokens), None, page_size=page_tokens))


def chained_keys(root: str, count: int) -> list[str]:
    """``count`` keys chained like sglang's page hashes (key i hashes key i-1), from ``root``:
    the keys of one request or conversation, without its tokens."""
    keys, prior = [], root
    for i in range(count):
        prior = hashlib.sha256(f"{prior}:{i}".encode()).hexdigest()
        keys.append(prior)
    return keys


def slots_of_pages(pages: Sequence[int], page_tokens: int) -> torch.Tensor:
    """The host slot indices of whole pages, in the pages' order."""
    return torch.cat([torch.arange(p * page_tokens, (p + 1) * page_tokens) for p in pages])


def indexer(keys: list[str] | None, slots: Any = None, *, follows_kv: bool = True) -> PoolTransfer:
    """The indexer pages of ``keys``. ``follows_kv``: addressed by the KV pool's
    host indices, as on a backup and a hit query (``keys`` None: KV's keys)."""
    return PoolTransfer(
        INDEXER, host_indices=slots, keys=keys, indices_from_pool=KV if follows_kv else None
    )


def state(keys: list[str], slots: Any = None) -> PoolTransfer:
    """The Mamba state of the request whose last key is ``keys[-1]``."""
    return PoolTransfer(
        MAMBA, host_indices=slots, keys=keys, hit_policy=PoolHitPolicy.TRAILING_PAGES
    )


def hit_query(placeholder: str = "__placeholder__") -> list[PoolTransfer]:
    """The sidecar transfers of a hit query over the DSA pools (the state's key is a
    placeholder: the backend answers for the query's last key)."""
    return [indexer(None), state([placeholder])]
