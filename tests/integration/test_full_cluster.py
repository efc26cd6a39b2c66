"""The put cool-down on a genuinely full segment of a real master.

A 16 MiB storage node is filled with hard-pinned objects that are then leased
(a 10-minute lease), so nothing can be evicted: every further put is answered
``NO_AVAILABLE_HANDLE``. Native put calls are counted by a wrapper around the
real store; no timing is asserted (the bound on probes holds however slow the
loop runs).
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from mooncake_span.config import SpanOptions
from mooncake_span.mooncake_settings import load_mooncake_settings
from mooncake_span.ops.cluster import ClusterSpec, LocalCluster
from mooncake_span.span.plan import PlanBatch
from mooncake_span.store.client import MooncakeClient, load_native_binding
from mooncake_span.store.router import FIRST_PAUSE_S, FULL_SKIPPED_LABEL, STREAK_TO_PAUSE
from mooncake_span_tools.bench.pressure import counting_binding

pytestmark = pytest.mark.integration

SEGMENT_BYTES = 16 << 20  # the smallest segment Mooncake accepts
OBJECT_BYTES = 1 << 20
# Bound of the fill: more objects than the segment can hold.
MAX_FILL_OBJECTS = SEGMENT_BYTES // OBJECT_BYTES + 8
BATCH = 4
STORM_S = 0.5


@pytest.fixture(scope="module")
def full_cluster(tmp_path_factory):
    spec = ClusterSpec(
        storage_nodes=1,
        storage_node_segment_bytes=SEGMENT_BYTES,
        lease_ttl_ms=600_000,
        log_dir=tmp_path_factory.mktemp("full-cluster"),
    )
    with LocalCluster(spec) as cluster:
        yield cluster


@pytest.fixture
def make_client(full_cluster):
    clients = []
    source = np.random.default_rng(3).integers(0, 256, BATCH * OBJECT_BYTES, dtype=np.uint8)

    def make(cooldown_s: float):
        binding, made = counting_binding(load_native_binding())
        client = MooncakeClient(
            load_mooncake_settings(full_cluster.client_config()),
            SpanOptions(full_cooldown_s=cooldown_s, placement=False),
            binding,
        )
        client.connect()
        client.register_buffer(source.ctypes.data, source.nbytes)
        clients.append(client)
        return client, made[-1]

    yield make, source
    for client in clients:
        client.close()


def _plans(source: np.ndarray, count: int) -> PlanBatch:
    base = source.ctypes.data
    return PlanBatch(
        [[base + i * OBJECT_BYTES] for i in range(count)],
        [[OBJECT_BYTES]] * count,
        [OBJECT_BYTES] * count,
    )


def _fill(client: MooncakeClient, source: np.ndarray, prefix: str) -> list[str]:
    """Hard-pinned objects until the segment refuses one; then lease them all."""
    stored: list[str] = []
    for start in range(0, MAX_FILL_OBJECTS, BATCH):
        keys = [f"{prefix}-pinned-{start + i}" for i in range(BATCH)]
        ok = client.put(keys, _plans(source, BATCH), hard_pin=True)
        stored += [k for k, good in zip(keys, ok, strict=True) if good]
        if not all(ok):
            break
    assert client.exists(stored) == [True] * len(stored)  # leases every object
    return stored


def test_cooldown_kicks_in_on_a_full_segment_and_reads_still_work(make_client, key_namespace):
    make, source = make_client
    filler, _ = make(0)
    pinned = _fill(filler, source, key_namespace)
    assert pinned, "the segment took no object at all"

    cooling, counted = make(60.0)
    # Refusals in a row are sent and answered; then puts pause (10 ms, doubling).
    for round_ in range(STREAK_TO_PAUSE):
        keys = [f"{key_namespace}-new-{round_}-{i}" for i in range(BATCH)]
        assert cooling.put(keys, _plans(source, BATCH)) == [False] * BATCH
    assert (counted.put_calls, counted.put_objects) == (STREAK_TO_PAUSE, STREAK_TO_PAUSE * BATCH)
    assert counted.put_codes == {-200: STREAK_TO_PAUSE * BATCH}
    assert cooling.pressure.cooldowns_started == 1  # not .cooling: 10 ms may be over

    rounds = 0
    deadline = time.monotonic() + STORM_S
    while time.monotonic() < deadline:  # a backup every millisecond
        keys = [f"{key_namespace}-later-{rounds}-{i}" for i in range(BATCH)]
        assert cooling.put(keys, _plans(source, BATCH)) == [False] * BATCH
        rounds += 1
        time.sleep(0.001)
    # Probes after pauses of 10, 20, 40 ... ms: a handful in STORM_S, not one per backup.
    probes = counted.put_calls - STREAK_TO_PAUSE
    assert 1 <= probes <= 1 + math.ceil(math.log2(STORM_S / FIRST_PAUSE_S)) < rounds
    skipped = cooling.stats()["error_counts"][FULL_SKIPPED_LABEL]
    assert skipped == (rounds - probes) * BATCH

    # Hit queries and restores are unaffected: a pinned object reads back byte-exact.
    assert cooling.exists(pinned[:1]) == [True]
    target = np.zeros(OBJECT_BYTES, dtype=np.uint8)
    cooling.register_buffer(target.ctypes.data, target.nbytes)
    plan = PlanBatch([[target.ctypes.data]], [[OBJECT_BYTES]], [OBJECT_BYTES])
    assert cooling.get(pinned[:1], plan) == [True]
    index = int(pinned[0].rsplit("-", 1)[1]) % BATCH
    assert bytes(target) == bytes(source[index * OBJECT_BYTES : (index + 1) * OBJECT_BYTES])


def test_without_cooldown_every_put_reaches_the_full_segment(make_client, key_namespace):
    make, source = make_client
    filler, _ = make(0)
    _fill(filler, source, key_namespace)
    storming, counted = make(0)
    for round_ in range(4):
        keys = [f"{key_namespace}-storm-{round_}-{i}" for i in range(BATCH)]
        assert storming.put(keys, _plans(source, BATCH)) == [False] * BATCH
    assert (counted.put_calls, counted.put_objects) == (4, 4 * BATCH)
    assert counted.put_codes == {-200: 4 * BATCH}
    assert FULL_SKIPPED_LABEL not in storming.stats()["error_counts"]
