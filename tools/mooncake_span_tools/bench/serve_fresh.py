"""The first request after a server starts: ``bench --serve --serve-workloads fresh``.

Every other workload warms its servers up first. A production server is not
warmed up: its first request after a start (or a restart) is the first use of
whatever sglang loads lazily, its page-hash extension above all (6-8 s here
with the extension built). That use is the first hit query, inside the prefetch
whose restore should serve the request, and sglang's default ``timeout``
prefetch policy drops a prefetch that slow. This backend loads the hash while
the server starts; sglang's ``MooncakeStore`` does not.

Per round and L3 arm: a warm writer (one per arm, on the arm's own cluster)
answers a fresh prompt and backs it up; then, once per extension state
(``CONDITIONS``), a reader that has just started, with no warm-up, answers the
same prompt, and is stopped. Arms alternate their order from round to round.
Measured per reader: its start-up time, storage tokens of its first request,
its TTFT, and sglang's unfulfilled prefetch tokens by reason. Every reader's
greedy tokens must equal its writer's (the writer computed them).
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mooncake_span_tools.bench import serve_arms as A
from mooncake_span_tools.bench import serve_stats as S
from mooncake_span_tools.lab.sglang_servers import EXTENSIONS_ENV, SglangServer
from mooncake_span_tools.testing.cpu_server.models import ensure_model

UNFULFILLED = "sglang:storage_prefetch_unfulfilled_tokens_total"
# The reader's JIT extension folder: the venv's, already built by the writers;
# or empty, as in a container that starts on a fresh file system (sglang then
# builds its page-hash extension, 13-27 s here, at first use).
CONDITIONS = ("built", "empty")


@dataclass(frozen=True)
class FreshConfig(A.ServeSetup):
    model: str = "llama"
    prompt_tokens: int = 2048
    answer_tokens: int = 8
    rounds: int = 4
    # What a production server runs unless told otherwise: sglang's default.
    prefetch_policy: str = "timeout"

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if self.prompt_tokens % self.page_size_tokens or self.prompt_tokens < 5 * (
            self.page_size_tokens
        ):
            raise ValueError(
                f"prompt_tokens {self.prompt_tokens} must be a multiple of the page "
                f"({self.page_size_tokens} tokens) and at least 5 pages"
            )

    @property
    def restorable_tokens(self) -> int:
        return self.prompt_tokens - self.page_size_tokens

    @property
    def max_total_tokens(self) -> int:
        return self.prompt_tokens + 4 * self.page_size_tokens


def _first_request(
    options: Any, name: str, log_dir: Path, prompt: list[int], config: FreshConfig, env: dict
) -> dict[str, Any]:
    """Start a reader, send it ``prompt`` as its very first request, stop it."""
    reader = SglangServer(name, options, log_dir, env=env)
    started = time.monotonic()
    try:
        reader.start(A.SERVER_START_TIMEOUT_S)
        startup_s = time.monotonic() - started
        ttft_s, answer = A.stream_generate(reader.url, prompt, config.answer_tokens)
        scraped = A.scrape(reader)
    finally:
        reader.stop()
    dropped = {k[len(UNFULFILLED) :]: v for k, v in scraped.items() if k.startswith(UNFULFILLED)}
    return {
        "startup_s": startup_s,
        "ttft_s": ttft_s,
        "storage_tokens": answer.storage_tokens,
        "output_ids": list(answer.output_ids),
        "unfulfilled_tokens": dropped,
    }


def _extensions_env(condition: str, folder: Path) -> dict[str, str]:
    """``built``: the venv's folder, where the writers built sglang's extensions;
    ``empty``: a folder of its own, as in a fresh container."""
    if condition == "built":
        return {}
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return {EXTENSIONS_ENV: str(folder)}


def run_fresh(
    config: FreshConfig, checkpoint: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    log_dir = config.work_dir / "logs" / "fresh"
    model_path = ensure_model(config.model_spec(config.model), config.work_dir / "models")
    result: dict[str, Any] = {"config": config.described(), "rounds": []}
    with ExitStack() as stack:
        clusters = A.arm_clusters(stack, config.segment_bytes, log_dir)
        options = {
            arm: A.arm_options(
                arm, model_path, clusters[arm], **config.server_fields(config.max_total_tokens)
            )
            for arm in S.L3_ARMS
        }
        writers = {arm: SglangServer(f"writer-{arm}", options[arm], log_dir) for arm in S.L3_ARMS}
        for writer in writers.values():
            stack.callback(writer.stop)
        writers = A.start_servers(writers, log_dir, stack)
        for index in range(config.rounds):
            prompt = A.round_prompt(config.seed, config.model, config.prompt_tokens, index)
            record: dict[str, Any] = {"round": index, "reads": {c: {} for c in CONDITIONS}}
            for arm in S.round_order(S.L3_ARMS, index):
                before = A.stored_keys(clusters[arm])
                written = writers[arm].generate(prompt, config.answer_tokens, A.REQUEST_TIMEOUT_S)
                A.wait_for_backup(clusters[arm], before, len(prompt) // config.page_size_tokens - 1)
                for condition in CONDITIONS:
                    name = f"reader-{arm}-{condition}-{index}"
                    env = _extensions_env(condition, config.work_dir / "extensions" / name)
                    read = _first_request(options[arm], name, log_dir, prompt, config, env)
                    read["agrees"] = read["output_ids"] == list(written.output_ids)
                    record["reads"][condition][arm] = read
            result["rounds"].append(record)
            print(f"fresh round {index}: {_round_line(record)}", file=sys.stderr, flush=True)
            result["summary"] = summarize_fresh(result["rounds"], config.restorable_tokens)
            if checkpoint is not None:
                checkpoint(result)
    return result


def _round_line(record: Mapping[str, Any]) -> str:
    return " ".join(
        f"{condition}/{arm}={r['storage_tokens']} tokens/{r['ttft_s']:.2f}s"
        for condition, reads in record["reads"].items()
        for arm, r in reads.items()
    )


def summarize_fresh(
    rounds: list[Mapping[str, Any]], restorable_tokens: int
) -> dict[str, dict[str, dict[str, Any]]]:
    """Per extension state and arm: first requests that restored every restorable token,
    their storage tokens, TTFT and the reader's start-up time."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for condition in CONDITIONS:
        for arm in S.L3_ARMS:
            reads = [r["reads"][condition][arm] for r in rounds if arm in r["reads"][condition]]
            if not reads:
                continue
            ttfts, startups = [r["ttft_s"] for r in reads], [r["startup_s"] for r in reads]
            out.setdefault(condition, {})[arm] = {
                "first_requests": len(reads),
                "restored_all": sum(r["storage_tokens"] >= restorable_tokens for r in reads),
                "storage_tokens": [r["storage_tokens"] for r in reads],
                "ttft_s": {"p50": S.percentile(ttfts, 50), "max": max(ttfts)},
                "startup_s": {"p50": S.percentile(startups, 50), "max": max(startups)},
                "disagreeing": sum(not r["agrees"] for r in reads),
            }
    return out


def format_fresh(result: Mapping[str, Any]) -> str:
    restorable = result["config"]["prompt_tokens"] - result["config"]["page_size_tokens"]
    lines = [f"fresh server, first request ({restorable} tokens restorable):"]
    for condition, arms in result.get("summary", {}).items():
        for arm, stats in arms.items():
            lines.append(
                f"  extensions {condition:<5} {arm:<10} restored all in {stats['restored_all']} "
                f"of {stats['first_requests']} first requests, storage tokens "
                f"{stats['storage_tokens']}, TTFT p50 {stats['ttft_s']['p50']:.2f} s, "
                f"start-up p50 {stats['startup_s']['p50']:.0f} s"
            )
    return "\n".join(lines)


def check_fresh(result: Mapping[str, Any]) -> list[str]:
    """Where a reader's answer differed from its writer's."""
    return [
        f"fresh round {r['round']} {condition} {arm}"
        for r in result.get("rounds", [])
        for condition, reads in r["reads"].items()
        for arm, read in reads.items()
        if not read["agrees"]
    ]
