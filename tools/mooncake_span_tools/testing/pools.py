"""Real sglang 0.5.23 HiCache host pools, built on a CPU-only machine.

The demo, the benchmark and the tests need the very host pool classes an
SGLang server hands to an L3 backend (``MLATokenToKVPoolHost``,
``MHATokenToKVPoolHost``, ``DSAIndexerPoolHost``, ``MambaPoolHost``), with
their real layouts, page geometry and zero-copy pointer tables. This module
builds them with ``device="cpu"``, ``pin_memory=False`` and the ``"default"``
(mmap) allocator, from a tiny real device pool that only supplies the buffer
geometry (sglang builds host pools from ``get_device_pool_infos()``, never from
bare shapes).

Two layers:

* ``make_*_device_pool`` (from :mod:`.device_pools`) and ``*_host_from_device``:
  one sglang object each, for callers (the controller test harness) that need
  the device pools too;
* ``build_*``: one call per pool kind, sizes chosen by the caller, tiny by
  default.

Re-exported here as well: the byte helpers of :mod:`.page_io`
(``fill_random_pages``, ``page_bytes``, ``meta_page_bytes``, ``wipe_pages``) and
``sglang_cpu_runtime()`` / ``single_rank_storage_config`` of :mod:`.sglang_cpu`,
the process-global context that sglang's own assemblers and the HiCache
controller read.

sglang is imported at module import time: this module is only ever loaded where
sglang is installed (tests, demo, benchmark).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.memory_pool import (
    DSATokenToKVPool,
    MambaPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
)
from sglang.srt.mem_cache.pool_host.base import HostKVCache
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

from mooncake_span_tools.testing.device_pools import (
    DSA_PAGE_TOKENS,
    _check_positive,
    make_dsa_device_pool,
    make_mamba_device_pool,
    make_mha_device_pool,
    make_mla_device_pool,
)
from mooncake_span_tools.testing.page_io import (
    alloc_pages,
    fill_random_pages,
    meta_page_bytes,
    page_bytes,
    page_starts,
    wipe_pages,
)
from mooncake_span_tools.testing.sglang_cpu import (
    _HOST_TO_DEVICE_RATIO,
    KV_LAYOUTS,
    MAMBA_LAYOUTS,
    _host_budget,
    sglang_cpu_runtime,
    single_rank_storage_config,
)

logger = logging.getLogger(__name__)

_HostPool = TypeVar("_HostPool", bound=HostKVCache)

__all__ = [
    "DSA_PAGE_TOKENS",
    "DSAPools",
    "HybridPoolSet",
    "KV_LAYOUTS",
    "MAMBA_LAYOUTS",
    "alloc_pages",
    "build_compressed_hybrid_dsa",
    "build_dsa_pools",
    "build_mamba_host",
    "build_mha_host",
    "build_mla_host",
    "build_swa_host",
    "dsa_host_from_device",
    "fill_random_pages",
    "make_dsa_device_pool",
    "make_mamba_device_pool",
    "make_mha_device_pool",
    "make_mla_device_pool",
    "mamba_host_from_device",
    "meta_page_bytes",
    "mha_host_from_device",
    "mla_host_from_device",
    "page_bytes",
    "page_starts",
    "sglang_cpu_runtime",
    "single_rank_storage_config",
    "wipe_pages",
]


class DSAPools(NamedTuple):
    """The two host pools of a DSA model."""

    kv: MLATokenToKVPoolHost
    indexer: DSAIndexerPoolHost


@dataclass(frozen=True)
class HybridPoolSet:
    """The host pools of one model, keyed by sglang ``PoolName``.

    ``storage_page_tokens`` is the radix-tree (storage) page of the model: one
    storage key covers ``pages_per_key`` host pages of the KV and KV-derived
    pools, and one state slot of a state pool.
    """

    pools: Mapping[PoolName, HostKVCache]
    host_page_tokens: int
    storage_page_tokens: int

    @property
    def pages_per_key(self) -> int:
        return self.storage_page_tokens // self.host_page_tokens

    def __getitem__(self, name: PoolName) -> HostKVCache:
        return self.pools[name]


# ---------------------------------------------------------------------------
# device pools (geometry donors)
# ---------------------------------------------------------------------------


def _check_layout(layout: str, allowed: Sequence[str]) -> None:
    if layout not in allowed:
        raise ValueError(f"unsupported host layout {layout!r}; expected one of {tuple(allowed)}")


def _device_capacity_tokens(host_tokens: int) -> int:
    # sglang uses the device capacity only to size a pool without an explicit
    # capacity and to warn when the host mirror is not larger than the device
    # pool. The device pools here only donate geometry, so report half the host
    # capacity: no misleading "host smaller than device" warning.
    return host_tokens // 2


def _built(host: _HostPool) -> _HostPool:
    logger.debug(
        "built %s (%s): layout=%s page_size=%d slots=%d page_bytes=%d",
        type(host).__name__,
        getattr(host, "pool_label", "-"),
        host.layout,
        host.page_size,
        host.size,
        host.get_dummy_flat_data_page().nbytes,
    )
    return host


def _kv_host(
    cls: type[_HostPool],
    device_pool: MLATokenToKVPool | MHATokenToKVPool,
    layout: str,
    *,
    host_pages: int,
    page_tokens: int,
    pool_label: str,
    allocator_type: str,
    **extra: Any,
) -> _HostPool:
    """An MLA or MHA host pool of ``host_pages`` pages mirroring ``device_pool``."""
    _check_layout(layout, KV_LAYOUTS)
    _check_positive(host_pages=host_pages, page_tokens=page_tokens)
    host_tokens = host_pages * page_tokens
    with _host_budget():
        host = cls(
            device_pool.get_device_pool_infos()[0].buffer_info,
            _HOST_TO_DEVICE_RATIO,
            0,
            page_tokens,
            layout,
            pin_memory=False,
            device="cpu",
            allocator_type=allocator_type,
            device_capacity_tokens=_device_capacity_tokens(host_tokens),
            start_layer=device_pool.start_layer,
            end_layer=device_pool.end_layer,
            pool_label=pool_label,
            host_token_capacity=host_tokens,
            **extra,
        )
    return _built(host)


def mla_host_from_device(
    device_pool: MLATokenToKVPool,
    layout: str,
    *,
    host_pages: int,
    page_tokens: int | None = None,
    pool_label: str = "kv",
    allocator_type: str = "default",
) -> MLATokenToKVPoolHost:
    """An ``MLATokenToKVPoolHost`` of ``host_pages`` pages mirroring ``device_pool``."""
    return _kv_host(
        MLATokenToKVPoolHost,
        device_pool,
        layout,
        host_pages=host_pages,
        page_tokens=page_tokens or device_pool.page_size,
        pool_label=pool_label,
        allocator_type=allocator_type,
        # The device pool resolved the row width (wider for fp8 DSA).
        override_kv_cache_dim=device_pool.kv_cache_dim,
        target_layer_num=device_pool.layer_num,
    )


def mha_host_from_device(
    device_pool: MHATokenToKVPool,
    layout: str,
    *,
    host_pages: int,
    pool_label: str = "kv",
    allocator_type: str = "default",
) -> MHATokenToKVPoolHost:
    """An ``MHATokenToKVPoolHost`` of ``host_pages`` pages mirroring ``device_pool``."""
    return _kv_host(
        MHATokenToKVPoolHost,
        device_pool,
        layout,
        host_pages=host_pages,
        page_tokens=device_pool.page_size,
        pool_label=pool_label,
        allocator_type=allocator_type,
    )


def dsa_host_from_device(
    device_pool: DSATokenToKVPool,
    layout: str,
    *,
    host_pages: int,
    allocator_type: str = "default",
) -> DSAPools:
    """The KV anchor (MLA) and INDEXER host pools of a DSA device pool."""
    anchor = mla_host_from_device(
        device_pool,
        layout,
        host_pages=host_pages,
        page_tokens=DSA_PAGE_TOKENS,
        allocator_type=allocator_type,
    )
    decls = {decl.pool_name: decl for decl in device_pool.host_pool_decls()}
    indexer_decl = decls.get(PoolName.INDEXER)
    if indexer_decl is None:
        raise ValueError("this DSA device pool declares no indexer (every layer skips top-k?)")
    with _host_budget():
        indexer = DSAIndexerPoolHost(
            indexer_decl,
            anchor,
            pin_memory=False,
            device="cpu",
            allocator_type=allocator_type,
        )
    return DSAPools(kv=anchor, indexer=_built(indexer))


def mamba_host_from_device(
    device_pool: MambaPool,
    *,
    slots: int,
    layout: str = "page_first",
    allocator_type: str = "default",
) -> MambaPoolHost:
    """A ``MambaPoolHost`` with at least ``slots`` usable state slots.

    sglang sizes Mamba host pools itself (no explicit capacity argument): the
    capacity is ``device_capacity * ratio`` plus one padding slot, all usable,
    so this pool has ``slots + 1`` slots.
    """
    _check_layout(layout, MAMBA_LAYOUTS)
    _check_positive(slots=slots)
    (pool_info,) = device_pool.get_device_pool_infos()
    with _host_budget():
        host = MambaPoolHost(
            pool_info.buffer_info,
            1.0,
            0,
            device_capacity=slots,
            pin_memory=False,
            device="cpu",
            allocator_type=allocator_type,
            layout=layout,
        )
    return _built(host)


# ---------------------------------------------------------------------------
# one-call builders
# ---------------------------------------------------------------------------


def build_mla_host(
    layout: str = "page_first",
    *,
    layers: int = 2,
    page_tokens: int = 64,
    host_pages: int = 4,
    kv_lora_rank: int = 32,
    rope_dim: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    pool_label: str = "kv",
    allocator_type: str = "default",
) -> MLATokenToKVPoolHost:
    """An MLA KV host pool; page = layers * page_tokens * (kv_lora_rank + rope_dim) * itemsize."""
    device_pool = make_mla_device_pool(
        layers=layers,
        page_tokens=page_tokens,
        kv_lora_rank=kv_lora_rank,
        rope_dim=rope_dim,
        dtype=dtype,
    )
    return mla_host_from_device(
        device_pool,
        layout,
        host_pages=host_pages,
        pool_label=pool_label,
        allocator_type=allocator_type,
    )


def build_mha_host(
    layout: str = "page_first",
    *,
    layers: int = 2,
    page_tokens: int = 64,
    host_pages: int = 4,
    heads: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    pool_label: str = "kv",
    allocator_type: str = "default",
) -> MHATokenToKVPoolHost:
    """An MHA KV host pool; page = 2 (K, V) * layers * page_tokens * heads * head_dim * itemsize."""
    device_pool = make_mha_device_pool(
        layers=layers, page_tokens=page_tokens, heads=heads, head_dim=head_dim, dtype=dtype
    )
    return mha_host_from_device(
        device_pool,
        layout,
        host_pages=host_pages,
        pool_label=pool_label,
        allocator_type=allocator_type,
    )


def build_swa_host(
    layout: str = "page_first",
    *,
    attention: str = "mha",
    layers: int = 2,
    page_tokens: int = 64,
    host_pages: int = 4,
    heads: int = 2,
    head_dim: int = 16,
    kv_lora_rank: int = 32,
    rope_dim: int = 16,
    dtype: torch.dtype = torch.bfloat16,
) -> MHATokenToKVPoolHost | MLATokenToKVPoolHost:
    """The SWA host pool: sglang mirrors the SWA layers with an ordinary MHA or
    MLA host pool (``build_hybrid_swa_group``), labelled "swa"."""
    common = {"layers": layers, "page_tokens": page_tokens, "host_pages": host_pages}
    if attention == "mha":
        return build_mha_host(
            layout, heads=heads, head_dim=head_dim, dtype=dtype, pool_label="swa", **common
        )
    if attention == "mla":
        return build_mla_host(
            layout,
            kv_lora_rank=kv_lora_rank,
            rope_dim=rope_dim,
            dtype=dtype,
            pool_label="swa",
            **common,
        )
    raise ValueError(f"attention must be 'mha' or 'mla', got {attention!r}")


def build_dsa_pools(
    layout: str = "page_first",
    *,
    layers: int = 2,
    host_pages: int = 4,
    kv_lora_rank: int = 32,
    rope_dim: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    index_kpool: int = 1,
    skip_topk_layers: Sequence[bool] | None = None,
) -> DSAPools:
    """(KV anchor, INDEXER) host pools of a real CPU ``DSATokenToKVPool``.

    Host pages are 64 tokens (``DSA_PAGE_TOKENS``). The indexer stores
    ``64 / index_kpool * 132`` bytes per page per indexer layer; layers marked
    in ``skip_topk_layers`` own no index keys and get no host layer.
    Note: the indexer's ``get_page_buffer_meta`` supports page_first and
    page_first_direct only (layer_first raises ValueError in sglang).
    """
    device_pool = make_dsa_device_pool(
        layers=layers,
        kv_lora_rank=kv_lora_rank,
        rope_dim=rope_dim,
        dtype=dtype,
        index_kpool=index_kpool,
        skip_topk_layers=skip_topk_layers,
    )
    return dsa_host_from_device(device_pool, layout, host_pages=host_pages)


def build_mamba_host(
    *,
    layers: int = 2,
    slots: int = 4,
    layout: str = "page_first",
    num_heads: int = 4,
    head_dim: int = 16,
    state_size: int = 8,
    conv_kernel: int = 4,
    conv_dtype: torch.dtype = torch.bfloat16,
    temporal_dtype: torch.dtype = torch.float32,
) -> MambaPoolHost:
    """A Mamba2 state host pool (``page_size`` 1: one slot per state), ``slots + 1`` slots."""
    device_pool = make_mamba_device_pool(
        layers=layers,
        num_heads=num_heads,
        head_dim=head_dim,
        state_size=state_size,
        conv_kernel=conv_kernel,
        conv_dtype=conv_dtype,
        temporal_dtype=temporal_dtype,
    )
    return mamba_host_from_device(device_pool, slots=slots, layout=layout)


def build_compressed_hybrid_dsa(
    layout: str = "page_first",
    *,
    layers: int = 2,
    host_pages: int = 8,
    mamba_layers: int = 2,
    mamba_slots: int = 4,
    kv_lora_rank: int = 32,
    rope_dim: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    index_kpool: int = 4,
) -> HybridPoolSet:
    """The pool set of a compressed hybrid DSA model (GLM-5.3-Flash family).

    KV anchor (MLA) + DSA INDEXER with compressed index keys + MAMBA state,
    as sglang's ``build_hybrid_mamba_stack`` assembles them: host page 64
    tokens, storage (tree) page ``64 * index_kpool`` tokens, i.e.
    ``index_kpool`` host pages per storage key. The Mamba pool uses the same
    layout as KV except that layer_first is not available for it (sglang
    asserts), so a layer_first set keeps Mamba page_first.
    """
    _check_layout(layout, KV_LAYOUTS)
    dsa = build_dsa_pools(
        layout,
        layers=layers,
        host_pages=host_pages,
        kv_lora_rank=kv_lora_rank,
        rope_dim=rope_dim,
        dtype=dtype,
        index_kpool=index_kpool,
    )
    mamba_layout = layout if layout in MAMBA_LAYOUTS else "page_first"
    mamba = build_mamba_host(layers=mamba_layers, slots=mamba_slots, layout=mamba_layout)
    return HybridPoolSet(
        pools={PoolName.KV: dsa.kv, PoolName.INDEXER: dsa.indexer, PoolName.MAMBA: mamba},
        host_page_tokens=DSA_PAGE_TOKENS,
        storage_page_tokens=DSA_PAGE_TOKENS * index_kpool,
    )
