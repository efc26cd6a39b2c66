"""Registered memory only, on the real client: every zero-copy pointer is checked.

The real Mooncake client runs under ``CheckedStore`` (tests/harness/registered.py),
which refuses any zero-copy call naming memory outside the regions given to
``register_buffer``, as RDMA would. Every pool kind (MHA, MLA, the DSA indexer,
Mamba state), every layout and every path (v1, v2, the generic flat-tensor
path) round-trips byte-exact with no violation; a small arena forces staged
calls to be cut into several parts. A case that hands the proxy unregistered
memory shows the check fails.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mooncake_span.config import SpanOptions
from mooncake_span.errors import TransportError
from mooncake_span.span.plan import ObjectPlan
from mooncake_span.store.client import MooncakeClient, load_native_binding
from mooncake_span_tools.testing import pools as P
from tests.harness.registered import CheckedStore, UnregisteredMemoryError, checked_binding
from tests.span_helpers import scattered_pages, slots_of

pytestmark = pytest.mark.integration

PAGE = 64
LAYOUTS = ["page_first", "page_first_direct", "layer_first"]


def _pools(model: str, layout: str):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    if model == "mha":
        kv = P.build_mha_host(layout, layers=2, host_pages=16)
        return {PoolName.KV: kv, PoolName.MAMBA: P.build_mamba_host(layers=2, slots=4)}, False
    if model == "mla":
        return {PoolName.KV: P.build_mla_host(layout, layers=2, host_pages=16)}, True
    pool_set = P.build_compressed_hybrid_dsa(layout, host_pages=16, mamba_slots=4)
    return dict(pool_set.pools), True


def _round_trip_v1_v2(store, pools, pages_per_key: int) -> None:
    """Back up KV (v1) and every sidecar (v2), wipe, restore, compare every byte."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    keys = ["r0", "r1", "r2"]
    pages = scattered_pages(16, len(keys) * pages_per_key, seed=5)
    starts = [p * PAGE for p in pages]
    slots = slots_of(pages, PAGE)
    paged = [name for name in pools if name not in (PoolName.KV, PoolName.MAMBA)]
    for seed, name in enumerate([PoolName.KV, *paged]):
        P.fill_random_pages(pools[name], starts, seed=seed)
    refs = {name: [P.page_bytes(pools[name], s) for s in starts] for name in [PoolName.KV, *paged]}
    transfers = [
        PoolTransfer(name, host_indices=slots, keys=keys, indices_from_pool=PoolName.KV)
        for name in paged
    ]
    if PoolName.MAMBA in pools:
        P.fill_random_pages(pools[PoolName.MAMBA], [1], seed=9)
        refs[PoolName.MAMBA] = [P.page_bytes(pools[PoolName.MAMBA], 1)]
        state = PoolTransfer(
            PoolName.MAMBA,
            host_indices=torch.tensor([1]),
            keys=keys[-1:],
            hit_policy=PoolHitPolicy.TRAILING_PAGES,
        )
        transfers.append(state)
    if transfers:
        assert all(all(v) for v in store.batch_set_v2(transfers).values())
    assert store.batch_set_v1(keys, slots) == [True] * len(keys)
    for name in refs:
        P.wipe_pages(pools[name], [1] if name == PoolName.MAMBA else starts)
    assert store.batch_get_v1(keys, slots) == [True] * len(keys)
    if transfers:
        got = store.batch_get_v2(
            [PoolTransfer(t.name, host_indices=t.host_indices, keys=t.keys) for t in transfers]
        )
        assert all(all(v) for v in got.values()), got
    for name, expected in refs.items():
        where = [1] if name == PoolName.MAMBA else starts
        assert [P.page_bytes(pools[name], s) for s in where] == expected, f"pool {name} differs"


def _round_trip_generic(store, proxy: CheckedStore) -> int:
    """The generic path: sglang's own (unregistered) flat tensors, staged.
    Returns how many native puts the backup took."""
    kv = store.pools["kv"]
    span_bytes = kv.layout.flat_page_bytes * store.geometry.pages_per_span
    rng = np.random.default_rng(11)
    keys = [f"g{i}" for i in range(5)]
    values = [torch.from_numpy(rng.integers(0, 256, span_bytes, dtype=np.uint8)) for _ in keys]
    puts_before = proxy.calls["batch_put_from_multi_buffers"]
    assert store.batch_set(keys, values) is True
    puts = proxy.calls["batch_put_from_multi_buffers"] - puts_before
    targets = [torch.zeros(span_bytes, dtype=torch.uint8) for _ in keys]
    got = store.batch_get(keys, targets)
    assert all(g is not None for g in got)
    assert all(torch.equal(t, v) for t, v in zip(targets, values, strict=True))
    return puts


@pytest.mark.parametrize("arena", ["64mb", "small"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", ["mha", "mla", "dsa_mamba"])
def test_every_path_sends_only_registered_memory(span_store_factory, model, layout, arena):
    pools, is_mla = _pools(model, layout)
    checked: list[CheckedStore] = []
    binding = checked_binding(load_native_binding(), checked)
    storage_page = 4 * PAGE
    # "small": one generic key row per lease, so staged calls are cut into parts.
    kv = next(iter(pools.values()))
    row_bytes = int(kv.get_dummy_flat_data_page().numel() * kv.dtype.itemsize) * 4
    size = arena if arena != "small" else str(max(row_bytes, 4096))
    store = span_store_factory(
        pools,
        storage_page_size=storage_page,
        is_mla=is_mla,
        binding=binding,
        span_staging_buffer_size=size,
    )
    (proxy,) = checked
    _round_trip_v1_v2(store, pools, pages_per_key=4)
    generic_puts = _round_trip_generic(store, proxy)
    # A lease of one key row cuts the 5-key backup into 5 native puts.
    assert generic_puts == (5 if arena == "small" else 1)
    assert proxy.violations == []
    assert proxy.checked_buffers > 0


def test_the_checking_proxy_fails_a_call_from_unregistered_memory(mooncake_cluster, key_namespace):
    from mooncake_span.mooncake_settings import load_mooncake_settings

    checked: list[CheckedStore] = []
    settings = load_mooncake_settings(mooncake_cluster.client_config())
    client = MooncakeClient(
        settings, SpanOptions(), checked_binding(load_native_binding(), checked)
    )
    client.connect()
    try:
        data = np.arange(4096, dtype=np.uint8)
        plan = [ObjectPlan([data.ctypes.data], [data.nbytes])]
        key = f"{key_namespace}-unregistered"
        with pytest.raises(TransportError) as caught:
            client.put([key], plan)
        assert isinstance(caught.value.__cause__, UnregisteredMemoryError)
        assert checked[0].violations == [
            ("batch_put_from_multi_buffers", data.ctypes.data, data.nbytes)
        ]
        client.register_buffer(data.ctypes.data, data.nbytes)
        assert client.put([key], plan) == [True]
        assert len(checked[0].violations) == 1
    finally:
        client.close()
