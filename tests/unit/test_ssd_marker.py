"""Seals by default where the cluster has an SSD tier (store/ssd_marker.py)."""

from __future__ import annotations

import pytest

from mooncake_span.errors import ConfigError, ErrorCode
from mooncake_span.store import ssd_marker


def _never() -> bool:
    raise AssertionError("the marker was asked for although the answer was known")


def test_not_given_seals_exactly_where_an_ssd_tier_exists():
    resolve = ssd_marker.resolve_object_checksums
    assert resolve(None, False, lambda: False, "store") == (False, "no SSD tier in the cluster")
    sealed, why = resolve(None, False, lambda: True, "store")
    assert sealed and ssd_marker.MARKER_KEY in why
    assert resolve(None, True, _never, "store") == (True, "this process's SSD tier")
    assert resolve(True, False, _never, "store") == (True, "span_object_checksums")
    assert resolve(False, False, lambda: False, "store") == (False, "span_object_checksums")


def test_false_on_a_cluster_with_an_ssd_tier_is_refused_in_one_line_unless_the_guard_is_off():
    with pytest.raises(ConfigError, match="span_object_checksums is false but") as refused:
        ssd_marker.resolve_object_checksums(False, False, lambda: True, "store")
    assert "\n" not in str(refused.value)
    with pytest.raises(ConfigError):
        ssd_marker.resolve_object_checksums(False, True, _never, "etcd")
    assert not ssd_marker.resolve_object_checksums(False, True, _never, "off")[0]


def test_publishing_accepts_a_marker_already_there_and_refuses_a_failed_put():
    stored = {}

    def put(key: str, data: bytes) -> int:
        if key in stored:
            return ErrorCode.OBJECT_ALREADY_EXISTS
        stored[key] = data
        return 0

    ssd_marker.publish(put, "127.0.0.1:1234")
    ssd_marker.publish(put, "127.0.0.1:5678")
    assert b"127.0.0.1:1234" in stored[ssd_marker.MARKER_KEY]
    with pytest.raises(ConfigError, match="could not store the SSD-tier marker"):
        ssd_marker.publish(lambda key, data: -200, "node")
