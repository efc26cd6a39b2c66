"""``probe_segment``: whether a segment's transfer endpoint answers, found the way
the real metadata services name it (HTTP metadata: ``mooncake/rpc_meta/<segment>``,
measured on the wheel's master; P2P handshake: the segment's own name)."""

from __future__ import annotations

import socket

from mooncake_span.store.segments import probe_segment
from tests.span_helpers import json_http_server, listening_port


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_p2p_handshake_segments_are_dialled_by_their_name():
    with listening_port() as live:
        assert probe_segment("P2PHANDSHAKE", live) is True
    assert probe_segment("P2PHANDSHAKE", f"127.0.0.1:{_closed_port()}") is False
    assert probe_segment("P2PHANDSHAKE", "node-a") is None


def test_http_metadata_names_the_rpc_endpoint():
    dead_port = _closed_port()
    with listening_port() as live:
        live_port = int(live.rsplit(":", 1)[1])
        entries = {
            "mooncake/rpc_meta/127.0.0.1:1": {
                "ip_or_host_name": "127.0.0.1",
                "rpc_port": live_port,
            },
            "mooncake/rpc_meta/127.0.0.1:2": {
                "ip_or_host_name": "127.0.0.1",
                "rpc_port": dead_port,
            },
        }
        with json_http_server(lambda path, query: entries.get(query["key"][0])) as url:
            metadata = url + "/metadata"
            assert probe_segment(metadata, "127.0.0.1:1") is True
            assert probe_segment(metadata, "127.0.0.1:2") is False
            assert probe_segment(metadata, "127.0.0.1:3") is None  # no entry
    assert probe_segment("etcd://127.0.0.1:2379", "127.0.0.1:1") is None
