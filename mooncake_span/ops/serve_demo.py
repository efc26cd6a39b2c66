"""``mooncake-span demo``: two real sglang servers share one Mooncake L3 through this backend.

An embedded cluster (master with its HTTP metadata server, one storage node)
on free loopback ports, a tiny random-weight model made locally, and two
``sglang.launch_server`` processes with ``--hicache-storage-backend dynamic``
loading ``MooncakeSpanStore``. Server A answers a prompt and backs its pages
up to L3 (write-through); server B, a separate process with empty caches,
answers the same prompt. The demo prints how many of B's prompt tokens came
from storage, whether both answers are the same greedy tokens, and the
timings. On a host without CUDA the servers run with the CPU stand-ins of
:mod:`mooncake_span.testing.cpu_server`.
"""

from __future__ import annotations

import random
import tempfile
import time
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


@dataclass(frozen=True)
class ServeDemoReport:
    first: Completion
    second: Completion
    startup_s: float

    @property
    def identical(self) -> bool:
        return self.first.output_ids == self.second.output_ids

    @property
    def ok(self) -> bool:
        return self.identical and self.second.storage_tokens > 0


def _stored_keys(cluster: LocalCluster) -> int:
    return sum(1 for _ in iter_lines(f"{cluster.metrics_url}/get_all_keys", timeout_s=5.0))


def _wait_for_backup(cluster: LocalCluster, min_keys: int) -> None:
    deadline = time.monotonic() + BACKUP_TIMEOUT_S
    while _stored_keys(cluster) < min_keys:
        if time.monotonic() > deadline:
            raise TimeoutError(f"server A's pages were not in L3 after {BACKUP_TIMEOUT_S:.0f}s")
        time.sleep(0.5)


def _words(token_ids: tuple[int, ...]) -> str:
    shown = prompt_text(list(token_ids[:SHOWN_WORDS]))
    return shown + (" ..." if len(token_ids) > SHOWN_WORDS else "")


def run_serve_demo(config: ServeDemoConfig, log_dir: Path | None = None) -> ServeDemoReport:
    spec = TinyModelSpec(architecture=config.architecture)
    model_path = ensure_model(spec, config.model_cache_dir)
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="mooncake-span-demo-"))
    rng = random.Random(config.seed)
    input_ids = [rng.randrange(spec.vocab_words) for _ in range(config.prompt_tokens)]
    print(f"model: tiny {config.architecture} made locally at {model_path}", flush=True)
    with LocalCluster(ClusterSpec(storage_nodes=1, log_dir=log_dir / "cluster")) as cluster:
        print(f"cluster: master {cluster.master_address}, one storage node", flush=True)
        options = ServerOptions(
            model_path=model_path,
            layout=config.layout,
            storage_config=cluster.client_config(0),
            env=cluster.client_env(),
        )
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
    _print_report(report, config)
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
    _wait_for_backup(cluster, base_keys + len(input_ids) // PAGE_TOKENS - 1)
    second = servers[1].generate(input_ids, answer_tokens)
    print(
        f"B: same prompt answered in {second.e2e_s:.2f}s "
        f"({second.storage_tokens} tokens from L3): {_words(second.output_ids)}",
        flush=True,
    )
    return ServeDemoReport(first=first, second=second, startup_s=startup_s)


def _print_report(report: ServeDemoReport, config: ServeDemoConfig) -> None:
    restorable = (config.prompt_tokens - 1) // PAGE_TOKENS * PAGE_TOKENS
    print(
        f"restored from L3: {report.second.storage_tokens} of {config.prompt_tokens} prompt "
        f"tokens (at most {restorable}: the last page is always computed)",
        flush=True,
    )
    print(f"identical greedy output: {'yes' if report.identical else 'NO'}", flush=True)
    print(
        f"time: A {report.first.e2e_s:.2f}s (computed), B {report.second.e2e_s:.2f}s "
        "(restored); one run on a shared box, not a benchmark (mooncake-span bench --serve)",
        flush=True,
    )
