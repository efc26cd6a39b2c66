"""Stand-ins 2 and 3 of ``standins``: sglang's host pools on a CPU build of torch.

Pinning is turned off (a CPU build refuses ``cudaHostRegister``) and the host
memory reserve is cut for small test boxes; the direct host/device copies,
which the pools import only on CUDA, HIP and XPU, get index-copy versions.
The GLM stand-ins' state pools (Mamba, DSA indexer) use the same two.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

# ---------------------------------------------------------------------------
# 2. host pools without pinned memory


def unpinned_init(init: Callable[..., None]) -> Callable[..., None]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["pin_memory"] = False
        init(self, *args, **kwargs)

    __init__.__wrapped__ = init
    return __init__


TEST_HOST_MEMORY_RESERVE_BYTES = 1 << 30


def patch_host_pool_base(module: ModuleType) -> None:
    cls = module.HostKVCache
    # Every host pool passes pin_memory by keyword (it is keyword-only here).
    cls.__init__ = unpinned_init(cls.__init__)
    # host_memory_budget_bytes reads the module global at each call.
    module.HICACHE_HOST_MEMORY_RESERVE_BYTES = TEST_HOST_MEMORY_RESERVE_BYTES


# ---------------------------------------------------------------------------
# 3. the direct host/device copies of the MHA and MLA host pools
#
# Host layouts: layer_first buffers are indexed [token]; page_first_direct
# buffers are [page, layer, slot], token t of a layer at (t // page, t % page).


def transfer_kv_direct(
    src_layers: Sequence[Any],
    dst_layers: Sequence[Any],
    src_indices: Any,
    dst_indices: Any,
    page_size: int,
) -> None:
    """Token rows ``src[src_indices]`` into ``dst[dst_indices]``, one pair of buffers at a time."""
    del page_size
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)].to(dst.device)


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: Sequence[Any],
    dst_ptrs: Sequence[Any],
    src_indices: Any,
    dst_indices: Any,
    layer_id: int,
    page_size: int,
) -> None:
    """One layer from page_first_direct host buffers into per-layer device buffers (load)."""
    pages, slots = src_indices // page_size, src_indices % page_size
    for src, dst in zip(src_ptrs, dst_ptrs, strict=True):
        dst[dst_indices.to(dst.device)] = src[pages, layer_id, slots].to(dst.device)


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: Sequence[Any],
    dst_ptrs: Sequence[Any],
    src_indices: Any,
    dst_indices: Any,
    page_size: int,
) -> None:
    """Every layer of per-layer device buffers into page_first_direct host buffers (backup).

    ``src_ptrs`` lists each host buffer's layers in turn (MHA: every k layer,
    then every v layer), so host buffer c takes ``src_ptrs[c * L : (c + 1) * L]``.
    """
    layers, rest = divmod(len(src_ptrs), len(dst_ptrs))
    if rest:
        raise ValueError(f"{len(src_ptrs)} device layers do not split over {len(dst_ptrs)} pools")
    pages, slots = dst_indices // page_size, dst_indices % page_size
    for c, dst in enumerate(dst_ptrs):
        for layer in range(layers):
            src = src_ptrs[c * layers + layer]
            dst[pages, layer, slots] = src[src_indices.to(src.device)].to(dst.device)


def patch_direct_copies(module: ModuleType) -> None:
    for copy in (
        transfer_kv_direct,
        transfer_kv_per_layer_direct_pf_lf,
        transfer_kv_all_layer_direct_lf_pf,
    ):
        if not hasattr(module, copy.__name__):
            setattr(module, copy.__name__, copy)
