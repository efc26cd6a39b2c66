"""Registration refuses what it cannot serve, at startup, with the missing piece named;
and no get ever hands back a buffer for a key that is not stored.

Each case was found by running sglang's own storage tests against the backend:
a KV pool without ``kv_buffer`` was taken for DeepSeek-V4's logical anchor (puts
then answered True while storing nothing), and a pool without zero-copy pointers
and without pages was accepted, to fail every transfer at run time.
"""

from __future__ import annotations

import pytest
import torch

from mooncake_span.errors import RegistrationError
from mooncake_span_tools.testing import pools as P
from mooncake_span_tools.testing.fake_store import FakeCluster
from tests.span_helpers import FAKE_CLIENT, slots_of

PAGE = 64


class BareKVPool:
    """A host pool shaped as sglang's test doubles are: pages and a layout, and
    neither ``kv_buffer`` nor page pointers."""

    page_size = PAGE
    size = 8 * PAGE
    layout = "page_first"
    dtype = torch.float32


class UnregisteredKVPool(BareKVPool):
    """Page pointers into memory it never offers for registration."""

    def __init__(self) -> None:
        self.memory = torch.zeros(self.size * 16, dtype=torch.uint8)

    def get_page_buffer_meta(self, indices):
        page = int(indices[0]) // PAGE
        return [self.memory.data_ptr() + page * PAGE * 16], [PAGE * 16]


class StagedOnlyPool:
    """No zero-copy pointers, only flat page copies, and no pages at all."""

    page_size = PAGE
    layout = "layer_first"

    def __init__(self, size):
        if size is not None:
            self.size = size

    def get_dummy_flat_data_page(self):
        return torch.zeros(128, dtype=torch.uint8)

    def get_data_page(self, index, flat=True):
        return torch.zeros(128, dtype=torch.uint8)

    def set_from_flat_data_page(self, index, data):
        return None


class ZeroByteConvPool:
    """A Mamba pool that names a conv state with no bytes in it."""

    page_size = PAGE
    size = 8 * PAGE
    conv_buffer = [None]
    temporal_state_elem_size = 4

    def __init__(self) -> None:
        self.memory = torch.zeros(8 * 16, dtype=torch.uint8)

    def get_page_buffer_meta(self, indices):
        page = int(indices[0]) // PAGE
        return [self.memory.data_ptr() + page * 16, self.memory.data_ptr()], [16, 0]


def test_kv_pool_without_kv_buffer_or_pointers_is_refused(make_backend):
    store = make_backend(dict(FAKE_CLIENT))
    with pytest.raises(RegistrationError, match="get_page_buffer_meta"):
        store.register_mem_pool_host(BareKVPool())


def test_kv_pointers_outside_registered_memory_are_refused(make_backend):
    store = make_backend(dict(FAKE_CLIENT))
    with pytest.raises(RegistrationError, match="outside the buffers"):
        store.register_mem_pool_host(UnregisteredKVPool())


@pytest.mark.parametrize("size", [None, 0])
def test_staged_pool_without_pages_is_refused(make_backend, size):
    store = make_backend(dict(FAKE_CLIENT))
    store.register_mem_pool_host(P.build_mla_host("layer_first", layers=1, host_pages=4))
    with pytest.raises(RegistrationError, match="'indexer'.*has no host pages"):
        store.register_mem_host_pool_v2(StagedOnlyPool(size), "indexer")


def test_zero_copy_pool_without_pages_is_refused(make_backend):
    store = make_backend(dict(FAKE_CLIENT))
    pool = P.build_mla_host("page_first", layers=1, host_pages=4)
    pool.size = 0
    with pytest.raises(RegistrationError, match="'kv'.*has no host pages"):
        store.register_mem_pool_host(pool)


def test_logical_anchor_is_sglangs_class_and_the_generic_path_refuses_it(make_backend):
    from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool

    store = make_backend(dict(FAKE_CLIENT), cluster=FakeCluster())
    store.register_mem_pool_host(LogicalHostPool(size=8 * PAGE, page_size=PAGE))
    assert store.pools["kv"].is_logical
    flat = torch.full((16,), 7, dtype=torch.uint8)
    # No bytes to store or restore: neither a put nor a get may claim success.
    assert store.batch_set(["k0"], [flat]) is False
    assert store.batch_get(["k0"], [flat]) == [None]
    assert store.get("k0", flat) is None
    assert torch.equal(flat, torch.full((16,), 7, dtype=torch.uint8))


def test_get_returns_none_for_a_key_never_stored(make_backend):
    pool = P.build_mla_host("page_first", layers=1, host_pages=4)
    store = make_backend(dict(FAKE_CLIENT), cluster=FakeCluster())
    store.register_mem_pool_host(pool)
    span = torch.zeros(store.registration.span_bytes, dtype=torch.uint8)
    assert store.get("never-stored", span) is None
    assert store.batch_get(["never-stored"], [span]) == [None]
    assert store.batch_get_v1(["never-stored"], slots_of([0], PAGE)) == [False]


def _store_listing(extra, asked):
    from mooncake_span.sglang_backend import MooncakeSpanStore
    from mooncake_span.store.client import NativeBinding
    from mooncake_span_tools.testing.fake_store import FakeReplicateConfig, FakeStore
    from tests.span_helpers import make_storage_config, skip_probe

    cluster = FakeCluster()
    binding = NativeBinding(
        lambda: FakeStore(cluster),
        FakeReplicateConfig,
        probe_endpoint=skip_probe,
        list_segments=lambda url: asked.append(url) or ["node0"],
    )
    return MooncakeSpanStore(make_storage_config({**FAKE_CLIENT, **extra}), {}, binding=binding)


def test_no_admin_url_is_guessed_and_the_cost_is_said_once(caplog):
    from mooncake_span.store import segments

    segments._warn_no_admin_url.cache_clear()
    asked: list[str] = []
    stores = [_store_listing({}, asked) for _ in range(2)]
    assert asked == [] and stores[0].client.segments() == ()
    warned = [r for r in caplog.records if "no master admin URL" in r.getMessage()]
    assert len(warned) == 1 and "span_master_admin_url" in warned[0].getMessage()
    stores.append(_store_listing({"master_metrics_port": 9100}, asked))
    stores.append(_store_listing({"span_master_admin_url": "http://m:9200"}, asked))
    assert asked[0] == "http://127.0.0.1:9100" and asked[-1] == "http://m:9200"
    for store in stores:
        store.close()


def test_a_component_without_bytes_is_refused(make_backend):
    """A component sglang names but gives no bytes stops registration with the
    pool's name; serving the pool without it instead would be a deliberate
    change, not a silent one."""
    store = make_backend(dict(FAKE_CLIENT))
    store.register_mem_pool_host(P.build_mla_host("page_first", layers=1, host_pages=4))
    with pytest.raises(
        RegistrationError, match=r"pool 'mamba': component\(s\) \[1\] have no bytes"
    ):
        store.register_mem_host_pool_v2(ZeroByteConvPool(), "mamba")
