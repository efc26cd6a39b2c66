"""A workload's host pools (real sglang classes) and which of their pages a run moves.

Filling, wiping and comparing those pages is ``testing.page_io``'s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sglang.srt.mem_cache.hicache_storage import (
    PoolName,
)

from mooncake_span.sglang_backend.pool_layout import describe_pool
from mooncake_span.span.plan import PageLayout
from mooncake_span_tools.bench.workloads import DSA_INDEX_KPOOL, HOST_PAGE_TOKENS, ModelShape
from mooncake_span_tools.testing import page_io
from mooncake_span_tools.testing import pools as P

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------
# host pools and page views


@dataclass
class PoolPart:
    """One host pool of a workload as the harness addresses it."""

    name: PoolName
    pool: Any
    layout: PageLayout
    per_key: bool  # True: K host pages per key; False: one state slot per call (Mamba)
    views: list[np.ndarray] = field(default_factory=list)  # one (pages, slot bytes) view per slot

    @property
    def page_bytes(self) -> int:
        return self.layout.flat_page_bytes


def _stock_parts(
    model: ModelShape, layout: str, host_pages: int, state_slots: int
) -> list[tuple[PoolName, Any, bool]]:
    # sglang sizes these pools itself (host = ratio x device): one device page
    # and one device state slot, so the ratio is the host page count.
    from mooncake_span_tools.testing.stock_glm import build_stock_glm_pools

    pools = build_stock_glm_pools(
        layout,
        host_to_device_ratio=float(max(host_pages, state_slots)),
        layers=model.layers,
        mamba_layers=model.mamba_layers,
        draft_layers=model.draft_layers,
        kv_lora_rank=model.kv_lora_rank,
        rope_dim=model.rope_dim,
        device_pages=1,
        mamba_slots=1,
    ).pools
    kv = pools[PoolName.KV]
    if kv.page_size != model.page_tokens or kv.size < host_pages * kv.page_size:
        raise ValueError(
            f"{model.label}: sglang built {kv.size // kv.page_size} host pages of "
            f"{kv.page_size} tokens, {host_pages} of {model.page_tokens} needed"
        )
    return [
        (PoolName.KV, kv, True),
        (PoolName.INDEXER, pools[PoolName.INDEXER], True),
        (PoolName.MAMBA, pools[PoolName.MAMBA], False),
    ]


def build_parts(
    model: ModelShape, layout: str, host_pages: int, state_slots: int
) -> list[PoolPart]:
    if model.family == "dsa":
        pools = P.build_compressed_hybrid_dsa(
            layout,
            layers=model.layers,
            host_pages=host_pages,
            mamba_layers=model.mamba_layers,
            mamba_slots=state_slots,
            kv_lora_rank=model.kv_lora_rank,
            rope_dim=model.rope_dim,
            index_kpool=DSA_INDEX_KPOOL,
        ).pools
        named = [
            (PoolName.KV, pools[PoolName.KV], True),
            (PoolName.INDEXER, pools[PoolName.INDEXER], True),
            (PoolName.MAMBA, pools[PoolName.MAMBA], False),
        ]
    elif model.family == "dsa-stock":
        named = _stock_parts(model, layout, host_pages, state_slots)
    elif model.family == "mla":
        kv = P.build_mla_host(
            layout,
            layers=model.layers,
            page_tokens=HOST_PAGE_TOKENS,
            host_pages=host_pages,
            kv_lora_rank=model.kv_lora_rank,
            rope_dim=model.rope_dim,
        )
        named = [(PoolName.KV, kv, True)]
    else:
        kv = P.build_mha_host(
            layout,
            layers=model.layers,
            page_tokens=HOST_PAGE_TOKENS,
            host_pages=host_pages,
            heads=model.heads,
            head_dim=model.head_dim,
        )
        named = [(PoolName.KV, kv, True)]
    parts = []
    for name, pool, per_key in named:
        shape = describe_pool(str(name.value), pool, is_mla=model.is_mla)
        if shape.staged or shape.layout is None:
            raise ValueError(f"{model.label}/{layout}: pool {name} has no zero-copy pointers")
        parts.append(PoolPart(name, pool, shape.layout, per_key, page_io.slot_views(shape.layout)))
    return parts


def host_pools(parts: list[PoolPart]) -> dict[PoolName, Any]:
    """The parts' pools by name, KV first: what a backend registers."""
    return {part.name: part.pool for part in parts}


@dataclass(frozen=True)
class Placement:
    """Source and destination host pages of a workload, in two orders.

    ``src``/``dst`` are the same page *sets* for both orders: ``scattered`` is
    a random permutation (the K pages of a key are almost never adjacent);
    ``consecutive`` lists random 8-page-aligned blocks in ascending page order,
    so every key of K <= 8 pages covers adjacent host pages.
    """

    scattered: tuple[np.ndarray, np.ndarray]
    consecutive: tuple[np.ndarray, np.ndarray]
    state_src: np.ndarray
    state_dst: np.ndarray

    @classmethod
    def make(cls, pages: int, calls: int, rng: np.random.Generator) -> Placement:
        block = 8
        blocks = rng.permutation(2 * pages // block)
        src_b, dst_b = blocks[: pages // block], blocks[pages // block :]
        expand = lambda b: (b[:, None] * block + np.arange(block)).reshape(-1)  # noqa: E731
        src_c, dst_c = expand(src_b), expand(dst_b)
        states = rng.permutation(2 * calls)
        return cls(
            scattered=(rng.permutation(src_c), rng.permutation(dst_c)),
            consecutive=(src_c, dst_c),
            state_src=states[:calls],
            state_dst=states[calls:],
        )

    def pages(self, placement: str) -> tuple[np.ndarray, np.ndarray]:
        return self.consecutive if placement == "consecutive" else self.scattered
