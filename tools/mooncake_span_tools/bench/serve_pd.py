"""Prefill/decode serving workload: turn 2 on a prefill process that never saw turn 1.

``mooncake-span bench --serve --serve-workloads pd``. Every arm is a prefill/
decode deployment behind sglang-router: two prefill servers and one decode
server, with a router in front of each (prefill, decode) pair; KV moves prefill
-> decode over the Mooncake transfer engine (TCP). In the L3 arms the prefill
servers write their prompts' pages to that arm's cluster and the decode server
writes the pages its answer fills (decode-side offload); the recompute arm has
no L3 anywhere.

Each round is a fresh conversation. Turn 1 goes through the first router of
every arm; once each L3 arm's master holds turn 1's pages, turn 2 (turn 1's
prompt and answer plus a page of new text) goes through the second router, so
it reaches a prefill process whose device and host caches never held this
conversation: what it finds of turn 1 can only come from L3. Turn 2's TTFT is
the time to its first streamed chunk through the router. Arms run in an order
that cycles through every permutation, round 0 is a warm-up, and every arm's
greedy tokens must equal recompute's in both turns.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mooncake_span.ops import launcher as L
from mooncake_span_tools.bench import serve_arms as A
from mooncake_span_tools.bench import serve_stats as S
from mooncake_span_tools.lab.sglang_servers import HOST, Router, SglangServer, start_together
from mooncake_span_tools.testing.cpu_server.models import ensure_model

logger = logging.getLogger(__name__)

ROUTER_TIMEOUT_S = 300.0
# sglang's --num-reserved-decode-tokens default: a decode server admits a request
# only when its pool holds the request and this many more tokens, and a request
# it cannot admit waits for ever.
DECODE_RESERVED_TOKENS = 512


@dataclass(frozen=True)
class PdConfig(A.ServeSetup):
    model: str = "llama"
    prompt_tokens: int = 2048
    # 96 answer tokens fill a page beyond the prompt, which decode writes to L3.
    answer_tokens: int = 96
    new_tokens: int = 64
    rounds: int = 6
    warmup_rounds: int = 1

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.warmup_rounds < 0:
            raise ValueError("rounds must be >= 1 and warmup_rounds >= 0")
        if self.prompt_tokens % self.page_size_tokens or self.prompt_tokens < 4 * (
            self.page_size_tokens
        ):
            raise ValueError(
                f"prompt_tokens {self.prompt_tokens} must be a multiple of the page "
                f"({self.page_size_tokens} tokens) and at least 4 pages"
            )
        if self.answer_tokens < 2 or self.new_tokens < 1:
            raise ValueError("need answer_tokens >= 2 and new_tokens >= 1")

    @property
    def turn1_l3_pages(self) -> int:
        """Whole pages of turn 1 in L3: the prompt's, and decode's up to the last output token."""
        return (self.prompt_tokens + self.answer_tokens - 1) // self.page_size_tokens

    @property
    def turn2_tokens(self) -> int:
        return self.prompt_tokens + self.answer_tokens + self.new_tokens

    @property
    def restorable_tokens(self) -> int:
        """Turn 2's tokens an L3 arm can restore: a match covers at most len - 1 tokens."""
        pages = min(self.turn1_l3_pages, (self.turn2_tokens - 1) // self.page_size_tokens)
        return pages * self.page_size_tokens

    @property
    def max_total_tokens(self) -> int:
        """Every server's device pool: turn 2 with its answer, decode's reserve and two pages."""
        tokens = self.turn2_tokens + self.answer_tokens + DECODE_RESERVED_TOKENS
        return (-(-tokens // self.page_size_tokens) + 2) * self.page_size_tokens


@dataclass
class PdArm:
    """One arm's deployment: turn 1 goes through ``first``, turn 2 through ``second``."""

    first: Router
    second: Router
    cluster: Any


def _arm_servers(
    config: PdConfig, arm: str, model_path: Path, cluster: Any, log_dir: Path
) -> tuple[dict[str, SglangServer], dict[str, int]]:
    fields = config.model_fields(config.model, config.max_total_tokens)
    servers, bootstrap = {}, {}
    for name in ("prefill1", "prefill2"):
        bootstrap[name] = L.pick_free_ports(HOST, 1)[0]
        options = A.arm_options(
            arm,
            model_path,
            cluster,
            disaggregation_mode="prefill",
            bootstrap_port=bootstrap[name],
            **fields,
        )
        servers[name] = SglangServer(f"pd-{arm}-{name}", options, log_dir)
    decode = A.arm_options(
        arm,
        model_path,
        cluster,
        disaggregation_mode="decode",
        decode_offload=cluster is not None,
        **fields,
    )
    servers["decode"] = SglangServer(f"pd-{arm}-decode", decode, log_dir)
    return servers, bootstrap


def _start_arms(config: PdConfig, stack: ExitStack, log_dir: Path) -> dict[str, PdArm]:
    model_path = ensure_model(config.model_spec(config.model), config.work_dir / "models")
    clusters = A.arm_clusters(stack, config.segment_bytes, log_dir)
    servers, bootstraps = {}, {}
    for arm in S.ARMS:
        arm_servers, bootstraps[arm] = _arm_servers(
            config, arm, model_path, clusters.get(arm), log_dir
        )
        for name, server in arm_servers.items():
            servers[arm, name] = server
            stack.callback(server.stop)
    servers = A.start_servers(servers, log_dir, stack)
    routers = {}
    for arm in S.ARMS:
        for name in ("prefill1", "prefill2"):
            prefill = [(servers[arm, name], bootstraps[arm][name])]
            router = Router(f"pd-{arm}-router-{name}", prefill, [servers[arm, "decode"]], log_dir)
            stack.callback(router.stop)
            routers[arm, name] = router
    start_together(list(routers.values()))
    for router in routers.values():
        # A router answers 503 until it has registered its workers.
        router.generate_until_served([1] * (config.page_size_tokens + 1), 1, ROUTER_TIMEOUT_S)
    return {
        arm: PdArm(routers[arm, "prefill1"], routers[arm, "prefill2"], clusters.get(arm))
        for arm in S.ARMS
    }


def run_pd_round(config: PdConfig, arms: Mapping[str, PdArm], index: int) -> dict[str, Any]:
    prompt = A.round_prompt(config.seed, f"pd-{config.model}", config.prompt_tokens, index)
    order = S.round_order(S.ARMS, index)
    turn1, before = {}, {}
    for arm in order:
        if arms[arm].cluster is not None:
            before[arm] = A.stored_keys(arms[arm].cluster)
        ttft_s, answer = A.stream_generate(arms[arm].first.url, prompt, config.answer_tokens)
        turn1[arm] = {
            "ttft_s": ttft_s,
            "storage_tokens": answer.storage_tokens,
            "output_ids": list(answer.output_ids),
        }
    backups = {
        arm: A.wait_for_backup(arms[arm].cluster, before[arm], config.turn1_l3_pages)
        for arm in before
    }
    new = A.round_prompt(config.seed + 1, f"pd-{config.model}", config.new_tokens, index)
    turn2 = {}
    for arm in order:
        history = [*prompt, *turn1[arm]["output_ids"], *new]
        ttft_s, answer = A.stream_generate(arms[arm].second.url, history, config.answer_tokens)
        turn2[arm] = {
            "ttft_s": ttft_s,
            "e2e_s": answer.e2e_s,
            "storage_tokens": answer.storage_tokens,
            "cached_tokens": answer.cached_tokens,
            "output_ids": list(answer.output_ids),
        }
    ttfts = " ".join(f"{arm}={turn2[arm]['ttft_s']:.2f}s" for arm in S.ARMS)
    print(f"pd round {index}: turn-2 TTFT {ttfts}", file=sys.stderr, flush=True)
    return {
        "model": config.model,
        "prompt_tokens": config.turn2_tokens,
        "round": index,
        "warmup": index < config.warmup_rounds,
        "order": list(order),
        "arms": turn2,
        "turn1": turn1,
        "backups": backups,
        "disagreeing": S.disagreeing({arm: turn2[arm]["output_ids"] for arm in S.ARMS})
        + [
            f"{arm}-turn1"
            for arm in S.disagreeing({arm: turn1[arm]["output_ids"] for arm in S.ARMS})
        ],
    }


def run_pd(
    config: PdConfig, checkpoint: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    started = time.monotonic()
    log_dir = config.work_dir / "logs" / f"pd-{config.model}"
    spec = config.model_spec(config.model)
    result: dict[str, Any] = {
        "workload": "pd",
        "config": config.described(),
        "model": asdict(spec),
        "restorable_tokens": config.restorable_tokens,
        "rounds": [],
    }
    with ExitStack() as stack:
        arms = _start_arms(config, stack, log_dir)
        for index in range(config.warmup_rounds + config.rounds):
            result["rounds"].append(run_pd_round(config, arms, index))
            result["wall_s"] = time.monotonic() - started
            if checkpoint is not None:
                checkpoint(result)
    result["cell"] = S.summarize_cell(result["rounds"])
    return result


def check_pd(result: Mapping[str, Any]) -> list[str]:
    """Rounds where an arm's answer differed, in either turn."""
    return [
        f"pd round {r['round']}: {', '.join(r['disagreeing'])}"
        for r in result["rounds"]
        if r["disagreeing"]
    ]


def format_pd(result: Mapping[str, Any]) -> str:
    config = result["config"]
    cell = result["cell"]
    lines = [
        f"pd {config['model']}: turn 2 ({config['prompt_tokens']}-token prompt + answer + "
        f"{config['new_tokens']} new) on a fresh prefill process, {cell['rounds']} rounds, "
        f"{result['restorable_tokens']} tokens restorable"
    ]
    for arm, stats in cell["arms"].items():
        lines.append(
            f"  {arm:<10} TTFT p50 {stats['ttft_s']['p50']:6.3f} s  "
            f"p99 {stats['ttft_s']['p99']:6.3f} s  storage tokens {stats['storage_tokens']}"
        )
    for pair, ratio in cell["paired_ttft_ratio"].items():
        lines.append(f"  {pair:<20} p50 {ratio['p50']:.2f}x  p99 {ratio['p99']:.2f}x")
    return "\n".join(lines)
