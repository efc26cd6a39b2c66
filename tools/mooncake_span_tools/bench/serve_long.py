"""``bench --serve --serve-workloads long``: one long prompt (64k tokens by default) through
real servers, restored whole by a second server (issue #46).

The ``repeated`` workload's shape at a length no other workload reaches: a writer per
L3 arm answers a fresh prompt and backs it up (write-through); then readers that never
saw it answer it one after another: recompute, sglang's ``MooncakeStore`` and this
backend. This backend's prompt is read by one reader per sglang prefetch policy
(``--hicache-storage-prefetch-policy``: ``wait_complete``, ``best_effort``, ``timeout``),
so the run shows which policy lets a long restore finish, and what it costs in TTFT.
Every reader asks for the first answer tokens' top logprobs, and the content oracle
(``ops/oracle.py``) compares each L3 reader's answer with recompute's.

A reader under ``wait_complete`` that restores fewer tokens than the prompt's whole
pages less one (sglang leaves the last page to compute) fails the run, as does any
answer the oracle rejects; the other policies' restored tokens are what the run
measures, not a pass condition.

The model is a smaller tiny Llama than the other workloads' (1 layer, hidden 128,
fp32: 1 KiB of KV per token, so a 64k-token prompt is 64 MiB of KV per copy), so that
seven servers fit a small box's memory and a 64k-token prefill (attention grows with
the square of the length) takes minutes, not tens of minutes, on two cores.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mooncake_span.ops import oracle
from mooncake_span_tools.bench import serve_arms as A
from mooncake_span_tools.bench import serve_stats as S
from mooncake_span_tools.lab.sglang_servers import PREFETCH_POLICIES, SglangServer
from mooncake_span_tools.testing.cpu_server.models import TinyModelSpec, ensure_model

logger = logging.getLogger(__name__)

ARCHITECTURE = "llama"
DEFAULT_PROMPT_TOKENS = 65536
# The policy the arms are compared under; the others run for this backend only.
MAIN_POLICY = "wait_complete"
TOP_LOGPROBS = 5
# A 64k-token prefill took 5-6 minutes on a loaded 2-core box (two layers).
REQUEST_TIMEOUT_S = 1800.0
READER_SETTLE_S = 1.0


@dataclass(frozen=True)
class LongServeConfig(A.ServeSetup):
    hidden_size: int = 128
    num_layers: int = 1
    num_heads: int = 2
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    answer_tokens: int = 4
    rounds: int = 2
    policies: tuple[str, ...] = ("wait_complete", "best_effort", "timeout")

    def __post_init__(self) -> None:
        page = self.page_size_tokens
        if self.prompt_tokens < 4 * page or self.prompt_tokens % page:
            raise ValueError(
                f"prompt length {self.prompt_tokens} must be a multiple of the {page}-token "
                "page and at least 4 pages"
            )
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if MAIN_POLICY not in self.policies or set(self.policies) - set(PREFETCH_POLICIES):
            raise ValueError(
                f"policies must include {MAIN_POLICY!r} and be some of {PREFETCH_POLICIES}, "
                f"got {self.policies}"
            )

    def model_spec(self, architecture: str) -> TinyModelSpec:
        # Room for the prompt, the answer and a page, in whole 4k steps.
        positions = -(-(self.prompt_tokens + self.answer_tokens + 64) // 4096) * 4096
        return dataclasses.replace(
            super().model_spec(architecture), max_position_embeddings=max(positions, 16384)
        )

    @property
    def max_total_tokens(self) -> int:
        page = self.page_size_tokens
        return (-(-(self.prompt_tokens + self.answer_tokens) // page) + 2) * page

    @property
    def restorable_tokens(self) -> int:
        """What a whole restore brings: every page but the last, which sglang computes."""
        return (self.prompt_tokens // self.page_size_tokens - 1) * self.page_size_tokens


def reader_names(config: LongServeConfig) -> list[str]:
    """recompute, mooncake (main policy), span/<policy> for each policy."""
    return [S.RECOMPUTE, S.MOONCAKE, *(f"{S.SPAN}/{p}" for p in config.policies)]


def _start(config: LongServeConfig, log_dir: Path, stack: ExitStack):
    model_path = ensure_model(config.model_spec(ARCHITECTURE), config.work_dir / "models")
    clusters = A.arm_clusters(stack, config.segment_bytes, log_dir)

    def options(arm: str, policy: str):
        fields = dataclasses.replace(config, prefetch_policy=policy).model_fields(
            ARCHITECTURE, config.max_total_tokens
        )
        # --max-total-tokens sizes the pools; a CPU server also checks the memory left after
        # loading against this fraction of what it found at start, and seven servers
        # starting at once on a shared box fail sglang's default (0.72) there.
        fields["extra_args"] = (*fields.get("extra_args", ()), "--mem-fraction-static", "0.95")
        return A.arm_options(arm, model_path, clusters.get(arm), **fields)

    servers: dict[tuple[str, str], SglangServer] = {}
    for name in reader_names(config):
        arm, _, policy = name.partition("/")
        servers[name, "reader"] = SglangServer(
            f"long-{name.replace('/', '-')}-reader", options(arm, policy or MAIN_POLICY), log_dir
        )
    for arm in S.L3_ARMS:
        servers[arm, "writer"] = SglangServer(
            f"long-{arm}-writer", options(arm, MAIN_POLICY), log_dir
        )
    for server in servers.values():
        stack.callback(server.stop)
    servers = A.start_servers(servers, log_dir, stack)
    readers = {name: s for (name, role), s in servers.items() if role == "reader"}
    writers = {name: s for (name, role), s in servers.items() if role == "writer"}
    return readers, writers, clusters


def _answer(server: SglangServer, prompt: list[int], config: LongServeConfig) -> dict[str, Any]:
    ttft_s, answer = A.stream_generate(
        server.url,
        prompt,
        config.answer_tokens,
        top_logprobs=TOP_LOGPROBS,
        timeout_s=REQUEST_TIMEOUT_S,
    )
    return {
        "ttft_s": ttft_s,
        "e2e_s": answer.e2e_s,
        "storage_tokens": answer.storage_tokens,
        "cached_tokens": answer.cached_tokens,
        "output_ids": list(answer.output_ids),
        "top_logprobs": [list(map(list, t)) for t in answer.top_logprobs],
    }


def run_round(readers, writers, clusters, config: LongServeConfig, index: int) -> dict[str, Any]:
    prompt = A.round_prompt(config.seed, "long", config.prompt_tokens, index)
    written = {}
    for arm, writer in writers.items():
        before = A.stored_keys(clusters[arm])
        answer = writer.generate(prompt, config.answer_tokens, timeout_s=REQUEST_TIMEOUT_S)
        backup = A.wait_for_backup(
            clusters[arm], before, config.prompt_tokens // config.page_size_tokens - 1
        )
        written[arm] = {"e2e_s": answer.e2e_s, **backup}
    for reader in readers.values():
        reader.flush_cache()
    names = list(readers)
    shift = index % len(names)
    answers = {}
    for name in names[shift:] + names[:shift]:
        answers[name] = _answer(readers[name], prompt, config)
        time.sleep(READER_SETTLE_S)  # the reader still writes its pages to host memory
    reference = answers[S.RECOMPUTE]
    for name, got in answers.items():
        if name == S.RECOMPUTE:
            continue
        verdict = oracle.compare(
            got["output_ids"],
            got["top_logprobs"],
            reference["output_ids"],
            reference["top_logprobs"],
        )
        got["oracle_agrees"] = verdict.agrees
        got["oracle"] = verdict.describe()
    line = " ".join(
        f"{n}={a['ttft_s']:.1f}s/{a['storage_tokens']}" for n, a in sorted(answers.items())
    )
    print(f"long {config.prompt_tokens} round {index}: {line}", file=sys.stderr, flush=True)
    return {
        "round": index,
        "order": names[shift:] + names[:shift],
        "writers": written,
        "readers": answers,
    }


def summarize(rounds: list[dict[str, Any]], config: LongServeConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    names = list(rounds[0]["readers"])
    for name in names:
        cells = [r["readers"][name] for r in rounds]
        out[name] = {
            "ttft_s_median": round(statistics.median(c["ttft_s"] for c in cells), 3),
            "ttft_s_each": [round(c["ttft_s"], 3) for c in cells],
            "storage_tokens_each": [c["storage_tokens"] for c in cells],
            "oracle_agrees": all(c.get("oracle_agrees", True) for c in cells),
        }
    main = f"{S.SPAN}/{MAIN_POLICY}"
    for other in (S.MOONCAKE, S.RECOMPUTE):
        ratios = [r["readers"][main]["ttft_s"] / r["readers"][other]["ttft_s"] for r in rounds]
        out[f"{main}_over_{other}"] = {
            "median": round(statistics.median(ratios), 3),
            "each": [round(x, 3) for x in ratios],
        }
    return out


def failures(result: dict[str, Any]) -> list[str]:
    """What fails the run: an answer the oracle rejects, or a main-policy reader of this
    backend that restored less than the whole restorable prompt."""
    bad = []
    whole = result["restorable_tokens"]
    for r in result.get("rounds", []):
        for name, got in r["readers"].items():
            if got.get("oracle_agrees") is False:
                bad.append(f"long round {r['round']} {name}: oracle: {got['oracle']}")
        main = r["readers"].get(f"{S.SPAN}/{MAIN_POLICY}")
        if main is not None and main["storage_tokens"] < whole:
            bad.append(
                f"long round {r['round']}: this backend restored {main['storage_tokens']} of "
                f"{whole} restorable tokens under {MAIN_POLICY}"
            )
    return bad


def run_long_serve(
    config: LongServeConfig, checkpoint: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    started = time.monotonic()
    log_dir = config.work_dir / "logs" / "long"
    spec = config.model_spec(ARCHITECTURE)
    result: dict[str, Any] = {
        "config": {**config.described(), "policies": list(config.policies)},
        "model": dataclasses.asdict(spec),
        "kv_bytes_per_token": A.kv_bytes_per_token(spec),
        "restorable_tokens": config.restorable_tokens,
        "log_dir": str(log_dir),
        "rounds": [],
    }
    with ExitStack() as stack:
        readers, writers, clusters = _start(config, log_dir, stack)
        for index in range(config.rounds):
            result["rounds"].append(run_round(readers, writers, clusters, config, index))
            result["summary"] = summarize(result["rounds"], config)
            result["wall_s"] = round(time.monotonic() - started, 1)
            if checkpoint is not None:
                checkpoint(result)
    result["failures"] = failures(result)
    return result


def format_long_serve(result: dict[str, Any]) -> str:
    lines = [
        f"long prompt {result['config']['prompt_tokens']} tokens "
        f"({result['restorable_tokens']} restorable), {len(result['rounds'])} rounds:"
    ]
    for name, cell in result.get("summary", {}).items():
        if "ttft_s_median" in cell:
            verdict = "agrees" if cell["oracle_agrees"] else "DISAGREES"
            lines.append(
                f"  {name:<22} TTFT median {cell['ttft_s_median']:7.2f} s  storage tokens "
                f"{cell['storage_tokens_each']}  oracle {verdict}"
            )
        else:
            lines.append(f"  {name:<36} TTFT ratio median {cell['median']:.2f} {cell['each']}")
    return "\n".join(lines)
