"""What sglang 0.5.23 lacks to serve GLM-5.3-Flash (``glm5_next``) on a CPU-only host.

Installed beside :mod:`~mooncake_span_tools.testing.cpu_server.standins` (whose
``PATCHES`` take these in), in every server process, and only where CUDA is
absent. Two kinds:

- platform gaps, where sglang assumes CUDA on a path a CPU server takes: the
  DSA start-up's device capability, the Mamba radix cache's platform gate,
  pinned memory of the Mamba and indexer host pools and of the decode track
  mask, those pools' direct host/device copies, a stream ``synchronize``,
  the KDA backend's ``sgl_kernel.mamba`` import and two GDN ``torch.ops``
  names, a triton copy of tracked states; and sglang's own switches to its
  torch paths (mHC, PD's early prefix send);
- compute sglang has only in triton or CUDA, written here from the math:
  the KDA kernels and norms (:mod:`~mooncake_span_tools.testing.cpu_server.kda_cpu`),
  the clamped SwiGLU, the compressed indexer's pool writes and top-k selection
  (:mod:`~mooncake_span_tools.testing.cpu_server.dsa_index_cpu`) and the sparse
  attention on ``torch_native`` that the selection drives.

``tests/unit/test_glm5_standins.py`` checks the compute against transformers'
``glm5_next`` reference; ``docs/real-servers.md`` lists each gap.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

from mooncake_span_tools.testing.cpu_server import dsa_index_cpu, kda_cpu
from mooncake_span_tools.testing.cpu_server.host_pools import patch_direct_copies, unpinned_init

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------
# sglang's own switches for the paths that have a torch version

# mHC (the hyper-connection residual streams) has tilelang kernels, used by
# default, and torch ones behind these switches; tilelang needs CUDA.
TORCH_PATH_ENV = {
    "SGLANG_OPT_USE_TILELANG_MHC_PRE": "0",
    "SGLANG_OPT_USE_TILELANG_MHC_POST": "0",
    # A PD prefill server sends a chunked request's cached prefix early, fenced
    # by a torch.cuda.Event; without it the prefix goes with the last chunk.
    "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0",
}


def choose_torch_paths(environ: dict | None = None) -> None:
    """Turn sglang's tilelang switches off unless the caller set them."""
    environ = os.environ if environ is None else environ
    for name, value in TORCH_PATH_ENV.items():
        environ.setdefault(name, value)


# ---------------------------------------------------------------------------
# the DSA start-up path asks for a CUDA device capability


def cpu_device_capability(device: Any = None) -> tuple[int, int]:
    """What a host without CUDA reports: no compute capability at all."""
    del device
    return (0, 0)


def patch_device_capability(module: ModuleType) -> None:
    import torch

    # model_hook and overrides import torch inside the functions that ask, so
    # only torch's own attribute reaches them.
    torch.cuda.get_device_capability = cpu_device_capability
    del module


# ---------------------------------------------------------------------------
# Mamba/KDA state snapshots for the radix cache (the "extra buffer")


def patch_mamba_extra_buffer(module: ModuleType) -> None:
    module._platform_supports_mamba_cache_extra_buffer = lambda: True


# ---------------------------------------------------------------------------
# the Mamba and DSA-indexer host pools pin their memory themselves


def patch_state_host_pool(class_name: str) -> Callable[[ModuleType], None]:
    """The Mamba and DSA-indexer host pools: pinning off and the direct copies bound.

    They do not go through ``HostKVCache.__init__`` (whose stand-in turns
    pinning off), so their own ``pin_memory`` keyword is turned off too; like
    the MHA and MLA pools they import their direct host/device copies only on
    CUDA and HIP, and call them with one-slot pages (``page_size=1``), which
    the index-copy versions take as they are.
    """

    def patch(module: ModuleType) -> None:
        cls = getattr(module, class_name)
        cls.__init__ = unpinned_init(cls.__init__)
        patch_direct_copies(module)

    return patch


# ---------------------------------------------------------------------------
# the L2 transfer engine syncs its stream on an error path


def patch_cpu_stream_synchronize(module: ModuleType) -> None:
    """torch's CPU stream has no ``synchronize`` (its work is done when a call returns);
    sglang's L2 transfer calls it when a copy fails, which hid the copy's own error."""
    import torch

    if not hasattr(torch.cpu.Stream, "synchronize"):
        torch.cpu.Stream.synchronize = lambda self: None
    del module


def unpinned(self: Any) -> Any:
    """``Tensor.pin_memory`` without an accelerator: the tensor itself (pinning
    exists for device copies, and there is no device)."""
    return self


def patch_tensor_pin_memory(module: ModuleType) -> None:
    import torch

    # schedule_batch pins the Mamba track mask before each decode step.
    torch.Tensor.pin_memory = unpinned
    del module


# ---------------------------------------------------------------------------
# KDA kernels: the conv and the recurrence in plain torch (kda_cpu)

causal_conv1d_update = kda_cpu.causal_conv1d_update


def patch_kda_backend(module: ModuleType) -> None:
    # The prefill conv is triton's on every platform; decode's came from sgl_kernel.mamba.
    module.causal_conv1d_fn = kda_cpu.causal_conv1d_fn
    module.causal_conv1d_update = kda_cpu.causal_conv1d_update


def patch_kda_triton_kernel(module: ModuleType) -> None:
    cls = module.TritonKDAKernel

    def decode(self: Any, *args: Any, **kwargs: Any) -> Any:
        return kda_cpu.kda_decode(*args, **kwargs)

    def extend(self: Any, *args: Any, **kwargs: Any) -> Any:
        return kda_cpu.kda_extend(*args, **kwargs)

    cls.decode = decode
    cls.extend = extend


def patch_fused_rms_norm_gated(module: ModuleType) -> None:
    def forward(
        self: Any,
        x: Any,
        g: Any,
        residual: Any = None,
        prenorm: bool = False,
        residual_in_fp32: bool = False,
    ) -> Any:
        if residual is not None or prenorm:
            raise NotImplementedError("the CPU stand-in of FusedRMSNormGated has no residual path")
        return kda_cpu.rms_norm_gated(x, g, self.weight, self.eps, self.activation)

    module.FusedRMSNormGated.forward = forward


# ---------------------------------------------------------------------------
# the clamped SwiGLU of GLM's MLPs (a CUDA JIT kernel in sglang)


def silu_and_mul_clamp(gate_up: Any, out: Any, swiglu_limit: float) -> None:
    """``out = silu(min(gate, limit)) * clamp(up, -limit, limit)``; gate_up is [gate | up]."""
    import torch.nn.functional as F

    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=swiglu_limit)
    up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    out.copy_(F.silu(gate.float()) * up.float())


def patch_silu_and_mul_clamp(module: ModuleType) -> None:
    module.silu_and_mul_clamp = silu_and_mul_clamp


# ---------------------------------------------------------------------------
# decode's state snapshots for the radix cache (a triton copy kernel)


def _copy_tracked_rows(
    pools: tuple[Any, ...],
    cache_indices: Any,
    mask: Any,
    track_indices: Any,
    batch_size: int,
    check_freed_slots: bool,
) -> None:
    """For each row i < batch_size with ``mask[i]``, copy slot ``cache_indices[i]`` to
    slot ``track_indices[i]`` in every pool (the slot axis is dim 1 of [layers, slots, ...])."""
    rows = [i for i in range(batch_size) if bool(mask[i])]
    for i in rows:
        src, dst = int(cache_indices[i]), int(track_indices[i])
        if check_freed_slots and (src < 0 or dst < 0):
            continue
        for pool in pools:
            pool[:, dst] = pool[:, src]


def track_mamba_states_all_layers(
    conv_states_pool: Any,
    ssm_states_pool: Any,
    cache_indices: Any,
    mamba_track_mask: Any,
    mamba_track_indices: Any,
    batch_size: int,
    check_freed_slots: bool = False,
) -> None:
    _copy_tracked_rows(
        (conv_states_pool, ssm_states_pool),
        cache_indices,
        mamba_track_mask,
        mamba_track_indices,
        batch_size,
        check_freed_slots,
    )


def track_mamba_states_if_needed(
    conv_states: Any,
    ssm_states: Any,
    cache_indices: Any,
    mamba_track_mask: Any,
    mamba_track_indices: Any,
    batch_size: int,
    check_freed_slots: bool = False,
) -> None:
    _copy_tracked_rows(
        (conv_states[None], ssm_states[None]),
        cache_indices,
        mamba_track_mask,
        mamba_track_indices,
        batch_size,
        check_freed_slots,
    )


def patch_mamba_track_copies(module: ModuleType) -> None:
    module.track_mamba_states_all_layers = track_mamba_states_all_layers
    module.track_mamba_states_if_needed = track_mamba_states_if_needed


# ---------------------------------------------------------------------------
# the compressed DSA indexer's writes to its pool (dsa_index_cpu)


def _step_requests(forward_batch: Any, positions: Any):
    """(request pool row, first position, token slice) of each request in a step."""
    if forward_batch.forward_mode.is_decode_or_idle():
        counts = [1] * int(forward_batch.req_pool_indices.shape[0])
    else:
        counts = [int(n) for n in forward_batch.extend_seq_lens_cpu]
    offset = 0
    for row, count in zip(forward_batch.req_pool_indices.tolist(), counts, strict=True):
        if count:
            yield int(row), int(positions[offset]), slice(offset, offset + count)
        offset += count


def indexer_forward_native(
    self: Any,
    x: Any,
    q_lora: Any,
    positions: Any,
    forward_batch: Any,
    layer_id: int,
    return_indices: bool = True,
    use_cuda_graph: bool = True,
) -> Any:
    """Writes this step's index keys to the pool, then selects each query's tokens
    from the pool (``dsa_index_cpu.select_tokens``): positions in its request,
    ``[tokens, index_topk + kpool - 1]``, -1 padded, which the sparse attention
    stand-in below reads. Keys and gate scores are rounded to bf16, the dtype
    sglang's kernels take them in (and keep waiting tokens in)."""
    import torch
    import torch.nn.functional as F
    from sglang.srt.model_executor.forward_context import (
        get_req_to_token_pool,
        get_token_to_kv_pool,
    )

    del use_cuda_graph
    mode = forward_batch.forward_mode
    if mode.is_idle() or not (mode.is_decode() or mode.is_extend()) or x.shape[0] == 0:
        return None
    keys = self.k_norm(self.wk(x)[0].float()).to(torch.bfloat16)
    scores = F.linear(x.float(), self.index_kpool_compress_gate.float()).to(torch.bfloat16)
    pool = get_token_to_kv_pool()
    buf = pool.get_index_k_with_scale_buffer(layer_id)
    tail_k, tail_score = pool.get_compress_tail_buffers(layer_id)
    req_to_token = get_req_to_token_pool().req_to_token
    requests = list(_step_requests(forward_batch, positions))
    for row, first_pos, part in requests:
        dsa_index_cpu.write_request(
            buf,
            tail_k,
            tail_score,
            row,
            first_pos,
            keys[part],
            scores[part],
            req_to_token[row],
            self.index_kpool_compress_ape,
            self.scale_fmt is not None,
        )
    if not return_indices:
        return None
    queries = self.wq_b(q_lora)[0].float().view(x.shape[0], self.n_heads, self.head_dim)
    queries = queries @ dsa_index_cpu.hadamard_matrix(self.head_dim)
    weights = self.weights_proj(x.float())[0] * self.n_heads**-0.5 * self.softmax_scale
    selected = []
    for row, first_pos, part in requests:
        n_pools = (first_pos + part.stop - part.start) // self.index_kpool
        pooled = dsa_index_cpu.pooled_keys(buf, req_to_token[row], n_pools, self.index_kpool)
        selected.append(
            dsa_index_cpu.select_tokens(
                queries[part],
                weights[part],
                pooled,
                positions[part].long().cpu(),
                self.index_topk,
                self.index_kpool,
            )
        )
    return torch.cat(selected).to(x.device)


def patch_indexer_kpool(module: ModuleType) -> None:
    module.IndexerKPool.forward_native = indexer_forward_native


# ---------------------------------------------------------------------------
# DSA attention on torch_native: each query attends to its selected tokens


def _sparse_attention(
    backend: Any,
    q: Any,
    k: Any,
    v: Any,
    layer: Any,
    forward_batch: Any,
    save_kv_cache: bool,
    topk_indices: Any,
    kv_write_loc: Any,
) -> Any:
    """torch_native's attention with each query restricted to the tokens the indexer
    selected for it (``dsa_index_cpu.attention_mask``), instead of every earlier token."""
    from torch.nn.functional import scaled_dot_product_attention

    pool = backend.token_to_kv_pool
    if save_kv_cache and k is not None and v is not None:
        pool.set_kv_buffer(
            layer, kv_write_loc(forward_batch.out_cache_loc, backend.swa_out_cache_loc), k, v
        )
    heads = layer.tp_q_head_num
    query = q.reshape(-1, heads, layer.qk_head_dim)
    out = query.new_empty(query.shape[0], heads, layer.v_head_dim)
    k_cache, v_cache = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
    req_to_token = backend.req_to_token_pool.req_to_token
    counts = (
        [1] * forward_batch.batch_size
        if forward_batch.forward_mode.is_decode_or_idle()
        else [int(n) for n in forward_batch.extend_seq_lens_cpu]
    )
    start = 0
    for i, count in enumerate(counts):
        seq_len = int(forward_batch.seq_lens_cpu[i])
        tokens = req_to_token[forward_batch.req_pool_indices[i], :seq_len]
        mask = dsa_index_cpu.attention_mask(topk_indices[start : start + count].cpu(), seq_len)
        keys, values = k_cache[tokens].to(query.dtype), v_cache[tokens].to(query.dtype)
        out[start : start + count] = scaled_dot_product_attention(
            query[start : start + count].movedim(0, 1)[None],
            keys.movedim(0, 1)[None],
            values.movedim(0, 1)[None],
            attn_mask=mask[None, None].to(query.device),
            scale=layer.scaling,
            enable_gqa=heads != layer.tp_k_head_num,
        )[0].movedim(0, 1)
        start += count
    return out.reshape(-1, heads * layer.v_head_dim)


def patch_torch_native_sparse(module: ModuleType) -> None:
    cls = module.TorchNativeAttnBackend
    dense_extend, dense_decode = cls.forward_extend, cls.forward_decode

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, topk_indices=None):
        if topk_indices is None:
            return dense_extend(self, q, k, v, layer, forward_batch, save_kv_cache)
        return _sparse_attention(
            self, q, k, v, layer, forward_batch, save_kv_cache, topk_indices, module.KVWriteLoc
        )

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, topk_indices=None):
        if topk_indices is None:
            return dense_decode(self, q, k, v, layer, forward_batch, save_kv_cache)
        return _sparse_attention(
            self, q, k, v, layer, forward_batch, save_kv_cache, topk_indices, module.KVWriteLoc
        )

    cls.forward_extend, cls.forward_decode = forward_extend, forward_decode


# Looked up on torch.ops.sgl_kernel when sglang imports its linear-attention
# backends on CPU (GDN's, which the KDA backend module imports too); never
# called for this model, so each answers with a clear error.
GDN_TORCH_OPS = ("fused_sigmoid_gating_delta_rule_update_cpu", "fused_gdn_gating_cpu")


def answer_torch_ops(missing_op: Callable[[str], Callable[..., Any]]) -> None:
    """Name the GDN ops on ``torch.ops.sgl_kernel`` (only these: answering every name
    would make sglang's ``register_fake_if_exists`` think real kernels are there)."""
    import torch

    namespace = torch.ops.sgl_kernel
    for name in GDN_TORCH_OPS:
        if name not in namespace.__dict__:
            setattr(namespace, name, missing_op(name))


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "sglang.srt.arg_groups.model_hook": patch_device_capability,
    "sglang.srt.arg_groups.mamba_hook": patch_mamba_extra_buffer,
    "sglang.srt.managers.schedule_batch": patch_tensor_pin_memory,
    "sglang.srt.mem_cache.pool_host.mamba": patch_state_host_pool("MambaPoolHost"),
    "sglang.srt.mem_cache.pool_host.dsa": patch_state_host_pool("DSAIndexerPoolHost"),
    "sglang.srt.mem_cache.l2_transfer": patch_cpu_stream_synchronize,
    "sglang.kernels.ops.mamba.mamba_state_scatter_triton": patch_mamba_track_copies,
    "sglang.srt.layers.attention.linear.kda_backend": patch_kda_backend,
    "sglang.kernels.ops.attention.fla.fused_norm_gate": patch_fused_rms_norm_gated,
    "sglang.kernels.ops.activation.silu_and_mul_clamp": patch_silu_and_mul_clamp,
    "sglang.srt.layers.attention.dsa.dsa_indexer_kpool": patch_indexer_kpool,
    "sglang.srt.layers.attention.torch_native_backend": patch_torch_native_sparse,
    "sglang.srt.layers.attention.linear.kernels.kda_triton": patch_kda_triton_kernel,
}
