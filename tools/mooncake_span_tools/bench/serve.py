"""Serving benchmark with real sglang servers: what a server gains from L3.

``mooncake-span bench --serve``. Three arms side by side, all on this host's
CPU (see ``serve_arms``): ``recompute`` (no L3 backend), ``span`` (this
project's backend) and ``mooncake`` (sglang's built-in ``MooncakeStore``).
Five workloads, chosen with ``--serve-workloads``:

- ``repeated`` (this module): a writer server answers a long prompt, and a
  reader server that never saw it answers it again;
- ``multiturn`` (``serve_multiturn``): concurrent conversations whose history
  outgrows host memory;
- ``pd`` (``serve_pd``): turn 2 of a conversation on a prefill process that
  never saw turn 1, with decode-side offload;
- ``fresh`` (``serve_fresh``, L3 arms only): the first request of a server
  that has just started, with no warm-up, under sglang's default prefetch policy;
- ``ssd`` (``serve_ssd``, only when named): the SSD tier: TTFT from SSD vs
  DRAM, multi-turn past the cluster's DRAM, restore after a whole-cluster restart;
- ``long`` (``serve_long``, only when named): one 64k-token prompt (the longest of
  ``--serve-lengths``) restored whole by a second server, under each prefetch policy.

In ``repeated`` each L3 arm has one writer and every arm one reader, all five
alive together (``--sleep-on-idle``). Each round takes a fresh random prompt:
both writers answer it and the bench waits until each writer's write-through
backup has reached its master; then every reader's device and host caches are
flushed and the readers answer it one after another (a second's pause after
each), in an order that cycles through every permutation of the arms. TTFT is
the time from sending the request to the first streamed chunk, which sglang
sends once the prefill has produced the first token. Round 0 of every length
is a warm-up and is left out of the figures. Every answer of every workload
must equal the recompute arm's; a difference fails the run (after the JSON is
written).

For the TTFT breakdown the readers run with ``--enable-metrics``: the span
reader's ``mooncake_span_operation_duration_seconds`` (hit query, get) and
sglang's queue and TTFT histograms are scraped before and after each timed
request, and the prefetch lines of every L3 reader's log are counted.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mooncake_span.ops.cluster import LocalCluster
from mooncake_span_tools.bench import serve_arms as A
from mooncake_span_tools.bench import serve_stats as S
from mooncake_span_tools.bench.serve_fresh import FreshConfig, check_fresh, format_fresh, run_fresh
from mooncake_span_tools.bench.serve_long import LongServeConfig, format_long_serve, run_long_serve
from mooncake_span_tools.bench.serve_multiturn import (
    MultiTurnConfig,
    format_multiturn,
    run_multiturn,
)
from mooncake_span_tools.bench.serve_pd import PdConfig, check_pd, format_pd, run_pd
from mooncake_span_tools.bench.serve_ssd import (
    SsdServeConfig,
    format_ssd,
    run_ssd_workload,
    ssd_disagreements,
)
from mooncake_span_tools.lab.sglang_servers import SglangServer
from mooncake_span_tools.testing.cpu_server.models import ensure_model

logger = logging.getLogger(__name__)

DEFAULT_LENGTHS_TOKENS = (2048, 4096)
DEFAULT_MODELS = ("llama",)
# Pause after each reader's answer, before the next reader's request.
READER_SETTLE_S = 1.0
METRIC_PREFIXES = (
    "mooncake_span_operation_duration_seconds_sum",
    "mooncake_span_operation_duration_seconds_count",
    "mooncake_span_bytes_total",
    "sglang:queue_time_seconds_sum",
    "sglang:time_to_first_token_seconds_sum",
    "sglang:storage_prefetch_hit_tokens_total",
)


@dataclass(frozen=True)
class ServeConfig(A.ServeSetup):
    models: tuple[str, ...] = DEFAULT_MODELS
    lengths_tokens: tuple[int, ...] = DEFAULT_LENGTHS_TOKENS
    rounds: int = 8
    warmup_rounds: int = 1
    answer_tokens: int = 8

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.warmup_rounds < 0:
            raise ValueError("rounds must be >= 1 and warmup_rounds >= 0")
        for length in self.lengths_tokens:
            for model in self.models:
                page = self.page_tokens(model)
                if length < 4 * page or length % page:
                    raise ValueError(
                        f"prompt length {length} must be a multiple of {model}'s page "
                        f"({page} tokens) and at least 4 pages"
                    )

    def max_total_tokens(self, architecture: str) -> int:
        """Device KV pool of every server: the longest prompt, its answer and two pages."""
        page = self.page_tokens(architecture)
        pages = -(-(max(self.lengths_tokens) + self.answer_tokens) // page)
        return (pages + 2) * page


def parse_csv(text: str | None, default: Sequence[Any], kind: type = str) -> tuple:
    """A comma list from the command line, or ``default`` when not given."""
    if not text:
        return tuple(default)
    return tuple(kind(part.strip()) for part in text.split(",") if part.strip())


@dataclass
class Arms:
    """The live servers of one model: a reader per arm, a writer and a cluster per L3 arm."""

    readers: dict[str, SglangServer]
    writers: dict[str, SglangServer]
    clusters: dict[str, LocalCluster]


@contextmanager
def started_arms(config: ServeConfig, architecture: str, log_dir: Path) -> Iterator[Arms]:
    """Clusters and servers of every arm for one model, all stopped on exit."""
    model_path = ensure_model(config.model_spec(architecture), config.work_dir / "models")
    with ExitStack() as stack:
        clusters = A.arm_clusters(stack, config.segment_bytes, log_dir)
        servers = {}
        for arm in S.ARMS:
            options = A.arm_options(
                arm,
                model_path,
                clusters.get(arm),
                **config.model_fields(architecture, config.max_total_tokens(architecture)),
            )
            roles = ("reader", "writer") if arm in S.L3_ARMS else ("reader",)
            for role in roles:
                servers[arm, role] = SglangServer(f"{architecture}-{arm}-{role}", options, log_dir)
                stack.callback(servers[arm, role].stop)
        servers = A.start_servers(servers, log_dir, stack)
        readers = {arm: server for (arm, role), server in servers.items() if role == "reader"}
        writers = {arm: server for (arm, role), server in servers.items() if role == "writer"}
        yield Arms(readers, writers, clusters)


def _write(arms: Arms, prompt: list[int], config: ServeConfig, page: int) -> dict[str, Any]:
    """Both writers answer the prompt; wait for each one's backup to reach its master."""
    min_new_keys = len(prompt) // page - 1
    records = {}
    for arm, writer in arms.writers.items():
        before = A.stored_keys(arms.clusters[arm])
        answer = writer.generate(prompt, config.answer_tokens, timeout_s=A.REQUEST_TIMEOUT_S)
        backup = A.wait_for_backup(arms.clusters[arm], before, min_new_keys)
        records[arm] = {"e2e_s": answer.e2e_s, "output_ids": list(answer.output_ids), **backup}
    return records


def _read(arms: Arms, arm: str, prompt: list[int], config: ServeConfig) -> dict[str, Any]:
    reader = arms.readers[arm]
    before = A.scrape(reader)
    ttft_s, answer = A.stream_generate(reader.url, prompt, config.answer_tokens)
    delta = S.metric_delta(before, A.scrape(reader), METRIC_PREFIXES)
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
    prompt = A.round_prompt(config.seed, architecture, length_tokens, index)
    writers = _write(arms, prompt, config, config.page_tokens(architecture))
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
        kv_bytes_per_token=A.kv_bytes_per_token(spec),
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
        "config": config.described(),
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
    return "\n".join(lines)


# "ssd" (bench/serve_ssd.py) and "long" (bench/serve_long.py) run only when named.
DEFAULT_WORKLOADS = ("repeated", "multiturn", "pd", "fresh")
WORKLOADS = (*DEFAULT_WORKLOADS, "ssd", "long")


def check_workloads(workloads: Sequence[str]) -> None:
    """Raise ValueError unless ``workloads`` names one or more of :data:`WORKLOADS`."""
    if not workloads or set(workloads) - set(WORKLOADS):
        raise ValueError(f"workloads must be some of {WORKLOADS}, got {list(workloads)}")


def disagreements(result: Mapping[str, Any]) -> list[str]:
    """Every place in a ``run_workloads`` result where some arm's answer differed."""
    bad = []
    repeated = result.get("repeated")
    if repeated is not None:
        try:
            S.check_agreement([r for m in repeated["models"].values() for r in m["rounds"]])
        except S.DisagreementError as exc:
            bad.append(str(exc))
    if "multiturn" in result:
        bad += [f"multiturn {where}" for where in result["multiturn"]["disagreeing"]]
    if "pd" in result:
        bad += check_pd(result["pd"])
    if "fresh" in result:
        bad += check_fresh(result["fresh"])
    if "ssd" in result:
        bad += ssd_disagreements(result["ssd"])
    if "long" in result:
        bad += result["long"].get("failures", [])
    return bad


def run_workloads(
    workloads: Sequence[str],
    repeated: ServeConfig,
    multiturn: MultiTurnConfig,
    pd: PdConfig,
    checkpoint: Callable[[dict[str, Any]], None] | None = None,
    fresh: FreshConfig | None = None,
    ssd: SsdServeConfig | None = None,
    long: LongServeConfig | None = None,
) -> dict[str, Any]:
    """The chosen workloads one after another, each on servers of its own."""
    check_workloads(workloads)
    started = time.monotonic()
    result: dict[str, Any] = {
        "bench": "serve",
        "workloads": list(workloads),
        "ttft_measure": "seconds from sending /generate to the first streamed chunk",
    }

    def progress(name: str) -> Callable[[dict[str, Any]], None]:
        def save(partial: dict[str, Any]) -> None:
            result[name] = partial
            result.update(
                date_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                agree=not disagreements(result),
                wall_s=time.monotonic() - started,
            )
            if checkpoint is not None:
                checkpoint(result)

        return save

    runners = {
        "repeated": lambda save: run_serve(repeated, save),
        "multiturn": lambda save: run_multiturn(multiturn, save),
        "pd": lambda save: run_pd(pd, save),
        "fresh": lambda save: run_fresh(fresh or FreshConfig(), save),
        "ssd": lambda save: run_ssd_workload(ssd or SsdServeConfig(model=multiturn.model), save),
        "long": lambda save: run_long_serve(long or LongServeConfig(), save),
    }
    for name in workloads:
        save = progress(name)
        save(runners[name](save))
    return result


def format_workloads(result: Mapping[str, Any]) -> str:
    parts = []
    if "repeated" in result:
        parts.append(format_serve(result["repeated"]))
    if "multiturn" in result:
        parts.append(format_multiturn(result["multiturn"]))
    if "pd" in result:
        parts.append(format_pd(result["pd"]))
    if "fresh" in result:
        parts.append(format_fresh(result["fresh"]))
    if "ssd" in result:
        parts.append(format_ssd(result["ssd"]))
    if "long" in result:
        parts.append(format_long_serve(result["long"]))
    parts.append("greedy tokens: " + ("all arms agree" if result["agree"] else "DISAGREE"))
    return "\n".join(parts)


ARM_COLORS = {S.RECOMPUTE: "#999999", S.SPAN: "#31a354", S.MOONCAKE: "#d62728"}


def _bars(ax: Any, groups: Sequence[str], values: Mapping[str, Sequence[float]], **kw: Any):
    """One bar per arm in each group; ``kw`` may carry ``whiskers`` (per arm, per group)."""
    width = 0.8 / len(S.ARMS)
    whiskers = kw.pop("whiskers", None)
    for offset, arm in enumerate(S.ARMS):
        xs = [i + (offset - 1) * width for i in range(len(groups))]
        errors = None
        if whiskers is not None:
            tops = whiskers[arm]
            errors = [[0] * len(groups), [t - v for v, t in zip(values[arm], tops, strict=True)]]
        ax.bar(xs, values[arm], width, yerr=errors, capsize=3, label=arm, color=ARM_COLORS[arm])
    ax.set_xticks(range(len(groups)), list(groups))
    ax.legend(loc="upper left")


def _plot_repeated(ax: Any, architecture: str, model: Mapping[str, Any]) -> None:
    lengths = list(model["cells"])
    ttft = {arm: [model["cells"][n]["arms"][arm]["ttft_s"] for n in lengths] for arm in S.ARMS}
    _bars(
        ax,
        [f"{n} tokens" for n in lengths],
        {arm: [t["p50"] for t in ttft[arm]] for arm in S.ARMS},
        whiskers={arm: [t["p99"] for t in ttft[arm]] for arm in S.ARMS},
    )
    ax.set_ylabel("second server's TTFT (s): p50 bar, p99 whisker")
    ax.set_title(f"repeated prompt, {architecture}: restored from L3")


def _plot_multiturn(ax: Any, multiturn: Mapping[str, Any]) -> None:
    from mooncake_span_tools.bench.serve_multiturn import TIERS

    later = {arm: multiturn["arms"][arm]["later_turns"] for arm in S.ARMS}
    _bars(ax, TIERS, {arm: [later[arm]["hit_rate"][t] for t in TIERS] for arm in S.ARMS})
    ax.set_ylabel("share of prompt tokens found (turns 2+)")
    ax.set_title(f"multi-turn, {multiturn['config']['model']}: cache hits by tier")


def _plot_pd(ax: Any, pd: Mapping[str, Any]) -> None:
    ttft = {arm: pd["cell"]["arms"][arm]["ttft_s"] for arm in S.ARMS}
    _bars(
        ax,
        ["turn 2, fresh prefill"],
        {arm: [ttft[arm]["p50"]] for arm in S.ARMS},
        whiskers={arm: [ttft[arm]["p99"]] for arm in S.ARMS},
    )
    ax.set_ylabel("TTFT through the router (s): p50 bar, p99 whisker")
    ax.set_title(f"prefill/decode, {pd['config']['model']}")


def write_plot(result: Mapping[str, Any], path: str) -> None:
    """TTFT per arm and prompt length, multi-turn hit rate by tier, PD turn-2 TTFT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: list[Callable[[Any], None]] = []
    for architecture, model in result.get("repeated", {}).get("models", {}).items():
        panels.append(lambda ax, a=architecture, m=model: _plot_repeated(ax, a, m))
    if "arms" in result.get("multiturn", {}):
        panels.append(lambda ax: _plot_multiturn(ax, result["multiturn"]))
    if "cell" in result.get("pd", {}):
        panels.append(lambda ax: _plot_pd(ax, result["pd"]))
    if not panels:
        raise ValueError("nothing measured to plot")
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        panel(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_serve_command(
    models: str | None,
    lengths: str | None,
    rounds: int | None,
    workloads: str | None,
    json_path: str | None,
    plot_path: str | None,
) -> int:
    """``mooncake-span bench --serve``: run, print, write JSON/plot; 1 when any answer differed."""
    try:
        chosen = parse_csv(workloads, DEFAULT_WORKLOADS)
        model_names = parse_csv(models, DEFAULT_MODELS)
        repeated = ServeConfig(
            models=model_names,
            lengths_tokens=parse_csv(lengths, DEFAULT_LENGTHS_TOKENS, int),
            rounds=rounds or ServeConfig.rounds,
        )
        # The conversation workloads run on the first model named.
        multiturn = MultiTurnConfig(model=model_names[0])
        pd = PdConfig(model=model_names[0], rounds=rounds or PdConfig.rounds)
        fresh = FreshConfig(model=model_names[0], rounds=rounds or FreshConfig.rounds)
        long = LongServeConfig(
            prompt_tokens=max(parse_csv(lengths, (LongServeConfig.prompt_tokens,), int)),
            rounds=rounds or LongServeConfig.rounds,
        )
        check_workloads(chosen)
    except ValueError as exc:
        print(f"mooncake-span bench --serve: {exc}")
        return 2
    result = run_workloads(
        chosen,
        repeated,
        multiturn,
        pd,
        (lambda partial: write_json(partial, json_path)) if json_path else None,
        fresh,
        long=long,
    )
    print(format_workloads(result), flush=True)
    if json_path:
        print(f"wrote {json_path}", flush=True)
    if plot_path:
        write_plot(result, plot_path)
        print(f"wrote {plot_path}", flush=True)
    bad = disagreements(result)
    if bad:
        print(f"mooncake-span bench --serve: answers differ: {'; '.join(bad)}", flush=True)
        return 1
    return 0
