"""Both ways sglang reaches MooncakeSpanStore, through sglang's own code:
``--hicache-storage-backend dynamic`` (StorageBackendFactory) and the
``sglang.srt.plugins`` entry point that serves ``--hicache-storage-backend
mooncake`` when opted in (load_plugins)."""

from __future__ import annotations

import pytest

from mooncake_span.sglang_backend.plugin import OPT_IN_ENV
from mooncake_span_tools.testing import pools as P
from tests.span_helpers import make_storage_config, slots_of

pytestmark = pytest.mark.integration

PAGE = 64


@pytest.fixture
def factory_registry(monkeypatch):
    """sglang's backend registry and plugin guard, restored after the test."""
    import sglang.srt.plugins as plugins
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    monkeypatch.setattr(StorageBackendFactory, "_registry", dict(StorageBackendFactory._registry))
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    return StorageBackendFactory


def _round_trip(backend, kv):
    backend.register_mem_pool_host(kv)
    backend.on_host_pools_registered()
    P.fill_random_pages(kv, [p * PAGE for p in range(8)], seed=3)
    expected = [P.page_bytes(kv, p * PAGE) for p in range(8)]
    assert backend.batch_set_v1(["w0", "w1"], slots_of(list(range(8)), PAGE)) == [True, True]
    P.wipe_pages(kv, [p * PAGE for p in range(8)])
    assert backend.batch_get_v1(["w0", "w1"], slots_of(list(range(8)), PAGE)) == [True, True]
    assert [P.page_bytes(kv, p * PAGE) for p in range(8)] == expected


def test_dynamic_backend_through_factory(factory_registry, mooncake_cluster, key_namespace):
    from mooncake_span.sglang_backend import MooncakeSpanStore

    extra = {
        "backend_name": "mooncake_span",
        "module_path": "mooncake_span.sglang_backend",
        "class_name": "MooncakeSpanStore",
        "interface_v1": 1,
        "storage_page_size": 4 * PAGE,
        **mooncake_cluster.client_config(),
    }
    kv = P.build_mla_host("page_first", layers=2, host_pages=10)
    backend = factory_registry.create_backend(
        "dynamic", make_storage_config(extra, model_name=key_namespace), kv
    )
    try:
        assert type(backend) is MooncakeSpanStore
        assert backend.geometry is None  # the host pool arrives through registration
        _round_trip(backend, kv)
        assert backend.geometry.pages_per_span == 4
    finally:
        backend.close()


def test_plugin_serves_mooncake_name_when_opted_in(
    factory_registry, monkeypatch, mooncake_cluster, key_namespace
):
    from sglang.srt.plugins import load_plugins

    from mooncake_span.sglang_backend import MooncakeSpanStore

    monkeypatch.setenv(OPT_IN_ENV, "1")
    load_plugins()
    entry = factory_registry._registry["mooncake"]
    assert (entry["module_path"], entry["class_name"]) == (
        "mooncake_span.sglang_backend",
        "MooncakeSpanStore",
    )
    # what span-aware builds' backend_supports_page_spans("mooncake") evaluates
    assert getattr(entry["loader"](), "supports_page_spans", False) is True

    extra = {"storage_page_size": 4 * PAGE, **mooncake_cluster.client_config()}
    kv = P.build_mla_host("page_first", layers=2, host_pages=10)
    backend = factory_registry.create_backend(
        "mooncake", make_storage_config(extra, model_name=key_namespace), kv
    )
    try:
        assert type(backend) is MooncakeSpanStore
        _round_trip(backend, kv)
    finally:
        backend.close()


def test_plugin_is_inert_without_opt_in(factory_registry, monkeypatch):
    from sglang.srt.plugins import load_plugins

    monkeypatch.delenv(OPT_IN_ENV, raising=False)
    load_plugins()
    entry = factory_registry._registry["mooncake"]
    assert entry["module_path"] == "sglang.srt.mem_cache.storage.mooncake_store.mooncake_store"


def test_plugin_rejects_garbage_opt_in(factory_registry, monkeypatch):
    from mooncake_span.sglang_backend.plugin import register

    monkeypatch.setenv(OPT_IN_ENV, "maybe")
    with pytest.raises(ValueError, match=OPT_IN_ENV):
        register()
