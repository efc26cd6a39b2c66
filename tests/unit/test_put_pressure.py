"""The full-cluster put cool-down (store/put_cooldown.py), on the contract-checked fake.

The fake answers ``NO_AVAILABLE_HANDLE`` once its capacity is used up, as a
full Mooncake segment does; the clock is injected, so nothing sleeps.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from mooncake_span.config import load_span_options
from mooncake_span.errors import ConfigError, ErrorCode
from mooncake_span.span.plan import PlanBatch
from mooncake_span.store.arena import StagingArena, create_blob, read_blob
from mooncake_span.store.client import MooncakeClient
from mooncake_span.store.put_cooldown import FULL_SKIPPED_LABEL, PutPressure
from mooncake_span.testing import pools as P
from mooncake_span.testing.fake_store import FakeCluster
from tests.span_helpers import FAKE_CLIENT, FakeClock, fake_client, listening_port, slots_of

OBJECT_BYTES = 256
PUT = "batch_put_from_multi_buffers"
NO_SPACE = int(ErrorCode.NO_AVAILABLE_HANDLE)
COOLDOWN_S = 5.0


@pytest.fixture
def rig():
    """A client on a fake cluster holding 4 objects, with an injected clock."""
    clock = FakeClock()
    with listening_port() as master:
        cluster = FakeCluster(capacity_bytes=4 * OBJECT_BYTES)
        client = fake_client(
            master, cluster, clock=clock, placement=False, full_cooldown_s=COOLDOWN_S
        )
        source = np.random.default_rng(7).integers(0, 256, 64 * OBJECT_BYTES, dtype=np.uint8)
        client.register_buffer(source.ctypes.data, source.nbytes)
        yield client, cluster, clock, source
        client.close()


def _plans(array: np.ndarray, first: int, count: int) -> PlanBatch:
    base = array.ctypes.data + first * OBJECT_BYTES
    ptrs = [[base + i * OBJECT_BYTES] for i in range(count)]
    return PlanBatch(ptrs, [[OBJECT_BYTES]] * count, [OBJECT_BYTES] * count)


def _put(client: MooncakeClient, source: np.ndarray, first: int, count: int) -> list[bool]:
    keys = [f"obj-{i}" for i in range(first, first + count)]
    return client.put(keys, _plans(source, first, count))


def _native_puts(cluster: FakeCluster) -> int:
    return sum(1 for op, _ in cluster.calls if op == PUT)


def test_partial_no_space_in_one_call_starts_the_cooldown(rig):
    client, cluster, _, source = rig
    assert _put(client, source, 0, 6) == [True] * 4 + [False] * 2
    assert client.pressure.cooling
    assert client.pressure.cooldowns_started == 1
    assert client.stats()["error_counts"]["NO_AVAILABLE_HANDLE"] == 2


def test_puts_in_the_cooldown_are_skipped_and_counted(rig):
    client, cluster, _, source = rig
    _put(client, source, 0, 6)
    cluster.calls.clear()
    assert _put(client, source, 10, 3) == [False] * 3
    assert _put(client, source, 20, 2) == [False] * 2
    assert _native_puts(cluster) == 0
    counts = client.stats()["error_counts"]
    assert counts[FULL_SKIPPED_LABEL] == 5
    assert counts["NO_AVAILABLE_HANDLE"] == 2  # only what Mooncake answered


def test_gets_and_existence_queries_are_unaffected(rig):
    client, cluster, _, source = rig
    _put(client, source, 0, 6)
    assert client.pressure.cooling
    keys = [f"obj-{i}" for i in range(6)]
    assert client.exists(keys) == [True] * 4 + [False] * 2
    target = np.zeros_like(source)
    client.register_buffer(target.ctypes.data, target.nbytes)
    assert client.get(keys[:4], _plans(target, 0, 4)) == [True] * 4
    n = 4 * OBJECT_BYTES
    assert bytes(target[:n]) == bytes(source[:n])


def test_the_cooldown_ends_with_its_time_and_the_next_put_probes(rig):
    client, cluster, clock, source = rig
    _put(client, source, 0, 6)
    clock.now_s += COOLDOWN_S - 0.01
    assert client.pressure.cooling
    clock.now_s += 0.02
    assert not client.pressure.cooling
    cluster.calls.clear()
    # Still full: the probe is sent, refused, and starts the next cool-down.
    assert _put(client, source, 10, 2) == [False, False]
    assert _native_puts(cluster) == 1
    assert client.pressure.cooling
    assert client.pressure.cooldowns_started == 2
    # Space came back (eviction); after the next cool-down puts succeed again.
    assert cluster.drop("obj-0") and cluster.drop("obj-1")
    clock.now_s += COOLDOWN_S
    assert _put(client, source, 10, 2) == [True, True]
    assert not client.pressure.cooling


def test_a_success_of_a_put_in_flight_ends_the_cooldown(rig):
    client, _, clock, _ = rig
    client.pressure.record([NO_SPACE, NO_SPACE])
    assert client.pressure.cooling
    client.pressure.record([0, 0])  # a put sent before the cool-down began
    assert not client.pressure.cooling
    assert client.pressure.cooldowns_started == 1


def test_each_refusal_restarts_the_cooldown_bounded_by_its_duration():
    clock = FakeClock()
    pressure = PutPressure(2.0, now_s=clock)
    pressure.record([NO_SPACE])
    clock.now_s += 1.5
    pressure.record([0, NO_SPACE])  # a success beside a refusal: still full
    clock.now_s += 1.9
    assert pressure.cooling
    clock.now_s += 0.2
    assert not pressure.cooling
    assert pressure.cooldowns_started == 1


def test_tenant_quota_counts_as_no_space_and_other_failures_do_not():
    clock = FakeClock()
    pressure = PutPressure(2.0, now_s=clock)
    for code in (ErrorCode.TRANSFER_FAIL, ErrorCode.RPC_FAIL, ErrorCode.INVALID_PARAMS):
        pressure.record([int(code)])
        assert not pressure.cooling
    pressure.record([int(ErrorCode.TENANT_QUOTA_EXCEEDED)])
    assert pressure.cooling


def test_zero_disables_the_cooldown(rig):
    with listening_port() as master:
        cluster = FakeCluster(capacity_bytes=2 * OBJECT_BYTES)
        client = fake_client(master, cluster, placement=False, full_cooldown_s=0)
        try:
            source = np.arange(8 * OBJECT_BYTES, dtype=np.uint8)
            client.register_buffer(source.ctypes.data, source.nbytes)
            assert _put(client, source, 0, 3) == [True, True, False]
            assert _put(client, source, 3, 3) == [False] * 3
            assert _native_puts(cluster) == 2
            assert not client.pressure.cooling
        finally:
            client.close()


def test_metadata_puts_are_not_held_back(rig):
    client, cluster, _, source = rig
    _put(client, source, 0, 3)
    client.pressure.record([NO_SPACE])
    arena = StagingArena(4096, client.register_buffer, 1.0)
    assert create_blob(client, arena, "guard-record", b"geometry")
    assert read_blob(client, arena, "guard-record") == b"geometry"


def test_one_log_line_per_interval(rig, caplog):
    clock = FakeClock()
    pressure = PutPressure(1.0, now_s=clock)
    with caplog.at_level(logging.WARNING, logger="mooncake_span.store.put_cooldown"):
        for _ in range(5):
            pressure.record([NO_SPACE])
            clock.now_s += 2.0  # each refusal after the last cool-down ended
    lines = [r for r in caplog.records if "cluster full" in r.getMessage()]
    assert len(lines) == 1
    assert pressure.cooldowns_started == 5


def test_option_sources_and_validation():
    assert load_span_options({}, environ={}).full_cooldown_s == 1.0
    env = {"MOONCAKE_SPAN_FULL_COOLDOWN_S": "0.25"}
    assert load_span_options({}, environ=env).full_cooldown_s == 0.25
    assert load_span_options({"span_full_cooldown_s": 0}, environ=env).full_cooldown_s == 0
    with pytest.raises(ConfigError, match="span_full_cooldown_s"):
        load_span_options({"span_full_cooldown_s": -1}, environ={})


PAGE = 64


@pytest.fixture
def backend(make_backend):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    kv = P.build_mla_host("page_first", layers=1, host_pages=16)
    key_bytes = 2 * kv.get_size_per_token() * PAGE
    # Room for two keys besides the layout-guard record.
    cluster = FakeCluster(capacity_bytes=2 * key_bytes + 4096)
    config = {**FAKE_CLIENT, "storage_page_size": 2 * PAGE, "span_full_cooldown_s": 30}
    store = make_backend(config, {PoolName.KV: kv}, cluster=cluster)
    return store, cluster


def test_backend_backups_skip_the_existence_query_and_the_put_in_a_cooldown(backend):
    import prometheus_client as prom

    from mooncake_span import metrics as M
    from mooncake_span.sglang_backend.observability import CallObserver

    store, cluster = backend
    registry = prom.CollectorRegistry()
    store.observer = CallObserver(store.client, M.SpanMetrics(registry))
    assert store.batch_set_v1(["a", "b", "c"], slots_of(list(range(6)), PAGE)) == [
        True,
        True,
        False,
    ]
    cluster.calls.clear()
    assert store.batch_set_v1(["d", "e"], slots_of([6, 7, 8, 9], PAGE)) == [False, False]
    assert cluster.calls == []  # neither batch_is_exist nor a put
    # Hit queries and restores still work.
    assert store.batch_exists(["a", "b", "c"]) == 2
    assert store.batch_get_v1(["a", "b"], slots_of([10, 11, 12, 13], PAGE)) == [True, True]
    assert store.get_stats().error_counts[FULL_SKIPPED_LABEL] == 2
    family = "mooncake_span_failed_objects_total"
    assert registry.get_sample_value(family, {"code": FULL_SKIPPED_LABEL}) == 2
    assert registry.get_sample_value(family, {"code": "NO_AVAILABLE_HANDLE"}) == 1
