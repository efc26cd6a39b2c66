"""Hit queries lease only what they can read, on a real master.

Mooncake 0.3.13 leases every existing object ``batch_is_exist`` finds; a
non-forced ``remove`` right after answers -706 (OBJECT_HAS_LEASE) for a
leased object and removes any other one. So removing every stored object after
a query shows exactly what the query pinned. Bound (issue #20): the objects of
the KV-hit prefix plus the KV objects of at most one probe chunk past the
first miss; with eviction group ids a key's objects are tied together, so the
keys probed past the miss pin their sidecars too (measured, see
docs/benchmarks.md "2026-12-01: hit queries and leases").
"""

from __future__ import annotations

import pytest

from mooncake_span.span.hit_rounds import KV_ROUNDS_WITH_SIDECARS
from mooncake_span_tools.bench import leases as L
from mooncake_span_tools.testing import pools as P

OBJECT_HAS_LEASE = -706


@pytest.fixture
def rig(span_store_factory, mooncake_store_factory):
    def make(group_ids: bool):
        pool_set = P.build_compressed_hybrid_dsa(
            "page_first", host_pages=L.QUERY_KEYS, mamba_slots=L.QUERY_KEYS, index_kpool=1
        )
        store = span_store_factory(
            pool_set.pools, storage_page_size=L.PAGE_TOKENS, span_group_ids=group_ids
        )
        return store, pool_set

    return make, mooncake_store_factory()


def _objects(store, pool, keys):
    return store.pools[pool].object_keys(store.key_schema, keys)


@pytest.mark.parametrize("group_ids", [True, False], ids=["group-ids", "no-group-ids"])
@pytest.mark.parametrize("shape", L.SHAPES)
def test_a_query_leases_only_its_hit_prefix_and_one_probe_chunk(
    rig, key_namespace, shape, group_ids
):
    make, raw = rig
    store, pool_set = make(group_ids)
    contender = L.Contender("span", None, store, pool_set)
    keys = [f"{key_namespace}-{shape}-{i}" for i in range(L.QUERY_KEYS)]
    assert L.backup(contender, keys) == L.QUERY_KEYS
    asked = L.query_keys(shape, keys, key_namespace)
    hit = store.batch_exists_v2(asked, L._transfers(asked, with_slots=False)).kv_hit_pages

    pools = list(store.pools)
    stored = [obj for pool in pools for obj in _objects(store, pool, keys)]
    leased = {obj for obj in stored if raw.remove(obj) == OBJECT_HAS_LEASE}

    chunks = store.prober.policy.chunks(len(asked), KV_ROUNDS_WITH_SIDECARS)
    miss_end = next((end for start, end in chunks if start <= hit < end), hit)
    past = [k for k in asked[hit + 1 : miss_end] if k in keys]
    bound = {obj for pool in pools for obj in _objects(store, pool, asked[:hit])}
    bound |= set(_objects(store, "kv", past))
    if group_ids:
        bound |= {obj for pool in pools for obj in _objects(store, pool, past)}
    assert leased <= bound, sorted(leased - bound)
    # The prefix itself is read next, so it is leased (the check can see leases).
    assert set(_objects(store, "kv", asked[:hit])) <= leased
    if shape == "first_miss":
        assert hit == 0 and not leased
    if shape == "full_hit":
        assert hit == L.QUERY_KEYS and leased == set(stored)
