"""The CPU stand-ins of ``mooncake_span_tools.testing.cpu_server.standins``, each against
sglang 0.5.23's own semantics: its host pools' page I/O, its triton kernels and
the callers that pick a path from what the stand-ins provide."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from tests import checkout

if importlib.util.find_spec("sglang") is None:
    pytest.skip("needs sglang 0.5.23", allow_module_level=True)

REPO_ROOT = Path(__file__).resolve().parents[2]
SITE_DIR = REPO_ROOT / "tools" / "mooncake_span_tools" / "testing" / "cpu_server" / "site"
DIRECT_COPIES = (
    "transfer_kv_direct",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_all_layer_direct_lf_pf",
)

# install() end to end runs in a fresh process with SITE_DIR on its PYTHONPATH.
# Importing sglang takes most of its time, so that process starts with this
# module's first test and runs beside the others; its test (the last one)
# collects the result.
_E2E = """
import json, types
import torch
import sgl_kernel
from mooncake_span_tools.testing.cpu_server import host_pools, standins
import sglang.srt.mem_cache.pool_host.base as base
import sglang.srt.mem_cache.pool_host.mha as mha
import sglang.srt.mem_cache.pool_host.mla as mla
import sglang.srt.models.deepseek_common.attention_backend_handler as h
import sglang.srt.disaggregation.mooncake.conn as conn
import os
from mooncake_span_tools.testing.cpu_server import glm5_standins as g
import sglang.srt.arg_groups.model_hook
import sglang.srt.arg_groups.mamba_hook as mamba_hook
import sglang.srt.mem_cache.pool_host.mamba as pool_mamba
import sglang.srt.mem_cache.pool_host.dsa as pool_dsa
import sglang.srt.layers.attention.dsa.dsa_indexer_kpool as kpool
import sglang.srt.layers.attention.torch_native_backend as tn
import sglang.srt.layers.attention.linear.kda_backend as kda_backend
import sglang.srt.layers.attention.linear.kernels.kda_triton as kda_triton
import sglang.kernels.ops.attention.fla.fused_norm_gate as norm_gate
import sglang.kernels.ops.activation.silu_and_mul_clamp as clamp
import sglang.kernels.ops.mamba.mamba_state_scatter_triton as track
names = %r
handler = h.AttentionBackendRegistry.get_handler("torch_native")
print("RESULT " + json.dumps({
    "installed": standins._installed(),
    "sgl_kernel": [sgl_kernel.assign_req_to_token_pool_cpu is standins.assign_req_to_token_pool_cpu,
                   sgl_kernel.copy_all_layer_kv_cache_cpu is standins.copy_all_layer_kv_cache_cpu,
                   type(sgl_kernel.__spec__.loader).__name__],
    "mha": [getattr(mha, n) is getattr(host_pools, n) for n in names],
    "mla": [getattr(mla, n) is getattr(host_pools, n) for n in names],
    "wrapped": base.HostKVCache.__init__.__wrapped__.__qualname__,
    "handler": [handler.__name__, handler(types.SimpleNamespace(), None).name],
    "sender": conn.MooncakeKVSender.supports_host_tensor_indices,
    # 1e-39 is denormal in fp32: read as zero once denormals are flushed.
    "denormals_flushed": (torch.tensor([1e-39]) * 1.0).item() == 0.0,
    "glm": [
        torch.cuda.get_device_capability() == (0, 0),
        mamba_hook._platform_supports_mamba_cache_extra_buffer(),
        pool_mamba.MambaPoolHost.__init__.__wrapped__.__qualname__,
        pool_dsa.DSAIndexerPoolHost.__init__.__wrapped__.__qualname__,
        [getattr(m, n) is getattr(host_pools, n) for m in (pool_mamba, pool_dsa) for n in names],
        kpool.IndexerKPool.forward_native is g.indexer_forward_native,
        tn.TorchNativeAttnBackend.forward_extend.__module__,
        kda_backend.causal_conv1d_fn is g.kda_cpu.causal_conv1d_fn,
        kda_triton.TritonKDAKernel.extend.__module__,
        norm_gate.FusedRMSNormGated.forward.__module__,
        clamp.silu_and_mul_clamp is g.silu_and_mul_clamp,
        track.track_mamba_states_all_layers is g.track_mamba_states_all_layers,
        [callable(getattr(torch.ops.sgl_kernel, n)) for n in g.GDN_TORCH_OPS],
        os.environ["SGLANG_OPT_USE_TILELANG_MHC_PRE"],
        torch.zeros(1).pin_memory().is_pinned(),
    ],
}))
"""


class _EndToEnd:
    """The fresh process of the last test, started by this module's first test.

    Not at import: every xdist worker imports (collects) every module, and only
    the one that runs this module needs the process."""

    def __init__(self) -> None:
        self.out = tempfile.TemporaryFile(mode="w+")  # files, not pipes: nothing can block it
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _E2E % (DIRECT_COPIES,)],
            env={**os.environ, "PYTHONPATH": f"{SITE_DIR}{os.pathsep}{checkout.PYTHONPATH}"},
            cwd=REPO_ROOT,
            stdout=self.out,
            stderr=self.err,
        )


@pytest.fixture(scope="module", autouse=True)
def end_to_end() -> Iterator[_EndToEnd]:
    started = _EndToEnd()
    yield started
    started.proc.kill()  # a no-op once it has exited
    started.proc.wait()


pytest.importorskip("sglang.srt.mem_cache.pool_host.mla", reason="needs sglang 0.5.23")

import torch  # noqa: E402
from sglang.kernels.ops.kvcache import cache_move  # noqa: E402
from sglang.srt.mem_cache import allocation  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host import base as pool_host_base  # noqa: E402
from sglang.srt.mem_cache.pool_host import mha as pool_host_mha  # noqa: E402
from sglang.srt.mem_cache.pool_host import mla as pool_host_mla  # noqa: E402
from sglang.srt.mem_cache.pool_host.base import HostKVCache  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.models.deepseek_common import attention_backend_handler  # noqa: E402
from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (  # noqa: E402
    AttnForwardMethod,
)

from mooncake_span_tools.testing import pools  # noqa: E402
from mooncake_span_tools.testing.cpu_server import SITE_DIR as PACKAGE_SITE_DIR  # noqa: E402
from mooncake_span_tools.testing.cpu_server import glm5_standins, host_pools, standins  # noqa: E402
from mooncake_span_tools.testing.sglang_cpu import _host_budget  # noqa: E402

DIRECT_LAYOUTS = ("layer_first", "page_first_direct")
LAYERS = 2
PAGE = 4
DEVICE_PAGES = 4  # device rows 0 .. (DEVICE_PAGES + 1) * PAGE - 1: sglang adds a padding page
HOST_PAGES = 3

# ---------------------------------------------------------------------------
# helpers


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _tokens(pages: list[int]) -> torch.Tensor:
    """The token indices of whole pages, in the given page order (as HiCache sends them)."""
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages]).to(torch.int64)


def _device_layers(device_pool) -> list[list[torch.Tensor]]:
    """[component][layer] -> the device pool's own per-layer buffer (MHA: k, v; MLA: kv)."""
    if isinstance(device_pool, MHATokenToKVPool):
        return [list(device_pool.k_buffer), list(device_pool.v_buffer)]
    return [list(device_pool.kv_buffer)]


def _host_page(host, index: int) -> list[list[torch.Tensor]]:
    """[component][layer] -> the (PAGE, ...) rows of the host page at token ``index``,
    read through sglang's own ``get_data_page(index, flat=False)``."""
    page = host.get_data_page(index, flat=False)
    if isinstance(host, MHATokenToKVPoolHost):
        # layer_first: (2, L, P, H, D); page_first_direct: (2, 1, L, P, H, D)
        if host.layout == "page_first_direct":
            page = page[:, 0]
        return [[page[c, layer] for layer in range(host.layer_num)] for c in range(2)]
    # layer_first: (L, P, 1, D); page_first_direct: (1, L, P, 1, D)
    if host.layout == "page_first_direct":
        page = page[0]
    return [[page[layer] for layer in range(host.layer_num)]]


def _flat_page_rows(host, flat: torch.Tensor) -> list[list[torch.Tensor]]:
    """[component][layer] -> rows of a flat page: for these layouts the flat order is
    component, layer, token (sglang's get_dummy_flat_data_page shape)."""
    if isinstance(host, MHATokenToKVPoolHost):
        page = flat.view(2, host.layer_num, PAGE, host.head_num, host.head_dim)
        return [[page[c, layer] for layer in range(host.layer_num)] for c in range(2)]
    page = flat.view(host.layer_num, PAGE, 1, host.kv_cache_dim)
    return [[page[layer] for layer in range(host.layer_num)]]


def _randomize(tensors, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))


def _make_pools(attention: str, layout: str):
    if attention == "mha":
        device = pools.make_mha_device_pool(
            layers=LAYERS, page_tokens=PAGE, heads=2, head_dim=8, device_pages=DEVICE_PAGES
        )
        host = pools.mha_host_from_device(device, layout, host_pages=HOST_PAGES)
    else:
        device = pools.make_mla_device_pool(
            layers=LAYERS,
            page_tokens=PAGE,
            kv_lora_rank=16,
            rope_dim=8,
            device_pages=DEVICE_PAGES,
        )
        host = pools.mla_host_from_device(device, layout, host_pages=HOST_PAGES)
    assert isinstance(host, MHATokenToKVPoolHost if attention == "mha" else MLATokenToKVPoolHost)
    assert (host.layout, host.page_size, host.layer_num, host.size) == (
        layout,
        PAGE,
        LAYERS,
        HOST_PAGES * PAGE,
    )
    return device, host


@pytest.fixture
def direct_copies(monkeypatch):
    """The stand-ins bound into sglang's MHA and MLA host pool modules for one test."""
    for module in (pool_host_mha, pool_host_mla):
        for name in DIRECT_COPIES:
            # On a CPU host sglang imports none of them; raising=False restores that.
            monkeypatch.setattr(module, name, getattr(host_pools, name), raising=False)


# ---------------------------------------------------------------------------
# 3. direct host/device copies against sglang's page I/O


def test_sglang_lacks_the_direct_copies_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("sglang imports the real direct copies on CUDA")
    for module in (pool_host_mha, pool_host_mla):
        assert [n for n in DIRECT_COPIES if hasattr(module, n)] == []


def test_patch_direct_copies_binds_only_missing_names():
    module = ModuleType("fake_pool_host")
    own = object()
    module.transfer_kv_direct = own
    host_pools.patch_direct_copies(module)
    assert module.transfer_kv_direct is own
    assert (
        module.transfer_kv_per_layer_direct_pf_lf is host_pools.transfer_kv_per_layer_direct_pf_lf
    )
    assert (
        module.transfer_kv_all_layer_direct_lf_pf is host_pools.transfer_kv_all_layer_direct_lf_pf
    )


@pytest.mark.parametrize("layout", DIRECT_LAYOUTS)
@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_direct_backup_and_load_match_sglang_pages(direct_copies, attention, layout):
    device, host = _make_pools(attention, layout)
    layers = _device_layers(device)
    _randomize([b for comp in layers for b in comp], seed=1)
    _randomize([host.kv_buffer], seed=2)
    untouched_host_page = _bytes(host.get_data_page(1 * PAGE))

    # Device pages 3 and 1 back up into host pages 2 and 0 (out of order on purpose).
    device_src, host_pages = _tokens([3, 1]), [2, 0]
    host_idx = _tokens(host_pages)
    host.backup_from_device_all_layer(device, host_idx, device_src, io_backend="direct")

    for n, host_page in enumerate(host_pages):
        rows = device_src[n * PAGE : (n + 1) * PAGE]
        page = _host_page(host, host_page * PAGE)
        for c, comp in enumerate(layers):
            for layer, buffer in enumerate(comp):
                assert _bytes(page[c][layer]) == _bytes(buffer[rows]), (n, c, layer)
    assert _bytes(host.get_data_page(1 * PAGE)) == untouched_host_page

    # Load every layer back into device pages 4 and 2; nothing else on the device moves.
    before = [[b.clone() for b in comp] for comp in layers]
    device_dst = _tokens([4, 2])
    for layer in range(LAYERS):
        host.load_to_device_per_layer(device, host_idx, device_dst, layer, io_backend="direct")
    others = torch.ones(layers[0][0].shape[0], dtype=torch.bool)
    others[device_dst] = False
    for c, comp in enumerate(layers):
        for layer, buffer in enumerate(comp):
            assert _bytes(buffer[device_dst]) == _bytes(before[c][layer][device_src])
            assert _bytes(buffer[others]) == _bytes(before[c][layer][others])


@pytest.mark.parametrize("layout", DIRECT_LAYOUTS)
@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_direct_load_of_a_flat_page(direct_copies, attention, layout):
    device, host = _make_pools(attention, layout)
    layers = _device_layers(device)
    _randomize([b for comp in layers for b in comp], seed=3)
    _randomize([host.kv_buffer], seed=4)

    flat = host.get_dummy_flat_data_page()
    _randomize([flat], seed=5)
    host.set_from_flat_data_page(2 * PAGE, flat)
    assert _bytes(host.get_data_page(2 * PAGE)) == _bytes(flat)

    device_dst = _tokens([1])
    for layer in range(LAYERS):
        host.load_to_device_per_layer(device, _tokens([2]), device_dst, layer, io_backend="direct")
    expected = _flat_page_rows(host, flat)
    for c, comp in enumerate(layers):
        for layer, buffer in enumerate(comp):
            assert _bytes(buffer[device_dst]) == _bytes(expected[c][layer]), (c, layer)


def test_direct_token_level_copies():
    """The copies map token to token (not page to page) for any index order."""
    src = [torch.arange(24, dtype=torch.float32).view(12, 2) + 100 * i for i in range(2)]
    dst = [torch.zeros(12, 2) for _ in range(2)]
    host_pools.transfer_kv_direct(src, dst, torch.tensor([5, 0, 7]), torch.tensor([1, 9, 3]), 4)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[[1, 9, 3]], s[[5, 0, 7]])
        assert int(torch.count_nonzero(d.sum(dim=1))) == 3

    # page_first_direct host buffer (page, layer, slot, width) with page 4; 2 layers.
    host = torch.zeros(3, 2, 4, 2)
    host_pools.transfer_kv_all_layer_direct_lf_pf(
        src, [host], torch.tensor([2, 3]), torch.tensor([6, 9]), page_size=4
    )
    assert torch.equal(host[1, 0, 2], src[0][2]) and torch.equal(host[2, 1, 1], src[1][3])
    assert int(torch.count_nonzero(host.sum(dim=-1))) == 4
    out = torch.zeros(12, 2)
    host_pools.transfer_kv_per_layer_direct_pf_lf(
        [host], [out], torch.tensor([9, 6]), torch.tensor([0, 11]), layer_id=1, page_size=4
    )
    assert torch.equal(out[0], src[1][3]) and torch.equal(out[11], src[1][2])
    with pytest.raises(ValueError, match="3 device layers do not split over 2 pools"):
        host_pools.transfer_kv_all_layer_direct_lf_pf(
            src + src[:1], [host, host], torch.tensor([0]), torch.tensor([0]), 4
        )


# ---------------------------------------------------------------------------
# 1. sgl_kernel's two ops


def _assign_reference(req_pool_indices, req_to_token, start, end, out_cache_loc) -> None:
    """sglang's triton ``assign_req_to_token_pool``, program by program: program ``pid``
    reads its slice of out_cache_loc at the sum of the earlier requests' lengths."""
    for pid in range(len(req_pool_indices)):
        out_offset = int(sum(int(end[j]) - int(start[j]) for j in range(pid)))
        row = int(req_pool_indices[pid])
        for save in range(int(start[pid]), int(end[pid])):
            req_to_token[row, save] = out_cache_loc[out_offset + save - int(start[pid])]


def _assign_case(rng: random.Random):
    pool_rows, pool_len = rng.randint(1, 6), rng.randint(1, 12)
    batch = rng.randint(1, pool_rows)
    rows = rng.sample(range(pool_rows), batch)  # a batch holds distinct requests
    start, end = [], []
    for _ in rows:
        a, b = sorted(rng.randint(0, pool_len) for _ in range(2))
        start.append(a)
        end.append(b)
    total = sum(b - a for a, b in zip(start, end, strict=True))
    return (
        torch.tensor(rows, dtype=torch.int64),
        torch.full((pool_rows, pool_len), -7, dtype=torch.int32),
        torch.tensor(start, dtype=torch.int64),
        torch.tensor(end, dtype=torch.int64),
        torch.tensor(rng.sample(range(1000, 5000), total), dtype=torch.int64),
    )


def test_assign_req_to_token_pool_matches_the_triton_kernel():
    rng = random.Random(11)
    for case in range(200):
        rows, table, start, end, out = _assign_case(rng)
        expected = table.clone()
        _assign_reference(rows, expected, start, end, out)
        standins.assign_req_to_token_pool_cpu(rows, table, start, end, out, table.shape[1])
        assert torch.equal(table, expected), case


def test_assign_req_to_token_pool_through_sglang(monkeypatch):
    """sglang's own CPU call site passes the arguments the stand-in takes."""
    monkeypatch.setattr(allocation, "_is_cpu", True)
    monkeypatch.setattr(
        allocation,
        "assign_req_to_token_pool_cpu",
        standins.assign_req_to_token_pool_cpu,
        raising=False,
    )
    table = torch.zeros((4, 8), dtype=torch.int32)
    allocation.assign_req_to_token_pool_func(
        torch.tensor([2, 0]),
        table,
        torch.tensor([3, 0]),
        torch.tensor([5, 1]),
        torch.tensor([11, 12, 13]),
        batch_size=2,
    )
    expected = torch.zeros((4, 8), dtype=torch.int32)
    expected[2, 3:5] = torch.tensor([11, 12], dtype=torch.int32)
    expected[0, 0] = 13
    assert torch.equal(table, expected)


@pytest.mark.parametrize(
    ("tgt", "src"),
    [
        ([0, 1], [1, 2]),  # a compaction shifting rows down
        ([1, 2], [0, 1]),  # shifting up: row 1 is a source after it is a target
        ([0, 1], [1, 0]),  # a swap
    ],
)
def test_copy_all_layer_kv_cache_reads_every_source_first(tgt, src):
    buffers = [torch.arange(8, dtype=torch.float32).view(4, 2) + 10 * i for i in range(3)]
    old = [b.clone() for b in buffers]
    standins.copy_all_layer_kv_cache_cpu(buffers, None, torch.tensor(tgt), torch.tensor(src))
    for b, o in zip(buffers, old, strict=True):
        for row in range(4):
            expected = o[src[tgt.index(row)]] if row in tgt else o[row]
            assert torch.equal(b[row], expected), (row, b)


def test_copy_all_layer_kv_cache_through_sglang_move(monkeypatch):
    """sglang's MHA pool passes its uint64 ``data_ptrs`` and byte ``data_strides``
    (the triton kernel's arguments): construction warms the copy up, and
    ``move_kv_cache`` moves every layer's rows, overlapping sources read first."""
    monkeypatch.setattr(cache_move, "_is_cpu", True)
    monkeypatch.setattr(
        cache_move,
        "copy_all_layer_kv_cache_cpu",
        standins.copy_all_layer_kv_cache_cpu,
        raising=False,
    )
    pool = MHATokenToKVPool(
        size=12,
        page_size=1,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=8,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
        enable_kv_cache_copy=True,
    )
    buffers = [*pool.k_buffer, *pool.v_buffer]
    assert pool._kv_copy_config is not None and not pool.use_native_move_kv_cache
    assert pool.data_ptrs.dtype == torch.uint64
    assert pool.data_ptrs.tolist() == [b.data_ptr() for b in buffers]
    _randomize(buffers, seed=9)
    old = [b.clone() for b in buffers]
    tgt, src = torch.tensor([1, 2, 7, 4]), torch.tensor([0, 1, 2, 7])  # sources overwritten
    pool.move_kv_cache(tgt, src)
    for b, o in zip(buffers, old, strict=True):
        expected = o.clone()
        expected[tgt] = o[src]
        assert _bytes(b) == _bytes(expected)
    moved = [_bytes(b) for b in buffers]
    empty = torch.tensor([], dtype=torch.int64)
    standins.copy_all_layer_kv_cache_cpu(pool.data_ptrs, pool.data_strides, empty, empty)
    assert [_bytes(b) for b in buffers] == moved


# ---------------------------------------------------------------------------
# the sgl_kernel module


def test_sgl_kernel_module_serves_its_ops_and_names_the_rest():
    module = standins.make_sgl_kernel_module()
    assert module.__name__ == "sgl_kernel"
    assert module.assign_req_to_token_pool_cpu is standins.assign_req_to_token_pool_cpu
    assert module.copy_all_layer_kv_cache_cpu is standins.copy_all_layer_kv_cache_cpu
    op = module.fused_add_rmsnorm
    assert op.__name__ == "fused_add_rmsnorm"
    with pytest.raises(NotImplementedError, match=r"sgl_kernel\.fused_add_rmsnorm has no CPU"):
        op(torch.zeros(1), weight=None)
    for dunder in ("__file__", "__wrapped__", "__all__"):
        with pytest.raises(AttributeError):
            getattr(module, dunder)
    # a package (KDA's backend imports sgl_kernel.mamba), with no files behind it
    assert module.__path__ == []
    mamba = standins.make_sgl_kernel_module("sgl_kernel.mamba")
    assert mamba.causal_conv1d_update_cpu is glm5_standins.causal_conv1d_update
    assert not hasattr(mamba, "__path__")
    with pytest.raises(NotImplementedError, match=r"sgl_kernel\.causal_conv1d_fn_cpu has no CPU"):
        mamba.causal_conv1d_fn_cpu()


def test_sgl_kernel_imports_through_the_finder(monkeypatch):
    if importlib.util.find_spec("sgl_kernel") is not None:
        pytest.skip("a real sgl_kernel is installed")
    finder = standins._SglKernelFinder()
    assert finder.find_spec("sgl_kernel_npu") is None and finder.find_spec("torch") is None
    monkeypatch.delitem(sys.modules, "sgl_kernel", raising=False)
    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, finder])
    try:
        import sgl_kernel
        from sgl_kernel import some_other_op
        from sgl_kernel.mamba import causal_conv1d_update_cpu

        assert sgl_kernel.assign_req_to_token_pool_cpu is standins.assign_req_to_token_pool_cpu
        assert sgl_kernel.__spec__.loader is finder
        assert causal_conv1d_update_cpu is glm5_standins.causal_conv1d_update
        with pytest.raises(NotImplementedError, match=r"sgl_kernel\.some_other_op"):
            some_other_op()
    finally:
        sys.modules.pop("sgl_kernel", None)
        sys.modules.pop("sgl_kernel.mamba", None)


# ---------------------------------------------------------------------------
# 2. host pools without pinned memory


def _mha_host(device_pool, **kwargs) -> MHATokenToKVPoolHost:
    with _host_budget():
        return MHATokenToKVPoolHost(
            device_pool.get_device_pool_infos()[0].buffer_info,
            2.0,
            0,
            PAGE,
            "layer_first",
            device="cpu",
            device_capacity_tokens=DEVICE_PAGES * PAGE,
            start_layer=0,
            end_layer=LAYERS - 1,
            host_token_capacity=HOST_PAGES * PAGE,
            **kwargs,
        )


def test_host_pools_are_never_pinned(monkeypatch, direct_copies):
    original = HostKVCache.__init__
    monkeypatch.setattr(HostKVCache, "__init__", original)  # restored after the test
    # The real class in a stand-in module: module globals the patch sets stay off sglang's.
    module = ModuleType(pool_host_base.__name__)
    module.HostKVCache = HostKVCache
    host_pools.patch_host_pool_base(module)
    assert HostKVCache.__init__ is not original
    assert HostKVCache.__init__.__wrapped__ is original

    device = pools.make_mha_device_pool(
        layers=LAYERS, page_tokens=PAGE, heads=2, head_dim=8, device_pages=DEVICE_PAGES
    )
    host = _mha_host(device, pin_memory=True)  # sglang's default, spelled out
    assert host.pin_memory is False
    assert host.kv_buffer.shape == (2, LAYERS, HOST_PAGES * PAGE, 2, 8)
    assert not host.kv_buffer.is_pinned()
    # The pool works: a page backs up and reads back.
    _randomize(device.k_buffer + device.v_buffer, seed=6)
    host.backup_from_device_all_layer(device, _tokens([0]), _tokens([2]), io_backend="direct")
    assert _bytes(_host_page(host, 0)[1][1]) == _bytes(device.v_buffer[1][_tokens([2])])
    assert host.get_dummy_flat_data_page().nbytes == 2 * LAYERS * PAGE * 2 * 8 * 2


def test_unpatched_host_pool_pins():
    if torch.cuda.is_available():
        pytest.skip("pinning works here")
    device = pools.make_mha_device_pool(
        layers=LAYERS, page_tokens=PAGE, heads=2, head_dim=8, device_pages=DEVICE_PAGES
    )
    assert not hasattr(HostKVCache.__init__, "__wrapped__")
    # sglang registers the buffer with cudaHostRegister, which CPU torch refuses.
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        _mha_host(device, pin_memory=True)
    assert _mha_host(device, pin_memory=False).pin_memory is False


# ---------------------------------------------------------------------------
# 4. MLA attention on torch_native


def test_torch_native_mla_handler(monkeypatch):
    registry = attention_backend_handler.AttentionBackendRegistry
    monkeypatch.setattr(registry, "_handlers", dict(registry._handlers))  # restored afterwards
    assert registry.get_handler("torch_native") is attention_backend_handler.handle_attention_triton

    standins.patch_mla_attention_handler(attention_backend_handler)
    handler = registry.get_handler("torch_native")
    assert handler is not attention_backend_handler.handle_attention_triton
    assert registry.get_handler("triton") is attention_backend_handler.handle_attention_triton

    # A prefill without prefix, which the triton handler sends down the MHA sub-path.
    mode = SimpleNamespace(is_extend_without_speculative=lambda: True, is_decode=lambda: False)
    prefill = SimpleNamespace(forward_mode=mode, extend_prefix_lens_cpu=[0, 0])
    assert handler(SimpleNamespace(kv_lora_rank=16), prefill) is AttnForwardMethod.MLA
    # It is sglang's own MLA dispatch: the AMX sub-type passes through.
    amx = SimpleNamespace(fused_qkv_a_proj_with_mqa=object(), use_intel_amx_backend=True)
    assert handler(amx, prefill) is AttnForwardMethod.MLA_FUSED_ROPE_CPU
    assert attention_backend_handler._dispatch_mla_subtype(amx, prefill) is (
        AttnForwardMethod.MLA_FUSED_ROPE_CPU
    )


def test_torch_native_handler_restored():
    """The registry the previous test patched is sglang's own again."""
    registry = attention_backend_handler.AttentionBackendRegistry
    assert "torch_native" not in registry._handlers


# ---------------------------------------------------------------------------
# 5. PD prefill without host-tensor indices


def test_mooncake_sender_declines_host_tensor_indices(monkeypatch):
    try:
        from sglang.srt.disaggregation.mooncake import conn
    except ImportError:  # heavy transfer deps missing: a stand-in module with the class
        conn = ModuleType("conn")
        conn.MooncakeKVSender = type("MooncakeKVSender", (), {"supports_host_tensor_indices": True})
    sender_cls = conn.MooncakeKVSender
    assert sender_cls.supports_host_tensor_indices is True  # sglang's own choice
    monkeypatch.setattr(sender_cls, "supports_host_tensor_indices", True)  # restored afterwards
    standins.patch_mooncake_kv_sender(conn)
    assert sender_cls.supports_host_tensor_indices is False
    # What prefill.py asks of a sender before building pinned host-tensor indices.
    sender = object.__new__(sender_cls)
    assert getattr(sender, "supports_host_tensor_indices", False) is False


# ---------------------------------------------------------------------------
# version check and install()


def test_version_check():
    assert importlib.metadata.version("sglang") == standins.SGLANG_VERSION == "0.5.23"
    standins.check_sglang_version()
    standins.check_sglang_version("0.5.23")
    with pytest.raises(standins.StandinVersionError) as err:
        standins.check_sglang_version("0.5.24")
    assert "sglang 0.5.23" in str(err.value) and "sglang 0.5.24 is installed" in str(err.value)
    assert isinstance(err.value, RuntimeError)


def _guard_meta_path(monkeypatch) -> list:
    if torch.cuda.is_available():
        pytest.skip("install() does nothing where CUDA is present")
    assert not standins._installed()
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    return list(sys.meta_path)


def test_install_refuses_another_sglang(monkeypatch):
    before = _guard_meta_path(monkeypatch)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.6.0")
    with pytest.raises(standins.StandinVersionError, match="0.6.0"):
        standins.install()
    assert sys.meta_path == before


def test_install_refuses_after_sglang_imported_a_patched_module(monkeypatch):
    """This process has no SITE_DIR and imported the patched modules at the top."""
    before = _guard_meta_path(monkeypatch)
    imported = sorted(name for name in standins.PATCHES if name in sys.modules)
    assert "sglang.srt.mem_cache.pool_host.base" in imported
    with pytest.raises(RuntimeError, match="must run before sglang imports") as err:
        standins.install()
    assert ", ".join(imported) in str(err.value)
    assert sys.meta_path == before


def test_install_end_to_end_in_a_fresh_process(end_to_end):
    """sitecustomize installs the stand-ins before sglang imports anything."""
    assert PACKAGE_SITE_DIR == SITE_DIR and (SITE_DIR / "sitecustomize.py").is_file()
    if torch.cuda.is_available():
        pytest.skip("install() does nothing where CUDA is present")
    if importlib.util.find_spec("sgl_kernel") is not None:
        pytest.skip("a real sgl_kernel is installed")
    # Generous: under a parallel run its sglang import shares two cores with the rest.
    returncode = end_to_end.proc.wait(timeout=300)
    end_to_end.out.seek(0)
    end_to_end.err.seek(0)
    assert returncode == 0, end_to_end.err.read()[-4000:]
    (line,) = [x for x in end_to_end.out.read().splitlines() if x.startswith("RESULT ")]
    assert json.loads(line.removeprefix("RESULT ")) == {
        "installed": True,
        "sgl_kernel": [True, True, "_SglKernelFinder"],
        "mha": [True, True, True],
        "mla": [True, True, True],
        "wrapped": "HostKVCache.__init__",
        "handler": ["handle_attention_torch_native", "MLA"],
        "sender": False,
        "denormals_flushed": True,
        "glm": [
            True,
            True,
            "MambaPoolHost.__init__",
            "DSAIndexerPoolHost.__init__",
            [True] * 6,
            True,
            "mooncake_span_tools.testing.cpu_server.glm5_standins",
            True,
            "mooncake_span_tools.testing.cpu_server.glm5_standins",
            "mooncake_span_tools.testing.cpu_server.glm5_standins",
            True,
            True,
            [True, True],
            "0",
            False,
        ],
    }
