"""MooncakeClient with an SSD tier behind it, on the fake's model of one.

The fake answers as the real tier did (``store/serving_ssd.py``; measured in
``tests/integration/test_ssd_tier.py``): a disk-only object whose owner is
down fails at the RPC layer while the master still answers, and one owner's
share of a get larger than its read buffer overflows.
"""

from __future__ import annotations

import pytest

from mooncake_span.store.serving_ssd import OWNER_DOWN_LABEL
from tests.span_helpers import json_http_server
from tests.unit import test_client_domains as domains
from tests.unit.test_client_domains import COMPONENTS, OBJECT_BYTES, SEGMENTS, Keys, native_calls

# The same fixtures: a fake cluster of two segments, clients placing by storage key.
cluster = domains.cluster
make_client = domains.make_client


def test_a_down_ssd_owner_is_remembered_not_asked_per_key(make_client, cluster):
    keys = Keys()
    writer, reader = make_client(), make_client(breaker_failures=1)
    assert all(keys.put(writer))
    cluster.evict_to_disk(keys.objects)
    dead = SEGMENTS[0]
    cluster.kill_segment(dead)
    on_dead = [k for k in range(24) if keys.home(k) == dead]
    assert not keys.get_key(reader, on_dead[0])  # the one read that pays the owner's RPC wait
    stats = reader.stats()
    assert stats["bad_segments"] == [dead]
    assert stats["breaker_state"] == "closed"  # the master answered: not a cluster failure
    assert stats["error_counts"][OWNER_DOWN_LABEL] == len(COMPONENTS)
    cluster.calls.clear()
    # The owner's other keys: misses without a read; hit queries no longer offer them.
    assert not any(keys.get_key(reader, k) for k in on_dead[1:])
    assert native_calls(cluster, "batch_get_into_multi_buffers") == 0
    assert reader.exists(keys.objects) == [
        keys.home(i // 3) != dead for i in range(len(keys.objects))
    ]
    # The other owner's disk-only keys still restore.
    assert all(keys.get_key(reader, k) for k in range(24) if k not in on_dead)


def test_an_rpc_failure_of_memory_objects_is_still_the_breakers(make_client, cluster):
    keys = Keys(2)
    client = make_client(breaker_failures=1, breaker_probe_interval_s=60.0)
    assert all(keys.put(client))
    cluster.inject("batch_get_into_multi_buffers", -900)
    assert not keys.get_key(client, 0)
    assert client.stats()["breaker_state"] == "open"
    assert client.stats()["bad_segments"] == []


def test_a_read_an_owners_buffer_cannot_take_is_asked_again_in_halves(make_client, cluster):
    keys = Keys(8)
    client = make_client()
    assert all(keys.put(client))
    cluster.evict_to_disk(keys.objects)
    # Each owner stages at most 2 objects: every call's share is cut until it fits.
    cluster.disk_read_buffer_bytes = 2 * OBJECT_BYTES
    idx = list(range(len(keys.objects)))
    keys.target[:] = 0
    flags = client.get(keys.objects, keys.plans(client, keys.target, idx))
    assert all(flags)
    assert (keys.target == keys.source).all()
    assert client.stats()["error_counts"]["BUFFER_OVERFLOW"] > 0
    assert client.stats()["ssd_read_rpcs"] > 0


@pytest.mark.parametrize("buffer_objects", [0])
def test_an_object_larger_than_the_read_buffer_is_a_clean_miss(
    make_client, cluster, buffer_objects
):
    keys = Keys(2)
    client = make_client()
    assert all(keys.put(client))
    cluster.evict_to_disk(keys.objects)
    cluster.disk_read_buffer_bytes = buffer_objects
    assert not keys.get_key(client, 0)
    assert client.stats()["breaker_state"] == "closed"


def test_the_owner_is_the_one_the_master_names_not_placements_guess(make_client, cluster):
    """A full segment's puts land on another one: the dead owner's keys are not
    where placement put them, and a healthy node must not be marked instead."""
    keys = Keys()
    writer, reader = make_client(), make_client()
    assert all(keys.put(writer))
    dead = SEGMENTS[0]
    moved = [k for k in range(24) if keys.home(k) != dead][:3]
    for k in moved:  # as Mooncake does when the preferred segment is full
        for obj in keys.objects[3 * k : 3 * k + 3]:
            cluster.placement[obj] = dead
    cluster.evict_to_disk(keys.objects)
    cluster.kill_segment(dead)
    owned = {k for k in range(24) if cluster.placement[keys.objects[3 * k]] == dead}
    assert not keys.get_key(reader, moved[0])  # placement says the live node: it pays once
    assert reader.stats()["bad_segments"] == [dead]
    cluster.calls.clear()
    restored = [keys.get_key(reader, k) for k in range(24)]
    assert [k for k in range(24) if not restored[k]] == sorted(owned)
    # Only the live owner's keys were read, each once.
    assert native_calls(cluster, "batch_get_into_multi_buffers") == 24 - len(owned)


def test_disk_owners_come_from_the_admin_servers_client_ids():
    from mooncake_span.store.segments import fetch_disk_owners

    detail = {
        "segments": [
            {"segment_name": "127.0.0.1:12001", "client_id": "1-1"},
            {"segment_name": "127.0.0.1:12002", "client_id": "2-2"},
        ]
    }
    disk = {"k0": "1-1", "k1": "2-2", "k2": "9-9"}  # k2: an owner with no segment listed

    def answer(path, query):
        if path == "/get_segments_detail":
            return detail
        keys = query["keys"][0].split(",")
        return {
            "success": True,
            "data": {
                k: {
                    "ok": True,
                    "local_disk_values": [{"client_id": disk[k]}] if k in disk else None,
                }
                for k in keys
            },
        }

    with json_http_server(answer) as url:
        owners = fetch_disk_owners(url, [f"k{i}" for i in range(40)])
    assert owners == {"k0": {"127.0.0.1:12001"}, "k1": {"127.0.0.1:12002"}, "k2": {"client:9-9"}}
    assert fetch_disk_owners("http://127.0.0.1:1", ["k0"]) is None
