"""``hit_query_rpcs`` counts every native RPC a hit query sends, on the fake store.

The store client splits an existence query at ``EXISTS_KEYS_PER_CALL`` keys
and, while a segment is bad, first asks the master where suspect copies are
(``batch_get_replica_desc``); both are RPCs of the hit query. The fake is
wrapped to log every such call, and the backend's count must equal the log.
"""

from __future__ import annotations

import pytest

from mooncake_span.store.client import NativeBinding
from mooncake_span.store.gate import EXISTS_KEYS_PER_CALL
from mooncake_span_tools.testing import pools as P
from mooncake_span_tools.testing.fake_store import FakeCluster, FakeReplicateConfig, FakeStore
from tests.span_helpers import (
    FAKE_CLIENT,
    make_storage_config,
    register_pools,
    skip_probe,
    slots_of,
)

PAGE = 64
SEGMENTS = tuple(f"10.0.0.{i}:1500{i}" for i in range(1, 5))
QUERY_RPCS = ("batch_is_exist", "batch_get_replica_desc")


class CountingStore(FakeStore):
    """The fake store, logging the name of every RPC a hit query can send."""

    def __init__(self, cluster: FakeCluster, sent: list[str]) -> None:
        super().__init__(cluster)
        self._sent = sent

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self._sent.append("batch_is_exist")
        return super().batch_is_exist(keys)

    def batch_get_replica_desc(self, keys: list[str]):
        self._sent.append("batch_get_replica_desc")
        return super().batch_get_replica_desc(keys)


def _kv_objects(store, keys: list[str]) -> list[str]:
    return store.key_schema.object_keys(keys, store.pools["kv"].components)


def _query_rpcs(store, sent: list[str], keys: list[str]) -> tuple[int, list[str]]:
    """One hit query: the RPCs the backend counted, and those the fake saw."""
    store.get_stats()  # drain the counters
    sent.clear()
    store.batch_exists(keys)
    stats = store.get_stats()
    assert stats.hit_queries == 1
    return stats.hit_query_rpcs, list(sent)


def test_a_query_longer_than_one_existence_call_counts_each_call(make_backend):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    cluster, sent = FakeCluster(), []
    config = {**FAKE_CLIENT, "span_layout_guard": "off"}
    kv = P.build_mla_host("page_first", layers=1, host_pages=4)
    store = make_backend(
        config, {PoolName.KV: kv}, cluster=cluster, native=lambda c: CountingStore(c, sent)
    )
    keys = [f"q{i}" for i in range(EXISTS_KEYS_PER_CALL + 904)]
    cluster.objects[_kv_objects(store, keys[:1])[0]] = b"x"  # round 1 hits: round 2 is asked
    counted, seen = _query_rpcs(store, sent, keys)
    # Round 1: key 0 (one call); round 2: the other 5,000 keys in calls of 4,096 and 904.
    assert seen == ["batch_is_exist"] * 3
    assert counted == len(seen)


@pytest.fixture
def placed_rig():
    """A backend placing objects on four fake segments, and the log of its RPCs."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from mooncake_span.sglang_backend import MooncakeSpanStore

    cluster, sent = FakeCluster(segments=SEGMENTS), []
    config = {**FAKE_CLIENT, "span_master_admin_url": "http://127.0.0.1:1"}
    binding = NativeBinding(
        lambda: CountingStore(cluster, sent),
        FakeReplicateConfig,
        lambda url: cluster.live_segments(),
        probe_endpoint=skip_probe,
    )
    store = MooncakeSpanStore(
        make_storage_config({**config, "span_layout_guard": "off"}), {}, binding=binding
    )
    kv = P.build_mla_host("page_first", layers=1, host_pages=16)
    register_pools(store, {PoolName.KV: kv})
    yield store, cluster, sent
    store.close()


def test_a_query_while_a_segment_is_bad_counts_the_locate_call(placed_rig):
    store, cluster, sent = placed_rig
    keys = [f"p{i}" for i in range(12)]
    assert store.batch_set_v1(keys, slots_of(list(range(12)), PAGE)) == [True] * 12
    homes = [cluster.placement[obj] for obj in _kv_objects(store, keys)]
    bad = next(segment for segment in homes[1:] if segment != homes[0])
    store.client.ledger.transfer_failed([bad], "get")
    counted, seen = _query_rpcs(store, sent, keys)
    # Round 1: key 0, on a good segment (one existence call); round 2: the
    # rest, some of them on the bad segment (where are they, then existence).
    assert seen == ["batch_is_exist", "batch_get_replica_desc", "batch_is_exist"]
    assert counted == len(seen)
