"""Multi-turn serving workload: concurrent conversations whose history outgrows host memory.

``mooncake-span bench --serve --serve-workloads multiturn``. In the spirit of
sglang's ``benchmark/hicache/bench_multiturn.py``: ``clients`` conversations
of ``turns`` turns each, at most ``parallel`` requests in flight; a
conversation's first prompt is fresh random text, and every later turn sends
its whole history (every earlier prompt and answer) plus new text. Device and
host memory together hold fewer tokens than all conversations, so by the time
a conversation comes back the other clients' turns have pushed its history
out of both: only an L3 can serve it. The host tier does hold what the
requests in flight prefetch at once, since sglang skips a storage prefetch it
cannot find host memory for, whichever backend it uses.

Each arm has one server (``recompute`` keeps sglang's host tier but has no L3),
all alive together (``--sleep-on-idle``). Turn t goes to every arm in the
order ``round_order(ARMS, t)``; an arm gets all its clients' requests of that
turn from ``parallel`` threads, streamed, so each request has its own TTFT and
the server batches them as it would real traffic. An arm's input throughput is the prompt
tokens it was sent over the wall time of its turns; the wait for an L3 arm's
backup to reach its master comes after that arm's turn and is not timed. Every
arm's greedy answers must equal recompute's for every client and turn; each arm
builds its histories from its own answers, so a difference shows in every later
turn too.
"""

from __future__ import annotations

import logging
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from typing import Any

from mooncake_span_tools.bench import serve_arms as A
from mooncake_span_tools.bench import serve_stats as S
from mooncake_span_tools.lab.sglang_servers import SglangServer, settled_count
from mooncake_span_tools.testing.cpu_server.models import ensure_model

logger = logging.getLogger(__name__)

# sglang's per-request split of cached prompt tokens (cached_tokens_details).
TIERS = ("device", "host", "storage")
# After an L3 arm's turn: its master's key count must hold still this long.
BACKUP_SETTLE_S = 1.0
BACKUP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class MultiTurnConfig(A.ServeSetup):
    model: str = "llama"
    clients: int = 12
    parallel: int = 3
    turns: int = 6
    first_prompt_tokens: int = 768
    new_tokens_per_turn: int = 192
    answer_tokens: int = 8
    # The device KV pool; the host tier is hicache_ratio times it.
    device_tokens: int = 4096

    def __post_init__(self) -> None:
        if self.clients < 1 or self.turns < 2 or not 1 <= self.parallel <= self.clients:
            raise ValueError(
                f"need clients >= 1, turns >= 2 and 1 <= parallel <= clients, got clients "
                f"{self.clients}, turns {self.turns}, parallel {self.parallel}"
            )
        if self.first_prompt_tokens < self.page_size_tokens or self.new_tokens_per_turn < 1:
            raise ValueError("the first prompt must fill a page and every turn must add text")
        if self.device_tokens < self.longest_request_tokens + self.page_size_tokens:
            raise ValueError(
                f"device_tokens {self.device_tokens} cannot hold the longest request "
                f"({self.longest_request_tokens} tokens) and a page"
            )
        if self.parallel * self.longest_request_tokens > self.host_tokens:
            raise ValueError(
                f"{self.parallel} requests in flight prefetch up to "
                f"{self.parallel * self.longest_request_tokens} tokens into a host tier of "
                f"{self.host_tokens}: sglang would skip prefetches for want of host memory; "
                "lower parallel or raise hicache_ratio"
            )
        if self.working_set_tokens <= self.device_tokens + self.host_tokens:
            raise ValueError(
                f"{self.clients} conversations ({self.working_set_tokens} tokens) fit in "
                f"device and host memory ({self.device_tokens + self.host_tokens} tokens): "
                "L3 would serve nothing; add clients or turns, or lower hicache_ratio"
            )

    @property
    def longest_request_tokens(self) -> int:
        """The last turn's prompt plus its answer."""
        return (
            self.first_prompt_tokens
            + (self.turns - 1) * (self.answer_tokens + self.new_tokens_per_turn)
            + self.answer_tokens
        )

    @property
    def host_tokens(self) -> int:
        return int(self.device_tokens * self.hicache_ratio)

    @property
    def working_set_tokens(self) -> int:
        return self.clients * self.longest_request_tokens


def new_text(seed: int, client: int, turn: int, n_tokens: int) -> list[int]:
    """The fresh text of one client's turn, shared with no other client or turn."""
    rng = random.Random(f"multiturn:{seed}:{client}:{turn}")
    return [rng.randrange(A.PROMPT_VOCAB_TOKENS) for _ in range(n_tokens)]


def tier_tokens(meta_info: Mapping[str, Any]) -> dict[str, int]:
    """Prompt tokens a request found in each cache tier, from sglang's meta_info."""
    details = meta_info.get("cached_tokens_details") or {}
    return {tier: int(details.get(tier, 0) or 0) for tier in TIERS}


def _one_request(url: str, prompt: list[int], answer_tokens: int) -> dict[str, Any]:
    ttft_s, answer = A.stream_generate(url, prompt, answer_tokens)
    return {
        "prompt_tokens": len(prompt),
        "ttft_s": ttft_s,
        "e2e_s": answer.e2e_s,
        "tiers": tier_tokens(answer.meta_info),
        "output_ids": list(answer.output_ids),
    }


def run_arm_turn(
    server: SglangServer, prompts: Sequence[list[int]], answer_tokens: int, parallel: int
) -> tuple[float, list[dict[str, Any]]]:
    """Every client's request of one turn, ``parallel`` in flight: (wall seconds, records)."""
    started = time.perf_counter()
    with ThreadPoolExecutor(parallel) as pool:
        futures = [
            pool.submit(_one_request, server.url, prompt, answer_tokens) for prompt in prompts
        ]
        records = [future.result() for future in futures]
    return time.perf_counter() - started, records


def summarize_arm(turns: Sequence[Mapping[str, Any]], arm: str) -> dict[str, Any]:
    """One arm over all turns and over the turns after the first (the ones with history)."""

    def over(selected: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        requests = [r for t in selected for r in t["arms"][arm]["requests"]]
        prompt_tokens = sum(r["prompt_tokens"] for r in requests)
        wall_s = sum(t["arms"][arm]["wall_s"] for t in selected)
        return {
            "requests": len(requests),
            "ttft_s": S.distribution([r["ttft_s"] for r in requests]),
            "hit_rate": {
                tier: sum(r["tiers"][tier] for r in requests) / prompt_tokens for tier in TIERS
            },
            "prompt_tokens": prompt_tokens,
            "wall_s": wall_s,
            "input_tokens_per_s": prompt_tokens / wall_s,
        }

    return {"all_turns": over(turns), "later_turns": over(turns[1:])}


def paired_turn_ratios(turns: Sequence[Mapping[str, Any]], numerator: str, denominator: str):
    """Per later turn, numerator over denominator: input throughput and slowest TTFT."""
    throughput, slowest = [], []
    for turn in turns[1:]:
        a, b = turn["arms"][numerator], turn["arms"][denominator]
        throughput.append(b["wall_s"] / a["wall_s"])
        worst = [max(r["ttft_s"] for r in arm["requests"]) for arm in (a, b)]
        slowest.append(worst[0] / worst[1])
    return {
        "input_throughput": {**S.distribution(throughput), "per_turn": throughput},
        "slowest_ttft": {**S.distribution(slowest), "per_turn": slowest},
    }


def disagreements(turns: Sequence[Mapping[str, Any]]) -> list[str]:
    """``turn T client C: arms`` wherever some arm's answer differs from recompute's."""
    bad = []
    for turn in turns:
        answers = {arm: turn["arms"][arm]["requests"] for arm in S.ARMS}
        for client in range(len(answers[S.RECOMPUTE])):
            outputs = {arm: answers[arm][client]["output_ids"] for arm in S.ARMS}
            names = S.disagreeing(outputs)
            if names:
                bad.append(f"turn {turn['turn']} client {client}: {', '.join(names)}")
    return bad


def _settle_backup(cluster: Any) -> int:
    return settled_count(
        lambda: len(A.stored_keys(cluster)), timeout_s=BACKUP_TIMEOUT_S, settle_s=BACKUP_SETTLE_S
    )


def run_multiturn(
    config: MultiTurnConfig, checkpoint: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """All turns on one server per arm; ``checkpoint`` gets the result after each turn."""
    started = time.monotonic()
    log_dir = config.work_dir / "logs" / f"multiturn-{config.model}"
    spec = config.model_spec(config.model)
    result: dict[str, Any] = {
        "workload": "multiturn",
        "config": config.described(),
        "model": asdict(spec),
        "kv_bytes_per_token": A.kv_bytes_per_token(spec),
        "host_tokens": config.host_tokens,
        "working_set_tokens": config.working_set_tokens,
        "turns": [],
    }
    model_path = ensure_model(spec, config.work_dir / "models")
    with ExitStack() as stack:
        clusters = A.arm_clusters(stack, config.segment_bytes, log_dir)
        servers = {}
        for arm in S.ARMS:
            options = A.arm_options(
                arm,
                model_path,
                clusters.get(arm),
                **config.model_fields(config.model, config.device_tokens),
            )
            servers[arm] = SglangServer(f"multiturn-{config.model}-{arm}", options, log_dir)
            stack.callback(servers[arm].stop)
        servers = A.start_servers(servers, log_dir, stack)
        for server in servers.values():
            server.warm_up()
        histories = {arm: [[] for _ in range(config.clients)] for arm in S.ARMS}
        for turn in range(config.turns):
            record = _run_turn(config, servers, clusters, histories, turn)
            result["turns"].append(record)
            result.update(
                arms={arm: summarize_arm(result["turns"], arm) for arm in S.ARMS} if turn else {},
                disagreeing=disagreements(result["turns"]),
                wall_s=time.monotonic() - started,
            )
            if checkpoint is not None:
                checkpoint(result)
    result["paired"] = {
        f"{a}/{b}": paired_turn_ratios(result["turns"], a, b) for a, b in S.RATIO_PAIRS
    }
    return result


def _run_turn(
    config: MultiTurnConfig,
    servers: Mapping[str, SglangServer],
    clusters: Mapping[str, Any],
    histories: dict[str, list[list[int]]],
    turn: int,
) -> dict[str, Any]:
    n_new = config.first_prompt_tokens if turn == 0 else config.new_tokens_per_turn
    fresh = [new_text(config.seed, c, turn, n_new) for c in range(config.clients)]
    order = S.round_order(S.ARMS, turn)
    arms = {}
    for arm in order:
        prompts = [histories[arm][c] + fresh[c] for c in range(config.clients)]
        wall_s, requests = run_arm_turn(
            servers[arm], prompts, config.answer_tokens, config.parallel
        )
        for c, request in enumerate(requests):
            histories[arm][c] = prompts[c] + request["output_ids"]
        arms[arm] = {"wall_s": wall_s, "requests": requests}
        if arm in clusters:
            arms[arm]["stored_keys"] = _settle_backup(clusters[arm])
    hits = " ".join(
        f"{arm}={sum(r['tiers']['storage'] for r in arms[arm]['requests'])}" for arm in S.ARMS
    )
    walls = " ".join(f"{arm}={arms[arm]['wall_s']:.1f}s" for arm in S.ARMS)
    print(f"multiturn turn {turn}: {walls} storage tokens {hits}", file=sys.stderr, flush=True)
    return {"turn": turn, "order": list(order), "arms": arms}


def format_multiturn(result: Mapping[str, Any]) -> str:
    config = result["config"]
    lines = [
        f"multiturn {config['model']}: {config['clients']} clients x {config['turns']} turns, "
        f"{config['parallel']} in flight, "
        f"working set {result['working_set_tokens']} tokens, device {config['device_tokens']} "
        f"+ host {result['host_tokens']} tokens"
    ]
    for arm, summary in result.get("arms", {}).items():
        later = summary["later_turns"]
        rates = " ".join(f"{tier} {later['hit_rate'][tier]:.1%}" for tier in TIERS)
        lines.append(
            f"  {arm:<10} turns 2+: TTFT p50 {later['ttft_s']['p50']:.2f} s "
            f"p99 {later['ttft_s']['p99']:.2f} s  hits {rates}  "
            f"{later['input_tokens_per_s']:.0f} input tokens/s"
        )
    for pair, ratios in result.get("paired", {}).items():
        lines.append(
            f"  {pair:<20} input throughput p50 {ratios['input_throughput']['p50']:.2f}x  "
            f"slowest TTFT p50 {ratios['slowest_ttft']['p50']:.2f}x"
        )
    return "\n".join(lines)
