"""sglang's real HybridCacheController on CPU, driven by the test harness
against the in-memory backend: backup -> hit query -> prefetch must restore
every pool byte for byte, through the generic and the v1 (zero-copy) KV path.

No Mooncake master is involved; these run wherever sglang is installed.
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolName  # noqa: E402

from mooncake_span_tools.testing.pools import KV_LAYOUTS  # noqa: E402
from tests.harness.controller import (  # noqa: E402
    PLACEHOLDER_KEY,
    build_compressed_dsa_harness,
    build_dsa_harness,
    build_mamba_swa_harness,
    build_stock_glm_harness,
)
from tests.harness.memory_backend import TransferRecord, memory_backend_config  # noqa: E402

PAGE_TOKENS = 64
SWA_WINDOW_PAGES = 2

HARNESSES = {"dsa": build_dsa_harness, "mamba_swa": build_mamba_swa_harness}
GENERIC_KV_METHODS = {"batch_set", "batch_get"}
V1_KV_METHODS = {"batch_set_v1", "batch_get_v1"}


def _config(interface_v1: bool, **extra):
    return memory_backend_config(**({"interface_v1": 1} if interface_v1 else {}), **extra)


def _expected_pages(pool_set: str, pages: int) -> dict[PoolName, int]:
    if pool_set == "dsa":
        return {PoolName.KV: pages, PoolName.INDEXER: pages}
    return {PoolName.KV: pages, PoolName.SWA: min(SWA_WINDOW_PAGES, pages), PoolName.MAMBA: 1}


@pytest.mark.parametrize("interface_v1", [False, True], ids=["generic", "v1"])
@pytest.mark.parametrize("layout", KV_LAYOUTS)
@pytest.mark.parametrize("pool_set", sorted(HARNESSES))
def test_backup_hit_query_prefetch_is_byte_exact(pool_set, layout, interface_v1):
    with HARNESSES[pool_set](_config(interface_v1), layout=layout) as harness:
        backup = harness.backup(3, seed=11)
        assert backup.completed_tokens == 3 * PAGE_TOKENS
        assert {n: len(p) for n, p in backup.pages.items()} == _expected_pages(pool_set, 3)

        # One page past the backup: the hit stops at the stored prefix.
        query = harness.hit_query(list(backup.token_ids) + harness.fresh_tokens(1))
        assert (query.hit_pages, query.hit_tokens) == (3, 3 * PAGE_TOKENS)
        assert query.keys == backup.keys

        restored = harness.prefetch(query)
        assert restored.completed_tokens == 3 * PAGE_TOKENS
        assert {n: len(p) for n, p in restored.pages.items()} == _expected_pages(pool_set, 3)
        assert harness.mismatches(restored, backup) == []

        kv_methods = {c.method for c in harness.backend.calls} & (
            GENERIC_KV_METHODS | V1_KV_METHODS
        )
        assert kv_methods == (V1_KV_METHODS if interface_v1 else GENERIC_KV_METHODS)


@pytest.mark.parametrize("pool_set", sorted(HARNESSES))
def test_chained_backups_restore_as_one_prefix(pool_set):
    with HARNESSES[pool_set](_config(True)) as harness:
        first = harness.backup(2, seed=1)
        second = harness.backup(token_ids=harness.fresh_tokens(2), last_hash=first.keys[-1], seed=2)
        tokens = list(first.token_ids + second.token_ids)
        assert harness.keys_for(tokens) == list(first.keys + second.keys)

        restored = harness.prefetch(harness.hit_query(tokens))
        assert restored.completed_tokens == 4 * PAGE_TOKENS
        assert harness.mismatches(restored, first, second) == []


def test_dsa_prefix_hit_without_trailing_state():
    with build_dsa_harness(_config(False)) as harness:
        backup = harness.backup(3)
        query = harness.hit_query(backup.token_ids[: 2 * PAGE_TOKENS])
        assert query.hit_pages == 2  # ALL_PAGES: any stored prefix is restorable
        restored = harness.prefetch(query)
        assert harness.mismatches(restored, backup) == []


def test_trailing_state_gates_the_hit():
    with build_mamba_swa_harness(_config(True)) as harness:
        backup = harness.backup(3)
        # The only Mamba checkpoint sits at page 3, so a 2-page prefix has no
        # restorable state even though its KV pages are stored.
        query = harness.hit_query(backup.token_ids[: 2 * PAGE_TOKENS])
        assert query.hit_pages == 0
        assert query.query_pool_hit_pages["kv"] == 2
        restored = harness.prefetch(query)
        assert restored.completed_tokens == 0 and restored.pages == {}


@pytest.mark.parametrize("pool_set", sorted(HARNESSES))
def test_harness_catches_a_wrong_restore(pool_set):
    with HARNESSES[pool_set](_config(False)) as harness:
        backup = harness.backup(2)
        page_nbytes = len(backup.pages[PoolName.KV][backup.keys[1]])
        # Replace the second KV page in storage with other bytes of the same size.
        harness.backend.set(backup.keys[1], torch.full((page_nbytes,), 7, dtype=torch.uint8))
        restored = harness.prefetch(harness.hit_query(backup.token_ids))
        problems = harness.mismatches(restored, backup)
        assert len(problems) == 1 and problems[0].startswith(f"kv:{backup.keys[1][:12]}")


@pytest.mark.parametrize("pool_set", sorted(HARNESSES))
def test_registration_and_storage_config(pool_set):
    with HARNESSES[pool_set](_config(True, some_option=123), model_name="tiny/model") as harness:
        backend = harness.backend
        registration = [(c.method, c.detail) for c in backend.calls]
        pools_v2 = [d for m, d in registration if m == "register_mem_host_pool_v2"]
        if pool_set == "dsa":
            anchor = "MLATokenToKVPoolHost"
            assert pools_v2 == ["kv:MLATokenToKVPoolHost", "indexer:DSAIndexerPoolHost"]
        else:
            anchor = "MHATokenToKVPoolHost"
            assert pools_v2 == [
                "kv:MHATokenToKVPoolHost",
                "swa:MHATokenToKVPoolHost",
                "mamba:MambaPoolHost",
            ]
        assert registration[:2] == [
            ("__init__", "HiCacheStorageConfig"),
            ("register_mem_pool_host", anchor),
        ]
        assert registration[-1][0] == "on_host_pools_registered"
        assert len(registration) == 3 + len(pools_v2)

        config = backend.storage_config
        assert config.is_mla_model is (pool_set == "dsa")
        assert (config.tp_rank, config.tp_size, config.pp_rank, config.pp_size) == (0, 1, 0, 1)
        assert config.model_name == "tiny/model"
        assert config.extra_config["some_option"] == 123
        assert config.extra_config["interface_v1"] == 1
        assert backend.factory_kwargs == {}
        assert not harness.controller.backup_skip


def test_dsa_pool_transfers_seen_by_the_backend():
    with build_dsa_harness(_config(True)) as harness:
        backend = harness.backend
        backup = harness.backup(3)
        harness.prefetch(harness.hit_query(list(backup.token_ids)))

        indexer = "indexer"
        (set_call,) = backend.calls_named("batch_set_v2")
        assert set_call.transfers == (TransferRecord(indexer, 3, 3 * 64, "all_pages", "kv", False),)
        (exists_call,) = backend.calls_named("batch_exists_v2")
        assert exists_call.keys == 3
        assert exists_call.transfers == (
            TransferRecord(indexer, None, None, "all_pages", "kv", False),
        )
        # Prefetch: the KV batch, its indexer rebuilt per batch (no
        # indices_from_pool), then the (empty) non-KV sidecar read.
        get_calls = backend.calls_named("batch_get_v1", "batch_get_v2")
        assert [c.method for c in get_calls] == ["batch_get_v1", "batch_get_v2", "batch_get_v2"]
        assert get_calls[1].transfers == (
            TransferRecord(indexer, 3, 3 * 64, "all_pages", None, False),
        )
        assert get_calls[2].transfers == ()


def test_mamba_swa_pool_transfers_seen_by_the_backend():
    with build_mamba_swa_harness(_config(True), swa_window_pages=SWA_WINDOW_PAGES) as harness:
        backend = harness.backend
        backup = harness.backup(3)
        restored = harness.prefetch(harness.hit_query(list(backup.token_ids)))

        (set_call,) = backend.calls_named("batch_set_v2")
        assert set_call.transfers == (
            TransferRecord("swa", 2, 2 * 64, "trailing_pages", None, False),
            TransferRecord("mamba", 1, 1, "trailing_pages", None, False),
        )
        (exists_call,) = backend.calls_named("batch_exists_v2")
        assert exists_call.transfers == (
            TransferRecord("swa", 2, None, "trailing_pages", None, True),
            TransferRecord("mamba", 1, None, "trailing_pages", None, True),
        )
        (get_call,) = backend.calls_named("batch_get_v2")
        assert get_call.transfers == (
            TransferRecord("swa", 2, 2 * 64, "trailing_pages", None, False),
            TransferRecord("mamba", 1, 1, "trailing_pages", None, False),
        )
        assert restored.sidecar_keys == {
            PoolName.SWA: backup.keys[-2:],
            PoolName.MAMBA: backup.keys[-1:],
        }
        assert PLACEHOLDER_KEY not in restored.pages[PoolName.SWA]


def test_harnesses_can_be_built_one_after_another():
    for builder in (build_dsa_harness, build_mamba_swa_harness, build_dsa_harness):
        with builder(_config(False)) as harness:
            assert dist.is_initialized()
            assert harness.backup(1).completed_tokens == PAGE_TOKENS
        assert not dist.is_initialized()


@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_compressed_dsa_span_mode_is_byte_exact(layout):
    # GLM-5.3-Flash pool set: 64-token host pages, one key per 256-token tree page.
    with build_compressed_dsa_harness(_config(True), layout=layout, index_kpool=4) as harness:
        assert (harness.page_tokens, harness.host_pages_per_key) == (256, 4)
        backend = harness.backend
        assert backend.storage_config.storage_page_size == 256

        backup = harness.backup(2, seed=5)
        assert backup.completed_tokens == 2 * 256
        kv_page_nbytes = harness.pool(PoolName.KV).get_dummy_flat_data_page().nbytes
        assert all(len(b) == 4 * kv_page_nbytes for b in backup.pages[PoolName.KV].values())

        query = harness.hit_query(list(backup.token_ids) + harness.fresh_tokens(1))
        assert query.hit_pages == 2
        restored = harness.prefetch(query)
        assert restored.completed_tokens == 2 * 256
        assert {n: len(p) for n, p in restored.pages.items()} == {
            PoolName.KV: 2,
            PoolName.INDEXER: 2,
            PoolName.MAMBA: 1,
        }
        assert harness.mismatches(restored, backup) == []

        (set_v1,) = backend.calls_named("batch_set_v1")
        assert (set_v1.keys, set_v1.host_indices) == (2, 2 * 256)
        (set_v2,) = backend.calls_named("batch_set_v2")
        assert set_v2.transfers == (
            TransferRecord("mamba", 1, 1, "trailing_pages", None, False),
            TransferRecord("indexer", 2, 2 * 256, "all_pages", "kv", False),
        )


def test_compressed_dsa_without_span_is_plain_0_5_23():
    with build_compressed_dsa_harness(_config(False), span=False) as harness:
        assert (harness.page_tokens, harness.host_pages_per_key) == (64, 1)
        assert not hasattr(harness.backend.storage_config, "storage_page_size")
        backup = harness.backup(3)
        restored = harness.prefetch(harness.hit_query(backup.token_ids))
        assert restored.completed_tokens == 3 * 64
        assert harness.mismatches(restored, backup) == []


def test_span_mode_needs_interface_v1():
    with pytest.raises(ValueError, match="interface_v1"):
        build_compressed_dsa_harness(_config(False))
    assert not dist.is_initialized()


def test_failed_backend_construction_releases_global_state():
    broken = memory_backend_config() | {"class_name": "NoSuchBackend"}
    # sglang's factory reports a missing class as AttributeError.
    with pytest.raises(AttributeError, match="NoSuchBackend"):
        build_dsa_harness(broken)
    assert not dist.is_initialized()
    with build_dsa_harness(_config(False)) as harness:
        assert harness.backup(1).completed_tokens == PAGE_TOKENS


STOCK_PAGE_TOKENS = 256  # deepseek_v2.py: 64 * index_kpool for compressed DSA


@pytest.mark.parametrize("interface_v1", [False, True], ids=["generic", "v1"])
@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_stock_glm_geometry_is_byte_exact(layout, interface_v1):
    # GLM-5.3-Flash on stock 0.5.23: 256-token host pages, one key per host
    # page, MTP draft layer packed into KV and INDEXER, KDA state.
    with build_stock_glm_harness(_config(interface_v1), layout=layout, draft_layers=1) as harness:
        assert (harness.page_tokens, harness.host_pages_per_key) == (STOCK_PAGE_TOKENS, 1)
        assert not hasattr(harness.backend.storage_config, "storage_page_size")
        kv, indexer = harness.pool(PoolName.KV), harness.pool(PoolName.INDEXER)
        assert kv.page_size == indexer.page_size == STOCK_PAGE_TOKENS
        # 2 target + 1 packed draft layer in both KV-derived pools; the
        # indexer page holds 256 / index_kpool = 64 rows of 132 bytes per layer.
        assert kv.layer_num == indexer.layer_num == 3
        assert indexer.indexer_page_stride_size == 64 * 132
        assert kv.get_dummy_flat_data_page().nbytes == 3 * STOCK_PAGE_TOKENS * 48 * 2
        assert indexer.get_dummy_flat_data_page().nbytes == 3 * 64 * 132
        assert type(harness.pool(PoolName.MAMBA)).__name__ == "MambaPoolHost"

        backup = harness.backup(3, seed=7)
        assert backup.completed_tokens == 3 * STOCK_PAGE_TOKENS
        query = harness.hit_query(list(backup.token_ids) + harness.fresh_tokens(1))
        assert (query.hit_pages, query.hit_tokens) == (3, 3 * STOCK_PAGE_TOKENS)
        restored = harness.prefetch(query)
        assert restored.completed_tokens == 3 * STOCK_PAGE_TOKENS
        assert {n: len(p) for n, p in restored.pages.items()} == {
            PoolName.KV: 3,
            PoolName.INDEXER: 3,
            PoolName.MAMBA: 1,
        }
        assert harness.mismatches(restored, backup) == []

        (set_v2,) = harness.backend.calls_named("batch_set_v2")
        assert set_v2.transfers == (
            TransferRecord("mamba", 1, 1, "trailing_pages", None, False),
            TransferRecord("indexer", 3, 3 * STOCK_PAGE_TOKENS, "all_pages", "kv", False),
        )


def test_stock_glm_harness_catches_a_wrong_draft_layer():
    with build_stock_glm_harness(_config(True), draft_layers=1) as harness:
        backup = harness.backup(2, seed=3)
        key = backup.keys[0]
        stored = bytearray(backup.pages[PoolName.KV][key])
        # The packed draft layer is the last third of a page_first MLA page
        # (token-major, layer-minor rows): flip one byte of its last row.
        stored[-1] ^= 0xFF
        harness.backend.set(key, torch.frombuffer(stored, dtype=torch.uint8))
        restored = harness.prefetch(harness.hit_query(backup.token_ids))
        problems = harness.mismatches(restored, backup)
        assert len(problems) == 1 and problems[0].startswith(f"kv:{key[:12]}")
