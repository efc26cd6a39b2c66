"""``probe_segment``: whether a segment's transfer endpoint answers, found the way
the real services name it (HTTP metadata: ``mooncake/rpc_meta/<segment>``; P2P
handshake: ``te_endpoint`` in the master's ``/get_segments_detail``; both
measured on the wheel's master and storage nodes)."""

from __future__ import annotations

import socket

from mooncake_span.store.segments import probe_segment
from tests.span_helpers import json_http_server, listening_port


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_p2p_handshake_segments_are_dialled_at_the_masters_te_endpoint():
    # With P2P handshake the master's segment detail names the RPC endpoint
    # (measured: te_endpoint is the port the node's log says it listens on).
    with listening_port() as live:
        detail = {
            "segments": [
                {"segment_name": "127.0.0.1:1", "te_endpoint": live},
                {"segment_name": "127.0.0.1:2", "te_endpoint": f"127.0.0.1:{_closed_port()}"},
            ]
        }
        answers = {"/get_segments_detail": detail}
        with json_http_server(lambda path, query: answers.get(path)) as admin:
            assert probe_segment("P2PHANDSHAKE", admin, "127.0.0.1:1") is True
            assert probe_segment("P2PHANDSHAKE", admin, "127.0.0.1:2") is False
            assert probe_segment("P2PHANDSHAKE", admin, "127.0.0.1:3") is None  # not listed
    assert probe_segment("P2PHANDSHAKE", None, "127.0.0.1:1") is None


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
            assert probe_segment(metadata, None, "127.0.0.1:1") is True
            assert probe_segment(metadata, None, "127.0.0.1:2") is False
            assert probe_segment(metadata, None, "127.0.0.1:3") is None  # no entry
    assert probe_segment("etcd://127.0.0.1:2379", None, "127.0.0.1:1") is None
