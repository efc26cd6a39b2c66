"""Prometheus metrics scraped over HTTP after real traffic, and the layout
description from the backend vs from ``mooncake-span inspect``."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from mooncake_span.ops.master_http import parse_prometheus
from mooncake_span_tools.testing import pools as P
from tests.integration.test_ops_tools import inspect_json
from tests.span_helpers import slots_of

pytestmark = pytest.mark.integration
prom = pytest.importorskip("prometheus_client")

REPO = Path(__file__).resolve().parents[2]
PAGE = 64
K = 4


def _scrape(port: int) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {
        (name, frozenset(labels.items())): value
        for name, labels, value in parse_prometheus(text)
        if name.startswith("mooncake_span_")
    }


def _get(samples, name, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture
def metrics_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server, thread = prom.start_http_server(port, addr="127.0.0.1")
    yield port
    server.shutdown()
    thread.join(timeout=5)


def test_metrics_after_real_traffic(span_store_factory, metrics_port):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    kv = P.build_mla_host("page_first", layers=2, host_pages=3 * K)
    store = span_store_factory({PoolName.KV: kv}, storage_page_size=K * PAGE)
    before = _scrape(metrics_port)
    keys = ["m0", "m1"]
    slots = slots_of(list(range(2 * K)), PAGE)
    assert store.batch_set_v1(keys, slots) == [True, True]
    assert store.batch_exists([*keys, "absent"]) == 2
    assert store.batch_get_v1([*keys, "absent"], slots_of(list(range(3 * K)), PAGE)) == [
        True,
        True,
        False,
    ]
    after = _scrape(metrics_port)

    def delta(name, **labels):
        return _get(after, name, **labels) - _get(before, name, **labels)

    page_bytes = store.pools["kv"].layout.flat_page_bytes
    count = "mooncake_span_operation_duration_seconds_count"
    assert delta(count, operation="batch_set_v1", outcome="ok") == 1
    assert delta(count, operation="batch_get_v1", outcome="partial") == 1
    assert delta(count, operation="batch_exists", outcome="ok") == 1
    assert delta("mooncake_span_bytes_total", operation="set", pool="kv") == 2 * K * page_bytes
    assert delta("mooncake_span_bytes_total", operation="get", pool="kv") == 2 * K * page_bytes
    assert delta("mooncake_span_pages_total", operation="get", pool="kv") == 2 * K
    assert delta("mooncake_span_keys_total", operation="get", pool="kv", result="failed") == 1
    assert delta("mooncake_span_hit_query_keys_total", result="hit") == 2
    assert delta("mooncake_span_hit_query_keys_total", result="miss") == 1
    assert ("mooncake_span_breaker_state", frozenset()) in after
    assert _get(after, "mooncake_span_breaker_state") == 0


def test_inspect_layout_matches_the_backend(span_store_factory, mooncake_cluster, key_namespace):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    kv = P.build_mla_host("page_first", layers=2, host_pages=2 * K)
    store = span_store_factory({PoolName.KV: kv}, storage_page_size=K * PAGE)
    assert store.batch_set_v1(["i0"], slots_of(list(range(K)), PAGE)) == [True]
    backend_doc = store.describe_l3_object_layout()
    doc = inspect_json(mooncake_cluster)
    (ns,) = [n for n in doc["namespaces"] if n["name"] == store.key_schema.prefix]
    assert ns["objects"] == 1 and ns["storage_keys"] == 1 and ns["pages_per_span"] == K
    inspected = ns["object_layout"]
    assert inspected is not None, ns["layout_guard"]
    assert inspected["page_size"] == backend_doc["page_size"] == K * PAGE
    ours = backend_doc["hicache_object_layout"]["pools"]
    theirs = inspected["hicache_object_layout"]["pools"]
    assert [(p["pool"], p["bytes_per_key"], p["suffixes"]) for p in theirs] == [
        (p["pool"], p["bytes_per_key"], p["suffixes"]) for p in ours
    ]
    assert inspected["span"]["namespace"] == backend_doc["span"]["namespace"]
