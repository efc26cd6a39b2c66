"""Eviction on a real master with a small segment: the put cool-down and the chain order.

One master and a 16 MiB storage node with a 500 ms lease, shared by the
module (each test starts from an empty store). What Mooncake does here:
eviction frees the objects with the oldest lease stamp first (a put stamps an
object when it lands, a lookup stamps what it finds with now + the lease),
never a leased or hard-pinned one, and a put it cannot place is answered
``NO_AVAILABLE_HANDLE``.

* A put right after an eviction is sent and stored: one refusal pauses nothing.
* A backup during a pause still answers True for keys already stored.
* A conversation backed up turn by turn with its prefix keys loses its last turn
  before its prefix; without the prefix's lease renewal (the control) it loses its
  first turn first, and every key it keeps is dead.

Nothing is timed; every wait is bounded and polls the master.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest

from mooncake_span.config import SpanOptions
from mooncake_span.mooncake_settings import load_mooncake_settings
from mooncake_span.ops import master_http
from mooncake_span.ops.cluster import ClusterSpec, LocalCluster
from mooncake_span.span.plan import PlanBatch
from mooncake_span.store import router
from mooncake_span.store.client import MooncakeClient, load_native_binding
from mooncake_span.store.router import COOLDOWN, STREAK_TO_PAUSE
from mooncake_span_tools.bench.pressure import counting_binding
from mooncake_span_tools.testing import pools as P
from tests.span_helpers import make_storage_config, register_pools, slots_of

pytestmark = pytest.mark.integration

SEGMENT_BYTES = 16 << 20  # the smallest segment Mooncake accepts
LEASE_MS = 500
OBJECT_BYTES = 1 << 20
PAGE = 64
TURN_KEYS = 4
TURNS = 3
WAIT_S = 10.0  # bound of every poll
FLOOD_BYTES = 256 << 10
# Mooncake's eviction pass frees 5 % of the objects: with some 80 objects here,
# about four, so eight spacers between two turns outlast two passes.
SPACERS_PER_TURN = 8
PAUSE_S = 60.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    spec = ClusterSpec(
        storage_nodes=1,
        storage_node_segment_bytes=SEGMENT_BYTES,
        lease_ttl_ms=LEASE_MS,
        log_dir=tmp_path_factory.mktemp("eviction-order"),
    )
    with LocalCluster(spec) as started:
        yield started


@pytest.fixture
def client(cluster):
    """A counted MooncakeClient on an emptied store, with 4 MiB of source bytes."""
    binding, made = counting_binding(load_native_binding())
    made_client = MooncakeClient(
        load_mooncake_settings(cluster.client_config()),
        SpanOptions(placement=False),
        binding,
    )
    made_client.connect()
    made_client.remove_all()
    source = np.random.default_rng(5).integers(0, 256, 4 * OBJECT_BYTES, dtype=np.uint8)
    made_client.register_buffer(source.ctypes.data, source.nbytes)
    yield made_client, made[-1], source
    made_client.remove_all()
    made_client.close()


def _plans(source: np.ndarray, count: int, object_bytes: int = OBJECT_BYTES) -> PlanBatch:
    base = source.ctypes.data
    return PlanBatch(
        [[base + i * object_bytes] for i in range(count)],
        [[object_bytes]] * count,
        [object_bytes] * count,
    )


def _evicted_bytes(cluster: LocalCluster) -> float:
    for name, _, value in master_http.master_metrics(cluster.metrics_url, 5.0):
        if name == "master_evicted_size_bytes":
            return value
    raise AssertionError("the master reports no master_evicted_size_bytes")


def test_a_put_right_after_an_eviction_is_sent_and_stored(cluster, client):
    mc, counted, source = client
    # Fill the segment and lease what it holds, until a put is refused.
    stored: list[str] = []
    refused = None
    for i in range(2 * SEGMENT_BYTES // OBJECT_BYTES):
        key = f"fill-{i}"
        if mc.put([key], _plans(source, 1)) == [True]:
            stored.append(key)
            mc.exists(stored)  # every object stays leased: nothing can be evicted
            continue
        refused = key
        break
    assert refused is not None, "the segment never refused a put"
    assert not mc.pressure.cooling  # one refusal pauses nothing
    evicted = _evicted_bytes(cluster)
    deadline = time.monotonic() + WAIT_S
    while _evicted_bytes(cluster) == evicted:  # the leases end, eviction frees space
        assert time.monotonic() < deadline, "Mooncake never evicted"
        time.sleep(0.02)
    calls = counted.put_calls
    assert mc.put(["after-eviction"], _plans(source, 1)) == [True]
    assert counted.put_calls == calls + 1
    assert mc.stats()["skipped_backups"].get(COOLDOWN, 0) == 0


def _pin(native, keys: list[str], object_bytes: int) -> int:
    """Hard-pinned objects under ``keys`` until the segment refuses one; how many."""
    from mooncake.store import ReplicateConfig

    buffer = ctypes.create_string_buffer(object_bytes)
    native.register_buffer(ctypes.addressof(buffer), object_bytes)
    config = ReplicateConfig()
    config.with_hard_pin = True
    for n, key in enumerate(keys):
        if native.batch_put_from([key], [ctypes.addressof(buffer)], [object_bytes], config) != [0]:
            return n
    return len(keys)


@pytest.fixture
def backend(cluster):
    """``make(**extra)``: MooncakeSpanStores (MLA pools, K=1) on the emptied store,
    each its own namespace; closed after the test."""
    binding, made = counting_binding(load_native_binding())
    stores = []

    def make(model: str, **extra):
        kv = P.build_mla_host("page_first", layers=1, host_pages=2 * TURNS * TURN_KEYS)
        config = {**cluster.client_config(), "storage_page_size": PAGE}
        config.update(span_layout_guard="off", **extra)
        from mooncake_span.sglang_backend import MooncakeSpanStore

        store = MooncakeSpanStore(
            make_storage_config(config, model_name=model), {}, binding=binding
        )
        stores.append(store)
        register_pools(store, {P.PoolName.KV: kv})
        return store, made[-1]

    yield make
    if stores:
        stores[0].client.remove_all()
    for store in stores:
        store.close()


def test_stored_keys_read_true_during_a_pause(backend, monkeypatch):
    # A first pause of a minute, not 10 ms: a loaded box may take longer than 10 ms
    # between the refusal that starts the pause and the backup made during it.
    monkeypatch.setattr(router, "FIRST_PAUSE_S", PAUSE_S)
    store, counted = backend("evict-pause", span_full_cooldown_s=PAUSE_S)
    store.client.remove_all()
    stored = ["kept-a", "kept-b"]
    objects = store.pools["kv"].object_keys(store.key_schema, stored)
    key_bytes = store.registration.span_bytes
    # The two keys' objects, then the rest of the segment, hard-pinned: nothing
    # can be evicted, every new backup is refused.
    assert _pin(counted, objects, key_bytes) == 2
    filler = [f"pinned-{i}" for i in range(SEGMENT_BYTES // key_bytes + 8)]
    assert 0 < _pin(counted, filler, key_bytes) < len(filler)
    for i in range(STREAK_TO_PAUSE):
        assert store.batch_set_v1([f"refused-{i}"], slots_of([0], PAGE)) == [False]
    assert store.client.pressure.cooling
    calls = counted.put_calls
    flags = store.batch_set_v1([*stored, "new"], slots_of([0, 1, 2], PAGE))
    assert flags == [True, True, False]
    assert counted.put_calls == calls  # the new key was skipped, not asked
    assert counted.exist_calls[-1][:2] == objects  # the stored keys were asked
    assert store.client.stats()["skipped_backups"][COOLDOWN] == 1


def _chain_flags(cluster: LocalCluster, objects: list[str]) -> list[bool]:
    """Which of ``objects`` the master lists, without leasing them (admin HTTP)."""
    listed = set(master_http.iter_lines(cluster.metrics_url + "/get_all_keys", 5.0))
    return [o in listed for o in objects]


def _back_up(store, chain: list[str], turn: int) -> None:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    rows = list(range(turn * TURN_KEYS, (turn + 1) * TURN_KEYS))
    extra = HiCacheStorageExtraInfo(prefix_keys=chain[: rows[0]])
    keys = chain[rows[0] : rows[-1] + 1]
    assert store.batch_set_v1(keys, slots_of(rows, PAGE), extra) == [True] * len(keys)


def test_a_chain_loses_its_last_turn_before_its_prefix(cluster, backend):
    renewing, counted = backend("evict-chain")
    control, _ = backend("evict-control", span_refresh_prefix=False, span_skip_unreachable=False)
    renewing.client.remove_all()
    chains = {
        s: [f"{s.key_schema.prefix}-k{i}" for i in range(TURNS * TURN_KEYS)]
        for s in (renewing, control)
    }
    buffer = ctypes.create_string_buffer(FLOOD_BYTES)
    counted.register_buffer(ctypes.addressof(buffer), FLOOD_BYTES)
    for turn in range(TURNS):  # the two conversations take turns
        for store, chain in chains.items():
            _back_up(store, chain, turn)
            time.sleep(0.01)
        # Unleased objects stamped between the control's turns: one eviction pass
        # frees a share of all objects, so without them a pass (or two passes
        # between two looks on a busy box) could take the control's first and
        # later turns together, and the look below would never see the first
        # turn gone while later ones stay.
        for j in range(SPACERS_PER_TURN if turn < TURNS - 1 else 0):
            assert (
                counted.put_from(f"spacer-{turn}-{j}", ctypes.addressof(buffer), FLOOD_BYTES) == 0
            )
    objects = {s: s.pools["kv"].object_keys(s.key_schema, c) for s, c in chains.items()}
    time.sleep(2 * LEASE_MS / 1000)  # every lease has ended
    # Flood with new objects (stamped later than both chains) until the renewing
    # chain is gone, looking after each put without leasing anything.
    deadline = time.monotonic() + WAIT_S
    seen: list[tuple[list[bool], list[bool]]] = []
    for i in range(4 * SEGMENT_BYTES // FLOOD_BYTES):
        counted.put_from(f"flood-{i}", ctypes.addressof(buffer), FLOOD_BYTES)
        time.sleep(0.005)
        seen.append(
            (_chain_flags(cluster, objects[renewing]), _chain_flags(cluster, objects[control]))
        )
        if not any(seen[-1][0]) or time.monotonic() > deadline:
            break
    last = TURN_KEYS * (TURNS - 1)
    assert not any(seen[-1][0]), "the flood never evicted the renewing chain"
    # The appended tail always went first: while a prefix key is missing, so is
    # every key of the last turn.
    for kept, _ in seen:
        assert all(kept[:last]) or not any(kept[last:]), kept
    # The control lost its first turn while it still held later keys: dead bytes
    # a hit query from the chain's root never reaches.
    assert any(not any(other[:TURN_KEYS]) and any(other[TURN_KEYS:]) for _, other in seen), seen


def test_inspect_estimates_the_reachable_share_from_chain_records(cluster, backend):
    from mooncake_span.ops.inspect_cmd import collect
    from mooncake_span.store.layout_guard import read_text

    store, _ = backend("evict-inspect", span_chain_sample_every=1)
    store.client.remove_all()
    chains = [[f"c{c}-k{i}" for i in range(2 * TURN_KEYS)] for c in range(4)]
    for chain in chains:
        for turn in range(2):
            _back_up(store, chain, turn)
    # A key evicted from the middle of the first chain: 7 of its keys stay, 2 reachable.
    (hole,) = store.pools["kv"].object_keys(store.key_schema, [chains[0][2]])
    assert store.client.remove([hole]) == 1

    def read(keys):
        return {k: read_text(store.client, store.stager.arena, k) for k in keys}

    doc = collect(cluster.metrics_url, read_records=read, chain_sample=8)
    (ns,) = [n for n in doc["namespaces"] if n["name"] == store.key_schema.prefix]
    assert ns["reachable"] == {
        "chain_records": 4,
        "chains_sampled": 4,
        "stored_keys": 31,
        "reachable_keys": 26,
        "share": round(26 / 31, 4),
    }
