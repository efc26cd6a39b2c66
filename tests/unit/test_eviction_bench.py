"""The eviction bench's accounting (bench/eviction.py), on the contract-checked fake.

The real run needs a master and minutes; here a few conversations go into a
fake store, objects are dropped by hand, and the figures the bench reports
(stored, reachable, dead bytes, hit tokens, wrong bytes, RPC ratios) must
follow exactly, including a restore that reads other bytes.
"""

from __future__ import annotations

import pytest

from mooncake_span_tools.bench import eviction as E
from mooncake_span_tools.bench.shared_native import RecordingNative
from mooncake_span_tools.testing import pools as P
from mooncake_span_tools.testing.fake_store import FakeCluster, FakeStore
from tests.span_helpers import FAKE_CLIENT

CONFIG = E.EvictionConfig(
    conversations=4, keys_per_conversation=8, turns=2, returning=2, round_s=0.0, layers=1
)


@pytest.fixture
def rig(make_backend):
    cluster = FakeCluster()
    natives: list[RecordingNative] = []

    def native(c):
        natives.append(RecordingNative(FakeStore(c), shared=False))
        return natives[-1]

    pools = E._pools(CONFIG)
    host = {P.PoolName.KV: pools.kv, P.PoolName.INDEXER: pools.indexer}
    store = make_backend(
        {**FAKE_CLIENT, "span_layout_guard": "off"}, host, cluster=cluster, native=native
    )
    keys = [E.conversation_keys(CONFIG.seed, c, CONFIG.keys_per_conversation) for c in range(4)]
    return E.Rig("span", store, natives[-1], pools, CONFIG, keys, E.key_bytes(CONFIG)), cluster


def _objects(rig, conversation, index):
    store, key = rig.store, rig.keys[conversation][index]
    return [
        *store.pools["kv"].object_keys(store.key_schema, [key]),
        *store.pools["indexer"].object_keys(store.key_schema, [key]),
    ]


def test_a_full_run_stores_everything_and_reaches_it_all(rig):
    rig, _ = rig
    row = E.drive(rig, sleep=lambda s: None)
    assert row["accepted_keys"] == 32 and row["reread_wrong_keys"] == 0
    order = row.pop("order")
    users = E.returning_users(rig, order)
    assert users["recent_hit_tokens"] == users["old_hit_tokens"] == 2 * 8 * E.PAGE_TOKENS
    stays = E.what_stays(rig)
    assert (stays["stored_keys"], stays["reachable_keys"], stays["dead_keys"]) == (32, 32, 0)
    assert stays["reachable_share"] == 1.0 and stays["dead_bytes"] == 0


def test_a_hole_makes_the_keys_after_it_dead_and_their_bytes_count(rig):
    rig, cluster = rig
    E.drive(rig, sleep=lambda s: None)
    assert all(cluster.drop(o) for o in _objects(rig, 0, 3))
    assert cluster.drop(_objects(rig, 1, 6)[1])  # half a key: its other object is dead bytes
    stays = E.what_stays(rig)
    assert stays["stored_keys"] == 30
    assert stays["reachable_keys"] == 3 + 6 + 8 + 8
    assert stays["dead_keys"] == 4 + 1  # conversation 0 past the hole, 1's last key
    kv_bytes = rig.native.stored[_objects(rig, 1, 6)[0]]
    assert stays["dead_bytes"] == 4 * rig.key_bytes + kv_bytes + rig.key_bytes
    assert E.read_back(rig, 0, 8) == (3, 0)


def test_a_restore_with_other_bytes_is_counted_wrong(rig):
    rig, cluster = rig
    E.drive(rig, sleep=lambda s: None)
    (kv_object, _) = _objects(rig, 2, 1)
    cluster.objects[kv_object] = bytes(len(cluster.objects[kv_object]))  # zeroed in place
    assert E.read_back(rig, 2, 8) == (1, 1)


def test_ratios_and_summary():
    row = {
        "contender": "span",
        "accepted_keys": 500,
        "master_requests": dict.fromkeys(E.DATA_REQUESTS, 0) | {"batch_exist_key": 320},
        "wrong_keys": 0,
        "reread_wrong_keys": 0,
    }
    done = E.finish_row(dict(row), CONFIG)
    assert done["master_rpcs"] == 320
    assert done["rpcs_per_1k_backed_up_tokens"] == 10.0  # 320 per 32,000 tokens
    assert done["rpcs_per_1k_offered_tokens"] == round(1000 * 320 / (32 * 64), 2)
    summary = E.summarize([{**done, "reachable_share": 0.9}, {**done, "reachable_share": 0.7}])
    assert summary["span"]["reachable_share"] == 0.8
    assert summary["span"]["reachable_share_range"] == [0.7, 0.9]


def test_config_is_validated():
    with pytest.raises(ValueError, match="multiple of turns"):
        E.EvictionConfig(keys_per_conversation=10, turns=4)
    with pytest.raises(ValueError, match="unknown contender"):
        E.EvictionConfig(contenders=("nope",))
