"""``mooncake-span demo``: two real sglang servers share one Mooncake L3 through this backend.

An embedded cluster (master with its HTTP metadata server, one storage node)
on free loopback ports, a tiny random-weight model made locally, and two
``sglang.launch_server`` processes with ``--hicache-storage-backend dynamic``
loading ``MooncakeSpanStore``. Server A answers a prompt and backs its pages
up to L3 (write-through); server B, a separate process with empty caches,
answers the same prompt. The demo prints how many of B's prompt tokens came
from storage, what B's backend read per host pool, whether both answers are
the same greedy tokens with the same top logprobs (the content oracle of
:mod:`mooncake_span.lab.oracle`; A computed its answer, so it is the recompute
reference), and the timings. ``--model glm5_next`` serves GLM-5.3-Flash's
shape: 256-token pages and three pools (MLA KV, the DSA indexer, KDA state).
On a host without CUDA the servers run with the CPU stand-ins of
:mod:`mooncake_span.testing.cpu_server`.
"""

from __future__ import annotations

import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from mooncake_span.lab import oracle
from mooncake_span.lab.sglang_servers import (
    Completion,
    ServerOptions,
    SglangServer,
    settled_count,
    start_together,
)
from mooncake_span.ops import inspect_cmd
from mooncake_span.ops.cluster import LocalCluster
from mooncake_span.ops.cluster_spec import ClusterSpec
from mooncake_span.ops.launcher import http_get
from mooncake_span.testing.cpu_server.models import (
    default_spec,
    ensure_model,
    prompt_text,
    serving_profile,
)

BACKUP_TIMEOUT_S = 60.0
SHOWN_WORDS = 8
TOP_LOGPROBS = 5
# The host pools a server of each model registers with the backend.
POOLS = {"glm5_next": ("kv", "indexer", "mamba")}


@dataclass(frozen=True)
class ServeDemoConfig:
    architecture: str = "llama"
    layout: str = "page_first_direct"
    prompt_tokens: int = 2048
    answer_tokens: int = 16
    seed: int = 0
    model_cache_dir: Path = Path.home() / ".cache" / "mooncake-span" / "tiny-models"

    def __post_init__(self) -> None:
        page = self.page_tokens  # validates the name
        if self.prompt_tokens < 5 * page:
            raise ValueError(
                f"prompt_tokens must be at least {5 * page}: sglang restores whole "
                f"{page}-token pages, never the last one, and does not prefetch a "
                f"remainder under its 256-token threshold (got {self.prompt_tokens})"
            )
        if self.answer_tokens <= 0:
            raise ValueError(f"answer_tokens must be positive, got {self.answer_tokens}")

    @property
    def page_tokens(self) -> int:
        return serving_profile(default_spec(self.architecture)).page_size_tokens

    @property
    def pools(self) -> tuple[str, ...]:
        return POOLS.get(self.architecture, ("kv",))


@dataclass(frozen=True)
class ServeDemoReport:
    first: Completion
    second: Completion
    startup_s: float
    # What B's backend read from L3 for its request, per host pool.
    reads: dict[str, oracle.PoolReads] = field(default_factory=dict)

    @property
    def identical(self) -> bool:
        return self.first.output_ids == self.second.output_ids

    @property
    def verdict(self) -> oracle.Verdict:
        return oracle.compare(
            self.second.output_ids,
            self.second.top_logprobs,
            self.first.output_ids,
            self.first.top_logprobs,
        )

    @property
    def ok(self) -> bool:
        every_pool = all(r.keys > 0 for r in self.reads.values())
        return self.verdict.agrees and self.second.storage_tokens > 0 and every_pool


def _stored_pages(cluster: LocalCluster) -> int:
    namespaces, _guards, _total = inspect_cmd.scan_keys(cluster.metrics_url, 0)
    return sum(len(ns.page_keys) for ns in namespaces.values())


def _wait_for_backup(cluster: LocalCluster, min_pages: int) -> None:
    deadline = time.monotonic() + BACKUP_TIMEOUT_S
    while _stored_pages(cluster) < min_pages:
        if time.monotonic() > deadline:
            raise TimeoutError(f"server A's pages were not in L3 after {BACKUP_TIMEOUT_S:.0f}s")
        time.sleep(0.5)


def _reads(server: SglangServer, pools: tuple[str, ...]) -> dict[str, oracle.PoolReads]:
    answer = http_get(f"{server.url}/metrics", timeout_s=10.0)
    return oracle.pool_reads(answer[1] if answer and answer[0] == 200 else "", pools)


def _words(token_ids: tuple[int, ...]) -> str:
    shown = prompt_text(list(token_ids[:SHOWN_WORDS]))
    return shown + (" ..." if len(token_ids) > SHOWN_WORDS else "")


def run_serve_demo(config: ServeDemoConfig, log_dir: Path | None = None) -> ServeDemoReport:
    spec = default_spec(config.architecture)
    model_path = ensure_model(spec, config.model_cache_dir)
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="mooncake-span-demo-"))
    rng = random.Random(config.seed)
    input_ids = [rng.randrange(spec.vocab_words) for _ in range(config.prompt_tokens)]
    print(f"model: tiny {config.architecture} made locally at {model_path}", flush=True)
    with LocalCluster(ClusterSpec(storage_nodes=1, log_dir=log_dir / "cluster")) as cluster:
        print(f"cluster: master {cluster.master_address}, one storage node", flush=True)
        # /metrics: what B's backend read per pool.
        fields = serving_profile(spec).server_fields(("--enable-metrics",), cluster.client_env())
        options = ServerOptions(
            model_path=model_path,
            layout=config.layout,
            storage_config=cluster.client_config(0),
            **fields,
        )
        servers = [SglangServer(name, options, log_dir) for name in ("A", "B")]
        started = time.monotonic()
        try:
            start_together(servers)
            startup_s = time.monotonic() - started
            print(f"servers A and B up in {startup_s:.0f}s (logs: {log_dir})", flush=True)
            report = _ask_both(cluster, servers, input_ids, config, startup_s)
        finally:
            for server in servers:
                server.stop()
    _print_report(report, config)
    return report


def _ask_both(
    cluster: LocalCluster,
    servers: list[SglangServer],
    input_ids: list[int],
    config: ServeDemoConfig,
    startup_s: float,
) -> ServeDemoReport:
    base_pages = settled_count(lambda: _stored_pages(cluster))
    answer_tokens = config.answer_tokens
    first = servers[0].generate(input_ids, answer_tokens, top_logprobs=TOP_LOGPROBS)
    print(
        f"A: {first.prompt_tokens}-token prompt answered in {first.e2e_s:.2f}s "
        f"({first.storage_tokens} tokens from L3): {_words(first.output_ids)}",
        flush=True,
    )
    # A backs up every full page of prompt + answer (the last answer token has no KV yet).
    _wait_for_backup(
        cluster, base_pages + (len(input_ids) + answer_tokens - 1) // config.page_tokens
    )
    before = _reads(servers[1], config.pools)
    second = servers[1].generate(input_ids, answer_tokens, top_logprobs=TOP_LOGPROBS)
    reads = oracle.reads_between(before, _reads(servers[1], config.pools))
    print(
        f"B: same prompt answered in {second.e2e_s:.2f}s "
        f"({second.storage_tokens} tokens from L3): {_words(second.output_ids)}",
        flush=True,
    )
    return ServeDemoReport(first=first, second=second, startup_s=startup_s, reads=reads)


def _print_report(report: ServeDemoReport, config: ServeDemoConfig) -> None:
    page = config.page_tokens
    restorable = (config.prompt_tokens - 1) // page * page
    print(
        f"restored from L3: {report.second.storage_tokens} of {config.prompt_tokens} prompt "
        f"tokens (at most {restorable}: the last page is always computed)",
        flush=True,
    )
    read = ", ".join(
        f"{pool} {r.keys:.0f} key{'' if r.keys == 1 else 's'} ({r.bytes:,.0f} B)"
        for pool, r in report.reads.items()
    )
    print(f"read from L3 per pool: {read}", flush=True)
    print(f"identical greedy output: {'yes' if report.identical else 'NO'}", flush=True)
    verdict = report.verdict
    agreement = "yes" if verdict.agrees else "NO"
    print(
        f"oracle agrees with A's computed answer: {agreement} ({verdict.describe()}, "
        f"tolerance {verdict.tolerance:g})",
        flush=True,
    )
    print(
        f"time: A {report.first.e2e_s:.2f}s (computed), B {report.second.e2e_s:.2f}s "
        "(restored); one run on a shared box, not a benchmark (mooncake-span bench --serve)",
        flush=True,
    )
