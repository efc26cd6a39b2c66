"""sglang 0.5.23's real HybridCacheController on CPU with MooncakeSpanStore as
the dynamic backend and a real Mooncake master + storage node.

Backup -> hit query -> prefetch, as the controller's own threads run them,
must restore every pool byte for byte: MLA KV + DSA indexer, MHA KV + SWA +
Mamba, generic and zero-copy (interface_v1) KV paths, and the compressed
hybrid DSA set with 256-token storage pages (K=4), and the same model as stock
0.5.23 runs it (256-token host pages, packed MTP draft layer, KDA state, K=1).
"""

from __future__ import annotations

import pytest

from mooncake_span_tools.testing.pools import KV_LAYOUTS
from tests.harness.controller import (
    build_compressed_dsa_harness,
    build_dsa_harness,
    build_mamba_swa_harness,
    build_stock_glm_harness,
)

pytestmark = pytest.mark.integration

HARNESSES = {"dsa": build_dsa_harness, "mamba_swa": build_mamba_swa_harness}


def _config(cluster, *, interface_v1: bool, **extra):
    return {
        "backend_name": "mooncake_span",
        "module_path": "mooncake_span.sglang_backend",
        "class_name": "MooncakeSpanStore",
        **({"interface_v1": 1} if interface_v1 else {}),
        **cluster.client_config(),
        **extra,
    }


@pytest.mark.parametrize("interface_v1", [False, True], ids=["generic", "v1"])
@pytest.mark.parametrize("layout", KV_LAYOUTS)
@pytest.mark.parametrize("pool_set", sorted(HARNESSES))
def test_controller_round_trip(mooncake_cluster, key_namespace, pool_set, layout, interface_v1):
    from mooncake_span.sglang_backend import MooncakeSpanStore

    config = _config(mooncake_cluster, interface_v1=interface_v1)
    with HARNESSES[pool_set](config, layout=layout, model_name=key_namespace) as harness:
        assert type(harness.backend) is MooncakeSpanStore
        backup = harness.backup(3, seed=5)
        assert backup.completed_tokens == 3 * harness.page_tokens
        query = harness.hit_query(list(backup.token_ids) + harness.fresh_tokens(1))
        assert query.hit_pages == 3
        restored = harness.prefetch(query)
        assert restored.completed_tokens == 3 * harness.page_tokens
        assert harness.mismatches(restored, backup) == []
        stats = harness.backend.get_stats()
        assert sum(stats.backup_pgs) >= 3 and sum(stats.prefetch_pgs) >= 3
        assert stats.rejected_calls == {}


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_controller_compressed_dsa_span_mode(mooncake_cluster, key_namespace, layout):
    """Storage page 256 = 4 host pages of 64: KV + DSA indexer + Mamba."""
    config = _config(mooncake_cluster, interface_v1=True)
    with build_compressed_dsa_harness(config, layout=layout, model_name=key_namespace) as harness:
        assert harness.backend.geometry.pages_per_span == 4
        backup = harness.backup(3, seed=9)
        assert backup.completed_tokens == 3 * 256
        restored = harness.prefetch(harness.hit_query(list(backup.token_ids)))
        assert restored.completed_tokens == 3 * 256
        assert harness.mismatches(restored, backup) == []
        stats = harness.backend.get_stats()
        assert stats.backup_tokens >= 3 * 256 and stats.prefetch_tokens >= 3 * 256


def test_controller_chained_requests_share_prefix(mooncake_cluster, key_namespace):
    """A second request extending the first restores as one prefix."""
    config = _config(mooncake_cluster, interface_v1=True)
    with build_dsa_harness(config, model_name=key_namespace) as harness:
        first = harness.backup(2, seed=1)
        second = harness.backup(token_ids=harness.fresh_tokens(2), last_hash=first.keys[-1], seed=2)
        tokens = list(first.token_ids + second.token_ids)
        restored = harness.prefetch(harness.hit_query(tokens))
        assert restored.completed_tokens == 4 * harness.page_tokens
        assert harness.mismatches(restored, first, second) == []


@pytest.mark.parametrize("interface_v1", [False, True], ids=["generic", "v1"])
@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_controller_stock_glm_geometry(mooncake_cluster, key_namespace, layout, interface_v1):
    """Stock 0.5.23 GLM-5.3-Flash: one key per 256-token host page; KV and
    indexer (each with the packed MTP draft layer) and the KDA state restore
    byte for byte."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    config = _config(mooncake_cluster, interface_v1=interface_v1)
    with build_stock_glm_harness(config, layout=layout, model_name=key_namespace) as harness:
        geometry = harness.backend.geometry
        assert (geometry.host_page_tokens, geometry.pages_per_span) == (256, 1)
        assert set(harness.backend.pools) == {"kv", "indexer", "mamba"}
        backup = harness.backup(3, seed=13)
        assert backup.completed_tokens == 3 * 256
        assert backup.pool_write_pages == {"mamba": 1, "indexer": 3}
        query = harness.hit_query(list(backup.token_ids) + harness.fresh_tokens(1))
        assert query.hit_pages == 3
        restored = harness.prefetch(query)
        assert restored.completed_tokens == 3 * 256
        assert {n: len(p) for n, p in restored.pages.items()} == {
            PoolName.KV: 3,
            PoolName.INDEXER: 3,
            PoolName.MAMBA: 1,
        }
        assert harness.mismatches(restored, backup) == []
        stats = harness.backend.get_stats()
        assert stats.rejected_calls == {}


def test_extra_config_span_on_a_stock_controller_warns_and_misses(
    mooncake_cluster, key_namespace, caplog
):
    """What the registration warning says: stock 0.5.23's controller hashes one
    64-token host page per key, so an extra-config storage_page_size of 256
    makes every call fail the stride rule: nothing is stored, every query
    misses, nothing wrong is restored."""
    import logging

    caplog.set_level(logging.WARNING, logger="mooncake_span.sglang_backend.storage_page")
    config = _config(mooncake_cluster, interface_v1=True, storage_page_size=256)
    with build_dsa_harness(config, model_name=key_namespace) as harness:
        (warning,) = [r.getMessage() for r in caplog.records if r.name.endswith("storage_page")]
        assert "storage_page_size=256" in warning and "64-token host page" in warning
        assert harness.backend.geometry.pages_per_span == 4
        backup = harness.backup(4, seed=3)
        assert backup.completed_tokens == 0
        query = harness.hit_query(list(backup.token_ids))
        assert query.hit_pages == 0
        assert harness.prefetch(query).pages == {}
        assert harness.backend.get_stats().rejected_calls
