"""What sglang 0.5.23 lacks to serve on a CPU-only host, and how each gap is filled.

A real ``sglang.launch_server`` runs on this project's CPU boxes with six
small stand-ins. None of them is needed on a GPU host, and the runtime never
imports this module: only test support and the demo put
``cpu_server/site`` on a server's ``PYTHONPATH``, whose ``sitecustomize``
calls :func:`install` in every process sglang starts (the scheduler and
detokenizer are spawned, so a patch made in the parent alone would not reach
them).

1. ``sgl_kernel``: with ``SGLANG_USE_CPU_ENGINE=1`` sglang imports its CPU
   ops at import time, but PyPI's wheels are CUDA-only. Without AMX every layer
   takes its torch path and only two ops run; the module serves those two and
   names every other op as missing when called.
2. Host pools pin their memory by default (``cudaHostRegister``), which a CPU
   build of torch refuses: pinning is turned off. They also keep 10 GiB of
   host RAM in reserve, sized for a production server, which leaves a small
   test box (24 GiB, several servers) with a negative budget: the reserve is
   cut to 1 GiB, so the out-of-memory check itself still runs.
3. The MHA and MLA host pools import their "direct" host/device copies only on
   CUDA, HIP and XPU: index-copy versions are bound in their place.
   (2 and 3 live in ``host_pools``, which the GLM stand-ins' state pools share.)
4. DeepSeek-style MLA on ``torch_native`` falls back to the triton handler,
   which picks the MHA prefill sub-path; a handler that always takes sglang's
   own MLA dispatch is registered.
5. PD prefill on a Mooncake sender asks for host-tensor indices, which build a
   pinned tensor: the sender says it cannot take them, so the page-index path
   runs.
6. ``torch_native`` extends a request with a cached prefix by padding its
   queries to the whole sequence in a ``torch.empty`` tensor, attending with all
   of them and keeping only the new rows. The prefix rows are whatever the
   allocator hands back; when that memory last held small integers (index
   tensors), they read as denormal floats, and x86 computes denormals in
   microcode: one layer's attention over 2,048 tokens took 12.3 s instead of
   0.45 s. So a restored request's TTFT depended on the allocator's history (a
   restored DeepSeek-V2 prompt took 5 s in one round and 50 s in another, for
   either L3 backend). Every server process flushes denormals to zero, which
   changes no result that is kept: the padded rows are dropped, and the
   recompute server runs with the same setting.

Each patch is applied right after sglang imports the module it patches (an
import hook, so importing sglang stays lazy and in sglang's own order).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from mooncake_span_tools.testing.cpu_server import glm5_standins
from mooncake_span_tools.testing.cpu_server.host_pools import (
    patch_direct_copies,
    patch_host_pool_base,
)

logger = logging.getLogger(__name__)

# The stand-ins patch internals of this release; another one may have moved them.
SGLANG_VERSION = "0.5.23"


class StandinVersionError(RuntimeError):
    """The installed sglang is not the release the stand-ins were written for."""


def check_sglang_version(installed: str | None = None) -> None:
    if installed is None:
        installed = importlib.metadata.version("sglang")
    if installed != SGLANG_VERSION:
        raise StandinVersionError(
            f"the CPU stand-ins in {__name__} were written for sglang {SGLANG_VERSION}, "
            f"but sglang {installed} is installed; check each stand-in against the new "
            "release before raising SGLANG_VERSION"
        )


# ---------------------------------------------------------------------------
# 1. sgl_kernel's two CPU ops


def assign_req_to_token_pool_cpu(
    req_pool_indices: Any,
    req_to_token: Any,
    start_offset: Any,
    end_offset: Any,
    out_cache_loc: Any,
    pool_len: int,
) -> None:
    """Write request i's new cache locations into ``req_to_token[req_pool_indices[i]]``.

    ``out_cache_loc`` holds every request's new locations back to back, in batch
    order; request i owns ``end_offset[i] - start_offset[i]`` of them and they go
    to columns ``start_offset[i]:end_offset[i]`` of its row.
    """
    del pool_len  # the row width; slicing the row bounds the write already
    taken = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        count = end - start
        req_to_token[row, start:end] = out_cache_loc[taken : taken + count]
        taken += count


def copy_all_layer_kv_cache_cpu(buffers: Any, strides: Any, tgt_loc: Any, src_loc: Any) -> None:
    """For every buffer, copy row ``src_loc[j]`` to row ``tgt_loc[j]``.

    sglang passes what its triton kernel takes: the pool's ``data_ptrs`` (a
    uint64 tensor of buffer base addresses) and ``data_strides`` (each buffer's
    row stride in bytes, which is also the bytes copied per row). A sequence of
    tensors (rows on dim 0, ``strides`` unused) is taken as well. All sources
    are read before any target is written, so overlapping moves (a compaction
    shifting rows down) see the old rows.
    """
    if tgt_loc.numel() == 0:
        return
    if not isinstance(buffers, Sequence):
        buffers = _byte_rows(buffers, strides, int(max(tgt_loc.max(), src_loc.max())) + 1)
    for buffer in buffers:
        buffer[tgt_loc] = buffer[src_loc].clone()


def _byte_rows(ptrs: Any, strides: Any, rows: int) -> list[Any]:
    """The first ``rows`` rows of each raw buffer, as a (rows, stride) uint8 tensor."""
    import ctypes

    import torch

    views = []
    for ptr, stride in zip(ptrs.tolist(), strides.tolist(), strict=True):
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(ptr)
        views.append(torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride))
    return views


def _missing_op(name: str) -> Callable[..., Any]:
    def missing(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name} has no CPU stand-in (mooncake_span_tools.testing.cpu_server); "
            "a CPU without AMX runs only the ops the stand-ins serve"
        )

    missing.__name__ = name
    return missing


def _sgl_kernel_ops() -> dict[str, dict[str, Callable[..., Any]]]:
    """The ops each served module answers; every other name imports but raises."""
    return {
        "sgl_kernel": {
            "assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu,
            "copy_all_layer_kv_cache_cpu": copy_all_layer_kv_cache_cpu,
        },
        # KDA's decode conv (kda_backend imports it at import time on CPU).
        "sgl_kernel.mamba": {"causal_conv1d_update_cpu": glm5_standins.causal_conv1d_update},
    }


def make_sgl_kernel_module(name: str = "sgl_kernel") -> ModuleType:
    """A module named ``name`` with its ops; any other op imports but raises."""
    module = ModuleType(name)
    for op_name, op in _sgl_kernel_ops()[name].items():
        setattr(module, op_name, op)
    if name == "sgl_kernel":
        module.__path__ = []  # a package, so ``sgl_kernel.mamba`` imports

    def __getattr__(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _missing_op(attr)

    module.__getattr__ = __getattr__
    return module


class _SglKernelFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``sgl_kernel`` only when no real one is installed (it sits last on the path)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in _sgl_kernel_ops():
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=name == "sgl_kernel")

    def create_module(self, spec: Any) -> ModuleType:
        return make_sgl_kernel_module(spec.name)

    def exec_module(self, module: ModuleType) -> None:
        logger.debug("%s served by the CPU stand-in", module.__name__)


# ---------------------------------------------------------------------------
# 4. MLA attention on torch_native


def patch_mla_attention_handler(module: ModuleType) -> None:
    dispatch = module._dispatch_mla_subtype

    def handle_attention_torch_native(attn: Any, forward_batch: Any) -> Any:
        # torch_native implements MLA's absorbed path only; the triton fallback
        # would send prefill down the MHA sub-path, whose K width does not fit.
        return dispatch(attn, forward_batch)

    module.AttentionBackendRegistry.register("torch_native", handle_attention_torch_native)


# ---------------------------------------------------------------------------
# 5. PD prefill without pinned host-tensor indices


def patch_mooncake_kv_sender(module: ModuleType) -> None:
    module.MooncakeKVSender.supports_host_tensor_indices = False


# ---------------------------------------------------------------------------
# 6. Denormals in torch_native's padded queries


def flush_denormals(torch: Any) -> None:
    """Flush denormal floats to zero in this thread, where sglang's scheduler runs the model.

    The flag is per thread; servers here run torch with one thread
    (``OMP_NUM_THREADS=1``), the scheduler's main thread, which runs this.
    """
    if not torch.set_flush_denormal(True):
        logger.warning("this CPU cannot flush denormals; restored-request TTFT may vary")


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    **glm5_standins.PATCHES,
    "sglang.srt.mem_cache.pool_host.base": patch_host_pool_base,
    "sglang.srt.mem_cache.pool_host.mha": patch_direct_copies,
    "sglang.srt.mem_cache.pool_host.mla": patch_direct_copies,
    "sglang.srt.models.deepseek_common.attention_backend_handler": patch_mla_attention_handler,
    "sglang.srt.disaggregation.mooncake.conn": patch_mooncake_kv_sender,
}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, patch: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._patch = patch

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._patch(module)


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds a patched module through the other finders and patches it once it has run."""

    def __init__(self, patches: dict[str, Callable[[ModuleType], None]]) -> None:
        self._patches = patches

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        patch = self._patches.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


def _installed() -> bool:
    return any(isinstance(f, _PatchAfterImport) for f in sys.meta_path)


def install() -> bool:
    """Put the stand-ins in place for this process; False (nothing done) where CUDA is present.

    Raises :class:`StandinVersionError` for another sglang release, and
    RuntimeError when a patched module was imported before this ran (it would
    keep the unpatched version).
    """
    import torch

    if torch.cuda.is_available():
        return False
    if _installed():
        return True
    check_sglang_version()
    early = sorted(name for name in PATCHES if name in sys.modules)
    if early:
        raise RuntimeError(f"install() must run before sglang imports {', '.join(early)}")
    glm5_standins.choose_torch_paths()
    sys.meta_path.insert(0, _PatchAfterImport(PATCHES))
    if importlib.util.find_spec("sgl_kernel") is None:
        sys.meta_path.append(_SglKernelFinder())
        glm5_standins.answer_torch_ops(_missing_op)
    flush_denormals(torch)
    return True
