"""``mooncake-span demo``: two real sglang servers share one Mooncake L3 through this backend.

An embedded cluster (master with its HTTP metadata server, one storage node)
on free loopback ports, a tiny random-weight model made locally, and two
``sglang.launch_server`` processes with ``--hicache-storage-backend dynamic``
loading ``MooncakeSpanStore``, configured as we recommend (prefix keys passed,
sglang's default ``timeout`` prefetch policy). Server A answers a prompt and
backs its pages up to L3 (write-through); server B, a separate process with
empty caches, answers the same prompt. The demo prints how many of B's prompt
tokens came from storage, what B's backend read per host pool, whether both
answers are the same greedy tokens with the same top logprobs (the content
oracle of :mod:`mooncake_span.ops.oracle`; A computed its answer, so it is the
recompute reference), and the timings; when B restored less than every page
it could, it says why from the master's key count and B's metrics, and what
to do. ``--model glm5_next`` serves GLM-5.3-Flash's shape: 256-token pages and
three pools (MLA KV, the DSA indexer, KDA state). On a host without CUDA the
servers run with the CPU stand-ins of :mod:`mooncake_span_tools.testing.cpu_server`.
"""

from __future__ import annotations

import random
import re
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mooncake_span.ops import inspect_cmd, oracle
from mooncake_span.ops.cluster import LocalCluster
from mooncake_span.ops.cluster_spec import ClusterSpec
from mooncake_span.ops.launcher import http_get
from mooncake_span_tools.lab.sglang_servers import (
    Completion,
    ServerOptions,
    SglangServer,
    settled_count,
    start_together,
    stop_together,
)
from mooncake_span_tools.testing.cpu_server.models import (
    ServingProfile,
    default_spec,
    ensure_model,
    prompt_text,
    serving_profile,
)

PASS_PREFIX_KEYS = "hicache_storage_pass_prefix_keys"

BACKUP_TIMEOUT_S = 60.0
SHOWN_WORDS = 8
TOP_LOGPROBS = 5
# The host pools a server of each model registers with the backend.
POOLS = {"glm5_next": ("kv", "indexer", "mamba")}


# ---------------------------------------------------------------------------
# what a server's backend read, per host pool (its Prometheus families)

_SAMPLE = re.compile(r"^(mooncake_span_[a-z_]+)(\{[^}]*\})?\s+(\S+)$")
_KEYS = 'mooncake_span_keys_total{{operation="get",pool="{pool}",result="ok"}}'
_BYTES = 'mooncake_span_bytes_total{{operation="get",pool="{pool}"}}'


@dataclass(frozen=True)
class PoolReads:
    keys: float
    bytes: float


def pool_reads(metrics_text: str, pools: Sequence[str]) -> dict[str, PoolReads]:
    """Keys and bytes this backend has read per pool, from a server's ``/metrics`` text
    (counters since the server started; subtract an earlier scrape for one request)."""
    samples = {}
    for line in metrics_text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match is not None:
            samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return {
        pool: PoolReads(
            keys=samples.get(_KEYS.format(pool=pool), 0.0),
            bytes=samples.get(_BYTES.format(pool=pool), 0.0),
        )
        for pool in pools
    }


def reads_between(
    before: dict[str, PoolReads], after: dict[str, PoolReads]
) -> dict[str, PoolReads]:
    return {
        pool: PoolReads(
            after[pool].keys - before[pool].keys, after[pool].bytes - before[pool].bytes
        )
        for pool in after
    }


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
    def profile(self) -> ServingProfile:
        return serving_profile(default_spec(self.architecture))

    @property
    def page_tokens(self) -> int:
        return self.profile.page_size_tokens

    @property
    def pools(self) -> tuple[str, ...]:
        return POOLS.get(self.architecture, ("kv",))


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
    # What B's backend read from L3 for its request, per host pool.
    reads: dict[str, PoolReads] = field(default_factory=dict)

    @property
    def identical(self) -> bool:
        return self.first.output_ids == self.second.output_ids

    @property
    def restored_all(self) -> bool:
        return self.second.storage_tokens == self.evidence.restorable_tokens

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
        return self.restored_all and self.verdict.agrees and every_pool


def _stored_pages(cluster: LocalCluster) -> int:
    """Storage keys (pages) in the master; a GLM page is several objects."""
    namespaces, _guards, _total = inspect_cmd.scan_keys(cluster.metrics_url, 0)
    return sum(len(ns.page_keys) for ns in namespaces.values())


def _wait_for_backup(cluster: LocalCluster, min_pages: int) -> int:
    """The master's page count once it reaches ``min_pages``, or when the wait ends."""
    deadline = time.monotonic() + BACKUP_TIMEOUT_S
    while (count := _stored_pages(cluster)) < min_pages and time.monotonic() < deadline:
        time.sleep(0.5)
    return count


def _reads(server: SglangServer, pools: tuple[str, ...]) -> dict[str, PoolReads]:
    answer = http_get(f"{server.url}/metrics", timeout_s=10.0)
    return pool_reads(answer[1] if answer and answer[0] == 200 else "", pools)


def _words(token_ids: tuple[int, ...]) -> str:
    shown = prompt_text(list(token_ids[:SHOWN_WORDS]))
    return shown + (" ..." if len(token_ids) > SHOWN_WORDS else "")


def demo_server_options(
    model_path: Path,
    layout: str,
    cluster: LocalCluster,
    profile: ServingProfile | None = None,
) -> ServerOptions:
    """What we recommend (sglang's default prefetch policy, prefix keys passed to the
    backend), plus ``--enable-metrics`` so the demo can say where a restore stopped and
    what B read; ``profile``: the model's page and flags (default: a 64-token page)."""
    profile = profile or serving_profile(default_spec("llama"))
    return ServerOptions(
        model_path=model_path,
        layout=layout,
        storage_config={**cluster.client_config(0), PASS_PREFIX_KEYS: True},
        **profile.server_fields(("--enable-metrics",), cluster.client_env()),
    )


def run_serve_demo(config: ServeDemoConfig, log_dir: Path | None = None) -> ServeDemoReport:
    spec = default_spec(config.architecture)
    model_path = ensure_model(spec, config.model_cache_dir)
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="mooncake-span-demo-"))
    rng = random.Random(config.seed)
    input_ids = [rng.randrange(spec.vocab_words) for _ in range(config.prompt_tokens)]
    print(f"model: tiny {config.architecture} made locally at {model_path}", flush=True)
    with LocalCluster(ClusterSpec(storage_nodes=1, log_dir=log_dir / "cluster")) as cluster:
        print(f"cluster: master {cluster.master_address}, one storage node", flush=True)
        options = demo_server_options(model_path, config.layout, cluster, config.profile)
        servers = [SglangServer(name, options, log_dir) for name in ("A", "B")]
        started = time.monotonic()
        try:
            start_together(servers)
            startup_s = time.monotonic() - started
            print(f"servers A and B up in {startup_s:.0f}s (logs: {log_dir})", flush=True)
            report = _ask_both(cluster, servers, input_ids, config, startup_s)
        finally:
            stop_together(servers)
    _print_report(report, config, log_dir)
    return report


def _ask_both(
    cluster: LocalCluster,
    servers: list[SglangServer],
    input_ids: list[int],
    config: ServeDemoConfig,
    startup_s: float,
) -> ServeDemoReport:
    base_keys = settled_count(lambda: _stored_pages(cluster))
    answer_tokens, page = config.answer_tokens, config.page_tokens
    first = servers[0].generate(input_ids, answer_tokens, top_logprobs=TOP_LOGPROBS)
    print(
        f"A: {first.prompt_tokens}-token prompt answered in {first.e2e_s:.2f}s "
        f"({first.storage_tokens} tokens from L3): {_words(first.output_ids)}",
        flush=True,
    )
    expected_keys = len(input_ids) // page - 1
    backed_up = _wait_for_backup(cluster, base_keys + expected_keys) - base_keys
    before, reads_before = servers[1].metrics(), _reads(servers[1], config.pools)
    second = servers[1].generate(input_ids, answer_tokens, top_logprobs=TOP_LOGPROBS)
    after, reads_after = servers[1].metrics(), _reads(servers[1], config.pools)
    print(
        f"B: same prompt answered in {second.e2e_s:.2f}s "
        f"({second.storage_tokens} tokens from L3): {_words(second.output_ids)}",
        flush=True,
    )
    evidence = RestoreEvidence(
        page_tokens=page,
        restorable_tokens=(len(input_ids) - 1) // page * page,
        storage_tokens=second.storage_tokens,
        backed_up_keys=backed_up,
        expected_keys=expected_keys,
        metrics_delta={k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k)},
    )
    reads = reads_between(reads_before, reads_after)
    return ServeDemoReport(first, second, startup_s, evidence, reads)


def _print_report(report: ServeDemoReport, config: ServeDemoConfig, log_dir: Path) -> None:
    print(
        f"restored from L3: {report.second.storage_tokens} of {config.prompt_tokens} prompt "
        f"tokens (at most {report.evidence.restorable_tokens}: the last page is always computed)",
        flush=True,
    )
    for reason in explain_restore(report.evidence):
        print(f"  why not all: {reason} (logs: {log_dir})", flush=True)
    read = ", ".join(
        f"{pool} {r.keys:.0f} key{'' if r.keys == 1 else 's'} ({r.bytes:,.0f} B)"
        for pool, r in report.reads.items()
    )
    print(f"read from L3 per pool: {read}", flush=True)
    print(f"identical greedy output: {'yes' if report.identical else 'NO'}", flush=True)
    verdict = report.verdict
    print(
        f"oracle agrees with A's computed answer: {'yes' if verdict.agrees else 'NO'} "
        f"({verdict.describe()}, tolerance {verdict.tolerance:g})",
        flush=True,
    )
    print(
        f"time: A {report.first.e2e_s:.2f}s (computed), B {report.second.e2e_s:.2f}s "
        "(restored); one run on a shared box, not a benchmark (mooncake-span bench --serve)",
        flush=True,
    )
