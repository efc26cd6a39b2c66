"""GLM-5.3-Flash's CPU stand-ins (``kda_cpu``, ``dsa_index_cpu``, ``glm5_standins``)
against transformers' own ``glm5_next`` reference, on random inputs.

Each check runs ``CASES`` seeded random cases and states its tolerance: the
KDA paths and the norms compute in fp32 like the reference, so they agree to
float rounding (``FP32_ATOL``); the indexer's keys go through bf16 and fp8
e4m3 on their way into the pool, so they are compared after dequantisation
within fp8's resolution (``FP8_REL``: 1/16 of each row's largest value).
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("transformers.models.glm5_next") is None:
    pytest.skip("needs transformers with glm5_next", allow_module_level=True)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers.models.glm5_next import modeling_glm5_next as ref  # noqa: E402
from transformers.models.glm5_next.configuration_glm5_next import (  # noqa: E402
    Glm5NextTextConfig,
)

from mooncake_span_tools.testing.cpu_server import dsa_index_cpu as dsa  # noqa: E402
from mooncake_span_tools.testing.cpu_server import glm5_standins  # noqa: E402
from mooncake_span_tools.testing.cpu_server import kda_cpu as kda  # noqa: E402

CASES = 20
FP32_ATOL = 2e-5
FP8_REL = 1 / 16
HEADS, HEAD_DIM, CONV_WIDTH = 2, 16, 4


def _reference(fn):
    """transformers' own torch function (its hub-kernel wrapper falls back to it here)."""
    return getattr(fn, "__wrapped__", fn)


def _rng(case: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + case)


def _lengths(gen: torch.Generator, n: int, most: int) -> list[int]:
    return [int(x) for x in torch.randint(1, most, (n,), generator=gen)]


def _packed(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


# ---------------------------------------------------------------------------
# causal conv1d


@pytest.mark.parametrize("case", range(CASES))
def test_prefill_conv_matches_the_reference_per_request(case):
    """Packed requests, each with its own slot; some carry a window from earlier tokens."""
    gen = _rng(case)
    dim = 24
    lengths = _lengths(gen, 3, 40)
    x = torch.randn(dim, sum(lengths), generator=gen)
    weight = torch.randn(dim, CONV_WIDTH, generator=gen) * 0.5
    states = torch.randn(6, dim, CONV_WIDTH - 1, generator=gen)
    before = states.clone()
    slots = torch.tensor([4, 1, 2])
    carried = torch.tensor([True, False, case % 2 == 0])
    out = kda.causal_conv1d_fn(x, weight, None, states, _packed(lengths), lengths, slots, carried)
    starts = _packed(lengths).tolist()
    for i, slot in enumerate(slots.tolist()):
        xs = x[None, :, starts[i] : starts[i + 1]]
        if carried[i]:
            window = before[slot][None].clone()
            expect = _reference(ref.causal_conv1d_update)(xs, window, weight, None, "silu")
        else:
            expect = _reference(ref.causal_conv1d_fn)(xs, weight, None, "silu")
            padded = torch.cat([torch.zeros(1, dim, CONV_WIDTH - 1), xs], dim=-1)
            window = padded[..., -(CONV_WIDTH - 1) :]
        torch.testing.assert_close(
            out[:, starts[i] : starts[i + 1]], expect[0], atol=FP32_ATOL, rtol=0
        )
        torch.testing.assert_close(states[slot], window[0], atol=0, rtol=0)
    untouched = [s for s in range(6) if s not in slots.tolist()]
    assert torch.equal(states[untouched], before[untouched])


@pytest.mark.parametrize("case", range(CASES))
def test_decode_conv_matches_the_reference_and_shifts_each_window(case):
    gen = _rng(case)
    dim, batch = 24, 3
    x = torch.randn(batch, dim, generator=gen)
    weight = torch.randn(dim, CONV_WIDTH, generator=gen) * 0.5
    # sglang hands the decode conv a transposed view of the pool's [slots, width-1, dim]
    pool = torch.randn(5, CONV_WIDTH - 1, dim, generator=gen)
    before = pool.clone()
    slots = torch.tensor([3, 0, 4])
    out = kda.causal_conv1d_update(
        x, pool.transpose(-1, -2), weight, None, "silu", conv_state_indices=slots
    )
    window = before[slots].transpose(-1, -2).clone()
    expect = _reference(ref.causal_conv1d_update)(x[..., None], window, weight, None, "silu")
    torch.testing.assert_close(out, expect[..., 0], atol=FP32_ATOL, rtol=0)
    torch.testing.assert_close(pool[slots].transpose(-1, -2), window, atol=0, rtol=0)
    assert torch.equal(pool[[1, 2]], before[[1, 2]])


# ---------------------------------------------------------------------------
# gates and norms


@pytest.mark.parametrize("case", range(CASES))
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_forget_gate_matches_the_reference(case, lower_bound):
    gen = _rng(case)
    config = Glm5NextTextConfig(
        hidden_size=32,
        linear_num_heads=HEADS,
        linear_head_dim=HEAD_DIM,
        linear_lower_bound=lower_bound,
    )
    gate = ref.Glm5NextTextForgetGate(config)
    with torch.no_grad():
        for param in gate.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
        x = torch.randn(1, 7, 32, generator=gen)
        raw = gate.f_b_proj(gate.f_a_proj(x)).view(1, 7, HEADS, HEAD_DIM)
        ours = kda.forget_gate(raw, gate.A_log.view(1, 1, HEADS, 1), gate.dt_bias, lower_bound)
        torch.testing.assert_close(ours, gate(x), atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("case", range(CASES))
def test_gated_rms_norm_matches_the_reference(case):
    gen = _rng(case)
    norm = ref.Glm5NextTextRMSNormGated(HEAD_DIM, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(HEAD_DIM, generator=gen))
        x, gate = (
            torch.randn(2, 5, HEADS, HEAD_DIM, generator=gen),
            torch.randn(2, 5, HEADS, HEAD_DIM, generator=gen),
        )
        torch.testing.assert_close(
            kda.rms_norm_gated(x, gate, norm.weight, 1e-5, "sigmoid"),
            norm(x, gate),
            atol=FP32_ATOL,
            rtol=0,
        )


@pytest.mark.parametrize("case", range(CASES))
def test_clamped_swiglu_matches_the_reference_mlp(case):
    gen = _rng(case)
    config = Glm5NextTextConfig(
        hidden_size=32, intermediate_size=48, swiglu_limit=0.05 * (case + 1)
    )
    mlp = ref.Glm5NextTextMLP(config)
    with torch.no_grad():
        x = torch.randn(6, 32, generator=gen)
        gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)
        out = torch.empty(6, 48)
        glm5_standins.silu_and_mul_clamp(gate_up, out, config.swiglu_limit)
        torch.testing.assert_close(mlp.down_proj(out), mlp(x), atol=FP32_ATOL, rtol=0)


# ---------------------------------------------------------------------------
# the KDA recurrence: decode (recurrent) and extend (chunked), packed, by slot


def _kda_inputs(gen: torch.Generator, tokens: int):
    q, k, v = (torch.randn(1, tokens, HEADS, HEAD_DIM, generator=gen) for _ in range(3))
    raw_gate = torch.randn(tokens, HEADS * HEAD_DIM, generator=gen)
    raw_beta = torch.randn(1, tokens, HEADS, generator=gen)
    A_log = torch.randn(1, 1, HEADS, 1, generator=gen) * 0.3
    dt_bias = torch.randn(HEADS * HEAD_DIM, generator=gen) * 0.3
    return q, k, v, raw_gate, raw_beta, A_log, dt_bias


def _reference_gates(raw_gate, raw_beta, A_log, dt_bias, lower_bound):
    """The reference's g and beta, computed as Glm5NextTextForgetGate and the layer do."""
    g = raw_gate.view(1, -1, HEADS, HEAD_DIM) + dt_bias.view(1, 1, HEADS, HEAD_DIM)
    rate = A_log.view(1, 1, HEADS, 1).exp()
    if lower_bound is not None:
        g = lower_bound * torch.sigmoid(rate * g)
    else:
        g = -rate * F.softplus(g)
    return g, torch.sigmoid(raw_beta)


@pytest.mark.parametrize("case", range(CASES))
def test_recurrent_decode_matches_the_reference_per_slot(case):
    gen = _rng(case)
    lower_bound = -5.0 if case % 2 else None
    lengths = [1, 1, 1, 2] if case % 3 else [1, 1]
    q, k, v, raw_gate, raw_beta, A_log, dt_bias = _kda_inputs(gen, sum(lengths))
    pool = torch.randn(6, HEADS, HEAD_DIM, HEAD_DIM, generator=gen) * 0.3  # [slot, H, V, K]
    before = pool.clone()
    slots = torch.tensor([5, 0, 3, 2][: len(lengths)])
    out = kda.kda_decode(
        q,
        k,
        v,
        raw_gate,
        raw_beta,
        A_log=A_log,
        dt_bias=dt_bias,
        ssm_states=pool,
        cache_indices=slots,
        query_start_loc=_packed(lengths),
        lower_bound=lower_bound,
    )
    g, beta = _reference_gates(raw_gate, raw_beta, A_log, dt_bias, lower_bound)
    starts = _packed(lengths).tolist()
    for i, slot in enumerate(slots.tolist()):
        part = slice(starts[i], starts[i + 1])
        expect, state = _reference(ref.recurrent_kimi_delta_attention)(
            q[:, part],
            k[:, part],
            v[:, part],
            g[:, part],
            beta[:, part],
            initial_state=before[slot][None].transpose(-1, -2),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        torch.testing.assert_close(out[:, part], expect, atol=FP32_ATOL, rtol=0)
        torch.testing.assert_close(pool[slot], state[0].transpose(-1, -2), atol=FP32_ATOL, rtol=0)
    untouched = [s for s in range(6) if s not in slots.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("case", range(CASES))
def test_chunked_extend_matches_the_reference_per_slot_with_chunk_states(case):
    gen = _rng(case)
    lower_bound = -5.0 if case % 2 else None
    lengths = _lengths(gen, 2, 150)
    q, k, v, raw_gate, raw_beta, A_log, dt_bias = _kda_inputs(gen, sum(lengths))
    pool = torch.randn(4, HEADS, HEAD_DIM, HEAD_DIM, generator=gen) * 0.3
    before = pool.clone()
    slots = torch.tensor([2, 0])
    track = torch.empty(2, HEADS, HEAD_DIM, HEAD_DIM)
    track_chunk = torch.tensor([(lengths[0] - 1) // 64, 0])
    out, h = kda.kda_extend(
        q,
        k,
        v,
        raw_gate.view(1, -1, HEADS, HEAD_DIM),
        raw_beta,
        ssm_states=pool,
        cache_indices=slots,
        query_start_loc=_packed(lengths),
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=lower_bound,
        beta_is_raw=True,
        return_intermediate_states=True,
        track_state=track,
        track_chunk_idx=track_chunk,
    )
    g, beta = _reference_gates(raw_gate, raw_beta, A_log, dt_bias, lower_bound)
    starts, chunk = _packed(lengths).tolist(), 0
    for i, slot in enumerate(slots.tolist()):
        part = slice(starts[i], starts[i + 1])
        initial = before[slot][None].transpose(-1, -2)
        expect, state = _reference(ref.chunk_kimi_delta_attention)(
            q[:, part],
            k[:, part],
            v[:, part],
            g[:, part],
            beta[:, part],
            initial_state=initial,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        torch.testing.assert_close(out[:, part], expect, atol=FP32_ATOL, rtol=0)
        torch.testing.assert_close(pool[slot], state[0].transpose(-1, -2), atol=FP32_ATOL, rtol=0)
        # h: the state at the start of each 64-token chunk, every request's chunks in turn
        for first in range(0, lengths[i], 64):
            head = slice(starts[i], starts[i] + first)
            _, at = _reference(ref.recurrent_kimi_delta_attention)(
                q[:, head],
                k[:, head],
                v[:, head],
                g[:, head],
                beta[:, head],
                initial_state=initial,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )
            torch.testing.assert_close(h[0, chunk], at[0].transpose(-1, -2), atol=FP32_ATOL, rtol=0)
            if first // 64 == int(track_chunk[i]):
                torch.testing.assert_close(
                    track[i], at[0].transpose(-1, -2), atol=FP32_ATOL, rtol=0
                )
            chunk += 1
    assert h.shape[1] == chunk
    assert torch.equal(pool[[1, 3]], before[[1, 3]])


def test_extend_skips_padding_rows_and_chunked_equals_recurrent():
    gen = _rng(99)
    q, k, v, raw_gate, raw_beta, A_log, dt_bias = _kda_inputs(gen, 70)
    pool = torch.randn(3, HEADS, HEAD_DIM, HEAD_DIM, generator=gen)
    before = pool.clone()
    out = kda.kda_extend(
        q,
        k,
        v,
        raw_gate.view(1, -1, HEADS, HEAD_DIM),
        raw_beta,
        ssm_states=pool,
        cache_indices=torch.tensor([-1]),
        query_start_loc=_packed([70]),
        A_log=A_log,
        dt_bias=dt_bias,
        beta_is_raw=True,
    )
    assert torch.equal(pool, before) and out.shape == (1, 70, HEADS, HEAD_DIM)
    qn, kn = kda.l2_normalise(q[0]), kda.l2_normalise(k[0])
    g = -torch.rand(70, HEADS, HEAD_DIM, generator=gen)
    beta = torch.rand(70, HEADS, generator=gen)
    state = torch.randn(HEADS, HEAD_DIM, HEAD_DIM, generator=gen)
    chunked, final, _ = kda.chunked_kda(qn, kn, v[0], g, beta, state)
    recurrent, final_r = kda.recurrent_kda(qn, kn, v[0], g, beta, state)
    torch.testing.assert_close(chunked, recurrent, atol=FP32_ATOL, rtol=0)
    torch.testing.assert_close(final, final_r, atol=FP32_ATOL, rtol=0)


# ---------------------------------------------------------------------------
# the compressed indexer's pool writes


def _butterfly_hadamard(x: torch.Tensor) -> torch.Tensor:
    """sglang's kernel's definition: seven stages pairing (a, b) -> (a + b, a - b)."""
    for stride in (1, 2, 4, 8, 16, 32, 64):
        x3 = x.reshape(128 // (2 * stride), 2, stride)
        a, b = x3[:, 0], x3[:, 1]
        x = torch.stack([a + b, a - b], dim=1).reshape(128)
    return x * 0.08838834764831845


def test_hadamard_is_sglangs_butterfly_and_its_own_inverse():
    h = dsa.hadamard_matrix()
    x = torch.randn(128, generator=_rng(0))
    torch.testing.assert_close(x @ h, _butterfly_hadamard(x), atol=1e-5, rtol=0)
    torch.testing.assert_close(h @ h, torch.eye(128), atol=1e-5, rtol=0)


def _indexer(gen: torch.Generator, hidden: int = 32) -> ref.Glm5NextTextIndexer:
    config = Glm5NextTextConfig(
        hidden_size=hidden,
        q_lora_rank=16,
        index_n_heads=2,
        index_head_dim=128,
        index_topk=64,
        index_kpool=4,
    )
    indexer = ref.Glm5NextTextIndexer(config, layer_idx=0)
    with torch.no_grad():
        for param in indexer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return indexer


def _ours_keys_scores(indexer: ref.Glm5NextTextIndexer, x: torch.Tensor):
    """What the stand-in feeds the pool: LayerNorm(wk(x)) and the gate scores, in bf16."""
    keys = indexer.k_norm(indexer.wk(x)).to(torch.bfloat16)
    scores = F.linear(x, indexer.index_kpool_compress_gate).to(torch.bfloat16)
    return keys, scores


def _pool_buffers(pages: int, requests: int = 4):
    buf = torch.zeros(pages, 64 * (128 + 4), dtype=torch.uint8)
    tail = torch.zeros(requests, 4 + 2, 128, dtype=torch.bfloat16)
    return buf, tail, tail.clone()


@pytest.mark.parametrize("case", range(CASES))
def test_index_pool_rows_match_the_reference_pooled_keys(case):
    """Every complete pool of a prompt, read back from the pool bytes (fp8 and scale,
    un-rotated), equals transformers' pooled key within fp8's resolution."""
    gen = _rng(case)
    indexer = _indexer(gen)
    tokens = int(torch.randint(8, 600, (1,), generator=gen))
    x = torch.randn(1, tokens, 32, generator=gen)
    with torch.no_grad():
        k = indexer.k_norm(indexer.wk(x))
        gate = F.linear(x, indexer.index_kpool_compress_gate)
        packed = torch.cat([k, gate, torch.ones(1, tokens, 1)], dim=-1)
        pool_keys, _, pool_valid = indexer.get_pooled_states(packed)
        keys, scores = _ours_keys_scores(indexer, x[0])
    # the request's tokens sit on shuffled 256-token device pages
    pages = torch.randperm(8, generator=gen)[: (tokens + 255) // 256]
    token_locs = torch.cat([torch.arange(p * 256, p * 256 + 256) for p in pages.tolist()])
    buf, tail_k, tail_score = _pool_buffers(8)
    written = dsa.write_request(
        buf, tail_k, tail_score, 1, 0, keys, scores, token_locs, indexer.index_kpool_compress_ape
    )
    complete = tokens // 4
    assert written == complete and bool(pool_valid[0, :complete].all())
    locs = torch.tensor([int(token_locs[4 * j]) // 4 for j in range(complete)])
    rows = dsa.unrotate(dsa.dequantise(*dsa.read_rows(buf, locs)))
    expect = pool_keys[0, :complete]
    bound = FP8_REL * expect.abs().amax(dim=-1, keepdim=True) + 0.02
    assert ((rows - expect).abs() <= bound).all(), (rows - expect).abs().max()
    # the unfinished pool's tokens wait in the ring, at position modulo its size
    for pos in range(complete * 4, tokens):
        assert torch.equal(tail_k[1, pos % 6], keys[pos])


@pytest.mark.parametrize("case", range(CASES))
def test_index_pool_bytes_do_not_depend_on_how_a_prompt_is_split(case):
    """Prefill in chunks, then decode token by token: the same bytes as one prefill
    (pools that straddle two steps are completed from the ring)."""
    gen = _rng(case)
    indexer = _indexer(gen)
    tokens = int(torch.randint(20, 300, (1,), generator=gen))
    with torch.no_grad():
        keys, scores = _ours_keys_scores(indexer, torch.randn(tokens, 32, generator=gen))
    token_locs = torch.arange(2 * 256, 2 * 256 + tokens)
    ape = indexer.index_kpool_compress_ape.detach()
    whole, tail_k, tail_score = _pool_buffers(4)
    dsa.write_request(whole, tail_k, tail_score, 0, 0, keys, scores, token_locs, ape)
    split, tail_k, tail_score = _pool_buffers(4)
    cuts = sorted(set(torch.randint(1, tokens - 8, (3,), generator=gen).tolist())) + [tokens - 8]
    first = 0
    for cut in [*cuts, *range(tokens - 7, tokens + 1)]:
        dsa.write_request(
            split, tail_k, tail_score, 0, first, keys[first:cut], scores[first:cut], token_locs, ape
        )
        first = cut
    assert torch.equal(whole, split)


def test_index_rows_land_on_the_page_of_their_first_token():
    buf, tail_k, tail_score = _pool_buffers(3)
    keys = torch.randn(8, 128).to(torch.bfloat16)
    scores = torch.zeros(8, 128, dtype=torch.bfloat16)
    # positions 0..255 sit on device page 2 and 256.. on page 0: the step's
    # tokens 252..259 end one page and start the next
    token_locs = torch.cat([torch.arange(512, 768), torch.arange(0, 4)])
    dsa.write_request(
        buf, tail_k, tail_score, 0, 252, keys, scores, token_locs, torch.zeros(4, 128)
    )
    assert buf[2, 63 * 128 : 64 * 128].any() and buf[0, :128].any()
    assert not buf[1].any() and not buf[0, 128 : 64 * 128].any()
    quantised, scale = dsa.read_rows(buf, torch.tensor([2 * 64 + 63, 0]))
    pooled = keys.float().view(2, 4, 128).mean(dim=1)  # zero scores: a plain mean
    torch.testing.assert_close(
        dsa.unrotate(dsa.dequantise(quantised, scale)), pooled, atol=0.1, rtol=0.07
    )
    assert (scale == torch.exp2(torch.log2(scale).round())).all()  # ue8m0: powers of two


# ---------------------------------------------------------------------------
# the radix cache's decode snapshots


def test_tracked_rows_copy_every_layer_and_skip_freed_slots():
    conv, ssm = torch.randn(2, 6, 3, 4), torch.randn(2, 6, 2, 2)
    before = (conv.clone(), ssm.clone())
    glm5_standins.track_mamba_states_all_layers(
        conv,
        ssm,
        torch.tensor([1, 2, -1]),
        torch.tensor([True, False, True]),
        torch.tensor([4, 5, 3]),
        batch_size=3,
        check_freed_slots=True,
    )
    assert torch.equal(conv[:, 4], before[0][:, 1]) and torch.equal(ssm[:, 4], before[1][:, 1])
    assert torch.equal(conv[:, [0, 1, 2, 3, 5]], before[0][:, [0, 1, 2, 3, 5]])
    single = torch.randn(6, 3, 4)
    state = torch.randn(6, 2, 2)
    glm5_standins.track_mamba_states_if_needed(
        single, state, torch.tensor([0]), torch.tensor([True]), torch.tensor([2]), batch_size=1
    )
    assert torch.equal(single[2], single[0]) and torch.equal(state[2], state[0])


# ---------------------------------------------------------------------------
# the indexer's selection and the sparse attention it drives


def _reference_selection(indexer, x, q_resid, keys):
    """transformers' indexer, its pooled keys replaced by ``keys`` (what the pool holds,
    un-rotated): the tokens each query attends to, and every pool's score."""
    pools = keys.shape[0]
    indices = (torch.arange(pools)[:, None] * 4 + torch.arange(4))[None]
    valid = torch.ones(1, pools, dtype=torch.bool)
    indexer.get_pooled_states = lambda packed_states: (keys[None], indices, valid)
    tokens = x.shape[1]
    with torch.no_grad():
        selected = indexer(x, q_resid, torch.ones(1, tokens, dtype=torch.bool), None)[0]
        q = indexer.wq_b(q_resid).view(1, tokens, -1, 128)
        scores = torch.relu(torch.matmul(q, keys.T[None, None]) * indexer.softmax_scale)
        weights = indexer.weights_proj(x) * indexer.n_heads**-0.5
        pool_scores = torch.matmul(weights[..., None, :], scores)[0, :, 0]
    return selected, pool_scores


@pytest.mark.parametrize("case", range(CASES))
def test_selection_matches_the_reference_indexer_on_the_pools_keys(case):
    """Against the pool's own (fp8) keys, the stand-in picks pools whose scores are the
    reference's picks (ties may pick either of equal scores) and the same tail tokens."""
    gen = _rng(case)
    indexer = _indexer(gen)
    tokens = int(torch.randint(70, 400, (1,), generator=gen))
    x, q_resid = (
        torch.randn(1, tokens, 32, generator=gen),
        torch.randn(1, tokens, 16, generator=gen),
    )
    with torch.no_grad():
        keys, scores = _ours_keys_scores(indexer, x[0])
        ape = indexer.index_kpool_compress_ape.detach()
    buf, tail_k, tail_score = _pool_buffers(2)
    token_locs = torch.arange(256, 256 + tokens) if tokens <= 256 else torch.arange(512)
    dsa.write_request(buf, tail_k, tail_score, 0, 0, keys, scores, token_locs, ape)
    rotated = dsa.pooled_keys(buf, token_locs, tokens // 4, 4)
    expect, pool_scores = _reference_selection(indexer, x, q_resid, dsa.unrotate(rotated))
    with torch.no_grad():
        q = indexer.wq_b(q_resid[0]).view(tokens, 2, 128) @ dsa.hadamard_matrix()
        w = indexer.weights_proj(x[0]) * 2**-0.5 * indexer.softmax_scale
    ours = dsa.select_tokens(q, w, rotated, torch.arange(tokens), 64, 4)
    assert ours.shape == expect.shape == (tokens, 64 + 3)
    for t in range(tokens):
        mine, theirs = ours[t][ours[t] >= 0], expect[t][expect[t] >= 0]
        mine_pools = sorted({int(p) // 4 for p in mine if p < (t + 1) // 4 * 4})
        their_pools = sorted({int(p) // 4 for p in theirs if p < (t + 1) // 4 * 4})
        torch.testing.assert_close(
            pool_scores[t, mine_pools].sort().values,
            pool_scores[t, their_pools].sort().values,
            atol=1e-5,
            rtol=1e-5,
        )
        assert sorted(int(p) for p in mine if p >= (t + 1) // 4 * 4) == sorted(
            int(p) for p in theirs if p >= (t + 1) // 4 * 4
        )


@pytest.mark.parametrize("case", range(CASES))
def test_sparse_mask_matches_the_reference_mask(case):
    gen = _rng(case)
    tokens = int(torch.randint(10, 200, (1,), generator=gen))
    selected = torch.randint(-1, tokens, (tokens, 19), generator=gen).to(torch.int32)
    config = Glm5NextTextConfig(q_lora_rank=16, qk_rope_head_dim=0)
    attention = ref.Glm5NextTextAttention(config, layer_idx=0)
    attention.config._attn_implementation = "sdpa"
    expect = attention.build_attention_mask_from_topk(selected[None], torch.zeros(1), tokens)
    assert torch.equal(dsa.attention_mask(selected, tokens), expect[0, 0])
