"""The registration warning for an extra-config ``storage_page_size`` that the
controller cannot be using (issue #17, stock GLM-5.3-Flash geometry).

Real sglang host pools and HiCacheStorageConfig, the contract-checked fake
store; the config either lacks the ``storage_page_size`` field (stock 0.5.23)
or carries it (span-aware builds).
"""

from __future__ import annotations

import logging

import pytest

from mooncake_span.bench import pools as P
from mooncake_span.store.client import NativeBinding
from mooncake_span.store.fake import FakeCluster, FakeReplicateConfig, FakeStore
from tests.span_helpers import make_storage_config, skip_probe

CLIENT = {
    "master_server_address": "127.0.0.1:1",
    "metadata_server": "P2PHANDSHAKE",
    "protocol": "tcp",
}
LOGGER = "mooncake_span.sglang_backend.storage_page"


def _register(extra, *, config_field=None, host_page_tokens=64):
    from mooncake_span.sglang_backend import MooncakeSpanStore

    binding = NativeBinding(
        lambda: FakeStore(FakeCluster()), FakeReplicateConfig, probe_endpoint=skip_probe
    )
    config = make_storage_config({**CLIENT, **extra})
    if config_field is not None:
        config.storage_page_size = config_field
    store = MooncakeSpanStore(config, {}, binding=binding)
    host = P.build_mla_host(
        "page_first", layers=1, page_tokens=host_page_tokens, host_pages=4, kv_lora_rank=16
    )
    store.register_mem_pool_host(host)
    return store


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING
    ]


def test_extra_config_span_without_the_field_warns_once(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    store = _register({"storage_page_size": 256})
    try:
        # Still honoured: a span-aware build without the field needs it.
        assert store.geometry.pages_per_span == 4
        (message,) = _warnings(caplog)
        assert "storage_page_size=256" in message
        assert "64-token host page" in message
        assert "no storage_page_size field" in message
        assert "only misses" in message
    finally:
        store.close()


@pytest.mark.parametrize(
    ("extra", "config_field", "host_page_tokens", "expected_k"),
    [
        ({}, None, 64, 1),  # nothing set
        ({"storage_page_size": 256}, None, 256, 1),  # stock GLM-5.3-Flash: equals the host page
        ({"storage_page_size": 0}, None, 64, 1),  # 0 = host page
        ({"storage_page_size": 256}, 256, 64, 4),  # span-aware build agrees with the field
        ({}, 256, 64, 4),  # span-aware build, nothing in extra-config
    ],
    ids=["unset", "stock-glm-k1", "zero", "field-agrees", "field-only"],
)
def test_no_warning_when_the_storage_page_is_consistent(
    caplog, extra, config_field, host_page_tokens, expected_k
):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    store = _register(extra, config_field=config_field, host_page_tokens=host_page_tokens)
    try:
        assert store.geometry.pages_per_span == expected_k
        assert _warnings(caplog) == []
    finally:
        store.close()


def test_field_overrides_a_different_extra_config_value(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    # Field present and 0 (= host page): the build is authoritative, the
    # extra-config value is not used, and the operator is told so.
    store = _register({"storage_page_size": 256}, config_field=0)
    try:
        assert store.geometry.pages_per_span == 1
        (message,) = _warnings(caplog)
        assert "overridden" in message and "HiCacheStorageConfig.storage_page_size=64" in message
        assert "no storage_page_size field" not in message
    finally:
        store.close()
