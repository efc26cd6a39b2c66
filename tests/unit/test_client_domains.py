"""Failure domains in MooncakeClient, on the fake's segment model.

The fake's segment behaviour (placement by ``preferred_segment``, a killed
node answering TRANSFER_FAIL while still listed) is what two real storage
nodes did; ``tests/faults/test_failure_domains.py`` runs the same scenario on a
real cluster.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

from mooncake_span.errors import ErrorCode
from mooncake_span.span.plan import ObjectPlan
from mooncake_span.store.client import MooncakeClient
from mooncake_span.store.domains import copy_key
from mooncake_span_tools.testing.fake_store import FakeCluster, FakeStore
from tests.span_helpers import FakeClock, fake_client, listening_port, rank_segments

SEGMENTS = ("127.0.0.1:12001", "127.0.0.1:12002")
COMPONENTS = ("kv", "indexer", "conv")
OBJECT_BYTES = 512


@pytest.fixture
def cluster() -> FakeCluster:
    return FakeCluster(segments=SEGMENTS)


@pytest.fixture
def make_client(cluster):
    clients = []
    with listening_port() as master:

        def make(**options) -> MooncakeClient:
            client = fake_client(master, cluster, **options)
            client.place_by(lambda key: key.rsplit("__", 1)[0])
            clients.append(client)
            return client

        yield make
        for client in clients:
            client.close()


class Keys:
    """24 storage keys x 3 components, each object filled with its own bytes."""

    def __init__(self, n: int = 24) -> None:
        self.domains = [f"ms1_m_h64x4_pf_bf16_{i:08x}" for i in range(n)]
        self.objects = [f"{d}__{c}" for d in self.domains for c in COMPONENTS]
        self.groups = [d for d in self.domains for _ in COMPONENTS]
        rng = np.random.default_rng(7)
        self.source = rng.integers(0, 256, len(self.objects) * OBJECT_BYTES, dtype=np.uint8)
        self.target = np.zeros_like(self.source)

    def plans(self, client: MooncakeClient, array: np.ndarray, idx: list[int]) -> list[ObjectPlan]:
        """Objects ``idx`` of ``array``, registered with ``client`` (RDMA's rule)."""
        client.register_buffer(array.ctypes.data, array.nbytes)
        base = array.ctypes.data
        return [ObjectPlan([base + i * OBJECT_BYTES], [OBJECT_BYTES]) for i in idx]

    def put(self, client: MooncakeClient) -> list[bool]:
        idx = list(range(len(self.objects)))
        return client.put(self.objects, self.plans(client, self.source, idx), self.groups)

    def get_key(self, client: MooncakeClient, k: int) -> bool:
        """Restore storage key ``k`` alone; True only if every component is byte-exact."""
        idx = [k * len(COMPONENTS) + c for c in range(len(COMPONENTS))]
        self.target[:] = 0
        flags = client.get([self.objects[i] for i in idx], self.plans(client, self.target, idx))
        exact = all(
            ctypes.string_at(self.target.ctypes.data + i * OBJECT_BYTES, OBJECT_BYTES)
            == self.source[i * OBJECT_BYTES : (i + 1) * OBJECT_BYTES].tobytes()
            for i in idx
        )
        assert not (all(flags) and not exact), f"key {k} reported restored with wrong bytes"
        return all(flags)

    def home(self, k: int) -> str:
        return rank_segments(self.domains[k], SEGMENTS)[0]


def native_calls(cluster: FakeCluster, op: str) -> int:
    return sum(1 for name, _ in cluster.calls if name == op)


def test_every_object_of_a_key_lands_on_its_home_segment(make_client, cluster):
    keys = Keys()
    assert all(keys.put(make_client()))
    for k in range(len(keys.domains)):
        homes = {cluster.placement[o] for o in keys.objects[3 * k : 3 * k + 3]}
        assert homes == {keys.home(k)}
    used = {cluster.placement[o] for o in keys.objects}
    assert used == set(SEGMENTS)  # spread, not all on one node


def test_a_dead_node_costs_its_keys_only_and_no_live_key_waits(make_client, cluster):
    keys = Keys()
    writer, reader = make_client(), make_client()
    assert all(keys.put(writer))
    dead = SEGMENTS[0]
    cluster.kill_segment(dead)
    on_dead = [k for k in range(24) if keys.home(k) == dead]
    # The first restore of every key: live ones succeed at once, dead ones fail.
    restored = [keys.get_key(reader, k) for k in range(24)]
    assert [k for k in range(24) if not restored[k]] == on_dead
    assert reader.stats()["breaker_state"] == "closed"
    assert reader.stats()["bad_segments"] == [dead]
    # Now the dead node's keys are misses without a transfer, live ones still read.
    cluster.calls.clear()
    assert reader.exists(keys.objects) == [
        keys.home(i // 3) != dead for i in range(len(keys.objects))
    ]
    assert not any(keys.get_key(reader, k) for k in on_dead)
    assert all(keys.get_key(reader, k) for k in range(24) if k not in on_dead)
    gets = native_calls(cluster, "batch_get_into_multi_buffers")
    assert gets == 24 - len(on_dead)
    # New writes avoid the dead node and restore.
    fresh = Keys(8)
    fresh.domains = [d + "-new" for d in fresh.domains]
    fresh.objects = [f"{d}__{c}" for d in fresh.domains for c in COMPONENTS]
    fresh.groups = [d for d in fresh.domains for _ in COMPONENTS]
    assert all(fresh.put(reader))
    assert {cluster.placement[o] for o in fresh.objects} == {SEGMENTS[1]}
    assert all(fresh.get_key(reader, k) for k in range(8))


@pytest.mark.parametrize("replica_num", [1, 2])
def test_a_put_reaches_every_segment_at_once(make_client, cluster, monkeypatch, replica_num):
    """Each segment's share of one put is in flight together: every native put of
    the call waits at a barrier of one party per segment, which a put sent one
    segment after another never passes (each waiter times out, the put fails)."""
    barrier = threading.Barrier(len(SEGMENTS), timeout=10.0)
    threads: set[str] = set()
    put = FakeStore.batch_put_from_multi_buffers

    def met(self, keys, *args, **kwargs):
        threads.add(threading.current_thread().name)
        barrier.wait()
        return put(self, keys, *args, **kwargs)

    monkeypatch.setattr(FakeStore, "batch_put_from_multi_buffers", met)
    keys = Keys()
    assert all(keys.put(make_client(replica_num=replica_num)))
    assert len(threads) == len(SEGMENTS)
    assert {cluster.placement[o] for o in keys.objects} == set(SEGMENTS)


def test_two_copies_survive_a_node_at_the_first_attempt(make_client, cluster):
    keys = Keys()
    client = make_client(replica_num=2)
    assert all(keys.put(client))
    for k in range(24):
        placed = {cluster.placement[copy_key(keys.objects[3 * k], r)] for r in (0, 1)}
        assert placed == set(SEGMENTS)
    cluster.kill_segment(SEGMENTS[0])
    assert all(keys.get_key(client, k) for k in range(24))
    assert client.stats()["breaker_state"] == "closed"
    # After the master drops the dead node, the surviving copy still serves.
    cluster.expire_dead()
    assert all(client.exists(keys.objects))
    assert all(keys.get_key(client, k) for k in range(24))


def test_a_failed_restore_is_not_a_hit_again_until_rewritten(make_client, cluster):
    cluster.segments.clear()  # no failure domains: the negative cache alone
    keys = Keys(2)
    client = make_client(placement=False)
    assert all(keys.put(client))
    cluster.inject("batch_get_into_multi_buffers", int(ErrorCode.TRANSFER_FAIL))
    assert not keys.get_key(client, 0)
    cluster.calls.clear()
    assert client.exists(keys.objects[:3]) == [False, False, False]
    assert native_calls(cluster, "batch_is_exist") == 0
    assert client.exists(keys.objects[3:]) == [True, True, True]
    # Written again (the put keeps the stored value): a hit again.
    assert all(keys.put(client))
    assert client.exists(keys.objects[:3]) == [True, True, True]
    assert keys.get_key(client, 0)


def test_lost_keys_come_back_after_their_ttl(make_client, cluster):
    cluster.segments.clear()  # no failure domains: the negative cache alone
    keys = Keys(1)
    clock = FakeClock()
    client = make_client(placement=False, lost_key_ttl_s=30.0, clock=clock)
    assert all(keys.put(client))
    cluster.inject("batch_get_into_multi_buffers", int(ErrorCode.TRANSFER_FAIL))
    assert not keys.get_key(client, 0)
    assert client.exists(keys.objects) == [False] * 3
    clock.advance(29.0)
    assert client.exists(keys.objects) == [False] * 3
    clock.advance(2.0)
    assert client.exists(keys.objects) == [True] * 3
    assert client.stats()["lost_keys"] == 0


def test_a_bad_segment_serves_again_after_its_ttl(make_client, cluster):
    keys = Keys()
    clock = FakeClock()
    client = make_client(domain_bad_ttl_s=20.0, clock=clock)
    assert all(keys.put(client))
    dead = SEGMENTS[0]
    on_dead = [k for k in range(24) if keys.home(k) == dead]
    cluster.kill_segment(dead)
    assert not keys.get_key(client, on_dead[0])
    assert client.stats()["bad_segments"] == [dead]
    cluster.dead.discard(dead)  # the node is back
    clock.advance(19.0)
    assert client.stats()["bad_segments"] == [dead]
    cluster.calls.clear()
    assert not any(keys.get_key(client, k) for k in on_dead[1:])  # misses without a transfer
    assert native_calls(cluster, "batch_get_into_multi_buffers") == 0
    clock.advance(2.0)
    assert client.stats()["bad_segments"] == []
    assert all(keys.get_key(client, k) for k in on_dead[1:])
    assert client.stats()["domains_marked_bad"] == 1


def _failed_put(client: MooncakeClient, cluster: FakeCluster) -> None:
    keys = Keys(4)
    cluster.inject("batch_put_from_multi_buffers", int(ErrorCode.TRANSFER_FAIL), times=8)
    assert not any(keys.put(client))


def test_a_failed_put_convicts_its_segment_only_when_that_segment_does_not_answer(
    make_client, cluster
):
    # Mooncake moves a put off a full preferred segment onto any listed one, so
    # a failed transfer does not name its segment: one that refuses a connection
    # is the culprit; one that answers was full, and puts move off it for a while
    # while its keys still read.
    stored = Keys()
    client = make_client()
    assert all(stored.put(client))
    _failed_put(client, cluster)
    homes = {Keys(4).home(k) for k in range(4)}
    assert client.stats()["bad_segments"] == []
    assert client.stats()["full_segments"] == sorted(homes)
    assert all(stored.get_key(client, k) for k in range(24))
    dead = make_client(segment_answers=lambda metadata, admin, segment: False)
    _failed_put(dead, cluster)
    assert dead.stats()["bad_segments"] == sorted(homes)


def test_puts_move_off_a_full_segment_to_the_next_one(make_client, cluster):
    client = make_client()
    full = SEGMENTS[0]
    client.ledger.put_target_failed(full, answers=True, whole_call=False)
    keys = Keys()
    assert all(keys.put(client))
    assert {cluster.placement[o] for o in keys.objects} == {SEGMENTS[1]}
    assert all(keys.get_key(client, k) for k in range(24))


def test_a_failed_put_no_probe_can_judge_convicts_only_while_no_segment_is_bad(
    make_client, cluster
):
    # Etcd metadata does not say where a segment's endpoint is: the first failed
    # call convicts its segment; once one is bad, another's failed put may have
    # been moved onto it, so it convicts nothing.
    client = make_client(segment_answers=lambda metadata, admin, segment: None)
    _failed_put(client, cluster)
    homes = {Keys(4).home(k) for k in range(4)}
    assert len(homes) == 2
    assert len(client.stats()["bad_segments"]) == 1
    assert set(client.stats()["bad_segments"]) < homes


def test_transfer_failures_never_open_the_breaker_but_rpc_failures_do(make_client, cluster):
    cluster.segments.clear()  # no failure domains: the negative cache alone
    keys = Keys(1)
    client = make_client(breaker_failures=2, breaker_probe_interval_s=60.0, placement=False)
    assert all(keys.put(client))
    plans = keys.plans(client, keys.target, [0, 1, 2])  # registering answers the breaker
    for _ in range(4):
        cluster.inject("batch_get_into_multi_buffers", int(ErrorCode.TRANSFER_FAIL))
        client.get(keys.objects, plans)
    assert client.stats()["breaker_state"] == "closed"
    for _ in range(2):
        cluster.inject("batch_get_into_multi_buffers", int(ErrorCode.RPC_FAIL))
        client.get(keys.objects, plans)
    assert client.stats()["breaker_state"] == "open"


def test_placement_follows_the_segment_list(make_client, cluster):
    client = make_client(segment_refresh_s=0.05)
    assert client.segments() == SEGMENTS
    cluster.add_segment("127.0.0.1:12003")
    import time

    deadline = time.monotonic() + 5
    while len(client.segments()) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.segments() == (*SEGMENTS, "127.0.0.1:12003")


def test_without_placement_a_dead_node_is_still_isolated(make_client, cluster):
    # Mooncake places the objects; while a segment is bad the client asks the
    # master where they are and skips only those on the dead node.
    keys = Keys()
    client = make_client(placement=False)
    assert all(keys.put(client))
    dead = SEGMENTS[0]
    on_dead = {k for k in range(24) if cluster.placement[keys.objects[3 * k]] == dead}
    assert 0 < len(on_dead) < 24
    cluster.kill_segment(dead)
    first = next(iter(on_dead))
    assert not keys.get_key(client, first)
    assert client.stats()["bad_segments"] == [dead]
    failed_transfers = client.stats()["error_counts"]["TRANSFER_FAIL"]
    restored = [keys.get_key(client, k) for k in range(24)]
    # A key restores when none of its objects sat on the dead node; no
    # transfer is attempted for an object known to sit there.
    intact = [
        all(cluster.placement[keys.objects[3 * k + c]] != dead for c in range(3)) for k in range(24)
    ]
    assert restored == intact
    assert client.stats()["error_counts"]["TRANSFER_FAIL"] == failed_transfers
    assert client.stats()["breaker_state"] == "closed"
