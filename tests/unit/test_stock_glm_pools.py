"""The stock sglang 0.5.23 GLM-5.3-Flash pool set built by sglang's own
builders on CPU (mooncake_span_tools.testing.stock_glm): page geometry, packed MTP
draft layers, KDA state, and the zero-copy pointers the backend plans with."""

from __future__ import annotations

import pytest
from sglang.srt.mem_cache.hicache_storage import PoolName

from mooncake_span_tools.testing import pools as P
from mooncake_span_tools.testing.stock_glm import build_stock_glm_pools, stock_page_tokens


@pytest.mark.parametrize("layout", P.KV_LAYOUTS)
def test_stock_pool_set_geometry(layout):
    pool_set = build_stock_glm_pools(layout, layers=2, mamba_layers=2, draft_layers=1)
    kv, indexer, kda = (pool_set[n] for n in (PoolName.KV, PoolName.INDEXER, PoolName.MAMBA))
    assert stock_page_tokens() == 256
    assert pool_set.pages_per_key == 1
    assert kv.page_size == indexer.page_size == pool_set.host_page_tokens == 256
    # 2 target layers + 1 packed draft layer behind them, in both pools
    assert kv.layer_num == indexer.layer_num == 3
    assert kv.get_dummy_flat_data_page().nbytes == 3 * 256 * (32 + 16) * 2
    # one 256-token host page holds 64 compressed index rows (132 B) per layer
    assert indexer.indexer_page_stride_size == 64 * 132
    # KDA state per layer: a (heads, head_dim, head_dim) temporal state and a
    # (kernel - 1, q + k + v channels) conv window, as KimiLinearStateShape has it
    assert kda.num_mamba_layers == 2
    assert tuple(kda.buffer_info.temporal.shape[2:]) == (2, 16, 16)
    assert [tuple(c.shape[2:]) for c in kda.buffer_info.conv] == [(3, 3 * 2 * 16)]
    assert kda.layout == ("page_first" if layout == "layer_first" else layout)


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_zero_copy_pointers_cover_the_draft_layer(layout):
    pool_set = build_stock_glm_pools(layout, draft_layers=1)
    for name, pool in pool_set.pools.items():
        P.fill_random_pages(pool, [0], seed=3)
        assert P.meta_page_bytes(pool, 0) == P.page_bytes(pool, 0), name


def test_layer_first_indexer_has_no_zero_copy_pointers():
    # sglang's indexer pool serves layer_first through get_data_page only, so
    # the backend stages it; this is why the bench's stock cell is page_first.
    indexer = build_stock_glm_pools("layer_first")[PoolName.INDEXER]
    with pytest.raises(ValueError, match="layer_first"):
        P.meta_page_bytes(indexer, 0)
