"""The process-global sglang state that CPU-only tools need around real host pools.

``sglang_cpu_runtime()`` publishes what sglang's own assemblers and the
HiCache controller read (server args, parallel ranks, ``pin_memory`` off, a
host memory budget without the production reserve);
``single_rank_storage_config`` is the storage config the controller builds
for one rank. Used by :mod:`mooncake_span_tools.testing.pools`, the demo, the
benchmark, the node worker and the tests.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

from sglang.srt.mem_cache.host_memory import available_host_memory_bytes
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.runtime_context import get_context, get_parallel

logger = logging.getLogger(__name__)

# Host layouts whose page I/O (get_data_page / set_from_flat_data_page) works
# for MHA and MLA pools. "page_head"/"page_unified" exist in sglang but are
# outside this project's scope.
KV_LAYOUTS = ("page_first", "page_first_direct", "layer_first")
# MambaPoolHost asserts one of these; it has no layer_first.
MAMBA_LAYOUTS = ("page_first", "page_first_direct")

# The host-to-device ratio only matters when sglang sizes a pool itself; every
# KV builder here passes an explicit host_token_capacity instead.
_HOST_TO_DEVICE_RATIO = 2.0


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
