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

* ``make_*_device_pool`` and ``*_host_from_device``: one sglang object each,
  for callers (the controller test harness) that need the device pools too;
* ``build_*``: one call per pool kind, sizes chosen by the caller, tiny by
  default.

Plus byte helpers (``fill_random_pages``, ``page_bytes``, ``meta_page_bytes``,
``wipe_pages``) and ``sglang_cpu_runtime()``, the process-global context that
sglang's own assemblers and the HiCache controller read.

sglang is imported at module import time: this module is only ever loaded where
sglang is installed (tests, demo, benchmark).
"""

from __future__ import annotations

import ctypes
import inspect
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import torch
from sglang.srt.configs.mamba_utils import (
    Mamba2CacheParams,
    Mamba2StateDType,
    Mamba2StateShape,
)
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.host_memory import available_host_memory_bytes
from sglang.srt.mem_cache.memory_pool import (
    DSATokenToKVPool,
    MambaPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
)
from sglang.srt.mem_cache.pool_host.base import HostKVCache, host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.runtime_context import get_context, get_parallel

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
    "wipe_pages",
]

# Host layouts whose page I/O (get_data_page / set_from_flat_data_page) works
# for MHA and MLA pools. "page_head"/"page_unified" exist in sglang but are
# outside this project's scope.
KV_LAYOUTS = ("page_first", "page_first_direct", "layer_first")
# MambaPoolHost asserts one of these; it has no layer_first.
MAMBA_LAYOUTS = ("page_first", "page_first_direct")

# DSATokenToKVPool asserts 64-token physical index pages on CUDA and CPU
# (index_page_size = page_size // index_kpool must be 64), and the indexer host
# pool takes the KV anchor's page size, so every DSA host page is 64 tokens.
DSA_PAGE_TOKENS = 64
# DSATokenToKVPool asserts index_head_dim == 128.
_DSA_INDEX_HEAD_DIM = 128

# The host-to-device ratio only matters when sglang sizes a pool itself; every
# KV builder here passes an explicit host_token_capacity instead.
_HOST_TO_DEVICE_RATIO = 2.0


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
# process-global sglang context
# ---------------------------------------------------------------------------


@contextmanager
def _host_budget() -> Iterator[None]:
    # sglang books each host pool against "available RAM minus a 10 GiB
    # reserve" (HICACHE_HOST_MEMORY_RESERVE_BYTES), sized for a production
    # server; on a small CI box that is negative and even a 1 MB pool is
    # refused. A scope with the real available RAM keeps the genuine
    # out-of-memory check without the reserve (sglang's own cgroup-aware
    # measure, page cache counted as free).
    with host_memory_budget_scope(available_host_memory_bytes(allow_cgroup_fallback=True)):
        yield


def _pin_memory_param(cls: type) -> inspect.Parameter:
    return inspect.signature(cls.__init__).parameters["pin_memory"]


@contextmanager
def _pin_memory_default_off(classes: Iterable[type]) -> Iterator[None]:
    # sglang's assemblers (build_kv_host_pool, DSAIndexerHostPoolBuilder.build,
    # build_mamba_host_pool) never pass pin_memory, so they get the class
    # default True, which calls cudaHostRegister and fails on CPU-only torch.
    # Flip the default for the duration of the scope and put it back after.
    saved: list[tuple[Any, str, Any]] = []
    try:
        for cls in classes:
            init = cls.__init__
            param = _pin_memory_param(cls)
            if param.kind is inspect.Parameter.KEYWORD_ONLY:
                saved.append((init, "__kwdefaults__", dict(init.__kwdefaults__)))
                init.__kwdefaults__ = {**init.__kwdefaults__, "pin_memory": False}
            else:
                names = [
                    p.name
                    for p in inspect.signature(init).parameters.values()
                    if p.default is not inspect.Parameter.empty
                    and p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
                ]
                defaults = list(init.__defaults__)
                saved.append((init, "__defaults__", tuple(defaults)))
                defaults[names.index("pin_memory")] = False
                init.__defaults__ = tuple(defaults)
        yield
    finally:
        for init, attr, value in reversed(saved):
            setattr(init, attr, value)


@contextmanager
def sglang_cpu_runtime(
    *, layout: str = "page_first", host_to_device_ratio: float = _HOST_TO_DEVICE_RATIO
) -> Iterator[None]:
    """Publish the global state sglang's assemblers and controller read.

    Constructing pools directly (every ``build_*`` here) needs none of this.
    It is for code that runs sglang's own builders and the HiCache controller
    in a single-rank CPU process (the controller test harness):

    * a dummy ``ServerArgs`` (``override_server_args``): the assemblers read
      ``hicache_ratio``/``hicache_size``/``hicache_mem_layout`` and the
      controller reads the memory and parallel namespaces (the assemblers
      size a host pool as ``host_to_device_ratio`` times its device pool);
    * rank 0 for every parallel coordinate: ranks are normally written when
      the process groups are built by the scheduler, and the controller's
      ``_generate_storage_config`` reads them;
    * ``pin_memory`` defaulting to False on the four host pool classes (the
      assemblers never pass it);
    * a host memory budget without sglang's 10 GiB reserve.

    Not re-entrant across threads: it patches process-global state, so use it
    from one thread and keep controllers built inside it alive only inside it.
    """
    if layout not in KV_LAYOUTS:
        raise ValueError(f"unsupported host layout {layout!r}; expected one of {KV_LAYOUTS}")
    with ExitStack() as stack:
        stack.enter_context(
            get_context().override_server_args(
                hicache_ratio=host_to_device_ratio,
                hicache_size=0,
                hicache_mem_layout=layout,
                hicache_io_backend="direct",
                hicache_write_policy="write_through",
                device="cpu",
            )
        )
        stack.enter_context(
            get_parallel().override(
                tp_rank=0,
                pp_rank=0,
                attn_tp_rank=0,
                attn_dp_rank=0,
                attn_cp_rank=0,
                attn_dcp_rank=0,
            )
        )
        stack.enter_context(
            _pin_memory_default_off(
                (MLATokenToKVPoolHost, MHATokenToKVPoolHost, DSAIndexerPoolHost, MambaPoolHost)
            )
        )
        stack.enter_context(_host_budget())
        yield


# ---------------------------------------------------------------------------
# device pools (geometry donors)
# ---------------------------------------------------------------------------


def _check_layout(layout: str, allowed: Sequence[str]) -> None:
    if layout not in allowed:
        raise ValueError(f"unsupported host layout {layout!r}; expected one of {tuple(allowed)}")


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
        device="cpu",
        enable_memory_saver=False,
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
        device="cpu",
        enable_memory_saver=False,
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
        device="cpu",
        enable_memory_saver=False,
    )


# ---------------------------------------------------------------------------
# host pools from device pools
# ---------------------------------------------------------------------------


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
    _check_layout(layout, KV_LAYOUTS)
    page_tokens = page_tokens or device_pool.page_size
    _check_positive(host_pages=host_pages, page_tokens=page_tokens)
    host_tokens = host_pages * page_tokens
    with _host_budget():
        host = MLATokenToKVPoolHost(
            device_pool.get_device_pool_infos()[0].buffer_info,
            _HOST_TO_DEVICE_RATIO,
            0,
            page_tokens,
            layout,
            pin_memory=False,
            device="cpu",
            allocator_type=allocator_type,
            # The device pool resolved the row width (wider for fp8 DSA).
            override_kv_cache_dim=device_pool.kv_cache_dim,
            device_capacity_tokens=_device_capacity_tokens(host_tokens),
            start_layer=device_pool.start_layer,
            end_layer=device_pool.end_layer,
            target_layer_num=device_pool.layer_num,
            pool_label=pool_label,
            host_token_capacity=host_tokens,
        )
    return _built(host)


def mha_host_from_device(
    device_pool: MHATokenToKVPool,
    layout: str,
    *,
    host_pages: int,
    pool_label: str = "kv",
    allocator_type: str = "default",
) -> MHATokenToKVPoolHost:
    """An ``MHATokenToKVPoolHost`` of ``host_pages`` pages mirroring ``device_pool``."""
    _check_layout(layout, KV_LAYOUTS)
    _check_positive(host_pages=host_pages)
    page_tokens = device_pool.page_size
    host_tokens = host_pages * page_tokens
    with _host_budget():
        host = MHATokenToKVPoolHost(
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
        )
    return _built(host)


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
        device_pool, layout, host_pages=host_pages, allocator_type=allocator_type
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
    if attention == "mha":
        return build_mha_host(
            layout,
            layers=layers,
            page_tokens=page_tokens,
            host_pages=host_pages,
            heads=heads,
            head_dim=head_dim,
            dtype=dtype,
            pool_label="swa",
        )
    if attention == "mla":
        device_pool = make_mla_device_pool(
            layers=layers,
            page_tokens=page_tokens,
            kv_lora_rank=kv_lora_rank,
            rope_dim=rope_dim,
            dtype=dtype,
        )
        return mla_host_from_device(device_pool, layout, host_pages=host_pages, pool_label="swa")
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


# ---------------------------------------------------------------------------
# storage config


def single_rank_storage_config(
    extra_config: Mapping[str, Any],
    *,
    model_name: str,
    is_mla: bool = True,
    tp_rank: int = 0,
    tp_size: int = 1,
    enable_storage_metrics: bool = True,
) -> Any:
    """The ``HiCacheStorageConfig`` sglang's controller builds for one rank with no
    PP/CP/DCP, for tools (demo, bench, node worker) and tests that drive the
    backend without a controller."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=is_mla,
        enable_storage_metrics=enable_storage_metrics,
        is_page_first_layout=True,
        model_name=model_name,
        extra_config=dict(extra_config),
    )


# ---------------------------------------------------------------------------
# page bytes
# ---------------------------------------------------------------------------


def alloc_pages(host_pool: HostKVCache, pages: int) -> torch.Tensor:
    """Allocate ``pages`` host pages; returns their slot indices (pages * page_size)."""
    slots = host_pool.alloc(pages * host_pool.page_size)
    if slots is None:
        raise MemoryError(
            f"{type(host_pool).__name__} has {host_pool.available_size()} free slots, "
            f"{pages} pages of {host_pool.page_size} requested"
        )
    return slots


def page_starts(host_pool: HostKVCache, slots: torch.Tensor | Sequence[int]) -> list[int]:
    """The first slot of each page in ``slots`` (a page-aligned slot list)."""
    values = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
    if len(values) % host_pool.page_size:
        raise ValueError(
            f"{len(values)} slots is not a whole number of {host_pool.page_size}-slot pages"
        )
    return [int(v) for v in values[:: host_pool.page_size]]


def _page_seed(seed: int, slot: int) -> int:
    # Distinct bytes per page (so a page restored at the wrong slot is caught),
    # reproducible per (seed, slot).
    return (seed * 1_000_003 + slot) & 0x7FFF_FFFF_FFFF_FFFF


def fill_random_pages(host_pool: HostKVCache, starts: Iterable[int], seed: int) -> None:
    """Overwrite each page (given by its first slot) with random bytes."""
    template = host_pool.get_dummy_flat_data_page()
    for slot in starts:
        generator = torch.Generator().manual_seed(_page_seed(seed, int(slot)))
        raw = torch.randint(0, 256, (template.nbytes,), dtype=torch.uint8, generator=generator)
        host_pool.set_from_flat_data_page(int(slot), raw.view(template.dtype))


def wipe_pages(host_pool: HostKVCache, starts: Iterable[int]) -> None:
    """Zero each page (given by its first slot)."""
    zeros = host_pool.get_dummy_flat_data_page()
    for slot in starts:
        host_pool.set_from_flat_data_page(int(slot), zeros)


def page_bytes(host_pool: HostKVCache, slot: int) -> bytes:
    """The flat page at ``slot`` as sglang serialises it (``get_data_page(flat=True)``)."""
    page = host_pool.get_data_page(int(slot), flat=True)
    return page.contiguous().view(torch.uint8).numpy().tobytes()


def meta_page_bytes(host_pool: HostKVCache, slot: int) -> bytes:
    """The page at ``slot`` read through the zero-copy pointers of
    ``get_page_buffer_meta``, concatenated in pointer order.

    Equals ``page_bytes`` for every pool and layout except MHA layer_first,
    whose pointers interleave K and V per layer while the flat page is all K
    layers then all V layers.
    """
    slots = torch.arange(int(slot), int(slot) + host_pool.page_size, dtype=torch.int64)
    ptrs, sizes = host_pool.get_page_buffer_meta(slots)
    return b"".join(ctypes.string_at(ptr, size) for ptr, size in zip(ptrs, sizes, strict=True))
