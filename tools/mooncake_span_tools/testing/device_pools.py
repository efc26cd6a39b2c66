"""Tiny real sglang device pools on CPU. They only donate geometry: sglang
builds host pools from ``get_device_pool_infos()``, never from bare shapes."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from sglang.srt.configs.mamba_utils import (
    Mamba2CacheParams,
    Mamba2StateDType,
    Mamba2StateShape,
)
from sglang.srt.mem_cache.memory_pool import (
    DSATokenToKVPool,
    MambaPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
)

logger = logging.getLogger(__name__)

# DSATokenToKVPool asserts 64-token physical index pages on CUDA and CPU
# (index_page_size = page_size // index_kpool must be 64), and the indexer host
# pool takes the KV anchor's page size, so every DSA host page is 64 tokens.
DSA_PAGE_TOKENS = 64
# DSATokenToKVPool asserts index_head_dim == 128.
_DSA_INDEX_HEAD_DIM = 128
# Every device pool here lives on the CPU and never swaps out.
_ON_CPU = {"device": "cpu", "enable_memory_saver": False}


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def make_mla_device_pool(
    *,
    layers: int,
    page_tokens: int,
    kv_lora_rank: int,
    rope_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    device_pages: int = 1,
) -> MLATokenToKVPool:
    """A CPU ``MLATokenToKVPool``; one page by default (it only donates geometry)."""
    _check_positive(layers=layers, page_tokens=page_tokens, device_pages=device_pages)
    return MLATokenToKVPool(
        size=device_pages * page_tokens,
        page_size=page_tokens,
        dtype=dtype,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope_dim,
        layer_num=layers,
        **_ON_CPU,
    )


def make_mha_device_pool(
    *,
    layers: int,
    page_tokens: int,
    heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    device_pages: int = 1,
) -> MHATokenToKVPool:
    """A CPU ``MHATokenToKVPool``; one page by default."""
    _check_positive(layers=layers, page_tokens=page_tokens, device_pages=device_pages)
    return MHATokenToKVPool(
        size=device_pages * page_tokens,
        page_size=page_tokens,
        dtype=dtype,
        head_num=heads,
        head_dim=head_dim,
        layer_num=layers,
        **_ON_CPU,
        enable_alt_stream=False,
    )


def make_dsa_device_pool(
    *,
    layers: int,
    kv_lora_rank: int,
    rope_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    index_kpool: int = 1,
    skip_topk_layers: Sequence[bool] | None = None,
    device_pages: int = 1,
) -> DSATokenToKVPool:
    """A CPU ``DSATokenToKVPool`` with 64-token physical index pages.

    With ``index_kpool`` K > 1 (compressed index keys, the GLM-5.3-Flash
    family) sglang requires a device page of 64*K tokens; each 64-token host
    page then carries 64/K compressed index rows.
    """
    _check_positive(layers=layers, index_kpool=index_kpool, device_pages=device_pages)
    device_page_tokens = DSA_PAGE_TOKENS * index_kpool
    size_tokens = device_pages * device_page_tokens
    return DSATokenToKVPool(
        size=size_tokens,
        page_size=device_page_tokens,
        kv_lora_rank=kv_lora_rank,
        dtype=dtype,
        qk_rope_head_dim=rope_dim,
        layer_num=layers,
        device="cpu",
        index_head_dim=_DSA_INDEX_HEAD_DIM,
        enable_memory_saver=False,
        kv_cache_dim=kv_lora_rank + rope_dim,
        # Passed explicitly because the default reads
        # get_parallel().attn_dcp_size, which only exists once a parallel
        # config is published (RuntimeError otherwise).
        index_buf_size=size_tokens,
        index_kpool=index_kpool,
        skip_topk_layers=None if skip_topk_layers is None else list(skip_topk_layers),
    )


def make_mamba_device_pool(
    *,
    layers: int,
    num_heads: int = 4,
    head_dim: int = 16,
    state_size: int = 8,
    conv_kernel: int = 4,
    n_groups: int = 1,
    conv_dtype: torch.dtype = torch.bfloat16,
    temporal_dtype: torch.dtype = torch.float32,
    device_slots: int = 1,
) -> MambaPool:
    """A CPU Mamba2 ``MambaPool`` (one conv state, one temporal state per layer)."""
    _check_positive(layers=layers, device_slots=device_slots)
    shape = Mamba2StateShape.create(
        tp_world_size=1,
        intermediate_size=num_heads * head_dim,
        n_groups=n_groups,
        num_heads=num_heads,
        head_dim=head_dim,
        state_size=state_size,
        conv_kernel=conv_kernel,
    )
    params = Mamba2CacheParams(
        shape=shape,
        layers=list(range(layers)),
        dtype=Mamba2StateDType(conv=conv_dtype, temporal=temporal_dtype),
    )
    return MambaPool(
        size=device_slots,
        spec_state_size=device_slots,
        cache_params=params,
        mamba_layer_ids=list(range(layers)),
        **_ON_CPU,
    )
