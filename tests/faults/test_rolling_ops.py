"""Rolling operations under traffic: node restarts and scale-out on a real cluster.

A traffic thread runs backup + restore rounds (4 fresh storage keys per round,
MLA KV + DSA indexer, K=4, content oracle) while the main thread restarts the
storage nodes one at a time (SIGKILL, then a fresh process: a new segment), or
adds a node. Per round the figures record how many fresh keys were written and
restored byte-exact, so the hit rate can be followed across each operation.
"""

from __future__ import annotations

import collections
import json
import signal
import threading
import time
import urllib.request
import uuid
from typing import Any

import pytest

from mooncake_span.store.segments import fetch_segments
from tests.faults.conftest import CallLog, SpanOracle, poll

pytestmark = pytest.mark.slow

KEYS_PER_ROUND = 4
SEGMENT_BYTES = 64 << 20
SCALE_OUT_SEGMENT_BYTES = 512 << 20
CALL_BOUND_S = 5.0
SETTLE_S = 4.0


class Traffic:
    """Backup + restore rounds in a thread; per round (t, written, restored)."""

    def __init__(self, oracle: SpanOracle) -> None:
        self.oracle = oracle
        self.rounds: list[tuple[float, int, int]] = []
        self.placed: list[str] = []  # fresh KV objects, for the placement check
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._n = 0

    def start(self) -> Traffic:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                self._n += 1
                keys = [f"r{self._n}-{i}-{uuid.uuid4().hex[:8]}" for i in range(KEYS_PER_ROUND)]
                written = self.oracle.write(keys, seed=self._n)
                restored = self.oracle.read(keys, single=False)
                self.rounds.append((time.monotonic(), sum(written), sum(restored)))
                self.placed += [k for k, ok in zip(keys, written, strict=True) if ok]
        except BaseException as exc:  # surfaced by the test
            self.errors.append(exc)

    def finish(self) -> None:
        self.stop.set()
        self._thread.join(timeout=60)
        assert not self._thread.is_alive(), "traffic thread did not stop"
        assert self.errors == [], self.errors

    def window(self, start_s: float, end_s: float) -> dict[str, Any]:
        rows = [r for r in self.rounds if start_s <= r[0] < end_s]
        written = sum(r[1] for r in rows)
        return {
            "rounds": len(rows),
            "keys_written": written,
            "keys_restored": sum(r[2] for r in rows),
            "restored_of_attempted": round(
                sum(r[2] for r in rows) / max(1, KEYS_PER_ROUND * len(rows)), 3
            ),
        }

    def full_round_after(self, start_s: float) -> float | None:
        for t, written, restored in self.rounds:
            if t > start_s and written == restored == KEYS_PER_ROUND:
                return t - start_s
        return None


def _node_segment(cluster: Any, i: int) -> str:
    text = (cluster.log_dir / f"node{i}.log").read_text(errors="replace")
    return (
        [line for line in text.splitlines() if line.startswith("READY ")][-1]
        .split("segment=")[1]
        .split()[0]
    )


def _wait_listed(cluster: Any, segment: str, present: bool) -> None:
    poll(
        lambda: (segment in (fetch_segments(cluster.metrics_url) or [])) == present,
        30,
        what=f"segment {segment} {'listed' if present else 'dropped'}",
    )


def _traffic_oracle(cluster: Any, oracle_factory: Any, log: CallLog, name: str) -> SpanOracle:
    return oracle_factory(
        cluster,
        model_name=f"{name}-{uuid.uuid4().hex[:8]}",
        log=log,
        host_keys=8,
        span_master_admin_url=cluster.metrics_url,
        span_segment_refresh_s=1.0,
    )


def test_rolling_restart_of_three_nodes(fault_cluster, oracle_factory, figures):
    cluster = fault_cluster(storage_nodes=3, storage_node_segment_bytes=SEGMENT_BYTES)
    log = CallLog()
    oracle = _traffic_oracle(cluster, oracle_factory, log, "roll")
    traffic = Traffic(oracle).start()
    phases = []
    try:
        time.sleep(SETTLE_S)
        for i in range(3):
            before = time.monotonic()
            old = _node_segment(cluster, i)
            cluster.kill_storage_node(i, signal.SIGKILL)
            killed = time.monotonic()
            cluster.restart_storage_node(i)
            restarted = time.monotonic()
            new = _node_segment(cluster, i)
            time.sleep(SETTLE_S)
            phases.append(
                {
                    "node": i,
                    "old_segment": old,
                    "new_segment": new,
                    "before": traffic.window(before - SETTLE_S, killed),
                    "down_and_restart": traffic.window(killed, restarted),
                    "after": traffic.window(restarted, time.monotonic()),
                    "restart_s": round(restarted - killed, 2),
                    "first_full_round_after_kill_s": traffic.full_round_after(killed),
                }
            )
    finally:
        traffic.finish()
    stats = oracle.store.client.stats()
    calls = log.calls
    figures.update(
        phases=phases,
        total_rounds=len(traffic.rounds),
        calls=CallLog.summary(calls),
        corrupt=len(oracle.corrupt),
        breaker_times_opened=stats["breaker_times_opened"],
        error_counts=stats["error_counts"],
        domains_marked_bad=stats["domains_marked_bad"],
    )
    assert oracle.corrupt == []
    assert max(s for _, s in calls) < CALL_BOUND_S
    assert stats["breaker_times_opened"] == 0
    for phase in phases:
        # The hit rate recovers after every restart: full rounds again.
        assert phase["first_full_round_after_kill_s"] is not None, phase
        assert phase["after"]["restored_of_attempted"] >= 0.75, phase


def _segment_usage(cluster: Any) -> dict[str, float]:
    """Per segment, the allocator's usage in percent (the master's segment detail)."""
    with urllib.request.urlopen(cluster.metrics_url + "/get_segments_detail", timeout=2) as r:
        detail = json.loads(r.read())
    return {
        s["segment_name"]: round(float(s["allocator_usage_percent"]), 1) for s in detail["segments"]
    }


def test_scale_out_under_traffic_takes_its_share(fault_cluster, oracle_factory, figures):
    # Segments large enough that no preferred segment fills up: a full one
    # makes Mooncake fall back to another, which would blur the share.
    cluster = fault_cluster(storage_nodes=3, storage_node_segment_bytes=SCALE_OUT_SEGMENT_BYTES)
    # Node 2 is the one "added": stopped before traffic, started under it.
    cluster.kill_storage_node(2, signal.SIGTERM)
    _wait_listed(cluster, _node_segment(cluster, 2), present=False)
    log = CallLog()
    oracle = _traffic_oracle(cluster, oracle_factory, log, "scale")
    traffic = Traffic(oracle).start()
    try:
        time.sleep(SETTLE_S)
        cluster.restart_storage_node(2)
        added = time.monotonic()
        new_segment = _node_segment(cluster, 2)
        poll(lambda: new_segment in oracle.store.client.segments(), 10, what="segment seen")
        seen = time.monotonic()
        first_new = len(traffic.placed)
        time.sleep(2 * SETTLE_S)
    finally:
        traffic.finish()
    fresh = traffic.placed[first_new:]
    schema = oracle.store.key_schema
    kv_objects = [oracle.store.pools["kv"].object_keys(schema, [k])[0] for k in fresh]
    where = oracle.store.client.locate(kv_objects)
    share = collections.Counter(next(iter(where.get(o, {"?"}))) for o in kv_objects)
    figures.update(
        new_segment=new_segment,
        seconds_until_backend_saw_it=round(seen - added, 2),
        keys_written_after=len(fresh),
        placement_after=dict(share),
        new_node_share=round(share[new_segment] / max(1, len(fresh)), 3),
        segment_usage_percent=_segment_usage(cluster),
        traffic_after=traffic.window(seen, time.monotonic()),
        calls=CallLog.summary(log.calls),
        corrupt=len(oracle.corrupt),
    )
    assert oracle.corrupt == []
    assert len(fresh) >= 30
    # About a third of the new keys, not all of them (or none).
    assert 0.15 <= share[new_segment] / len(fresh) <= 0.55
    assert traffic.window(seen, time.monotonic())["restored_of_attempted"] == 1.0
