"""The compressed DSA indexer's writes to its pool, in plain torch.

GLM-5.3-Flash's DSA layers keep, beside the MLA latent KV, one index key per
group of ``index_kpool`` consecutive tokens (a "pool"). sglang 0.5.23 writes
them with triton kernels a CPU cannot run; this is the same computation from
the math, with sglang's byte layout, so that the index pool a server backs up
to L3 (and restores from it) carries the content a GPU server would write:

1. per token: ``k = LayerNorm(wk(x))`` (128 wide) and a gate score
   ``s = compress_gate @ x`` (128 wide, one per channel);
2. per pool of ``kpool`` tokens, per channel: softmax over the pool's tokens of
   ``s + ape[slot]``, and the pooled key is the softmax-weighted sum of their k;
3. the pooled key, rounded to bf16, is rotated by the 128-point Hadamard
   transform (orthonormal), rounded to bf16 again, and quantised to fp8 e4m3
   with one fp32 scale for the 128 values: ``scale = 2^ceil(log2(absmax / 448))``
   ("ue8m0", what sglang's GLM indexer asks for) or ``absmax / 448``;
4. the fp8 row and its scale go to the index page of the pool's first token:
   each 256-token device page owns one index page of 64 rows, laid out as the
   64 rows' fp8 bytes (64 x 128) followed by their 64 fp32 scales.

Tokens of a pool that is not complete yet wait in a per-request ring (the
"tail" buffers, ``kpool + extra`` slots, bf16), indexed by position modulo the
ring size; a later step that completes the pool takes them from there.
"""

from __future__ import annotations

from functools import lru_cache

import torch

INDEX_HEAD_DIM = 128
FP8_MAX = 448.0
SCALE_BYTES = 4
MIN_ABSMAX = 1e-4


@lru_cache(maxsize=4)
def hadamard_matrix(size: int = INDEX_HEAD_DIM) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix (symmetric, its own inverse)."""
    h = torch.ones(1, 1)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    if h.shape[0] != size:
        raise ValueError(f"Hadamard size must be a power of two, got {size}")
    return h / size**0.5


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def compress_pools(
    slot_k: torch.Tensor, slot_score: torch.Tensor, ape: torch.Tensor
) -> torch.Tensor:
    """Pooled keys [n, D] from each pool's tokens ``slot_k`` / ``slot_score`` [n, kpool, D]:
    per channel, the softmax over the pool's tokens of ``score + ape`` weighs their keys."""
    weights = torch.softmax(slot_score.float() + ape.float()[None], dim=1)
    return (weights * slot_k.float()).sum(dim=1)


def rotate_and_quantise(
    pooled: torch.Tensor, round_scale: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 rows [n, D] and their fp32 scales [n] of the Hadamard-rotated pooled keys."""
    x = _bf16(_bf16(pooled) @ hadamard_matrix(pooled.shape[-1]))
    absmax = x.abs().amax(dim=-1).clamp_min(MIN_ABSMAX)
    scale = (
        torch.exp2(torch.ceil(torch.log2(absmax / FP8_MAX))) if round_scale else absmax / FP8_MAX
    )
    quantised = (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return quantised, scale.float()


def dequantise(quantised: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The rotated keys an fp8 row and its scale stand for."""
    return quantised.float() * scale[:, None]


def unrotate(rotated: torch.Tensor) -> torch.Tensor:
    """Undo the Hadamard rotation (the transform is its own inverse)."""
    return rotated @ hadamard_matrix(rotated.shape[-1])


def rows_per_page(buf: torch.Tensor, head_dim: int = INDEX_HEAD_DIM) -> int:
    return buf.shape[1] // (head_dim + SCALE_BYTES)


def write_rows(
    buf: torch.Tensor, locs: torch.Tensor, quantised: torch.Tensor, scale: torch.Tensor
) -> None:
    """Put rows at index locations ``locs`` (page * rows_per_page + slot) of a uint8 buffer
    [pages, rows_per_page * (D + 4)]: a page's fp8 rows first, then its fp32 scales."""
    rows, dim = rows_per_page(buf, quantised.shape[1]), quantised.shape[1]
    pages, slots = locs // rows, locs % rows
    keys = buf[:, : rows * dim].view(buf.shape[0], rows, dim)
    scales = buf[:, rows * dim :].view(buf.shape[0], rows, SCALE_BYTES)
    keys[pages, slots] = quantised.view(torch.uint8)
    scales[pages, slots] = scale.float().view(torch.uint8).view(-1, SCALE_BYTES)


def read_rows(
    buf: torch.Tensor, locs: torch.Tensor, dim: int = INDEX_HEAD_DIM
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 rows and fp32 scales at ``locs`` (the inverse of :func:`write_rows`)."""
    rows = rows_per_page(buf, dim)
    pages, slots = locs // rows, locs % rows
    keys = buf[:, : rows * dim].view(buf.shape[0], rows, dim)
    scales = buf[:, rows * dim :].view(buf.shape[0], rows, SCALE_BYTES)
    quantised = keys[pages, slots].view(torch.float8_e4m3fn)
    scale = scales[pages, slots].contiguous().view(torch.float32).view(-1)
    return quantised, scale


# ---------------------------------------------------------------------------
# a step's writes: every pool the step completes, and the tokens left waiting


def write_request(
    buf: torch.Tensor,
    tail_k: torch.Tensor,
    tail_score: torch.Tensor,
    req: int,
    first_pos: int,
    keys: torch.Tensor,
    scores: torch.Tensor,
    token_locs: torch.Tensor,
    ape: torch.Tensor,
    round_scale: bool = True,
) -> int:
    """One request's new tokens (positions ``first_pos ..``, ``keys``/``scores`` [n, D]).

    ``token_locs[p]`` is the device location of position p (the request's
    req_to_token row). Every pool the new tokens complete is compressed and
    written (its earlier tokens come from the ring); the new tokens then go to
    the ring. Returns the number of pooled rows written.
    """
    kpool, ring = ape.shape[0], tail_k.shape[1]
    rows = rows_per_page(buf, keys.shape[1])
    page_tokens = rows * kpool
    n = keys.shape[0]
    pool_start = first_pos - first_pos % kpool
    # The unfinished pool's earlier tokens wait in the ring (at most kpool - 1 of them).
    waiting = torch.arange(pool_start, first_pos) % ring
    all_k = torch.cat([tail_k[req, waiting].float(), keys.float()])
    all_score = torch.cat([tail_score[req, waiting].float(), scores.float()])
    n_pools = all_k.shape[0] // kpool
    if n_pools:
        take = n_pools * kpool
        pooled = compress_pools(
            all_k[:take].view(n_pools, kpool, -1), all_score[:take].view(n_pools, kpool, -1), ape
        )
        starts = pool_start + torch.arange(n_pools) * kpool
        pages = token_locs[starts].long() // page_tokens
        locs = pages * rows + (starts % page_tokens) // kpool
        write_rows(buf, locs, *rotate_and_quantise(pooled, round_scale))
    kept = torch.arange(max(0, n - ring), n)
    slots = (first_pos + kept) % ring
    tail_k[req, slots] = keys[kept].to(tail_k.dtype)
    tail_score[req, slots] = scores[kept].to(tail_score.dtype)
    return n_pools


# ---------------------------------------------------------------------------
# selection: which tokens a query attends to


def pooled_keys(
    buf: torch.Tensor, token_locs: torch.Tensor, n_pools: int, kpool: int
) -> torch.Tensor:
    """A request's first ``n_pools`` pooled keys as the pool holds them (rotated,
    dequantised), [n_pools, D]; ``token_locs`` is its req_to_token row."""
    if n_pools == 0:
        return torch.zeros(0, INDEX_HEAD_DIM)
    rows = rows_per_page(buf)
    starts = torch.arange(n_pools) * kpool
    locs = (token_locs[starts].long() // (rows * kpool)) * rows + (starts % (rows * kpool)) // kpool
    return dequantise(*read_rows(buf, locs))


def select_tokens(
    queries: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    topk: int,
    kpool: int,
) -> torch.Tensor:
    """The token positions each query attends to, [T, topk + kpool - 1], -1 padded.

    ``queries`` [T, heads, D] (rotated like the keys), ``weights`` [T, heads]
    (the per-head gate, softmax scale included), ``keys`` [P, D] the request's
    complete pools, ``positions`` [T]. A pool is a candidate when its last
    token is at or before the query; the ``topk // kpool`` best by
    ``sum_h weights_h * relu(q_h . k)`` are taken whole, and the query's own
    pool, while incomplete, is added token by token.
    """
    n_pools = keys.shape[0]
    scores = torch.relu(torch.einsum("thd,pd->thp", queries.float(), keys.float()))
    scores = torch.einsum("th,thp->tp", weights.float(), scores)
    pool_end = torch.arange(n_pools) * kpool + kpool - 1
    visible = pool_end[None, :] <= positions[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    take = min(topk // kpool, n_pools)
    out = torch.full((queries.shape[0], topk + kpool - 1), -1, dtype=torch.int32)
    if take:
        best = scores.topk(take, dim=-1).indices
        chosen = visible.gather(1, best)
        tokens = (best[..., None] * kpool + torch.arange(kpool)).flatten(1)
        tokens = tokens.masked_fill(~chosen.repeat_interleave(kpool, dim=1), -1)
        out[:, : tokens.shape[1]] = tokens.to(torch.int32)
    tail_count = (positions + 1) % kpool
    tail = (positions + 1 - tail_count)[:, None] + torch.arange(kpool - 1)
    tail = tail.masked_fill(torch.arange(kpool - 1)[None, :] >= tail_count[:, None], -1)
    out[:, topk:] = tail.to(torch.int32)
    return out


def attention_mask(selected: torch.Tensor, kv_len: int) -> torch.Tensor:
    """[T, kv_len] bool: True where a query attends (its selected positions)."""
    mask = torch.zeros(selected.shape[0], kv_len + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where(selected < 0, kv_len, selected.long()), True)
    return mask[:, :kv_len]
