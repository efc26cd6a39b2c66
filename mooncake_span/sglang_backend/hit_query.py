"""Hit queries (``batch_exists`` / ``batch_exists_v2``) that probe only what can be read.

A probe leases what it finds, so the rounds follow ``span.hit_rounds`` (which
says why and how); the hit math itself is ``span.hits``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from mooncake_span.sglang_backend.pool_layout import pool_name_str
from mooncake_span.sglang_backend.stored_pool import StoredPool, split
from mooncake_span.span.hit_rounds import (
    KV_ROUNDS_ALONE,
    KV_ROUNDS_WITH_SIDECARS,
    ProbePolicy,
    ProbeTally,
    sidecar_pages,
)
from mooncake_span.span.hits import (
    HitResult,
    PoolHitQuery,
    compute_hits,
    leading_run,
)
from mooncake_span.span.keys import KeySchema
from mooncake_span.store.client import MooncakeClient
from mooncake_span.store.domains import ChainSpot


def _pool_query(transfer: Any, page_exists: Sequence[bool]) -> PoolHitQuery:
    return PoolHitQuery(
        name=pool_name_str(transfer.name),
        policy=pool_name_str(transfer.hit_policy),
        page_exists=page_exists,
        window_pages=len(transfer.keys) if transfer.keys else 1,
        block_pages=int(getattr(transfer, "block_pages", 0) or 0),
        group_pages=int(getattr(transfer, "group_pages", 0) or 0),
    )


class HitProber:
    """Existence rounds of one backend's hit queries, counted in a ``ProbeTally``."""

    def __init__(self, client: MooncakeClient) -> None:
        self._client = client
        self.policy = ProbePolicy()

    def _round(
        self,
        schema: KeySchema,
        parts: Sequence[tuple[StoredPool, list[str], int]],
        tally: ProbeTally,
        chain: ChainSpot | None,
        touch: Sequence[str] = (),
    ) -> list[list[bool]]:
        """One existence query for every (pool, keys, offset of keys[0] in the
        query) part, counted by the RPCs the client sends for it; per part, per
        key flags. With ``chain``, the client learns where each object was
        placed (it matters while a segment is bad). ``touch``: objects whose
        leases the query renews besides (``MooncakeClient.exists_and_touch``)."""
        per_part = [pool.object_keys(schema, keys) for pool, keys, _ in parts]
        flat = [k for keys in per_part for k in keys]
        domains = steps = None
        if chain is not None:
            domains, steps = [], []
            for pool, keys, offset in parts:
                per_key = 0 if pool.is_logical else pool.num_components
                more = chain.objects(range(offset, offset + len(keys)), per_key)
                domains += more[0]
                steps += more[1]
        sent: list[None] = []  # one entry per native RPC the client sends
        found = []
        if flat:
            on_rpc = functools.partial(sent.append, None)
            found = self._client.exists_and_touch(flat, touch, domains, steps, on_rpc).found
        tally.add(len(flat) + len(touch), len(sent))
        counts = [len(keys) for keys in per_part]
        return [
            pool.fold(flags)
            for (pool, _, _), flags in zip(parts, split(found, counts), strict=True)
        ]

    def kv_prefix(
        self,
        schema: KeySchema,
        kv: StoredPool,
        page_keys: list[str],
        max_rounds: int,
        tally: ProbeTally,
        chain: ChainSpot | None = None,
        prefix_keys: Sequence[str] = (),
    ) -> int:
        """Leading keys whose KV objects all exist, probed chunk by chunk. The
        first round also renews the leases of the KV objects of ``prefix_keys``
        (the chain's keys before ``page_keys``): reading a chain keeps its prefix
        as new as its tail for Mooncake's eviction, at no extra RPC."""
        touch = kv.object_keys(schema, list(prefix_keys)) if prefix_keys else []
        for start, end in self.policy.chunks(len(page_keys), max_rounds):
            part = [(kv, page_keys[start:end], start)]
            (flags,) = self._round(schema, part, tally, chain, touch)
            touch = []
            run = leading_run(flags)
            if run < end - start:
                return start + run
        return len(page_keys)

    def hits(
        self,
        schema: KeySchema,
        kv: StoredPool,
        page_keys: list[str],
        transfers: Sequence[tuple[Any, StoredPool]],
        tally: ProbeTally,
        chain: ChainSpot | None = None,
        prefix_keys: Sequence[str] = (),
    ) -> HitResult:
        """``batch_exists_v2``'s answer; ``transfers`` pairs each PoolTransfer with its pool.
        ``prefix_keys``: as for ``kv_prefix``."""
        # Each query checks its policy: a bad request is refused before anything is leased.
        queries = [_pool_query(t, ()) for t, _ in transfers]
        if kv.is_logical:
            # A logical anchor (DeepSeek-V4) stores no KV bytes: the sidecars
            # decide, over every key asked.
            kv_pages = len(page_keys)
        else:
            rounds = KV_ROUNDS_WITH_SIDECARS if transfers else KV_ROUNDS_ALONE
            kv_pages = self.kv_prefix(schema, kv, page_keys, rounds, tally, chain, prefix_keys)
        if not kv_pages or not transfers:
            return compute_hits(kv_pages, [])
        needed = [sidecar_pages(q.policy, kv_pages, q.block_pages, q.group_pages) for q in queries]
        parts = [(pool, page_keys[:n], 0) for (_, pool), n in zip(transfers, needed, strict=True)]
        flags = self._round(schema, parts, tally, chain)
        queries = [replace(q, page_exists=f) for q, f in zip(queries, flags, strict=True)]
        return compute_hits(kv_pages, queries)
