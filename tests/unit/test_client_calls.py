"""How many native calls one client put/get makes, on the contract-checked fake.

A healthy cluster's call goes to Mooncake as built (one native call, no
per-object work); a repeated key, a buffer budget overrun, copies or a bad
segment fall back to the per-object path, which must still give the same
answers.
"""

from __future__ import annotations

import numpy as np
import pytest

from mooncake_span.errors import ErrorCode
from mooncake_span.span.plan import PlanBatch
from mooncake_span.store.client import MooncakeClient
from mooncake_span_tools.testing.fake_store import FakeCluster
from tests.span_helpers import fake_client, listening_port, rank_segments

OBJECT_BYTES = 256
BUFFERS = 4
PUT = "batch_put_from_multi_buffers"
GET = "batch_get_into_multi_buffers"


@pytest.fixture
def make_client():
    clients = []
    with listening_port() as master:

        def make(cluster: FakeCluster, **options) -> MooncakeClient:
            client = fake_client(master, cluster, **options)
            clients.append(client)
            return client

        yield make
        for client in clients:
            client.close()


def _plans(client: MooncakeClient, array: np.ndarray, count: int) -> PlanBatch:
    """``count`` objects of BUFFERS buffers each, laid out back to back in ``array``
    (registered with ``client``: the fake refuses unregistered memory, as RDMA does)."""
    client.register_buffer(array.ctypes.data, array.nbytes)
    step = OBJECT_BYTES // BUFFERS
    base = array.ctypes.data
    ptrs = [[base + i * OBJECT_BYTES + j * step for j in range(BUFFERS)] for i in range(count)]
    return PlanBatch(ptrs, [[step] * BUFFERS] * count, [OBJECT_BYTES] * count)


def _ops(cluster: FakeCluster) -> list[str]:
    return [op for op, _ in cluster.calls if op in (PUT, GET)]


@pytest.mark.parametrize("segments", [(), ("127.0.0.1:12001",)])
def test_a_healthy_batch_is_one_native_call_each_way(make_client, segments):
    cluster = FakeCluster(segments=segments)
    client = make_client(cluster)
    keys = [f"obj-{i}" for i in range(128)]
    source = np.random.default_rng(1).integers(0, 256, 128 * OBJECT_BYTES, dtype=np.uint8)
    target = np.zeros_like(source)
    assert client.put(keys, _plans(client, source, 128)) == [True] * 128
    assert client.get(keys, _plans(client, target, 128)) == [True] * 128
    assert _ops(cluster) == [PUT, GET]
    assert np.array_equal(source, target)
    if segments:
        assert set(cluster.placement.values()) == set(segments)


def test_a_repeated_key_and_a_small_budget_split_the_call(make_client):
    cluster = FakeCluster()
    client = make_client(cluster, max_buffers_per_call=2 * BUFFERS)
    source = np.arange(4 * OBJECT_BYTES, dtype=np.uint32).astype(np.uint8)
    assert client.put(["a", "b", "c", "a"], _plans(client, source, 4)) == [True] * 4
    assert _ops(cluster) == [PUT, PUT]  # "a" once, three objects in calls of two
    cluster.calls.clear()
    target = np.zeros_like(source)
    assert client.get(["a", "b", "a"], _plans(client, target, 3)) == [True] * 3
    # rounds without a repeated key, then the budget: [a, b] and [a]
    assert _ops(cluster) == [GET, GET]
    first = target[:OBJECT_BYTES]
    assert np.array_equal(first, source[:OBJECT_BYTES])
    assert np.array_equal(target[2 * OBJECT_BYTES : 3 * OBJECT_BYTES], first)


def test_a_failed_direct_read_is_a_miss_and_the_key_is_remembered_lost(make_client):
    cluster = FakeCluster(segments=("127.0.0.1:12001",))
    client = make_client(cluster)
    source = np.ones(2 * OBJECT_BYTES, dtype=np.uint8)
    assert client.put(["x", "y"], _plans(client, source, 2)) == [True, True]
    cluster.inject(GET, int(ErrorCode.TRANSFER_FAIL))
    assert client.get(["x", "y"], _plans(client, np.zeros_like(source), 2)) == [False, False]
    assert client.stats()["lost_keys"] == 2
    # A lost key reads as absent until it is written again.
    assert client.exists(["x", "y"]) == [False, False]
    assert client.stats()["error_counts"]["TRANSFER_FAIL"] == 2


def test_a_short_read_is_counted_and_is_a_miss(make_client):
    cluster = FakeCluster()
    client = make_client(cluster)
    source = np.ones(OBJECT_BYTES, dtype=np.uint8)
    assert client.put(["x"], _plans(client, source, 1)) == [True]
    store = client._gate.store
    real_get = store.batch_get_into_multi_buffers
    store.batch_get_into_multi_buffers = lambda *a: [c - 1 for c in real_get(*a)]
    assert client.get(["x"], _plans(client, np.zeros_like(source), 1)) == [False]
    assert client.stats()["error_counts"]["SHORT_READ"] == 1
    assert client.stats()["lost_keys"] == 0


def test_unique_keys_over_the_budget_go_in_consecutive_calls(make_client):
    cluster = FakeCluster()
    client = make_client(cluster, max_buffers_per_call=2 * BUFFERS)
    keys = [f"obj-{i}" for i in range(5)]
    source = np.random.default_rng(3).integers(0, 256, 5 * OBJECT_BYTES, dtype=np.uint8)
    groups = [f"group-{i // 2}" for i in range(5)]
    assert client.put(keys, _plans(client, source, 5), groups) == [True] * 5
    assert [n for op, n in cluster.calls if op == PUT] == [8, 8, 4]
    assert [cluster.groups[k] for k in keys] == groups
    target = np.zeros_like(source)
    assert client.get(keys, _plans(client, target, 5)) == [True] * 5
    assert [n for op, n in cluster.calls if op == GET] == [8, 8, 4]
    assert np.array_equal(source, target)


def test_a_direct_put_over_several_segments_places_and_answers_per_key(make_client):
    segments = ("127.0.0.1:12001", "127.0.0.1:12002", "127.0.0.1:12003")
    cluster = FakeCluster(segments=segments)
    client = make_client(cluster)
    client.place_by(lambda key: key.split("#")[0])
    keys = [f"d{i}#{c}" for i in range(30) for c in ("kv", "idx")]
    groups = [k.split("#")[0] for k in keys]
    source = np.random.default_rng(5).integers(0, 256, len(keys) * OBJECT_BYTES, dtype=np.uint8)
    cluster.objects[keys[7]] = b"x" * OBJECT_BYTES  # stored already: Mooncake answers 0
    assert client.put(keys, _plans(client, source, len(keys)), groups) == [True] * len(keys)
    puts = [n for op, n in cluster.calls if op == PUT]
    assert len(puts) == len({rank_segments(g, segments)[0] for g in groups})
    for key, group in zip(keys, groups, strict=True):
        if key != keys[7]:
            assert cluster.placement[key] == rank_segments(group, segments)[0]
            assert cluster.groups[key] == group
    target = np.zeros_like(source)
    ok = client.get(keys, _plans(client, target, len(keys)))
    assert ok == [True] * len(keys)
    mine = [i for i in range(len(keys)) if i != 7]
    view = target.reshape(len(keys), OBJECT_BYTES)
    assert np.array_equal(view[mine], source.reshape(len(keys), OBJECT_BYTES)[mine])


@pytest.mark.parametrize("with_groups", [True, False])
def test_a_put_with_group_ids_goes_in_calls_of_at_most_64_objects(make_client, with_groups):
    cluster = FakeCluster()
    client = make_client(cluster)
    count = 150
    keys = [f"obj-{i}" for i in range(count)]
    source = np.ones(count * OBJECT_BYTES, dtype=np.uint8)
    groups = [f"g{i // 2}" for i in range(count)] if with_groups else None
    assert client.put(keys, _plans(client, source, count), groups) == [True] * count
    objects_per_call = [n // BUFFERS for op, n in cluster.calls if op == PUT]
    assert objects_per_call == ([64, 64, 22] if with_groups else [150])
    if with_groups:
        assert [cluster.groups[k] for k in keys] == groups
