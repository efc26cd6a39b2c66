"""The GLM-5.3-Flash pool set as stock sglang 0.5.23 builds it, on CPU.

On stock 0.5.23, ``arg_groups/model_overrides/deepseek_v2.py`` forces
``page_size = 64 * index_kpool`` for DSA models with compressed index keys
(256 tokens at ``index_kpool=4``), whatever ``--page-size`` says. That page is
the device page, the host page (``build_kv_host_pool(page_size=...)``) and
the radix-tree page, so one storage key covers one host page (K=1). The
indexer host pool strides by the anchor's 256-token host page: one host page
holds ``256 / index_kpool = 64`` compressed index rows per layer.
``build_hybrid_mamba_stack`` packs the MTP draft layers behind the target
layers of the KV and indexer host pools and adds the Mamba/KDA state entry.

Everything here goes through sglang's own objects and builders:
``DSATokenToKVPool`` (target and draft), ``HybridReqToTokenPool`` with KDA
(``KimiLinearCacheParams``) state, ``prepare_host_pool_config`` +
``build_host_pool_group`` (which calls ``build_kv_host_pool`` and the
indexer's own builder with the packed drafts) and ``build_mamba_host_pool``.
That is the composition ``build_hybrid_mamba_stack`` runs, minus the
controller (the test harness calls ``build_hybrid_mamba_stack`` itself).
One deviation: ``MambaPoolHost`` has no layer_first layout, and stock
``build_hybrid_mamba_stack`` hands it the global layout, so stock 0.5.23
refuses ``--hicache-mem-layout layer_first`` for this model at startup; a
layer_first set here keeps the KDA state page_first so the KV and indexer
layer_first paths can still be measured.

Call the builders inside ``sglang_cpu_runtime(layout=...)``: sglang's
assemblers read the published layout and host ratio.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from sglang.srt.configs.mamba_utils import (
    KimiLinearCacheParams,
    KimiLinearStateShape,
    Mamba2StateDType,
)
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.hybrid_cache.host_pool_config import prepare_host_pool_config
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
    build_host_pool_group,
    build_mamba_host_pool,
    build_pool_entry,
)
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, HybridReqToTokenPool
from sglang.srt.mem_cache.pool_host import HostPoolGroup

from mooncake_span_tools.testing.device_pools import (
    DSA_PAGE_TOKENS,
    _check_positive,
    make_dsa_device_pool,
)
from mooncake_span_tools.testing.pools import HybridPoolSet
from mooncake_span_tools.testing.sglang_cpu import KV_LAYOUTS, MAMBA_LAYOUTS

logger = logging.getLogger(__name__)

__all__ = [
    "STOCK_INDEX_KPOOL",
    "StockGlmDevice",
    "build_stock_glm_group",
    "build_stock_glm_pools",
    "make_stock_glm_device",
    "mamba_layout_for",
    "stock_page_tokens",
]

# GLM-5.3-Flash's compressed index keys: 4 tokens pooled per index row.
STOCK_INDEX_KPOOL = 4


def stock_page_tokens(index_kpool: int = STOCK_INDEX_KPOOL) -> int:
    """The page stock 0.5.23 forces for compressed DSA (deepseek_v2.py)."""
    return DSA_PAGE_TOKENS * index_kpool


def mamba_layout_for(layout: str) -> str:
    """The Mamba/KDA host layout next to a KV layout (no layer_first for it)."""
    return layout if layout in MAMBA_LAYOUTS else "page_first"


@dataclass(frozen=True)
class StockGlmDevice:
    """The device side sglang's stack builder reads: target + draft DSA pools,
    the request pool owning the KDA state, and the layer ids of each."""

    kv: DSATokenToKVPool
    drafts: tuple[DSATokenToKVPool, ...]
    req_to_token: HybridReqToTokenPool
    allocator: PagedTokenToKVPoolAllocator
    full_layer_mapping: dict[int, int]
    mamba_layer_ids: tuple[int, ...]

    @property
    def page_tokens(self) -> int:
        return self.kv.page_size

    @property
    def mamba(self):
        return self.req_to_token.mamba_pool

    @property
    def transfer_layer_id_max(self) -> int:
        """Transfer layer ids of the target model (drafts come after)."""
        return len(self.full_layer_mapping) + len(self.mamba_layer_ids)


def _interleaved_layer_ids(layers: int, mamba_layers: int) -> tuple[list[int], list[int]]:
    # Full attention and KDA layers alternate, extra layers of either kind at the end.
    full, mamba = [], []
    for i in range(max(layers, mamba_layers)):
        if i < layers:
            full.append(len(full) + len(mamba))
        if i < mamba_layers:
            mamba.append(len(full) + len(mamba))
    return full, mamba


def _kda_params(layer_ids: list[int], heads: int, head_dim: int) -> KimiLinearCacheParams:
    shape = KimiLinearStateShape.create(
        tp_world_size=1, num_heads=heads, head_dim=head_dim, conv_kernel_size=4
    )
    return KimiLinearCacheParams(
        shape=shape,
        layers=layer_ids,
        dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32),
    )


def make_stock_glm_device(
    *,
    layers: int = 2,
    mamba_layers: int = 2,
    draft_layers: int = 1,
    index_kpool: int = STOCK_INDEX_KPOOL,
    kv_lora_rank: int = 32,
    rope_dim: int = 16,
    device_pages: int = 2,
    mamba_slots: int = 8,
    kda_heads: int = 2,
    kda_head_dim: int = 16,
) -> StockGlmDevice:
    """Tiny real device pools of the stock GLM-5.3-Flash geometry (page
    ``64 * index_kpool``; one single-layer DSA pool per MTP draft layer)."""
    _check_positive(layers=layers, mamba_layers=mamba_layers, mamba_slots=mamba_slots)
    if draft_layers < 0:
        raise ValueError(f"draft_layers must be >= 0, got {draft_layers}")
    geometry = {
        "kv_lora_rank": kv_lora_rank,
        "rope_dim": rope_dim,
        "index_kpool": index_kpool,
        "device_pages": device_pages,
    }
    kv = make_dsa_device_pool(layers=layers, **geometry)
    drafts = tuple(make_dsa_device_pool(layers=1, **geometry) for _ in range(draft_layers))
    full_ids, mamba_ids = _interleaved_layer_ids(layers, mamba_layers)
    req_to_token = HybridReqToTokenPool(
        size=4,
        mamba_size=mamba_slots,
        mamba_spec_state_size=mamba_slots,
        max_context_len=kv.size,
        device="cpu",
        enable_memory_saver=False,
        cache_params=_kda_params(mamba_ids, kda_heads, kda_head_dim),
        mamba_layer_ids=mamba_ids,
        enable_mamba_extra_buffer=False,
        enable_overlap_schedule=False,
    )
    allocator = PagedTokenToKVPoolAllocator(
        kv.size, kv.page_size, kv.dtype, "cpu", kv, need_sort=False
    )
    return StockGlmDevice(
        kv=kv,
        drafts=drafts,
        req_to_token=req_to_token,
        allocator=allocator,
        full_layer_mapping={layer: i for i, layer in enumerate(full_ids)},
        mamba_layer_ids=tuple(mamba_ids),
    )


def build_stock_glm_group(device: StockGlmDevice, layout: str) -> HostPoolGroup:
    """KV + INDEXER (packed drafts included) + MAMBA host pools, in the order
    and with the layer mappings ``build_hybrid_mamba_stack`` gives them."""
    if layout not in KV_LAYOUTS:
        raise ValueError(f"unsupported host layout {layout!r}; expected one of {KV_LAYOUTS}")
    config = prepare_host_pool_config(
        decls=device.kv.host_pool_decls(),
        full_layer_mapping=device.full_layer_mapping,
        transfer_layer_id_max=device.transfer_layer_id_max,
        transfer_page_size=device.page_tokens,
        packed_draft_device_pools=device.drafts,
    )
    group = build_host_pool_group(config=config)
    (mamba_info,) = device.mamba.get_device_pool_infos()
    mamba_host = build_mamba_host_pool(
        device.mamba, mamba_info, host_size=0, layout=mamba_layout_for(layout)
    )
    group.add_entry(
        build_pool_entry(
            name=PoolName.MAMBA,
            host_pool=mamba_host,
            device_pool=device.mamba,
            layer_mapping={layer: i for i, layer in enumerate(device.mamba_layer_ids)},
            transfer_layer_id_max=device.transfer_layer_id_max,
        )
    )
    return group


def build_stock_glm_pools(
    layout: str = "page_first", *, host_to_device_ratio: float = 4.0, **device_options: int
) -> HybridPoolSet:
    """The stock pool set as a ``HybridPoolSet`` (K=1: host page = storage page),
    about ``host_to_device_ratio * device_pages`` host pages.

    Runs sglang's builders inside its own ``sglang_cpu_runtime``; the pools
    stay valid after it closes.
    """
    from mooncake_span_tools.testing.sglang_cpu import sglang_cpu_runtime

    with sglang_cpu_runtime(layout=layout, host_to_device_ratio=host_to_device_ratio):
        device = make_stock_glm_device(**device_options)
        group = build_stock_glm_group(device, layout)
    pools = {entry.name: entry.host_pool for entry in group.entries}
    return HybridPoolSet(
        pools=pools,
        host_page_tokens=device.page_tokens,
        storage_page_tokens=device.page_tokens,
    )
