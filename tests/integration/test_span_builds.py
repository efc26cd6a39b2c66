"""Every build shape of GLM-5.3-Flash's pool set, replayed in its own order
through sglang 0.5.23's real HybridCacheController, with MooncakeSpanStore on
a real Mooncake master and storage node (issue #36).

* the span fork at startup: backend built and pools registered at the
  64-token host page, the fork's gate, then ``storage_page_size = 256``
  assigned on the live backend; served as ``mooncake`` through the plugin,
  since the gate sees only registered names;
* the span fork at runtime attach: the page on the config when built;
* transfer-page hashing: keys at the 64-token host page (K=1) under a
  256-token tree, hits trimmed to whole tree pages;
* stock 0.5.23: 256-token pages everywhere (K=1).

Each backs up a chain of two backups (prefix keys passed), over host pages
that are not contiguous, queries the hit at its own page, restores into
zeroed host pages and compares every pool byte for byte (the content
oracle); a negative control swaps two pages inside one span and must be
caught.
"""

from __future__ import annotations

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolName

from mooncake_span.sglang_backend.plugin import OPT_IN_ENV
from mooncake_span_tools.testing.page_io import alloc_pages
from tests.harness.controller import (
    build_compressed_dsa_harness,
    build_stock_glm_harness,
    fork_backend_supports_page_spans,
)

pytestmark = pytest.mark.integration

HOST_PAGE = 64
TREE_PAGE = 256

# shape -> (harness keyword arguments, tokens per storage key, K)
SHAPES = {
    "fork_startup": ({"order": "fork_startup", "storage_backend": "mooncake"}, TREE_PAGE, 4),
    "fork_runtime_attach": (
        {"order": "runtime_attach", "storage_backend": "mooncake"},
        TREE_PAGE,
        4,
    ),
    "transfer_page_hashing": (
        {"span": False, "transfer_page_hashing": True, "storage_backend": "mooncake"},
        HOST_PAGE,
        1,
    ),
}


@pytest.fixture
def plugin_registry(monkeypatch):
    """sglang's factory registry with our plugin serving ``mooncake`` (opted
    in), restored after the test."""
    import sglang.srt.plugins as plugins
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.plugins import load_plugins

    monkeypatch.setattr(StorageBackendFactory, "_registry", dict(StorageBackendFactory._registry))
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    monkeypatch.setenv(OPT_IN_ENV, "1")
    load_plugins()
    return StorageBackendFactory


def _config(cluster):
    return {"interface_v1": 1, "hicache_storage_pass_prefix_keys": True, **cluster.client_config()}


def _fragment(host_pool) -> None:
    """Leave the pool's free pages interleaved with held ones, so the host
    pages of one storage key are not contiguous (as in a busy server)."""
    pages = host_pool.available_size() // host_pool.page_size
    held = alloc_pages(host_pool, pages)
    per_page = held.view(pages, host_pool.page_size)
    host_pool.free(torch.cat([per_page[i] for i in range(pages) if i % 2]))
    spare = alloc_pages(host_pool, 2)
    assert int(spare[host_pool.page_size]) - int(spare[0]) != host_pool.page_size
    host_pool.free(spare)


def _chain_round_trip(harness, *, seed: int):
    """Two chained backups (the second passes the first's keys as its prefix),
    then a hit query and a restore of the whole chain."""
    first = harness.backup(2, seed=seed, prefix_keys=[])
    second = harness.backup(
        token_ids=harness.fresh_tokens(1),
        last_hash=first.keys[-1],
        seed=seed + 1,
        prefix_keys=list(first.keys),
    )
    tokens = list(first.token_ids) + list(second.token_ids)
    query = harness.hit_query(tokens + harness.fresh_tokens(1))
    return first, second, query


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_build_shape_restores_every_pool_byte_exact(
    plugin_registry, mooncake_cluster, key_namespace, shape
):
    from mooncake_span.sglang_backend import MooncakeSpanStore

    kwargs, key_tokens, k = SHAPES[shape]
    with build_compressed_dsa_harness(
        _config(mooncake_cluster), model_name=key_namespace, **kwargs
    ) as harness:
        backend = harness.backend
        assert type(backend) is MooncakeSpanStore
        assert (backend.storage_page_size, backend.geometry.pages_per_span) == (key_tokens, k)
        assert f"h{HOST_PAGE}x{k}" in backend.key_schema.prefix
        assert backend.layout_guard_result in ("published", "matched")
        _fragment(harness.pool(PoolName.KV))

        first, second, query = _chain_round_trip(harness, seed=11)
        keys = len(first.keys) + len(second.keys)
        assert first.completed_tokens == len(first.keys) * key_tokens
        if shape == "transfer_page_hashing":
            # 3 host-page keys: the radix tree keeps whole 256-token pages only.
            assert query.hit_tokens == 0
            whole = harness.backup(TREE_PAGE // HOST_PAGE, seed=13)
            query = harness.hit_query(list(whole.token_ids) + harness.fresh_tokens(1))
            assert query.hit_tokens == TREE_PAGE
            restored = harness.prefetch(query)
            assert restored.completed_tokens == TREE_PAGE
            assert harness.mismatches(restored, whole) == []
            return
        assert query.hit_pages == keys
        restored = harness.prefetch(query)
        assert restored.completed_tokens == keys * key_tokens
        assert {n: len(p) for n, p in restored.pages.items()} == {
            PoolName.KV: keys,
            PoolName.INDEXER: keys,
            PoolName.MAMBA: 1,
        }
        assert harness.mismatches(restored, first, second) == []
        stats = backend.get_stats()
        assert stats.rejected_calls == {}


def test_fork_index_layout_and_a_swapped_page_inside_a_span_is_caught(
    plugin_registry, mooncake_cluster, key_namespace
):
    """The fork's index layout (rows only in each key's first host page) is
    restored as it was; a restore that swaps two host pages of one span,
    answering success, is caught by the oracle."""
    with build_compressed_dsa_harness(
        _config(mooncake_cluster),
        model_name=key_namespace,
        order="fork_startup",
        storage_backend="mooncake",
        indexer_first_page_only=True,
    ) as harness:
        backup = harness.backup(2, seed=21)
        page_nbytes = harness.pool(PoolName.INDEXER).get_dummy_flat_data_page().nbytes
        for data in backup.pages[PoolName.INDEXER].values():
            assert any(data[:page_nbytes]) and not any(data[page_nbytes:])
        good = harness.prefetch(harness.hit_query(backup.token_ids))
        assert harness.mismatches(good, backup) == []

        backend = harness.backend
        real_get = backend.batch_get_v1
        kv = harness.pool(PoolName.KV)

        def swapping_get(keys, host_indices, extra_info=None):
            ok = real_get(keys, host_indices, extra_info)
            first, second = int(host_indices[0]), int(host_indices[kv.page_size])
            a = kv.get_data_page(first, flat=True).clone()
            kv.set_from_flat_data_page(first, kv.get_data_page(second, flat=True))
            kv.set_from_flat_data_page(second, a)
            return ok

        backend.batch_get_v1 = swapping_get
        try:
            bad = harness.prefetch(harness.hit_query(backup.token_ids))
        finally:
            del backend.batch_get_v1
        assert bad.completed_tokens == 2 * TREE_PAGE  # the swap answered success
        problems = harness.mismatches(bad, backup)
        assert len(problems) == 1 and problems[0].startswith(f"{PoolName.KV}:")


def test_backup_skip_on_an_mla_rank_above_zero(plugin_registry, mooncake_cluster, key_namespace):
    """TP rank 1 of an MLA model writes only its own Mamba state (the KV and
    indexer are rank 0's), acks a whole storage page per key, and restores
    rank 0's KV and indexer with its own state."""
    config = _config(mooncake_cluster)
    common = {"model_name": key_namespace, "order": "fork_startup", "storage_backend": "mooncake"}
    with build_compressed_dsa_harness(config, tp_size=2, **common) as rank0:
        tokens = rank0.fresh_tokens(2)
        written = rank0.backup(token_ids=tokens, seed=31)
        assert written.completed_tokens == 2 * TREE_PAGE
    with build_compressed_dsa_harness(config, tp_rank=1, tp_size=2, **common) as rank1:
        assert rank1.controller.backup_skip
        skipped = rank1.backup(token_ids=tokens, seed=41)
        assert skipped.completed_tokens == 2 * TREE_PAGE
        assert skipped.pool_write_pages.get(str(PoolName.MAMBA)) == 1
        # Rank 1 filled its KV pages too, but never wrote them.
        assert skipped.pages[PoolName.KV] != written.pages[PoolName.KV]
        restored = rank1.prefetch(rank1.hit_query(tokens))
        assert restored.completed_tokens == 2 * TREE_PAGE
        expected = {
            PoolName.KV: written.pages[PoolName.KV],
            PoolName.INDEXER: written.pages[PoolName.INDEXER],
            PoolName.MAMBA: skipped.pages[PoolName.MAMBA],
        }
        for name, by_key in restored.pages.items():
            assert by_key and all(expected[name][key] == data for key, data in by_key.items())


def test_stock_0_5_23_at_256_token_pages(mooncake_cluster, key_namespace):
    config = {
        "backend_name": "mooncake_span",
        "module_path": "mooncake_span.sglang_backend",
        "class_name": "MooncakeSpanStore",
        **_config(mooncake_cluster),
    }
    with build_stock_glm_harness(config, model_name=key_namespace) as harness:
        backend = harness.backend
        assert (backend.storage_page_size, backend.geometry.pages_per_span) == (TREE_PAGE, 1)
        first = harness.backup(2, seed=51, prefix_keys=[])
        query = harness.hit_query(list(first.token_ids) + harness.fresh_tokens(1))
        assert query.hit_pages == 2
        restored = harness.prefetch(query)
        assert restored.completed_tokens == 2 * TREE_PAGE
        assert harness.mismatches(restored, first) == []


def test_the_forks_gate_sees_the_plugin_not_dynamic(plugin_registry):
    assert fork_backend_supports_page_spans("mooncake")
    assert not fork_backend_supports_page_spans("dynamic")
    with pytest.raises(ValueError, match="L2 HiCache only"):
        build_compressed_dsa_harness(
            {"interface_v1": 1}, order="runtime_attach", storage_backend="dynamic"
        )


def test_without_the_plugin_the_gate_stays_closed(monkeypatch):
    """Not opted in, ``mooncake`` is sglang's own MooncakeStore, which does not
    declare page spans: the fork refuses span mode (L2 only)."""
    import sglang.srt.plugins as plugins
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.plugins import load_plugins

    monkeypatch.setattr(StorageBackendFactory, "_registry", dict(StorageBackendFactory._registry))
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    monkeypatch.delenv(OPT_IN_ENV, raising=False)
    load_plugins()
    assert not fork_backend_supports_page_spans("mooncake")


@pytest.mark.parametrize("order", ["fork-startup", "runtime-attach", "derived"])
def test_demo_span_runs_each_order(mooncake_cluster, order):
    from mooncake_span_tools.lab.span_demo import ORDERS, DemoConfig, run_demo

    config = mooncake_cluster.client_config()
    lines: list[str] = []
    report = run_demo(
        DemoConfig(
            requests=2,
            keys_per_request=2,
            layers=2,
            order=order,
            master_server_address=config["master_server_address"],
            metadata_server=config["metadata_server"],
        ),
        say=lines.append,
    )
    assert report.ok and report.hit_keys == 4 and report.mismatched_pages == 0
    assert lines[0] == f"order: {ORDERS[order]}"
    assert any("K=4 host pages per key" in line for line in lines)


def test_demo_span_refuses_an_unknown_order():
    from mooncake_span_tools.lab.span_demo import DemoConfig

    with pytest.raises(ValueError, match="order must be one of"):
        DemoConfig(order="late")


def test_fork_startup_with_object_seals(plugin_registry, mooncake_cluster, key_namespace):
    """The fork's startup order with every object sealed (the SSD default):
    the late page and the seal trailer compose, byte-exact."""
    config = {**_config(mooncake_cluster), "span_object_checksums": True}
    with build_compressed_dsa_harness(
        config, model_name=key_namespace, order="fork_startup", storage_backend="mooncake"
    ) as harness:
        assert harness.backend.geometry.pages_per_span == 4
        first, second, query = _chain_round_trip(harness, seed=61)
        restored = harness.prefetch(query)
        assert restored.completed_tokens == 3 * TREE_PAGE
        assert harness.mismatches(restored, first, second) == []
