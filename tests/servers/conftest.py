"""Fixtures for tests with real ``sglang.launch_server`` processes (CPU, tiny local models).

Every server, router and cluster a test starts is stopped at teardown by its
process group, and the test fails if one survived. A recompute reference per
model (a server without an L3 whose caches are flushed before each request)
gives the greedy output every L3 answer is compared against.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from mooncake_span.ops.cluster import LocalCluster
from mooncake_span.ops.cluster_spec import ClusterSpec
from mooncake_span.ops.master_http import iter_lines
from mooncake_span_tools.lab.sglang_servers import (
    Completion,
    ServerOptions,
    SglangServer,
    _Served,
    settled_count,
    start_together,
    stop_together,
)
from mooncake_span_tools.testing.cpu_server.models import (
    default_spec,
    ensure_model,
    serving_profile,
)
from tests.conftest import require_mooncake

PAGE_TOKENS = 64
# sglang leaves the last page of a prompt to compute, and does not prefetch a
# remainder shorter than its prefetch threshold (256 tokens by default).
PROMPT_TOKENS = 10 * PAGE_TOKENS
ANSWER_TOKENS = 12


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def prompt(seed: int, n_tokens: int = PROMPT_TOKENS, vocab: int = 500) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n_tokens)]


@pytest.fixture(autouse=True)
def _servers_need_mooncake() -> None:
    require_mooncake()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    # One cache for the run: xdist workers' base folders share a parent.
    base = tmp_path_factory.getbasetemp()
    cache = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "tiny-models"

    def make(architecture: str) -> Path:
        return ensure_model(default_spec(architecture), cache)

    return make


class Launched:
    """What one test started; teardown stops it all and checks that no PID survived."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.clusters: list[LocalCluster] = []
        self.processes: list[_Served] = []
        self.pids: set[int] = set()

    def cluster(self, **spec_fields: Any) -> LocalCluster:
        spec_fields.setdefault("log_dir", self.log_dir / f"cluster{len(self.clusters)}")
        cluster = LocalCluster(ClusterSpec(**spec_fields))
        self.clusters.append(cluster)
        return cluster.start()

    def server(self, name: str, options: ServerOptions, **kwargs: Any) -> SglangServer:
        server = SglangServer(name, options, self.log_dir, **kwargs)
        self.processes.append(server)
        return server

    def track(self, served: _Served) -> _Served:
        self.processes.append(served)
        return served

    def start(self, *servers: _Served) -> None:
        start_together(servers)
        self.pids.update(s.pid for s in servers if s.pid is not None)

    def start_cold(self, server: SglangServer) -> None:
        """Start without the warm-up: its next request is the first after a start."""
        server.start()
        self.pids.add(server.pid)

    def stop_all(self) -> None:
        # Servers (the clusters' clients) first, all at once; then the clusters.
        stop_together(self.processes)
        for cluster in self.clusters:
            if cluster.started:
                self.pids.update(cluster.pids().values())
            cluster.stop()


@pytest.fixture
def launched(tmp_path: Path) -> Iterator[Launched]:
    launched = Launched(tmp_path / "logs")
    yield launched
    launched.stop_all()
    left = sorted(pid for pid in launched.pids if _pid_alive(pid))
    assert not left, f"processes still running after stop: {left}"


class Recompute:
    """A server without an L3: the greedy answer every restored request must match."""

    def __init__(self, server: SglangServer) -> None:
        self.server = server

    def __call__(
        self, input_ids: Sequence[int], max_new_tokens: int = ANSWER_TOKENS, top_logprobs: int = 0
    ) -> Completion:
        self.server.flush_cache()
        answer = self.server.generate(input_ids, max_new_tokens, top_logprobs=top_logprobs)
        assert answer.cached_tokens == 0, answer.meta_info
        return answer


class RecomputeServers:
    """One reference server per model for the session. ``prestart(architecture)``
    boots it beside a test's own servers; calling waits for it and returns a
    :class:`Recompute` (the servers start in parallel rather than one after another)."""

    def __init__(self, tiny_model: Callable[[str], Path], log_dir: Path) -> None:
        self._tiny_model = tiny_model
        self._log_dir = log_dir
        self._servers: dict[str, SglangServer] = {}
        self._ready: set[str] = set()

    def prestart(self, architecture: str) -> None:
        if architecture in self._servers:
            return
        profile = serving_profile(default_spec(architecture))
        options = ServerOptions(
            model_path=self._tiny_model(architecture),
            storage_backend=None,
            **profile.server_fields(),
        )
        server = SglangServer(f"recompute-{architecture}", options, self._log_dir)
        self._servers[architecture] = server
        server.process.start()

    def __call__(self, architecture: str) -> Recompute:
        self.prestart(architecture)
        server = self._servers[architecture]
        if architecture not in self._ready:
            server.wait_ready()
            self._ready.add(architecture)
        return Recompute(server)

    def stop(self) -> None:
        stop_together(list(self._servers.values()))


@pytest.fixture(scope="session")
def recompute_server(
    tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RecomputeServers]:
    """``recompute_server(architecture)``: one reference server per model, kept for the
    session; ``recompute_server.prestart(architecture)`` before a test starts its own."""
    servers = RecomputeServers(tiny_model, tmp_path_factory.mktemp("recompute-logs"))
    yield servers
    servers.stop()


BACKUP_TIMEOUT_S = 30.0


def stored_keys(cluster) -> list[str]:
    return list(iter_lines(f"{cluster.metrics_url}/get_all_keys", timeout_s=5.0))


def settled_key_count(count: Callable[[], int]) -> int:
    return settled_count(count, timeout_s=BACKUP_TIMEOUT_S)


def wait_for_backup(cluster, min_keys: int) -> None:
    """Write-through backups are asynchronous: wait until the objects are on the master."""
    wait_until(
        lambda: len(stored_keys(cluster)) >= min_keys, BACKUP_TIMEOUT_S, f"{min_keys} keys stored"
    )


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s:.0f}s")
        time.sleep(0.5)
