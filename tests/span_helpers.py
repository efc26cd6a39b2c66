"""Small helpers shared by unit and integration tests (no fixtures here)."""

from __future__ import annotations

import contextlib
import http.server
import json
import random
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from mooncake_span.store.domains import copy_candidates

# Client settings for a backend on the fake store: the master address is only
# ever probed (tests patch the probe or listen there), never dialled.
FAKE_CLIENT = {
    "master_server_address": "127.0.0.1:1",
    "metadata_server": "P2PHANDSHAKE",
    "protocol": "tcp",
}


def make_storage_config(
    extra_config: dict[str, Any],
    *,
    is_mla: bool = True,
    model_name: str = "test-model",
    tp_rank: int = 0,
    tp_size: int = 1,
) -> Any:
    """An sglang 0.5.23 HiCacheStorageConfig as the controller would build it."""
    from mooncake_span_tools.testing.pools import single_rank_storage_config

    return single_rank_storage_config(
        extra_config, model_name=model_name, is_mla=is_mla, tp_rank=tp_rank, tp_size=tp_size
    )


def register_pools(store: Any, pools: Mapping[Any, Any]) -> None:
    """Register host pools the way sglang's controller does: the KV pool (the
    anchor) through the v1 call, every pool by name, then the end-of-registration
    hook. ``pools`` maps sglang PoolName -> host pool."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    store.register_mem_pool_host(pools[PoolName.KV])
    for name, pool in pools.items():
        store.register_mem_host_pool_v2(pool, name)
    store.on_host_pools_registered()


def fake_backend(
    config: Any,
    *,
    cluster: Any = None,
    native: Callable[[Any], Any] | None = None,
    is_mla: bool = True,
) -> Any:
    """A MooncakeSpanStore whose native stores are ``native(cluster)`` (default:
    a contract-checked ``FakeStore`` of ``cluster``, a fresh ``FakeCluster`` when
    None). ``config``: the extra-config dict, or a storage config already built.
    The master's reachability probe is skipped (``skip_probe``), so no port is
    needed; the ``make_backend`` fixture also closes the store after the test."""
    from mooncake_span.sglang_backend import MooncakeSpanStore
    from mooncake_span.store.client import NativeBinding
    from mooncake_span_tools.testing.fake_store import FakeCluster, FakeReplicateConfig, FakeStore

    cluster = FakeCluster() if cluster is None else cluster
    native = FakeStore if native is None else native
    if isinstance(config, Mapping):
        config = make_storage_config(dict(config), is_mla=is_mla)
    binding = NativeBinding(lambda: native(cluster), FakeReplicateConfig, probe_endpoint=skip_probe)
    return MooncakeSpanStore(config, {}, binding=binding)


def scattered_pages(total_pages: int, count: int, seed: int) -> list[int]:
    """``count`` distinct host pages in a shuffled (non-monotonic) order."""
    pages = list(range(total_pages))
    random.Random(seed).shuffle(pages)
    return pages[:count]


def slots_of(pages: list[int], page_tokens: int) -> torch.Tensor:
    """Token slots of ``pages`` in the given order, as sglang passes host_indices."""
    return torch.cat([torch.arange(p * page_tokens, (p + 1) * page_tokens) for p in pages])


@contextlib.contextmanager
def listening_port() -> Iterator[str]:
    """A loopback address that accepts TCP connections: the client's reachability
    probe of the master succeeds, and nothing else ever talks to it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(4)
        yield f"127.0.0.1:{sock.getsockname()[1]}"


@contextlib.contextmanager
def json_http_server(
    answer: Callable[[str, dict[str, list[str]]], Any],
) -> Iterator[str]:
    """A loopback HTTP server whose GET of a path with a query is ``answer(path,
    query)`` as JSON (None: 404), as the master's admin and metadata servers
    answer; yields its base URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 -- http.server's name
            url = urllib.parse.urlparse(self.path)
            body = answer(url.path, urllib.parse.parse_qs(url.query))
            if body is None:
                self.send_response(404)
                self.end_headers()
                return
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def skip_probe(endpoint: str, timeout_s: float) -> None:
    """``NativeBinding.probe_endpoint`` for a fake cluster: no master to dial."""


class FakeClock:
    """A monotonic clock that moves only when told: TTL and cool-down tests
    advance it past the deadline instead of sleeping."""

    def __init__(self, now_s: float = 1000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


def fake_client(
    master: str,
    cluster: Any,
    clock: Callable[[], float] = time.monotonic,
    segment_answers: Callable[[str, str | None, str], bool | None] | None = None,
    **options: Any,
) -> Any:
    """A connected MooncakeClient on the contract-checked fake; placement reads
    the fake cluster's live segments (the admin URL is never dialled). Every
    TTL and cool-down of the client runs on ``clock``. A segment answers a
    liveness probe unless the fake killed it (``segment_answers`` overrides)."""
    from mooncake_span.config import SpanOptions
    from mooncake_span.mooncake_settings import MooncakeSettings
    from mooncake_span.store.client import MooncakeClient, NativeBinding
    from mooncake_span_tools.testing.fake_store import FakeReplicateConfig, FakeStore

    options.setdefault("master_admin_url", "http://127.0.0.1:1")
    client = MooncakeClient(
        MooncakeSettings(
            master_server_address=master, metadata_server="P2PHANDSHAKE", protocol="tcp"
        ),
        SpanOptions(**options),
        NativeBinding(
            lambda: FakeStore(cluster),
            FakeReplicateConfig,
            lambda url: cluster.live_segments(),
            list_disk_owners=lambda url, keys: cluster.disk_owners(keys),
            segment_answers=segment_answers
            or (lambda metadata, admin, seg: seg not in cluster.dead),
        ),
        clock=clock,
    )
    client.connect()
    return client


def master_replicas(cluster: Any, keys: Sequence[str]) -> dict[str, Any]:
    """What a real cluster's master says of ``keys`` (``batch_get_replica_desc``),
    asked by a client of its own that mounts nothing."""
    from mooncake_span_tools.bench.shared_native import raw_client

    store = raw_client(cluster.client_config())
    try:
        return store.batch_get_replica_desc(list(keys))
    finally:
        store.close()


def rank_segments(
    domain_key: str, segments: Sequence[str], bad: frozenset[str] = frozenset(), step: int = 0
) -> list[str]:
    """``segments`` in the order placement prefers them for ``domain_key`` at chain step
    ``step`` (the root's order rotated left by ``step``), those in ``bad`` last."""
    if not segments:
        return []
    (row,) = copy_candidates([domain_key], None, segments, len(segments), [step])
    ranked = [segment for _, segment in row]
    return [s for s in ranked if s not in bad] + [s for s in ranked if s in bad]
