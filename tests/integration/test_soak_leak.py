"""CI-sized soak: per-call state must not grow with storage metrics off.

The same traffic as ``mooncake-span soak`` (backup, prefetch, hit queries on
MLA KV + DSA indexer + Mamba, K=4) against a real cluster whose segment is
smaller than the working set, in one thread for about a minute. Python
allocations made by mooncake-span's own files are compared between the end of
a warm-up and the end of the run with tracemalloc: a structure that grows per
call (as the per-call metric lists did while nobody called ``get_stats()``)
shows up as bytes proportional to the number of calls. No timing is asserted.
"""

from __future__ import annotations

import gc
import os
import random
import tracemalloc
from pathlib import Path

import pytest

from mooncake_span.ops.cluster import ClusterSpec, LocalCluster

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PACKAGE_DIR = str(Path(__file__).resolve().parents[2] / "mooncake_span")
WARMUP_ROUNDS = 500
MEASURED_ROUNDS = 500
# The warm-up fills the backend's bounded windows (64 metric records per list
# with metrics off) and lets torch's own bookkeeping for the index tensors
# settle (it moves by a few KB either way over the first few hundred rounds).
# Allowed growth of mooncake-span's own live allocations over the measured
# rounds (about 2.7k backend calls): before the fix the per-call metric lists
# grew by ~30 KB here (~40 B per v1 call); after it, growth stays within
# about +-2 KB.
BUDGET_BYTES = 12 << 10


@pytest.fixture(scope="module")
def small_cluster(tmp_path_factory):
    spec = ClusterSpec(
        storage_nodes=1,
        storage_node_segment_bytes=32 << 20,
        lease_ttl_ms=500,
        log_dir=tmp_path_factory.mktemp("soak-leak-cluster"),
    )
    with LocalCluster(spec) as cluster:
        yield cluster


def _own(snapshot: tracemalloc.Snapshot) -> tracemalloc.Snapshot:
    return snapshot.filter_traces([tracemalloc.Filter(True, os.path.join(PACKAGE_DIR, "*"))])


def _snapshot() -> tracemalloc.Snapshot:
    gc.collect()  # cyclic garbage is not growth
    return _own(tracemalloc.take_snapshot())


def _rounds(traffic, rng: random.Random, count: int) -> None:
    for _ in range(count):
        traffic.backup_once(rng)
        traffic.prefetch_once(rng)
        traffic.hit_once(rng)


def test_per_call_state_stays_flat_with_storage_metrics_off(small_cluster):
    from mooncake_span.sglang_backend.stats import UNPOLLED_WINDOW
    from mooncake_span_tools.lab.soak import LatencyBook, SoakConfig, Traffic

    config = SoakConfig(
        storage_nodes=1,
        segment_bytes=32 << 20,
        working_set_ratio=2.0,
        kv_lora_rank=64,
        storage_metrics=False,
    )
    book = LatencyBook(minutes=30)
    traffic = Traffic(config, small_cluster.client_config(), book)
    rng = random.Random(7)
    tracemalloc.start(4)
    try:
        _rounds(traffic, rng, WARMUP_ROUNDS)
        before = _snapshot()
        calls_before = book.calls()
        _rounds(traffic, rng, MEASURED_ROUNDS)
        after = _snapshot()
        calls = book.calls() - calls_before
        stats = traffic.store.get_stats()
    finally:
        tracemalloc.stop()
        traffic.close()
    diff = after.compare_to(before, "lineno")
    growth = sum(stat.size_diff for stat in diff)
    top = [f"{stat.traceback}: {stat.size_diff:+d} B" for stat in diff[:5]]
    assert calls > 5 * MEASURED_ROUNDS, "the traffic did not reach the backend"
    assert growth < BUDGET_BYTES, (
        f"mooncake-span's own allocations grew by {growth} bytes over {calls} calls "
        f"({growth / calls:.1f} B/call); largest: {top}"
    )
    # Nothing drains per-call records with metrics off: only the last window is kept.
    assert len(stats.backup_pgs) == UNPOLLED_WINDOW and len(stats.prefetch_pgs) <= UNPOLLED_WINDOW
    assert stats.dropped_metric_records > 0
