"""The builders of real sglang host pools on CPU, and the page byte helpers."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("sglang.srt.mem_cache.pool_host.mla", reason="needs sglang 0.5.23")

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolName  # noqa: E402
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.runtime_context import get_memory  # noqa: E402

from mooncake_span_tools.testing import pools  # noqa: E402

BF16_BYTES = 2
FP32_BYTES = 4
DSA_INDEX_BYTES_PER_TOKEN_PER_LAYER = 128 + 4  # fp8 key + one fp32 scale per 128-wide block


def _round_trip(host_pool, pages: int = 2) -> list[bytes]:
    """Fill, snapshot, wipe, refill: returns the snapshot after checking it."""
    starts = pools.page_starts(host_pool, pools.alloc_pages(host_pool, pages))
    pools.fill_random_pages(host_pool, starts, seed=7)
    snapshot = [pools.page_bytes(host_pool, s) for s in starts]
    page_nbytes = host_pool.get_dummy_flat_data_page().nbytes
    assert all(len(b) == page_nbytes for b in snapshot)
    assert len(set(snapshot)) == pages, "pages of one fill must differ"

    pools.wipe_pages(host_pool, starts)
    assert all(pools.page_bytes(host_pool, s) == bytes(page_nbytes) for s in starts)

    pools.fill_random_pages(host_pool, starts, seed=7)
    assert [pools.page_bytes(host_pool, s) for s in starts] == snapshot
    pools.fill_random_pages(host_pool, starts, seed=8)
    assert [pools.page_bytes(host_pool, s) for s in starts] != snapshot
    return snapshot


@pytest.mark.parametrize("layout", pools.KV_LAYOUTS)
def test_mla_host(layout):
    host = pools.build_mla_host(
        layout, layers=3, page_tokens=32, host_pages=5, kv_lora_rank=32, rope_dim=16
    )
    assert isinstance(host, MLATokenToKVPoolHost)
    assert (host.page_size, host.layout, host.dtype, host.size) == (32, layout, torch.bfloat16, 160)
    assert host.get_dummy_flat_data_page().nbytes == 3 * 32 * 48 * BF16_BYTES
    _round_trip(host)


@pytest.mark.parametrize("layout", pools.KV_LAYOUTS)
def test_mha_host(layout):
    host = pools.build_mha_host(layout, layers=3, page_tokens=16, host_pages=4, heads=2, head_dim=8)
    assert isinstance(host, MHATokenToKVPoolHost)
    assert (host.page_size, host.layout, host.size) == (16, layout, 64)
    assert host.get_dummy_flat_data_page().nbytes == 2 * 3 * 16 * 2 * 8 * BF16_BYTES
    assert len(host.get_hybrid_pool_buffer()) == 2  # K and V
    _round_trip(host)


@pytest.mark.parametrize("layout", pools.KV_LAYOUTS)
@pytest.mark.parametrize("index_kpool", [1, 4])
def test_dsa_pools(layout, index_kpool):
    kv, indexer = pools.build_dsa_pools(
        layout,
        layers=3,
        host_pages=4,
        index_kpool=index_kpool,
        skip_topk_layers=[False, True, False],
    )
    assert isinstance(kv, MLATokenToKVPoolHost)
    assert isinstance(indexer, DSAIndexerPoolHost)
    assert kv.page_size == indexer.page_size == pools.DSA_PAGE_TOKENS
    assert indexer.layout == layout
    # The skip-top-k layer owns no index keys, so it has no host layer.
    assert indexer.layer_num == 2
    index_page_bytes = 2 * 64 // index_kpool * DSA_INDEX_BYTES_PER_TOKEN_PER_LAYER
    assert indexer.get_dummy_flat_data_page().nbytes == index_page_bytes
    _round_trip(kv)
    _round_trip(indexer)


@pytest.mark.parametrize("layout", pools.MAMBA_LAYOUTS)
def test_mamba_host(layout):
    host = pools.build_mamba_host(layers=2, slots=3, layout=layout)
    assert isinstance(host, MambaPoolHost)
    assert host.page_size == 1
    assert host.size == 4  # slots + sglang's padding slot
    temporal_bytes = 2 * host.temporal_state_elem_size * FP32_BYTES
    conv_bytes = 2 * sum(host.conv_state_elem_sizes) * BF16_BYTES
    assert host.get_dummy_flat_data_page().nbytes == temporal_bytes + conv_bytes
    _round_trip(host, pages=3)


def test_mamba_has_no_layer_first():
    with pytest.raises(ValueError, match="layer_first"):
        pools.build_mamba_host(layout="layer_first")


@pytest.mark.parametrize(
    "attention,cls", [("mha", MHATokenToKVPoolHost), ("mla", MLATokenToKVPoolHost)]
)
def test_swa_host(attention, cls):
    host = pools.build_swa_host(attention=attention)
    assert isinstance(host, cls)
    assert host.pool_label == "swa"
    _round_trip(host)


@pytest.mark.parametrize("layout", pools.KV_LAYOUTS)
def test_compressed_hybrid_dsa(layout):
    pool_set = pools.build_compressed_hybrid_dsa(layout, host_pages=8, index_kpool=4)
    assert set(pool_set.pools) == {PoolName.KV, PoolName.INDEXER, PoolName.MAMBA}
    assert (pool_set.host_page_tokens, pool_set.storage_page_tokens) == (64, 256)
    assert pool_set.pages_per_key == 4
    assert pool_set[PoolName.KV].layout == layout
    # sglang has no layer_first Mamba host layout.
    assert pool_set[PoolName.MAMBA].layout in pools.MAMBA_LAYOUTS
    for host in pool_set.pools.values():
        _round_trip(host)


def test_benchmark_sized_page():
    # 64 KB pages, as the benchmark asks for them.
    host = pools.build_mla_host(
        layers=1, page_tokens=64, host_pages=2, kv_lora_rank=448, rope_dim=64
    )
    assert host.get_dummy_flat_data_page().nbytes == 64 * 1024
    _round_trip(host)


@pytest.mark.parametrize(
    "build",
    [
        lambda layout: pools.build_mla_host(layout),
        lambda layout: pools.build_mha_host(layout),
        lambda layout: pools.build_dsa_pools(layout).kv,
        lambda layout: pools.build_dsa_pools(layout).indexer,
    ],
    ids=["mla", "mha", "dsa-kv", "dsa-indexer"],
)
@pytest.mark.parametrize("layout", pools.KV_LAYOUTS)
def test_zero_copy_pointers_match_flat_page(build, layout):
    host = build(layout)
    start = pools.page_starts(host, pools.alloc_pages(host, 1))[0]
    pools.fill_random_pages(host, [start], seed=3)
    flat = pools.page_bytes(host, start)
    if isinstance(host, DSAIndexerPoolHost) and layout == "layer_first":
        with pytest.raises(ValueError, match="layer_first"):
            pools.meta_page_bytes(host, start)
    elif isinstance(host, MHATokenToKVPoolHost) and layout == "layer_first":
        # Pointers go K0, V0, K1, V1, ...; the flat page is all K then all V.
        meta = pools.meta_page_bytes(host, start)
        assert meta != flat and sorted(meta) == sorted(flat)
        layer_bytes = len(flat) // (2 * host.layer_num)
        chunks = [meta[i : i + layer_bytes] for i in range(0, len(meta), layer_bytes)]
        assert b"".join(chunks[0::2] + chunks[1::2]) == flat
    else:
        assert pools.meta_page_bytes(host, start) == flat


@pytest.mark.parametrize("layout", pools.MAMBA_LAYOUTS)
def test_mamba_zero_copy_pointers_match_flat_page(layout):
    host = pools.build_mamba_host(layout=layout)
    start = pools.page_starts(host, pools.alloc_pages(host, 1))[0]
    pools.fill_random_pages(host, [start], seed=4)
    assert pools.meta_page_bytes(host, start) == pools.page_bytes(host, start)


def test_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="page_unified"):
        pools.build_mla_host("page_unified")


def test_alloc_pages_reports_exhaustion():
    host = pools.build_mla_host(host_pages=2)
    pools.alloc_pages(host, 2)
    with pytest.raises(MemoryError):
        pools.alloc_pages(host, 1)


def _pin_memory_default(cls) -> bool:
    return inspect.signature(cls.__init__).parameters["pin_memory"].default


def test_cpu_runtime_publishes_config_and_restores_defaults():
    classes = (MLATokenToKVPoolHost, MHATokenToKVPoolHost, DSAIndexerPoolHost, MambaPoolHost)
    assert all(_pin_memory_default(cls) is True for cls in classes)
    with pools.sglang_cpu_runtime(layout="page_first_direct", host_to_device_ratio=3.0):
        assert get_memory().hicache_mem_layout == "page_first_direct"
        assert get_memory().hicache_ratio == 3.0
        assert all(_pin_memory_default(cls) is False for cls in classes)
    assert all(_pin_memory_default(cls) is True for cls in classes)
