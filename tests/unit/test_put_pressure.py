"""The put cool-down (store/router.py): pure state on an injected clock, then the
client and the backend on the contract-checked fake.

The fake answers ``NO_AVAILABLE_HANDLE`` once its capacity is used up, as a
full Mooncake segment does (it never evicts: the tests free space with
``drop``); the clock is injected, so nothing sleeps.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from mooncake_span.config import load_span_options
from mooncake_span.errors import ConfigError, ErrorCode
from mooncake_span.span.plan import PlanBatch
from mooncake_span.store.arena import StagingArena
from mooncake_span.store.client import MooncakeClient
from mooncake_span.store.layout_guard import create_text, read_text
from mooncake_span.store.router import (
    COOLDOWN,
    FIRST_PAUSE_S,
    FULL_SKIPPED_LABEL,
    REFUSED,
    STORED,
    STREAK_TO_PAUSE,
    PutPressure,
)
from mooncake_span_tools.testing import pools as P
from mooncake_span_tools.testing.fake_store import FakeCluster
from tests.span_helpers import FAKE_CLIENT, FakeClock, fake_client, listening_port, slots_of

OBJECT_BYTES = 256
PUT = "batch_put_from_multi_buffers"
NO_SPACE = int(ErrorCode.NO_AVAILABLE_HANDLE)
MAX_PAUSE_S = 5.0

# ---- the pure state ------------------------------------------------------------------


def _refuse(pressure: PutPressure, times: int) -> None:
    for _ in range(times):
        pressure.record([NO_SPACE, NO_SPACE])


def test_one_or_two_refusals_pause_nothing_and_the_third_in_a_row_does():
    clock = FakeClock()
    pressure = PutPressure(MAX_PAUSE_S, now_s=clock)
    _refuse(pressure, STREAK_TO_PAUSE - 1)
    assert not pressure.cooling  # eviction runs within ~10 ms: the next put asks again
    _refuse(pressure, 1)
    assert pressure.cooling
    assert pressure.cooldowns_started == 1
    clock.advance(FIRST_PAUSE_S * 0.99)
    assert pressure.cooling
    clock.advance(FIRST_PAUSE_S * 0.02)
    assert not pressure.cooling  # the next put is the probe


def test_refused_probes_double_the_pause_up_to_its_bound():
    clock = FakeClock()
    pressure = PutPressure(0.05, now_s=clock)
    _refuse(pressure, STREAK_TO_PAUSE)
    for pause_s in (0.01, 0.02, 0.04, 0.05, 0.05):
        clock.advance(pause_s * 0.99)
        assert pressure.cooling
        clock.advance(pause_s * 0.02)
        assert not pressure.cooling
        _refuse(pressure, 1)  # the probe is refused too
    assert pressure.cooldowns_started == 6


def test_a_refusal_of_a_call_sent_before_the_pause_neither_extends_nor_doubles_it():
    clock = FakeClock()
    pressure = PutPressure(MAX_PAUSE_S, now_s=clock)
    _refuse(pressure, STREAK_TO_PAUSE)
    clock.advance(FIRST_PAUSE_S / 2)
    _refuse(pressure, 2)  # calls of other threads, already in flight
    clock.advance(FIRST_PAUSE_S / 2 + 1e-6)
    assert not pressure.cooling
    assert pressure.cooldowns_started == 1


def test_a_call_that_stores_anything_ends_the_pause_and_the_streak():
    clock = FakeClock()
    pressure = PutPressure(MAX_PAUSE_S, now_s=clock)
    _refuse(pressure, STREAK_TO_PAUSE + 3)
    assert pressure.cooling
    pressure.record([0, NO_SPACE])  # space ran out within the call, but it took one
    assert not pressure.cooling
    _refuse(pressure, STREAK_TO_PAUSE - 1)
    assert not pressure.cooling  # the streak started over
    _refuse(pressure, 1)
    clock.advance(FIRST_PAUSE_S + 1e-6)  # and the pause starts short again
    assert not pressure.cooling


def test_tenant_quota_counts_as_no_space_and_other_failures_do_not():
    pressure = PutPressure(MAX_PAUSE_S, now_s=FakeClock())
    for code in (ErrorCode.TRANSFER_FAIL, ErrorCode.RPC_FAIL, ErrorCode.INVALID_PARAMS):
        _refuse(pressure, 0)
        for _ in range(STREAK_TO_PAUSE):
            pressure.record([int(code)])
        assert not pressure.cooling
    for _ in range(STREAK_TO_PAUSE):
        pressure.record([int(ErrorCode.TENANT_QUOTA_EXCEEDED)])
    assert pressure.cooling


def test_zero_never_pauses_but_still_counts_refusals():
    pressure = PutPressure(0, now_s=FakeClock())
    _refuse(pressure, 10)
    assert not pressure.cooling
    assert pressure.skipped() == {REFUSED: 20}


def test_skips_are_counted_by_reason():
    pressure = PutPressure(MAX_PAUSE_S, now_s=FakeClock())
    pressure.record([0, NO_SPACE, NO_SPACE])
    pressure.count(STORED, 4)
    pressure.count(COOLDOWN, 3)
    assert pressure.skipped() == {REFUSED: 2, STORED: 4, COOLDOWN: 3}
    assert pressure.skipped_total == 9
    with pytest.raises(ValueError, match="unknown skip reason"):
        pressure.count("full", 1)


def test_a_cluster_that_stays_full_gets_a_bounded_number_of_puts():
    """Backups every millisecond for 10 s against a cluster that refuses all:
    a few refusals, then about one probe per max pause."""
    clock = FakeClock()
    pressure = PutPressure(1.0, now_s=clock)
    sent = 0
    for _ in range(10_000):
        if not pressure.cooling:
            sent += 1
            pressure.record([NO_SPACE])
        clock.advance(0.001)
    # 3 to start, 7 probes while the pause grows (10 ms .. 640 ms), then one per second.
    assert 3 + 7 <= sent <= 3 + 7 + 10
    without = PutPressure(0, now_s=clock)
    assert sum(1 for _ in range(10_000) if not without.cooling) == 10_000


def test_one_log_line_per_interval(caplog):
    clock = FakeClock()
    pressure = PutPressure(1.0, now_s=clock)
    with caplog.at_level(logging.WARNING, logger="mooncake_span.store.router"):
        for _ in range(5):
            _refuse(pressure, STREAK_TO_PAUSE)
            pressure.record([0])  # space came back
            clock.advance(2.0)
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


# ---- the client on the fake ------------------------------------------------------------


@pytest.fixture
def rig():
    """A client on a fake cluster holding 4 objects, with an injected clock."""
    clock = FakeClock()
    with listening_port() as master:
        cluster = FakeCluster(capacity_bytes=4 * OBJECT_BYTES)
        client = fake_client(
            master, cluster, clock=clock, placement=False, full_cooldown_s=MAX_PAUSE_S
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


def _fill_and_refuse(client: MooncakeClient, source: np.ndarray) -> None:
    """Fill the 4-object cluster, then ``STREAK_TO_PAUSE`` refused calls."""
    assert _put(client, source, 0, 4) == [True] * 4
    for i in range(STREAK_TO_PAUSE):
        assert _put(client, source, 10 + i, 1) == [False]


def test_a_refused_put_is_followed_by_one_that_is_sent(rig):
    client, cluster, _, source = rig
    assert _put(client, source, 0, 6) == [True] * 4 + [False] * 2
    assert not client.pressure.cooling
    assert cluster.drop("obj-0")  # eviction freed one object
    cluster.calls.clear()
    assert _put(client, source, 6, 1) == [True]
    assert _native_puts(cluster) == 1
    assert client.stats()["skipped_backups"] == {REFUSED: 2}


def test_puts_in_a_pause_are_skipped_and_counted(rig):
    client, cluster, _, source = rig
    _fill_and_refuse(client, source)
    assert client.pressure.cooling
    cluster.calls.clear()
    assert _put(client, source, 20, 3) == [False] * 3
    assert _put(client, source, 30, 2) == [False] * 2
    assert _native_puts(cluster) == 0
    stats = client.stats()
    assert stats["error_counts"][FULL_SKIPPED_LABEL] == 5
    assert stats["error_counts"]["NO_AVAILABLE_HANDLE"] == STREAK_TO_PAUSE  # what Mooncake said
    assert stats["skipped_backups"] == {REFUSED: STREAK_TO_PAUSE, COOLDOWN: 5}


def test_gets_and_existence_queries_are_unaffected(rig):
    client, _, _, source = rig
    _fill_and_refuse(client, source)
    assert client.pressure.cooling
    keys = [f"obj-{i}" for i in range(6)]
    assert client.exists(keys) == [True] * 4 + [False] * 2
    target = np.zeros_like(source)
    client.register_buffer(target.ctypes.data, target.nbytes)
    assert client.get(keys[:4], _plans(target, 0, 4)) == [True] * 4
    n = 4 * OBJECT_BYTES
    assert bytes(target[:n]) == bytes(source[:n])


def test_the_pause_ends_with_its_time_and_the_next_put_probes(rig):
    client, cluster, clock, source = rig
    _fill_and_refuse(client, source)
    clock.advance(FIRST_PAUSE_S + 1e-6)
    assert not client.pressure.cooling
    cluster.calls.clear()
    # Still full: the probe is sent, refused, and the pause doubles.
    assert _put(client, source, 20, 2) == [False, False]
    assert _native_puts(cluster) == 1
    clock.advance(FIRST_PAUSE_S + 1e-6)
    assert client.pressure.cooling
    # Space came back (eviction); the probe after the pause is stored.
    assert cluster.drop("obj-0") and cluster.drop("obj-1")
    clock.advance(FIRST_PAUSE_S)
    assert _put(client, source, 20, 2) == [True, True]
    assert not client.pressure.cooling


def test_touched_objects_fill_the_last_query_and_never_add_a_call(rig):
    client, cluster, _, source = rig
    assert _put(client, source, 0, 3) == [True] * 3
    cluster.calls.clear()
    # The touched objects' answers come apart from the keys' ones.
    answer = client.exists_and_touch(["obj-1", "obj-5"], ["obj-0", "obj-2", "nope"])
    assert answer.found + answer.touched_head == [True, False, True, True, False]
    assert cluster.calls == [("batch_is_exist", 5)]
    cluster.calls.clear()
    many = [f"absent-{i}" for i in range(4094)]
    answer = client.exists_and_touch(many, ["obj-0", "obj-1", "obj-2"])
    assert answer.found + answer.touched_head == [False] * 4094 + [True, True]  # two of three fit
    assert len(answer.found) == 4094
    assert cluster.calls == [("batch_is_exist", 4096)]


def test_metadata_puts_are_not_held_back(rig):
    client, _, _, source = rig
    assert _put(client, source, 0, 3) == [True] * 3
    _refuse(client.pressure, STREAK_TO_PAUSE)
    assert client.pressure.cooling
    arena = StagingArena(4096, client.register_buffer, 1.0)
    assert create_text(client, arena, "guard-record", "geometry")
    assert read_text(client, arena, "guard-record") == "geometry"


# ---- the backend on the fake --------------------------------------------------------------

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


def test_stored_keys_read_true_in_a_pause_and_new_ones_are_skipped(backend, monkeypatch):
    import prometheus_client as prom

    from mooncake_span import metrics as M
    from mooncake_span.sglang_backend.recording import CallObserver

    store, cluster = backend
    # A frozen clock: on the real one the 10 ms first pause could end between two
    # calls on a loaded box (seen under the parallel suite), letting a put through.
    monkeypatch.setattr(store.client.pressure, "_now_s", FakeClock())
    registry = prom.CollectorRegistry()
    store.recorder.observer = CallObserver(store.client, M.SpanMetrics(registry))
    slots = slots_of([0, 1, 2, 3, 4, 5], PAGE)
    assert store.batch_set_v1(["a", "b", "c"], slots) == [True, True, False]
    for _ in range(STREAK_TO_PAUSE):
        assert store.batch_set_v1(["c"], slots_of([4, 5], PAGE)) == [False]
    assert store.client.pressure.cooling
    cluster.calls.clear()
    # A backup of stored keys and new ones: the stored ones read True, the new ones
    # are skipped without a put.
    assert store.batch_set_v1(["a", "b", "d"], slots) == [True, True, False]
    assert [op for op, _ in cluster.calls] == ["batch_is_exist"]
    # Hit queries and restores still work.
    assert store.batch_exists(["a", "b", "c"]) == 2
    assert store.batch_get_v1(["a", "b"], slots_of([10, 11, 12, 13], PAGE)) == [True, True]
    assert store.get_stats().error_counts[FULL_SKIPPED_LABEL] == 1
    family = "mooncake_span_backup_objects_skipped_total"
    assert registry.get_sample_value(family, {"reason": "cooldown"}) == 1
    assert registry.get_sample_value(family, {"reason": "stored"}) == 2
    assert registry.get_sample_value(family, {"reason": "refused"}) == 1 + STREAK_TO_PAUSE
