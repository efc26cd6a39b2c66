"""``mooncake-span demo``: two real sglang servers share one Mooncake L3 through this backend.

An embedded cluster (master with its HTTP metadata server, one storage node)
on free loopback ports, a tiny random-weight model made locally, and two
``sglang.launch_server`` processes with ``--hicache-storage-backend dynamic``
loading ``MooncakeSpanStore``, configured as we recommend (prefix keys passed,
sglang's default ``timeout`` prefetch policy). Server A answers a prompt and
backs its pages up to L3 (write-through); server B, a separate process with
empty caches, answers the same prompt. The demo prints how many of B's prompt
tokens came from storage, whether both answers are the same greedy tokens, and
the timings; when B restored less than every page it could, it says why from
the master's key count and B's metrics, and what to do. On a host without
CUDA the servers run with the CPU stand-ins of
:mod:`mooncake_span.testing.cpu_server`.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mooncake_span.lab.sglang_servers import (
    Completion,
    ServerOptions,
    SglangServer,
    settled_count,
    start_together,
)
from mooncake_span.ops.cluster import LocalCluster
from mooncake_span.ops.cluster_spec import ClusterSpec
from mooncake_span.ops.master_http import iter_lines
from mooncake_span.testing.cpu_server.models import TinyModelSpec, ensure_model, prompt_text

PASS_PREFIX_KEYS = "hicache_storage_pass_prefix_keys"

PAGE_TOKENS = 64
BACKUP_TIMEOUT_S = 60.0
SHOWN_WORDS = 8


@dataclass(frozen=True)
class ServeDemoConfig:
    architecture: str = "llama"
    layout: str = "page_first_direct"
    prompt_tokens: int = 2048
    answer_tokens: int = 16
    seed: int = 0
    model_cache_dir: Path = Path.home() / ".cache" / "mooncake-span" / "tiny-models"

    def __post_init__(self) -> None:
        TinyModelSpec(architecture=self.architecture)  # validates the name
        if self.prompt_tokens < 5 * PAGE_TOKENS:
            raise ValueError(
                f"prompt_tokens must be at least {5 * PAGE_TOKENS}: sglang restores whole "
                f"{PAGE_TOKENS}-token pages, never the last one, and does not prefetch a "
                f"remainder under its 256-token threshold (got {self.prompt_tokens})"
            )
        if self.answer_tokens <= 0:
            raise ValueError(f"answer_tokens must be positive, got {self.answer_tokens}")


# This backend's and sglang's counters that say where a restore stopped.
HIT_QUERIES = "mooncake_span_hit_queries_total"
HIT_KEYS = 'mooncake_span_hit_query_keys_total{result="hit"}'
UNFULFILLED = "sglang:storage_prefetch_unfulfilled_tokens_total"


@dataclass(frozen=True)
class RestoreEvidence:
    """What B's restore can be explained by: A's backup in the master, and B's counters
    (this backend's hit queries, sglang's unfulfilled prefetch tokens) over B's request."""

    page_tokens: int
    restorable_tokens: int
    storage_tokens: int
    backed_up_keys: int
    expected_keys: int
    metrics_delta: Mapping[str, float]

    def delta(self, name: str) -> float:
        return self.metrics_delta.get(name, 0.0)


def explain_restore(evidence: RestoreEvidence) -> list[str]:
    """Why B restored less than it could, and what to do about it (empty: it restored all)."""
    e = evidence
    if e.storage_tokens >= e.restorable_tokens:
        return []
    reasons = []
    if e.backed_up_keys < e.expected_keys:
        reasons.append(
            f"nothing or too little stored: A's backup put {e.backed_up_keys} of "
            f"{e.expected_keys} pages in L3 within {BACKUP_TIMEOUT_S:.0f}s; see A's log for "
            "backup errors, and `mooncake-span inspect` for what the cluster holds"
        )
    if e.delta(HIT_QUERIES) == 0:
        reasons.append(
            "B never asked L3: sglang asks only for a remainder of at least 256 tokens that "
            "is not already in B's device or host cache"
        )
    elif e.delta(HIT_KEYS) * e.page_tokens < e.restorable_tokens:
        reasons.append(
            f"B's hit query found {e.delta(HIT_KEYS):.0f} of "
            f"{e.restorable_tokens // e.page_tokens} pages in L3: the rest were not stored "
            "(or were evicted) under the keys B computed"
        )
    for key, tokens in sorted(e.metrics_delta.items()):
        if not key.startswith(UNFULFILLED + "{reason="):
            continue
        reason = key[len(UNFULFILLED) + len('{reason="') : -2]
        advice = (
            "the prefetch took longer than the 'timeout' policy allows (1 s + 0.25 s per "
            "1,024 tokens); on a loaded box rerun, or serve with "
            "--hicache-storage-prefetch-policy wait_complete"
            if reason == "deadline"
            else "see B's log"
        )
        reasons.append(f"sglang dropped {tokens:.0f} prefetched tokens (reason {reason}): {advice}")
    if not reasons:
        reasons.append("no counter explains it; B's log says what its prefetch did")
    return reasons


@dataclass(frozen=True)
class ServeDemoReport:
    first: Completion
    second: Completion
    startup_s: float
    evidence: RestoreEvidence

    @property
    def identical(self) -> bool:
        return self.first.output_ids == self.second.output_ids

    @property
    def restored_all(self) -> bool:
        return self.second.storage_tokens == self.evidence.restorable_tokens

    @property
    def ok(self) -> bool:
        return self.identical and self.restored_all


def _stored_keys(cluster: LocalCluster) -> int:
    return sum(1 for _ in iter_lines(f"{cluster.metrics_url}/get_all_keys", timeout_s=5.0))


def _wait_for_backup(cluster: LocalCluster, min_keys: int) -> int:
    """The master's key count once it reaches ``min_keys``, or when the wait ends."""
    deadline = time.monotonic() + BACKUP_TIMEOUT_S
    while (count := _stored_keys(cluster)) < min_keys and time.monotonic() < deadline:
        time.sleep(0.5)
    return count


def _words(token_ids: tuple[int, ...]) -> str:
    shown = prompt_text(list(token_ids[:SHOWN_WORDS]))
    return shown + (" ..." if len(token_ids) > SHOWN_WORDS else "")


def demo_server_options(
    model_path: Path, layout: str, cluster: LocalCluster, page_tokens: int = PAGE_TOKENS
) -> ServerOptions:
    """What we recommend (sglang's default prefetch policy, prefix keys passed to the
    backend), plus ``--enable-metrics`` so the demo can say where a restore stopped."""
    return ServerOptions(
        model_path=model_path,
        layout=layout,
        page_size_tokens=page_tokens,
        storage_config={**cluster.client_config(0), PASS_PREFIX_KEYS: True},
        env=cluster.client_env(),
        extra_args=("--enable-metrics",),
    )


def run_serve_demo(config: ServeDemoConfig, log_dir: Path | None = None) -> ServeDemoReport:
    spec = TinyModelSpec(architecture=config.architecture)
    model_path = ensure_model(spec, config.model_cache_dir)
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="mooncake-span-demo-"))
    rng = random.Random(config.seed)
    input_ids = [rng.randrange(spec.vocab_words) for _ in range(config.prompt_tokens)]
    print(f"model: tiny {config.architecture} made locally at {model_path}", flush=True)
    with LocalCluster(ClusterSpec(storage_nodes=1, log_dir=log_dir / "cluster")) as cluster:
        print(f"cluster: master {cluster.master_address}, one storage node", flush=True)
        options = demo_server_options(model_path, config.layout, cluster)
        servers = [SglangServer(name, options, log_dir) for name in ("A", "B")]
        started = time.monotonic()
        try:
            start_together(servers)
            startup_s = time.monotonic() - started
            print(f"servers A and B up in {startup_s:.0f}s (logs: {log_dir})", flush=True)
            report = _ask_both(cluster, servers, input_ids, config.answer_tokens, startup_s)
        finally:
            for server in servers:
                server.stop()
    _print_report(report, config, log_dir)
    return report


def _ask_both(
    cluster: LocalCluster,
    servers: list[SglangServer],
    input_ids: list[int],
    answer_tokens: int,
    startup_s: float,
) -> ServeDemoReport:
    base_keys = settled_count(lambda: _stored_keys(cluster))
    first = servers[0].generate(input_ids, answer_tokens)
    print(
        f"A: {first.prompt_tokens}-token prompt answered in {first.e2e_s:.2f}s "
        f"({first.storage_tokens} tokens from L3): {_words(first.output_ids)}",
        flush=True,
    )
    expected_keys = len(input_ids) // PAGE_TOKENS - 1
    backed_up = _wait_for_backup(cluster, base_keys + expected_keys) - base_keys
    before = servers[1].metrics()
    second = servers[1].generate(input_ids, answer_tokens)
    after = servers[1].metrics()
    print(
        f"B: same prompt answered in {second.e2e_s:.2f}s "
        f"({second.storage_tokens} tokens from L3): {_words(second.output_ids)}",
        flush=True,
    )
    evidence = RestoreEvidence(
        page_tokens=PAGE_TOKENS,
        restorable_tokens=(len(input_ids) - 1) // PAGE_TOKENS * PAGE_TOKENS,
        storage_tokens=second.storage_tokens,
        backed_up_keys=backed_up,
        expected_keys=expected_keys,
        metrics_delta={k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k)},
    )
    return ServeDemoReport(first=first, second=second, startup_s=startup_s, evidence=evidence)


def _print_report(report: ServeDemoReport, config: ServeDemoConfig, log_dir: Path) -> None:
    print(
        f"restored from L3: {report.second.storage_tokens} of {config.prompt_tokens} prompt "
        f"tokens (at most {report.evidence.restorable_tokens}: the last page is always computed)",
        flush=True,
    )
    for reason in explain_restore(report.evidence):
        print(f"  why not all: {reason} (logs: {log_dir})", flush=True)
    print(f"identical greedy output: {'yes' if report.identical else 'NO'}", flush=True)
    print(
        f"time: A {report.first.e2e_s:.2f}s (computed), B {report.second.e2e_s:.2f}s "
        "(restored); one run on a shared box, not a benchmark (mooncake-span bench --serve)",
        flush=True,
    )
