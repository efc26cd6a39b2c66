"""The backend's Prometheus metrics and layout description, on the contract-checked fake."""

from __future__ import annotations

import pytest

prom = pytest.importorskip("prometheus_client")

from mooncake_span import metrics as M  # noqa: E402
from mooncake_span.errors import ErrorCode  # noqa: E402
from mooncake_span.sglang_backend.recording import CallObserver, outcome_of  # noqa: E402
from tests.span_helpers import slots_of  # noqa: E402
from tests.unit.test_backend_faults import rig  # noqa: E402, F401 -- the fixture

PAGE = 64
K = 2


@pytest.fixture
def metered(request):
    """test_backend_faults' rig (fake cluster, K=2, breaker after 2 failures) with
    a private registry; the backend's own observer uses the global one."""
    store, cluster = request.getfixturevalue("rig")
    registry = prom.CollectorRegistry()
    store.recorder.observer = CallObserver(store.client, M.SpanMetrics(registry))
    return store, cluster, registry


def _v(registry, name, **labels):
    return registry.get_sample_value(name, labels) or 0.0


def test_traffic_is_counted_by_operation_pool_and_outcome(metered):
    store, _, registry = metered
    page_bytes = store.pools["kv"].layout.flat_page_bytes
    assert store.batch_set_v1(["a", "b"], slots_of([0, 1, 2, 3], PAGE)) == [True, True]
    assert store.batch_exists(["a", "b", "zz"]) == 2
    assert store.batch_get_v1(["a", "zz"], slots_of([4, 5, 6, 7], PAGE)) == [True, False]

    duration = "mooncake_span_operation_duration_seconds_count"
    assert _v(registry, duration, operation="batch_set_v1", outcome="ok") == 1
    assert _v(registry, duration, operation="batch_exists", outcome="ok") == 1
    assert _v(registry, duration, operation="batch_get_v1", outcome="partial") == 1
    assert _v(registry, "mooncake_span_keys_total", operation="set", pool="kv", result="ok") == 2
    assert _v(registry, "mooncake_span_keys_total", operation="get", pool="kv", result="ok") == 1
    assert (
        _v(registry, "mooncake_span_keys_total", operation="get", pool="kv", result="failed") == 1
    )
    assert _v(registry, "mooncake_span_pages_total", operation="set", pool="kv") == 2 * K
    assert _v(registry, "mooncake_span_bytes_total", operation="set", pool="kv") == (
        2 * K * page_bytes
    )
    assert _v(registry, "mooncake_span_bytes_total", operation="get", pool="kv") == K * page_bytes
    assert _v(registry, "mooncake_span_hit_query_keys_total", result="hit") == 2
    assert _v(registry, "mooncake_span_hit_query_keys_total", result="miss") == 1


def test_failed_objects_by_code_and_breaker(metered):
    store, cluster, registry = metered
    cluster.inject("batch_is_exist", int(ErrorCode.RPC_FAIL), times=1000)
    assert store.batch_exists(["a"]) == 0
    assert store.batch_exists(["a"]) == 0
    assert store.batch_exists(["a"]) == 0  # refused by the open breaker
    assert _v(registry, "mooncake_span_failed_objects_total", code="RPC_FAIL") == 2
    assert _v(registry, "mooncake_span_failed_objects_total", code="BREAKER_REJECTED") == 1
    assert _v(registry, "mooncake_span_breaker_opens_total") == 1
    assert _v(registry, "mooncake_span_breaker_state") == 1
    duration = "mooncake_span_operation_duration_seconds_count"
    assert _v(registry, duration, operation="batch_exists", outcome="rejected") == 3


def test_bad_input_is_a_rejected_call(metered):
    store, _, registry = metered
    assert store.batch_get_v1(["bad key"], slots_of([0, 1], PAGE)) == [False]
    duration = "mooncake_span_operation_duration_seconds_count"
    assert _v(registry, duration, operation="batch_get_v1", outcome="rejected") == 1


@pytest.mark.parametrize(
    ("result", "outcome"),
    [
        ([True, True], "ok"),
        ([True, False], "partial"),
        ([False], "miss"),
        ({"kv": [True], "mamba": [False]}, "partial"),
        ([None, None], "miss"),
        (3, "ok"),
        (True, "ok"),
        ([], "ok"),
    ],
)
def test_outcome_of_results(result, outcome):
    assert outcome_of(result) == outcome


def test_layout_description_from_the_backend(metered):
    store, _, _ = metered
    doc = store.describe_l3_object_layout(sidecar_pool_specs=(), page_size=PAGE)
    (kv,) = doc["hicache_object_layout"]["pools"]
    page_bytes = store.pools["kv"].layout.flat_page_bytes
    assert doc["backend"] == "mooncake-span" and doc["page_size"] == K * PAGE
    assert kv["suffixes"] == ["__k"] and kv["components"][0]["rank_scope"] == "replicated"
    assert kv["bytes_per_key"] == K * page_bytes
    assert doc["hicache_object_layout"]["key_prefix"] == store.key_schema.prefix
    assert doc["hicache_object_layout"]["is_mla_backend"] is True
    assert doc["span"]["pages_per_span"] == K
    assert doc["integrity"] == {"verify_checksums": False, "checksum": None, "source": "default"}
    # The description names exactly the objects the backend writes.
    (key,) = store.key_schema.object_keys(["abc"], store.pools["kv"].components)
    assert key == f"{doc['hicache_object_layout']['key_prefix']}_abc{kv['suffixes'][0]}"
