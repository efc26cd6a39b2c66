"""KDA (Kimi delta attention) in plain torch, the compute sglang 0.5.23 has only in triton.

GLM-5.3-Flash's linear-attention layers keep, per request, a causal-conv
window and a recurrent state in a Mamba-style state pool. sglang computes
them with triton kernels (``causal_conv1d_fn``, ``chunk_kda``,
``fused_sigmoid_gating_delta_rule_update``) that a CPU cannot run; these are
the same computations written from the recurrence, with sglang's calling
conventions: tokens of several requests packed back to back
(``query_start_loc``), each request's state gathered from and scattered back
to its pool slot (``cache_indices``), the forget gate and beta passed raw and
activated here (``A_log``, ``dt_bias``, ``lower_bound``).

The recurrence, per head, with a K x V state ``S`` and per-channel log decay
``g_t`` (a K vector)::

    S   <- diag(exp(g_t)) S
    u_t  = beta_t * (v_t - S^T k_t)
    S   <- S + k_t u_t^T
    o_t  = S^T (q_t / sqrt(K))

with ``q_t`` and ``k_t`` L2-normalised. sglang's state pool stores each head's
state transposed (V x K); the functions here take and return pool tensors in
that layout.

The chunked form (what a prefill runs) solves the same recurrence a block
of tokens at a time. Within a block, with ``G_t`` the running sum of ``g`` and
``S0`` the state at the block start, the updates ``u`` satisfy the
lower-triangular system::

    u_t + beta_t * sum_{s<t} <k_t, exp(G_t - G_s) * k_s> u_s
        = beta_t * (v_t - <exp(G_t) * k_t, S0>)

after which ``o_t = <exp(G_t) * q_t, S0> + sum_{s<=t} <q_t, exp(G_t - G_s) * k_s> u_s``
and the block's final state is ``exp(G_C) * S0 + sum_s (exp(G_C - G_s) * k_s) u_s^T``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

# sglang's chunked KDA kernel works in 64-token chunks; the per-chunk states it
# reports (the radix cache's state snapshots) sit at these boundaries.
CHUNK_TOKENS = 64
# What this module solves at once; it divides CHUNK_TOKENS (see chunked_kda).
BLOCK_TOKENS = 16
L2NORM_EPS = 1e-6
SOFTPLUS_THRESHOLD = 20.0


# ---------------------------------------------------------------------------
# causal depthwise conv1d with a per-request window


def _activate(x: torch.Tensor, activation: Any) -> torch.Tensor:
    if activation in (None, False):
        return x
    if activation in (True, "silu", "swish"):
        return F.silu(x)
    raise ValueError(f"unsupported conv activation {activation!r}")


def _conv_window(window: torch.Tensor, weight: torch.Tensor, bias: Any) -> torch.Tensor:
    """Depthwise causal conv over ``window`` ([dim, width - 1 + n]), the last ``n`` outputs."""
    width = weight.shape[1]
    frames = window.unfold(1, width, 1)  # [dim, n, width]
    out = (frames * weight[:, None, :]).sum(-1)
    if bias is not None:
        out = out + bias[:, None]
    return out


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens_cpu: Sequence[int] | None = None,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: Any = "silu",
    pad_slot_id: int = -1,
    **kwargs: Any,
) -> torch.Tensor:
    """Prefill conv: ``x`` is [dim, tokens] of several requests packed back to back.

    Request ``i`` owns tokens ``query_start_loc[i]:query_start_loc[i + 1]``
    and conv window ``conv_states[cache_indices[i]]`` ([dim, width - 1]),
    which it starts from when ``has_initial_state[i]`` (else from zeros) and
    which is left holding its last ``width - 1`` inputs. A request whose slot
    is ``pad_slot_id`` is skipped (its outputs are zeros).
    """
    del seq_lens_cpu, kwargs
    state_len = weight.shape[1] - 1
    out = torch.zeros_like(x)
    starts = query_start_loc.tolist()
    for i, (start, end) in enumerate(zip(starts[:-1], starts[1:], strict=True)):
        slot = i if cache_indices is None else int(cache_indices[i])
        if slot == pad_slot_id or end == start:
            continue
        carried = has_initial_state is not None and bool(has_initial_state[i])
        initial = (
            conv_states[slot].to(weight.dtype)
            if carried
            else x.new_zeros(x.shape[0], state_len).to(weight.dtype)
        )
        window = torch.cat([initial, x[:, start:end].to(weight.dtype)], dim=1)
        out[:, start:end] = _activate(_conv_window(window, weight, bias), activation).to(x.dtype)
        conv_states[slot] = window[:, -state_len:].to(conv_states.dtype)
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: Any = None,
    cache_seqlens: Any = None,
    conv_state_indices: torch.Tensor | None = None,
    pad_slot_id: int = -1,
    **kwargs: Any,
) -> torch.Tensor:
    """Decode conv: one new token per request (``x`` is [batch, dim]), windows shifted in place."""
    del cache_seqlens, kwargs
    if x.dim() == 3:  # [batch, dim, tokens]: several tokens per request, in order
        outs = [
            causal_conv1d_update(
                x[..., t],
                conv_state,
                weight,
                bias,
                activation,
                None,
                conv_state_indices,
                pad_slot_id,
            )
            for t in range(x.shape[-1])
        ]
        return torch.stack(outs, dim=-1)
    out = torch.zeros_like(x)
    for row in range(x.shape[0]):
        slot = row if conv_state_indices is None else int(conv_state_indices[row])
        if slot == pad_slot_id:
            continue
        window = torch.cat(
            [conv_state[slot].to(weight.dtype), x[row, :, None].to(weight.dtype)], dim=1
        )
        out[row] = _activate(_conv_window(window, weight, bias)[:, 0], activation).to(x.dtype)
        conv_state[slot] = window[:, 1:].to(conv_state.dtype)
    return out


# ---------------------------------------------------------------------------
# gates


def forget_gate(
    raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None
) -> torch.Tensor:
    """Per-channel log decay from the raw gate ``raw`` ([..., H, K]).

    With a lower bound ("safe gate"): ``lower_bound * sigmoid(exp(A_log) * (raw + dt_bias))``,
    in (lower_bound, 0); without: ``-exp(A_log) * softplus(raw + dt_bias)``.
    """
    heads, head_dim = raw.shape[-2:]
    x = raw.float() + dt_bias.float().reshape(heads, head_dim)
    rate = A_log.float().reshape(heads, 1).exp()
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * x)
    softplus = torch.where(x > SOFTPLUS_THRESHOLD, x, torch.log1p(torch.exp(x)))
    return -rate * softplus


def l2_normalise(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


# ---------------------------------------------------------------------------
# the recurrence, one request at a time (state K x V per head)


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token: q, k, g [T, H, K] (q, k normalised), v [T, H, V], beta [T, H],
    state [H, K, V]. Returns the outputs [T, H, V] and the final state."""
    scale = q.shape[-1] ** -0.5
    outs = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[..., None]
        remembered = torch.einsum("hkv,hk->hv", state, k[t])
        update = beta[t][:, None] * (v[t] - remembered)
        state = state + k[t][..., None] * update[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", state, q[t] * scale))
    return torch.stack(outs) if outs else v.new_zeros(v.shape), state


def _chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of the recurrence at once (shapes as :func:`recurrent_kda`, T <= chunk)."""
    n = q.shape[0]
    scale = q.shape[-1] ** -0.5
    cum = g.cumsum(0)  # G_t, [T, H, K]
    # decay[t, s] = exp(G_t - G_s) for s <= t (the exponent is <= 0 there)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    diff = (cum[:, None] - cum[None, :]).masked_fill(~causal[..., None, None], float("-inf"))
    decay = diff.exp()  # [T, S, H, K]
    kk = torch.einsum("thk,tshk,shk->hts", k, decay, k)
    qk = torch.einsum("thk,tshk,shk->hts", q * scale, decay, k)
    start_k = k * cum.exp()  # exp(G_t) * k_t
    rhs = beta.T[..., None] * (v.transpose(0, 1) - torch.einsum("thk,hkv->htv", start_k, state))
    system = torch.eye(n) + beta.T[..., None] * kk.tril(-1)
    u = torch.linalg.solve_triangular(system, rhs, upper=False)  # [H, T, V]
    out = torch.einsum("thk,hkv->thv", q * scale * cum.exp(), state)
    out = out + torch.einsum("hts,hsv->thv", qk, u)
    tail = (cum[-1:] - cum).exp() * k  # exp(G_C - G_s) * k_s
    state = state * cum[-1].exp()[..., None] + torch.einsum("shk,hsv->hkv", tail, u)
    return out, state


def chunked_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_tokens: int = CHUNK_TOKENS,
    block_tokens: int = BLOCK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The recurrence a block at a time. Returns the outputs, the final state and the
    state at the start of every ``chunk_tokens`` chunk (what sglang's kernel reports as
    ``h``). Any block size gives the same result; a block's cost grows with its square,
    so blocks smaller than sglang's chunks are faster here."""
    if chunk_tokens % block_tokens:
        raise ValueError(f"block_tokens {block_tokens} must divide chunk_tokens {chunk_tokens}")
    outs, starts = [], []
    for first in range(0, q.shape[0], block_tokens):
        if first % chunk_tokens == 0:
            starts.append(state)
        part = slice(first, first + block_tokens)
        out, state = _chunk(q[part], k[part], v[part], g[part], beta[part], state)
        outs.append(out)
    out = torch.cat(outs) if outs else v.new_zeros(v.shape)
    return out, state, starts


# ---------------------------------------------------------------------------
# sglang's calling conventions: packed requests, pool slots, raw gates


def _requests(query_start_loc: torch.Tensor, cache_indices: torch.Tensor):
    """(request, first token, end token, pool slot) of every request; a padding row's
    slot is negative (it starts from a zero state and nothing of it is stored)."""
    starts = query_start_loc.tolist()
    for i, (start, end) in enumerate(zip(starts[:-1], starts[1:], strict=True)):
        yield i, start, end, int(cache_indices[i])


def _load_state(ssm_states: torch.Tensor, slot: int) -> torch.Tensor:
    """A slot's state as [H, K, V] fp32 (the pool keeps [H, V, K])."""
    if slot < 0:
        return ssm_states.new_zeros(ssm_states.shape[1:], dtype=torch.float32).transpose(-1, -2)
    return ssm_states[slot].float().transpose(-1, -2).clone()


def _store_state(ssm_states: torch.Tensor, slot: int, state: torch.Tensor) -> None:
    if slot >= 0:
        ssm_states[slot] = state.transpose(-1, -2).to(ssm_states.dtype)


def _gates(
    q: torch.Tensor,
    k: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
    beta_is_raw: bool = True,
) -> tuple[torch.Tensor, ...]:
    """Token-major fp32 q, k (normalised), log decay g [T, H, K] and beta [T, H]."""
    tokens, heads, head_dim = q.shape[-3:]
    q = l2_normalise(q.reshape(tokens, heads, head_dim).float())
    k = l2_normalise(k.reshape(tokens, heads, head_dim).float())
    a = a.reshape(tokens, heads, head_dim)
    g = a.float() if A_log is None else forget_gate(a, A_log, dt_bias, lower_bound)
    beta = b.reshape(tokens, heads).float()
    return q, k, g, beta.sigmoid() if beta_is_raw else beta


def kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    cache_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    lower_bound: float | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """The recurrent path (``TritonKDAKernel.decode``): q, k, v [1, T, H, D], raw gate
    ``a`` (T x H*K), raw beta ``b`` (T x H); each request's state read from and written
    back to ``ssm_states[cache_indices[i]]`` ([H, V, K]). Returns [1, T, H, V]."""
    del kwargs
    q, k, g, beta = _gates(q, k, a, b, A_log, dt_bias, lower_bound)
    v = v.reshape(q.shape[0], q.shape[1], -1).float()
    out = v.new_zeros(v.shape)
    for _, start, end, slot in _requests(query_start_loc, cache_indices):
        part = slice(start, end)
        state = _load_state(ssm_states, slot)
        out[part], state = recurrent_kda(q[part], k[part], v[part], g[part], beta[part], state)
        _store_state(ssm_states, slot, state)
    return out[None]


def kda_extend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    ssm_states: torch.Tensor,
    cache_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    beta_is_raw: bool = False,
    return_intermediate_states: bool = False,
    track_state: torch.Tensor | None = None,
    track_chunk_idx: torch.Tensor | None = None,
    **kwargs: Any,
) -> Any:
    """The chunked path (``TritonKDAKernel.extend``, sglang's ``chunk_kda``).

    Every request starts from the state in its slot (a fresh request's slot is
    zeroed by the pool) and leaves its final state there. ``h`` ([1, chunks, H,
    V, K], every request's chunks in order) holds the state at the start of each
    64-token chunk; ``track_state[i]`` gets request i's state at the start of its
    chunk ``track_chunk_idx[i]`` (the radix cache's snapshot).
    """
    del kwargs
    q, k, g, beta = _gates(q, k, g, beta, A_log, dt_bias, lower_bound, beta_is_raw)
    v = v.reshape(q.shape[0], q.shape[1], -1).float()
    out = v.new_zeros(v.shape)
    chunk_states = []
    for i, start, end, slot in _requests(query_start_loc, cache_indices):
        part = slice(start, end)
        state = _load_state(ssm_states, slot)
        out[part], state, starts = chunked_kda(
            q[part], k[part], v[part], g[part], beta[part], state
        )
        _store_state(ssm_states, slot, state)
        chunk_states += starts
        if track_state is not None and i < track_chunk_idx.shape[0]:
            chunk = int(track_chunk_idx[i])
            if 0 <= chunk < len(starts):
                track_state[i] = starts[chunk].transpose(-1, -2).to(track_state.dtype)
    out = out[None]
    if not return_intermediate_states:
        return out
    h = torch.stack(chunk_states).transpose(-1, -2)[None] if chunk_states else None
    return out, h


# ---------------------------------------------------------------------------
# the gated RMS norm on the KDA output (FusedRMSNormGated)


def rms_norm_gated(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    activation: str = "sigmoid",
) -> torch.Tensor:
    """``weight * x / rms(x) * act(gate)`` over the last dim, in fp32, returned in x's dtype."""
    acts = {"sigmoid": torch.sigmoid, "silu": F.silu, "swish": F.silu}
    if activation not in acts:
        raise ValueError(f"unsupported gate activation {activation!r}")
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return (y * acts[activation](gate.float())).to(x.dtype)
