"""Serving benchmark with real sglang servers: a second server's TTFT from L3.

``mooncake-span bench --serve``. Three arms side by side, all on this host's
CPU: ``recompute`` (no L3 backend), ``span`` (this project's backend through
``--hicache-storage-backend dynamic``) and ``mooncake`` (sglang's built-in
``MooncakeStore``). Each L3 arm has its own embedded Mooncake cluster (one
storage node, same segment size), so neither arm's keys or evictions touch the
other's, and one writer server; every arm has one reader server. All five
servers stay alive together (``--sleep-on-idle``).

Each round takes a fresh random prompt: both writers answer it and the bench
waits until each writer's write-through backup has reached its master; then
every reader's device and host caches are flushed and the readers answer it
one after another (a second's pause after each), in an order that cycles
through every permutation of the arms. TTFT is the time from sending the
request to the first streamed chunk (``"stream": true``), which sglang sends
once the prefill has produced the first token. Round 0 of every
length is a warm-up and is left out of the figures. Every reader's and
writer's greedy tokens must equal the recompute reader's; a difference fails
the run (after the JSON is written).

For the TTFT breakdown the readers run with ``--enable-metrics``: the span
reader's ``mooncake_span_operation_duration_seconds`` (hit query, get) and
sglang's queue and TTFT histograms are scraped before and after each timed
request, and the prefetch lines of every L3 reader's log are counted.
"""

from __future__ import annotations

import json
import logging
import random
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mooncake_span.bench import serve_stats as S
from mooncake_span.lab.sglang_servers import (
    Completion,
    ServerOptions,
    SglangServer,
    generate_body,
    parse_completion,
)
from mooncake_span.ops.cluster import LocalCluster
from mooncake_span.ops.cluster_spec import ClusterSpec
from mooncake_span.ops.launcher import http_get
from mooncake_span.ops.master_http import iter_lines
from mooncake_span.testing.cpu_server.models import TinyModelSpec, ensure_model

logger = logging.getLogger(__name__)

DEFAULT_LENGTHS_TOKENS = (2048, 4096)
DEFAULT_MODELS = ("llama",)
SERVER_START_TIMEOUT_S = 420.0
BACKUP_TIMEOUT_S = 60.0
BACKUP_POLL_S = 0.25
# The backup is complete when the writer's new keys stop growing for this long.
BACKUP_SETTLED_S = 1.0
REQUEST_TIMEOUT_S = 300.0
# Pause after each reader's answer, before the next reader's request.
READER_SETTLE_S = 1.0
# sglang's log lines for a server that serves, and for one that lost its port.
READY_TEXT = "The server is fired up and ready to roll"
PORT_TAKEN_TEXT = "address already in use"
PROMPT_VOCAB_TOKENS = 500
METRIC_PREFIXES = (
    "mooncake_span_operation_duration_seconds_sum",
    "mooncake_span_operation_duration_seconds_count",
    "mooncake_span_bytes_total",
    "sglang:queue_time_seconds_sum",
    "sglang:time_to_first_token_seconds_sum",
    "sglang:storage_prefetch_hit_tokens_total",
)


@dataclass(frozen=True)
class ServeConfig:
    models: tuple[str, ...] = DEFAULT_MODELS
    lengths_tokens: tuple[int, ...] = DEFAULT_LENGTHS_TOKENS
    rounds: int = 8
    warmup_rounds: int = 1
    answer_tokens: int = 8
    hidden_size: int = 512
    num_layers: int = 8
    num_heads: int = 8
    page_size_tokens: int = 64
    hicache_ratio: float = 2.0
    # Per L3 arm's storage node; old rounds' objects are evicted to make room.
    segment_bytes: int = 1 << 30
    # wait_complete: a prefetch is never dropped half way, so each round
    # measures a full restore rather than the policy's timeout under load.
    prefetch_policy: str = "wait_complete"
    seed: int = 0
    work_dir: Path = field(default_factory=lambda: Path("/tmp/mooncake-span-serve"))

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.warmup_rounds < 0:
            raise ValueError("rounds must be >= 1 and warmup_rounds >= 0")
        for length in self.lengths_tokens:
            if length < 4 * self.page_size_tokens or length % self.page_size_tokens:
                raise ValueError(
                    f"prompt length {length} must be a multiple of the page "
                    f"({self.page_size_tokens} tokens) and at least 4 pages"
                )

    def model_spec(self, architecture: str) -> TinyModelSpec:
        return TinyModelSpec(
            architecture=architecture,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
        )

    @property
    def max_total_tokens(self) -> int:
        """Device KV pool of every server: the longest prompt, its answer and two pages."""
        pages = -(-(max(self.lengths_tokens) + self.answer_tokens) // self.page_size_tokens)
        return (pages + 2) * self.page_size_tokens


def kv_bytes_per_token(spec: TinyModelSpec) -> int:
    """fp32 KV bytes one token occupies (MHA: K and V; MLA: latent plus rope part)."""
    head_dim = spec.hidden_size // spec.num_heads
    if spec.is_mla:
        # models.py: kv_lora_rank = 2 * head_dim, qk_rope_head_dim = head_dim.
        return spec.num_layers * 3 * head_dim * 4
    return spec.num_layers * 2 * spec.hidden_size * 4


def parse_csv(text: str | None, default: Sequence[Any], kind: type = str) -> tuple:
    """A comma list from the command line, or ``default`` when not given."""
    if not text:
        return tuple(default)
    return tuple(kind(part.strip()) for part in text.split(",") if part.strip())


def round_prompt(seed: int, architecture: str, length_tokens: int, index: int) -> list[int]:
    """A fresh random prompt for one round, sharing no prefix with any other round."""
    rng = random.Random(f"{seed}:{architecture}:{length_tokens}:{index}")
    return [rng.randrange(PROMPT_VOCAB_TOKENS) for _ in range(length_tokens)]


def stream_generate(
    url: str, input_ids: Sequence[int], max_new_tokens: int
) -> tuple[float, Completion]:
    """One streamed greedy generation: (seconds to the first chunk, the final answer)."""
    body = {**generate_body(input_ids, max_new_tokens), "stream": True}
    request = urllib.request.Request(
        f"{url}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    started = time.perf_counter()
    ttft_s, last = None, None
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as answer:
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


@dataclass
class Arms:
    """The live servers of one model: a reader per arm, a writer and a cluster per L3 arm."""

    readers: dict[str, SglangServer]
    writers: dict[str, SglangServer]
    clusters: dict[str, LocalCluster]


def _options(config: ServeConfig, model_path: Path, arm: str, cluster: LocalCluster | None):
    common = dict(
        model_path=model_path,
        prefetch_policy=config.prefetch_policy,
        page_size_tokens=config.page_size_tokens,
        max_total_tokens=config.max_total_tokens,
        hicache_ratio=config.hicache_ratio,
        extra_args=("--enable-metrics",),
    )
    if arm == S.RECOMPUTE:
        return ServerOptions(storage_backend=None, **common)
    storage = cluster.client_config(0)
    if arm == S.MOONCAKE:
        storage = {k: v for k, v in storage.items() if not k.startswith("span_")}
    backend = "dynamic" if arm == S.SPAN else "mooncake"
    return ServerOptions(
        storage_backend=backend, storage_config=storage, env=cluster.client_env(), **common
    )


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


def _start_together(
    servers: dict[str, SglangServer], log_dir: Path, stack: ExitStack
) -> dict[str, SglangServer]:
    """Start every server at once (each takes ~30 s here) and wait for all of them."""
    for server in servers.values():
        server.process.start()
    return {key: _wait_or_relaunch(server, log_dir, stack) for key, server in servers.items()}


@contextmanager
def started_arms(config: ServeConfig, architecture: str, log_dir: Path) -> Iterator[Arms]:
    """Clusters and servers of every arm for one model, all stopped on exit."""
    model_path = ensure_model(config.model_spec(architecture), config.work_dir / "models")
    with ExitStack() as stack:
        clusters = {}
        for arm in S.L3_ARMS:
            spec = ClusterSpec(
                storage_nodes=1,
                storage_node_segment_bytes=config.segment_bytes,
                eviction_ratio=0.2,
                log_dir=log_dir / f"cluster-{arm}",
            )
            clusters[arm] = stack.enter_context(LocalCluster(spec))
        servers = {}
        for arm in S.ARMS:
            options = _options(config, model_path, arm, clusters.get(arm))
            roles = ("reader", "writer") if arm in S.L3_ARMS else ("reader",)
            for role in roles:
                servers[arm, role] = SglangServer(f"{architecture}-{arm}-{role}", options, log_dir)
                stack.callback(servers[arm, role].stop)
        servers = _start_together(servers, log_dir, stack)
        readers = {arm: server for (arm, role), server in servers.items() if role == "reader"}
        writers = {arm: server for (arm, role), server in servers.items() if role == "writer"}
        yield Arms(readers, writers, clusters)


def _write(arms: Arms, prompt: list[int], config: ServeConfig) -> dict[str, Any]:
    """Both writers answer the prompt; wait for each one's backup to reach its master."""
    min_new_keys = len(prompt) // config.page_size_tokens - 1
    records = {}
    for arm, writer in arms.writers.items():
        before = stored_keys(arms.clusters[arm])
        answer = writer.generate(prompt, config.answer_tokens, timeout_s=REQUEST_TIMEOUT_S)
        backup = wait_for_backup(arms.clusters[arm], before, min_new_keys)
        records[arm] = {"e2e_s": answer.e2e_s, "output_ids": list(answer.output_ids), **backup}
    return records


def _read(arms: Arms, arm: str, prompt: list[int], config: ServeConfig) -> dict[str, Any]:
    reader = arms.readers[arm]
    before = scrape(reader)
    ttft_s, answer = stream_generate(reader.url, prompt, config.answer_tokens)
    delta = S.metric_delta(before, scrape(reader), METRIC_PREFIXES)
    return {
        "ttft_s": ttft_s,
        "e2e_s": answer.e2e_s,
        "storage_tokens": answer.storage_tokens,
        "cached_tokens": answer.cached_tokens,
        "server_e2e_s": answer.meta_info.get("e2e_latency"),
        "output_ids": list(answer.output_ids),
        "metrics_delta": delta,
    }


def run_round(
    arms: Arms, config: ServeConfig, architecture: str, length_tokens: int, index: int
) -> dict[str, Any]:
    """One round: a fresh prompt, the writers, then every reader in this round's order."""
    prompt = round_prompt(config.seed, architecture, length_tokens, index)
    writers = _write(arms, prompt, config)
    for reader in arms.readers.values():
        reader.flush_cache()
    order = S.round_order(S.ARMS, index)
    answers = {}
    for arm in order:
        answers[arm] = _read(arms, arm, prompt, config)
        # The server that just answered still writes its pages back to host memory.
        time.sleep(READER_SETTLE_S)
    record = {
        "model": architecture,
        "prompt_tokens": length_tokens,
        "round": index,
        "warmup": index < config.warmup_rounds,
        "order": list(order),
        "arms": answers,
        "writers": writers,
    }
    record["disagreeing"] = S.disagreeing(S.round_outputs(record))
    ttfts = " ".join(f"{arm}={answers[arm]['ttft_s']:.2f}s" for arm in S.ARMS)
    print(
        f"{architecture} {length_tokens} tokens round {index}: {ttfts}", file=sys.stderr, flush=True
    )
    return record


def prefetch_log_lines(server: SglangServer) -> dict[str, int]:
    """Counts of sglang's ``HiCache prefetch`` outcomes in one reader's log."""
    counts: dict[str, int] = {}
    for line in server.log_text().splitlines():
        if "HiCache prefetch " in line:
            outcome = line.split("HiCache prefetch ", 1)[1].split(" ", 1)[0]
            counts[outcome] = counts.get(outcome, 0) + 1
    return counts


def run_model(
    config: ServeConfig, architecture: str, out: dict[str, Any], checkpoint: Callable[[], None]
) -> None:
    """Every length's rounds for one model, on one set of servers, into ``out``.

    ``checkpoint`` runs after each length, so a run that dies keeps what it measured.
    """
    log_dir = config.work_dir / "logs" / architecture
    spec = config.model_spec(architecture)
    out.update(
        model=asdict(spec),
        kv_bytes_per_token=kv_bytes_per_token(spec),
        log_dir=str(log_dir),
        cells={},
        rounds=[],
    )
    with started_arms(config, architecture, log_dir) as arms:
        for length_tokens in config.lengths_tokens:
            cell = [
                run_round(arms, config, architecture, length_tokens, index)
                for index in range(config.warmup_rounds + config.rounds)
            ]
            out["rounds"] += cell
            out["cells"][str(length_tokens)] = {**S.summarize_cell(cell), **breakdown(cell)}
            out["prefetch_log_lines"] = {
                arm: prefetch_log_lines(arms.readers[arm]) for arm in S.L3_ARMS
            }
            checkpoint()


def breakdown(cell: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Mean per timed request of each scraped sample, per arm (the TTFT breakdown's inputs)."""
    timed = [r for r in cell if not r["warmup"]]
    per_request, parts = {}, {}
    for arm in S.ARMS:
        per_request[arm] = S.mean_deltas([r["arms"][arm]["metrics_delta"] for r in timed])
        mean_ttft_s = sum(r["arms"][arm]["ttft_s"] for r in timed) / len(timed)
        parts[arm] = S.ttft_parts(per_request[arm], mean_ttft_s)
    return {"ttft_breakdown_mean_s": parts, "metrics_per_request": per_request}


def run_serve(
    config: ServeConfig, checkpoint: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Every model in turn; ``checkpoint`` gets the result so far after each length."""
    started = time.monotonic()
    result: dict[str, Any] = {
        "bench": "serve",
        "config": {**asdict(config), "work_dir": str(config.work_dir)},
        "ttft_measure": "seconds from sending /generate to the first streamed chunk",
        "models": {},
    }

    def progress() -> None:
        models = result["models"].values()
        result.update(
            date_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            agree=all(not r["disagreeing"] for m in models for r in m["rounds"]),
            wall_s=time.monotonic() - started,
        )
        if checkpoint is not None:
            checkpoint(result)

    for architecture in config.models:
        run_model(config, architecture, result["models"].setdefault(architecture, {}), progress)
    return result


def write_json(result: Mapping[str, Any], path: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)


def format_serve(result: Mapping[str, Any]) -> str:
    """A text table: TTFT per arm and length, and the paired ratios."""
    lines = [f"serve: TTFT = {result['ttft_measure']}"]
    for architecture, model in result["models"].items():
        for length, cell in model["cells"].items():
            lines.append(f"{architecture} {length}-token prompt, {cell['rounds']} rounds:")
            for arm, stats in cell["arms"].items():
                ttft = stats["ttft_s"]
                lines.append(
                    f"  {arm:<10} TTFT p50 {ttft['p50']:6.3f} s  p99 {ttft['p99']:6.3f} s  "
                    f"storage tokens {stats['storage_tokens']}"
                )
            for pair, ratio in cell["paired_ttft_ratio"].items():
                lines.append(f"  {pair:<20} p50 {ratio['p50']:.2f}x  p99 {ratio['p99']:.2f}x")
    lines.append("greedy tokens: " + ("all arms agree" if result["agree"] else "DISAGREE"))
    return "\n".join(lines)


ARM_COLORS = {S.RECOMPUTE: "#999999", S.SPAN: "#31a354", S.MOONCAKE: "#d62728"}


def _plot_ttft(ax: Any, architecture: str, model: Mapping[str, Any]) -> None:
    lengths = list(model["cells"])
    width = 0.8 / len(S.ARMS)
    for offset, arm in enumerate(S.ARMS):
        p50 = [model["cells"][n]["arms"][arm]["ttft_s"]["p50"] for n in lengths]
        p99 = [model["cells"][n]["arms"][arm]["ttft_s"]["p99"] for n in lengths]
        xs = [i + (offset - 1) * width for i in range(len(lengths))]
        errors = [[0] * len(p50), [hi - lo for lo, hi in zip(p50, p99, strict=True)]]
        ax.bar(xs, p50, width, yerr=errors, capsize=3, label=arm, color=ARM_COLORS[arm])
    ax.set_xticks(range(len(lengths)), [f"{n} tokens" for n in lengths])
    ax.set_ylabel("second server's TTFT (s): p50 bar, p99 whisker")
    ax.set_title(f"{architecture}: repeated prompt, restored from L3")
    ax.legend(loc="upper left")


def _plot_breakdown(ax: Any, architecture: str, model: Mapping[str, Any]) -> None:
    labels, queue_s, after_s = [], [], []
    for length, cell in model["cells"].items():
        for arm in S.ARMS:
            parts = cell["ttft_breakdown_mean_s"][arm]
            labels.append(f"{arm}\n{length}")
            queue_s.append(parts["queue_s"])
            after_s.append(parts["after_queue_s"])
    ax.bar(labels, queue_s, label="queue (prefetch from L3)", color="#6baed6")
    ax.bar(labels, after_s, bottom=queue_s, label="after queue (load, compute)", color="#bdbdbd")
    ax.set_ylabel("mean server TTFT (s)")
    ax.set_title(f"{architecture}: where a restored request's TTFT goes")
    ax.legend(loc="upper left")


def write_plot(result: Mapping[str, Any], path: str) -> None:
    """Per model: TTFT p50/p99 per arm and length, and the mean TTFT split at the queue."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    fig, axes = plt.subplots(2, len(models), figsize=(7 * len(models), 9), squeeze=False)
    for column, (architecture, model) in enumerate(models.items()):
        _plot_ttft(axes[0][column], architecture, model)
        _plot_breakdown(axes[1][column], architecture, model)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_serve_command(
    models: str | None,
    lengths: str | None,
    rounds: int | None,
    json_path: str | None,
    plot_path: str | None,
) -> int:
    """``mooncake-span bench --serve``: run, print, write JSON/plot; 1 when any answer differed."""
    try:
        config = ServeConfig(
            models=parse_csv(models, DEFAULT_MODELS),
            lengths_tokens=parse_csv(lengths, DEFAULT_LENGTHS_TOKENS, int),
            rounds=rounds or ServeConfig.rounds,
        )
    except ValueError as exc:
        print(f"mooncake-span bench --serve: {exc}")
        return 2
    result = run_serve(
        config, (lambda partial: write_json(partial, json_path)) if json_path else None
    )
    print(format_serve(result), flush=True)
    if json_path:
        print(f"wrote {json_path}", flush=True)
    if plot_path:
        write_plot(result, plot_path)
        print(f"wrote {plot_path}", flush=True)
    try:
        S.check_agreement([r for m in result["models"].values() for r in m["rounds"]])
    except S.DisagreementError as exc:
        print(f"mooncake-span bench --serve: {exc}", flush=True)
        return 1
    return 0
