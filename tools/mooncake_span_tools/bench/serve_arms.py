"""Servers, clusters and requests shared by the serving benchmark's workloads.

Each arm of ``mooncake-span bench --serve`` is a set of real sglang servers:
``recompute`` without an L3, ``span`` with this project's backend
(``--hicache-storage-backend dynamic``) and ``mooncake`` with sglang's built-in
``MooncakeStore``, each L3 arm on an embedded Mooncake cluster of its own.
This module starts them, sends streamed greedy requests (TTFT is the time to
the first streamed chunk) and watches a master for the pages a server backs up.
"""

from __future__ import annotations

import json
import logging
import random
import time
import urllib.request
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mooncake_span.ops.cluster import LocalCluster
from mooncake_span.ops.cluster_spec import ClusterSpec
from mooncake_span.ops.launcher import http_get
from mooncake_span.ops.master_http import iter_lines
from mooncake_span_tools.bench import serve_stats as S
from mooncake_span_tools.lab.sglang_servers import (
    Completion,
    ServerOptions,
    SglangServer,
    generate_body,
    parse_completion,
)
from mooncake_span_tools.testing.cpu_server.models import TinyModelSpec, serving_profile

logger = logging.getLogger(__name__)

SERVER_START_TIMEOUT_S = 420.0
BACKUP_TIMEOUT_S = 60.0
BACKUP_POLL_S = 0.25
# The backup is complete when the writer's new keys stop growing for this long.
BACKUP_SETTLED_S = 1.0
REQUEST_TIMEOUT_S = 300.0
# sglang's log lines for a server that serves, and for one that lost its port.
READY_TEXT = "The server is fired up and ready to roll"
PORT_TAKEN_TEXT = "address already in use"
PROMPT_VOCAB_TOKENS = 500


@dataclass(frozen=True)
class ServeSetup:
    """What the servers of every workload share: the tiny model, the caches, the clusters."""

    hidden_size: int = 512
    num_layers: int = 8
    num_heads: int = 8
    page_size_tokens: int = 64
    hicache_ratio: float = 2.0
    # Per L3 arm's storage node; old rounds' objects are evicted to make room.
    segment_bytes: int = 1 << 30
    # wait_complete: a prefetch is never dropped half way, so every request
    # measures a whole restore rather than the policy's timeout under load.
    prefetch_policy: str = "wait_complete"
    seed: int = 0
    work_dir: Path = field(default_factory=lambda: Path("/tmp/mooncake-span-serve"))

    def model_spec(self, architecture: str) -> TinyModelSpec:
        return TinyModelSpec(
            architecture=architecture,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
        )

    def server_fields(self, max_total_tokens: int) -> dict[str, Any]:
        """The :class:`ServerOptions` fields every arm's servers share."""
        return {
            "prefetch_policy": self.prefetch_policy,
            "page_size_tokens": self.page_size_tokens,
            "max_total_tokens": max_total_tokens,
            "hicache_ratio": self.hicache_ratio,
        }

    def page_tokens(self, architecture: str) -> int:
        """The page a model's servers use: ``page_size_tokens``, unless the model's
        serving profile needs its own (GLM-5.3-Flash: 256, what sglang forces)."""
        if architecture == "glm5_next":
            return serving_profile(self.model_spec(architecture)).page_size_tokens
        return self.page_size_tokens

    def model_fields(self, architecture: str, max_total_tokens: int) -> dict[str, Any]:
        """:meth:`server_fields` for one model: its page (the device pool rounded up to
        whole pages) and the flags and environment its serving profile adds."""
        page = self.page_tokens(architecture)
        fields = self.server_fields(-(-max_total_tokens // page) * page)
        if architecture != "glm5_next":
            return fields
        profile = serving_profile(self.model_spec(architecture))
        return {
            **fields,
            "page_size_tokens": page,
            "extra_args": profile.extra_args,
            "env": dict(profile.env),
        }

    def described(self) -> dict[str, Any]:
        """The configuration as JSON can hold it."""
        return {**asdict(self), "work_dir": str(self.work_dir)}


def kv_bytes_per_token(spec: TinyModelSpec) -> int:
    """KV bytes one token occupies: fp32 for MHA (K and V) and MLA (latent plus rope part);
    GLM-5.3-Flash's DSA layers keep a bf16 latent and a quarter of a 132-byte index row
    (its KDA layers' state is per request, not per token)."""
    head_dim = spec.hidden_size // spec.num_heads
    if spec.architecture == "glm5_next":
        dsa_layers = spec.layer_types.count("indexed_attention")
        return dsa_layers * (2 * head_dim * 2 + (128 + 4) // 4)
    if spec.is_mla:
        # models.py: kv_lora_rank = 2 * head_dim, qk_rope_head_dim = head_dim.
        return spec.num_layers * 3 * head_dim * 4
    return spec.num_layers * 2 * spec.hidden_size * 4


def round_prompt(seed: int, architecture: str, length_tokens: int, index: int) -> list[int]:
    """A fresh random prompt for one round, sharing no prefix with any other round."""
    rng = random.Random(f"{seed}:{architecture}:{length_tokens}:{index}")
    return [rng.randrange(PROMPT_VOCAB_TOKENS) for _ in range(length_tokens)]


def stream_generate(
    url: str,
    input_ids: Sequence[int],
    max_new_tokens: int,
    top_logprobs: int = 0,
    timeout_s: float = REQUEST_TIMEOUT_S,
) -> tuple[float, Completion]:
    """One streamed greedy generation: (seconds to the first chunk, the final answer,
    with the answer tokens' ``top_logprobs`` best candidates when asked)."""
    body = {**generate_body(input_ids, max_new_tokens, top_logprobs), "stream": True}
    request = urllib.request.Request(
        f"{url}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    started = time.perf_counter()
    ttft_s, last = None, None
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        for raw in answer:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            if ttft_s is None:
                ttft_s = time.perf_counter() - started
            last = json.loads(line[len("data:") :])
    if last is None or ttft_s is None:
        raise RuntimeError(f"{url}/generate streamed no chunk")
    return ttft_s, parse_completion(last, time.perf_counter() - started)


def scrape(server: SglangServer) -> dict[str, float]:
    answer = http_get(f"{server.url}/metrics", timeout_s=10.0)
    if answer is None or answer[0] != 200:
        return {}
    return S.parse_prometheus(answer[1])


def stored_keys(cluster: LocalCluster) -> set[str]:
    return set(iter_lines(f"{cluster.metrics_url}/get_all_keys", timeout_s=10.0))


def wait_for_backup(cluster: LocalCluster, before: set[str], min_new_keys: int) -> dict:
    """Wait until the writer's new keys number ``min_new_keys`` and stop growing."""
    started = time.monotonic()
    seen, settled_at = -1, started
    while True:
        new_keys = len(stored_keys(cluster) - before)
        now = time.monotonic()
        if new_keys != seen:
            seen, settled_at = new_keys, now
        if new_keys >= min_new_keys and now - settled_at >= BACKUP_SETTLED_S:
            return {"new_keys": new_keys, "complete": True, "wait_s": now - started}
        if now - started > BACKUP_TIMEOUT_S:
            logger.warning("backup incomplete: %d of %d keys", new_keys, min_new_keys)
            return {"new_keys": new_keys, "complete": False, "wait_s": now - started}
        time.sleep(BACKUP_POLL_S)


def arm_options(
    arm: str, model_path: Path, cluster: LocalCluster | None, **fields: Any
) -> ServerOptions:
    """One arm's server: no L3 (recompute), this backend (``dynamic``) or ``MooncakeStore``.

    ``fields`` are the remaining :class:`ServerOptions`; every server serves
    ``/metrics`` for the TTFT breakdown.
    """
    extra_args = ("--enable-metrics", *fields.pop("extra_args", ()))
    env = dict(fields.pop("env", {}))
    fields = {"extra_args": extra_args, **fields}
    if arm == S.RECOMPUTE:
        return ServerOptions(model_path=model_path, storage_backend=None, env=env, **fields)
    storage = cluster.client_config(0)
    if arm == S.MOONCAKE:
        storage = {k: v for k, v in storage.items() if not k.startswith("span_")}
    backend = "dynamic" if arm == S.SPAN else "mooncake"
    return ServerOptions(
        model_path=model_path,
        storage_backend=backend,
        storage_config=storage,
        env={**cluster.client_env(), **env},
        **fields,
    )


def arm_clusters(stack: ExitStack, segment_bytes: int, log_dir: Path) -> dict[str, LocalCluster]:
    """An embedded cluster per L3 arm (one storage node each), stopped with ``stack``.

    Separate clusters keep one arm's keys and evictions from touching the other's.
    """
    clusters = {}
    for arm in S.L3_ARMS:
        spec = ClusterSpec(
            storage_nodes=1,
            storage_node_segment_bytes=segment_bytes,
            eviction_ratio=0.2,
            log_dir=log_dir / f"cluster-{arm}",
        )
        clusters[arm] = stack.enter_context(LocalCluster(spec))
    return clusters


def _wait_or_relaunch(server: SglangServer, log_dir: Path, stack: ExitStack) -> SglangServer:
    """Wait for a started server; one whose port another process bound first starts again.

    A port picked free can be taken before the server binds it (other servers
    start on this host too); sglang then logs the bind error and hangs in its
    shutdown instead of exiting, so the log is what tells.
    """
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while PORT_TAKEN_TEXT not in (text := server.log_text()):
        if READY_TEXT in text or not server.running() or time.monotonic() > deadline:
            server.wait_ready(max(1.0, deadline - time.monotonic()))
            return server
        time.sleep(1.0)
    logger.warning("%s lost port %d to another process; starting again", server.name, server.port)
    server.stop()
    fresh = SglangServer(server.name, server.options, log_dir)
    stack.callback(fresh.stop)
    fresh.process.start()
    fresh.wait_ready(SERVER_START_TIMEOUT_S)
    return fresh


def start_servers(servers: dict[Any, SglangServer], log_dir: Path, stack: ExitStack) -> dict:
    """Start every server at once (each takes ~30 s here), wait for all of them, and warm
    each up (``SglangServer.warm_up``), so no measured request pays a lazy load."""
    for server in servers.values():
        server.process.start()
    ready = {key: _wait_or_relaunch(server, log_dir, stack) for key, server in servers.items()}
    for server in ready.values():
        server.warm_up()
    return ready
