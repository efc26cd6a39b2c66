"""mooncake_span.metrics: families, shared construction, client-stat deltas, multiprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

prom = pytest.importorskip("prometheus_client")

from mooncake_span import metrics as M  # noqa: E402


def _value(registry, name: str, labels: dict[str, str] | None = None) -> float | None:
    return registry.get_sample_value(name, labels or {})


def test_every_family_is_registered_with_the_prefix():
    registry = prom.CollectorRegistry()
    M.get_metrics(registry)
    text = prom.generate_latest(registry).decode()
    for name in (f"mooncake_span_{family}" for family in M.FAMILIES):
        assert f"# TYPE {name.removesuffix('_total')}" in text, name


def test_constructing_twice_in_one_registry_shares_the_collectors():
    registry = prom.CollectorRegistry()
    first = M.SpanMetrics(registry)
    # A second backend in the same process (or a reloaded module) must not
    # trip prometheus_client's duplicate-name check.
    second = M.SpanMetrics(registry)
    first.observe_call("batch_get_v1", "ok", 0.01)
    second.observe_call("batch_get_v1", "ok", 0.02)
    labels = {"operation": "batch_get_v1", "outcome": "ok"}
    assert _value(registry, "mooncake_span_operation_duration_seconds_count", labels) == 2
    assert M.get_metrics(registry) is M.get_metrics(registry)


def test_calls_record_durations_by_operation_and_outcome():
    registry = prom.CollectorRegistry()
    m = M.get_metrics(registry)
    m.observe_call("batch_set_v1", "partial", 0.003)
    labels = {"operation": "batch_set_v1", "outcome": "partial"}
    assert _value(registry, "mooncake_span_operation_duration_seconds_count", labels) == 1
    bucket = "mooncake_span_operation_duration_seconds_bucket"
    assert _value(registry, bucket, {**labels, "le": "0.005"}) == 1
    assert _value(registry, bucket, {**labels, "le": "0.001"}) == 0


def test_transfers_record_keys_pages_and_bytes_per_pool():
    registry = prom.CollectorRegistry()
    m = M.get_metrics(registry)
    m.observe_transfer("set", "kv", ok_keys=3, failed_keys=1, pages=12, moved_bytes=4096)
    m.observe_transfer("set", "kv", ok_keys=1, failed_keys=0, pages=4, moved_bytes=1024)
    m.observe_transfer("set", "mamba", ok_keys=1, failed_keys=0, pages=1, moved_bytes=10)
    kv = {"operation": "set", "pool": "kv"}
    assert _value(registry, "mooncake_span_keys_total", {**kv, "result": "ok"}) == 4
    assert _value(registry, "mooncake_span_keys_total", {**kv, "result": "failed"}) == 1
    assert _value(registry, "mooncake_span_pages_total", kv) == 16
    assert _value(registry, "mooncake_span_bytes_total", kv) == 5120
    assert _value(registry, "mooncake_span_bytes_total", {**kv, "pool": "mamba"}) == 10


def test_hit_queries_split_into_hits_and_misses_and_clamp():
    registry = prom.CollectorRegistry()
    m = M.get_metrics(registry)
    m.observe_hit_query(8, 5)
    m.observe_hit_query(2, 7)  # a hit count past the query is clamped, not negative misses
    assert _value(registry, "mooncake_span_hit_query_keys_total", {"result": "hit"}) == 7
    assert _value(registry, "mooncake_span_hit_query_keys_total", {"result": "miss"}) == 3


def test_client_stats_sync_adds_only_the_difference():
    registry = prom.CollectorRegistry()
    sync = M.ClientStatsSync(M.get_metrics(registry))
    sync.sync(
        {"error_counts": {"TRANSFER_FAIL": 2}, "breaker_state": "open", "breaker_times_opened": 1}
    )
    sync.sync(
        {
            "error_counts": {"TRANSFER_FAIL": 5, "RPC_FAIL": 1},
            "breaker_state": "closed",
            "breaker_times_opened": 1,
        }
    )
    assert _value(registry, "mooncake_span_failed_objects_total", {"code": "TRANSFER_FAIL"}) == 5
    assert _value(registry, "mooncake_span_failed_objects_total", {"code": "RPC_FAIL"}) == 1
    assert _value(registry, "mooncake_span_breaker_opens_total") == 1
    assert _value(registry, "mooncake_span_breaker_state") == 0


def test_breaker_state_gauge_and_node_failures():
    registry = prom.CollectorRegistry()
    m = M.get_metrics(registry)
    m.set_breaker_state("open")
    m.add("node_failures_total", 3, "198.18.0.2:12345")
    assert _value(registry, "mooncake_span_breaker_state") == 1
    assert _value(registry, "mooncake_span_node_failures_total", {"node": "198.18.0.2:12345"}) == 3


def test_multiprocess_directory_is_honoured(tmp_path):
    # prometheus_client picks its value store when it is imported, so the
    # multiprocess mode needs a fresh interpreter with the variable set.
    code = textwrap.dedent(
        """
        import prometheus_client as prom
        from mooncake_span import metrics as M
        m = M.get_metrics()
        m.observe_transfer("get", "kv", ok_keys=4, failed_keys=0, pages=16, moved_bytes=64)
        m.set_breaker_state("open")
        print(prom.generate_latest(M.exposition_registry()).decode())
        """
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert any(tmp_path.iterdir()), "no multiprocess value files were written"
    assert 'mooncake_span_keys_total{operation="get",pool="kv",result="ok"} 4.0' in out.stdout
    assert "mooncake_span_breaker_state 1.0" in out.stdout


def test_segments_marked_bad_count_as_node_failures():
    registry = prom.CollectorRegistry()
    sync = M.ClientStatsSync(M.get_metrics(registry))
    node = {"node": "127.0.0.1:14001"}
    sync.sync({"bad_segments": ["127.0.0.1:14001"]})
    sync.sync({"bad_segments": ["127.0.0.1:14001"]})  # still bad: not a new failure
    assert _value(registry, "mooncake_span_node_failures_total", node) == 1
    sync.sync({"bad_segments": []})
    sync.sync({"bad_segments": ["127.0.0.1:14001", "127.0.0.1:14002"]})
    assert _value(registry, "mooncake_span_node_failures_total", node) == 2
    assert _value(registry, "mooncake_span_node_failures_total", {"node": "127.0.0.1:14002"}) == 1


def test_ssd_reads_follow_the_clients_cumulative_count():
    registry = prom.CollectorRegistry()
    sync = M.ClientStatsSync(M.get_metrics(registry))
    sync.sync({"ssd_read_rpcs": 3})
    sync.sync({"ssd_read_rpcs": 3})
    sync.sync({"ssd_read_rpcs": 2})  # an older snapshot adds nothing
    sync.sync({"ssd_read_rpcs": 5, "error_counts": {"SSD_OWNER_DOWN": 4}})
    assert _value(registry, "mooncake_span_ssd_reads_total", {}) == 5
    assert _value(registry, "mooncake_span_failed_objects_total", {"code": "SSD_OWNER_DOWN"}) == 4


def test_every_cumulative_stats_entry_feeds_its_counter_once():
    registry = prom.CollectorRegistry()
    sync = M.ClientStatsSync(M.get_metrics(registry))
    stats = {
        "error_counts": {"RPC_FAIL": 2},
        "integrity_failures": {"SEAL_MISMATCH": 1},
        "skipped_backups": {"cooldown": 7},
        "breaker_times_opened": 1,
        "breaker_state": "open",
    }
    sync.sync(stats)
    sync.sync(stats)  # the same cumulative counts again add nothing
    sync.sync({**stats, "skipped_backups": {"cooldown": 9, "stored": 3}})
    assert _value(registry, "mooncake_span_failed_objects_total", {"code": "RPC_FAIL"}) == 2
    assert (
        _value(registry, "mooncake_span_integrity_failures_total", {"code": "SEAL_MISMATCH"}) == 1
    )
    skipped = "mooncake_span_backup_objects_skipped_total"
    assert _value(registry, skipped, {"reason": "cooldown"}) == 9
    assert _value(registry, skipped, {"reason": "stored"}) == 3
    assert _value(registry, "mooncake_span_breaker_opens_total", {}) == 1
    assert _value(registry, "mooncake_span_breaker_state", {}) == 1
    sync.sync({**stats, "breaker_state": "closed"})
    assert _value(registry, "mooncake_span_breaker_state", {}) == 0
