"""The registration warning for an extra-config ``storage_page_size`` that the
controller cannot be using (issue #17, stock GLM-5.3-Flash geometry).

Real sglang host pools and HiCacheStorageConfig, the contract-checked fake
store; the config either lacks the ``storage_page_size`` field (stock 0.5.23)
or carries it (span-aware builds).
"""

from __future__ import annotations

import logging

import pytest

from mooncake_span_tools.testing import pools as P
from tests.span_helpers import FAKE_CLIENT, make_storage_config

LOGGER = "mooncake_span.sglang_backend.storage_page"


def _register(make_backend, extra, *, config_field=None, host_page_tokens=64):
    config = make_storage_config({**FAKE_CLIENT, **extra})
    if config_field is not None:
        config.storage_page_size = config_field
    store = make_backend(config)
    host = P.build_mla_host(
        "page_first", layers=1, page_tokens=host_page_tokens, host_pages=4, kv_lora_rank=16
    )
    store.register_mem_pool_host(host)
    return store


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING
    ]


def test_extra_config_span_without_the_field_warns_once(make_backend, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    store = _register(make_backend, {"storage_page_size": 256})
    # Still honoured: a span-aware build without the field needs it.
    assert store.geometry.pages_per_span == 4
    (message,) = _warnings(caplog)
    assert "storage_page_size=256" in message
    assert "64-token host page" in message
    assert "no storage_page_size field" in message
    assert "only misses" in message


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
    make_backend, caplog, extra, config_field, host_page_tokens, expected_k
):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    store = _register(
        make_backend, extra, config_field=config_field, host_page_tokens=host_page_tokens
    )
    assert store.geometry.pages_per_span == expected_k
    assert _warnings(caplog) == []


def test_field_overrides_a_different_extra_config_value(make_backend, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    # Field present and 0 (= host page): the build is authoritative, the
    # extra-config value is not used, and the operator is told so.
    store = _register(make_backend, {"storage_page_size": 256}, config_field=0)
    assert store.geometry.pages_per_span == 1
    (message,) = _warnings(caplog)
    assert "overridden" in message and "HiCacheStorageConfig.storage_page_size=64" in message
    assert "no storage_page_size field" not in message
