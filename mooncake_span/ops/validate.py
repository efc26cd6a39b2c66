"""``mooncake-span validate``'s pure half: what a server reports, probes, the verdict, ``--save``.

The method: docs/operating.md, "Validating a deployment". No I/O here:
:mod:`mooncake_span.ops.validate_http` talks to the servers and
:mod:`mooncake_span.ops.validate_cmd` runs the passes.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from itertools import takewhile
from typing import Any, TypeVar

from mooncake_span.ops import oracle

Saved = TypeVar("Saved")

DEFAULT_DEPTHS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
DEFAULT_MAX_CONTEXT_TOKENS = 8192
# sglang does not prefetch a remainder shorter than its prefetch threshold
# (256 tokens by default) and always computes the last page.
PREFETCH_THRESHOLD_TOKENS = 256
MIN_PROBE_PAGES = 3
ANSWER_TOKENS = 16
TOP_LOGPROBS = 5
# Half precision recomputes the last page with other batch shapes than the cold
# pass did; this bound is a choice, not a measurement (--logprob-tolerance).
HALF_PRECISION_LOGPROB_TOLERANCE = 0.1
MIN_POOL_TOKENS = 64
MAX_WORD_CHARS = 12
CODE_TOKENS = 3
CODE_INTRO = "\nThe secret code is: "
CODE_OUTRO = "\n"
QUESTION = "What is the secret code? Answer with the code only."
# A message that starts unlike QUESTION: where two chat prompts part is where
# the template's opening ends.
OTHER_MESSAGE = "0"
# Churn's unique tokens per device + host pool token (why: docs/operating.md).
CHURN_FACTOR = 1.5
HOST_TOTAL_GAUGE = "sglang:hicache_host_total_tokens"
COUNTER_PREFIXES = (
    "sglang:storage_",
    "sglang:prefetched_tokens",
    "sglang:backuped_tokens",
    "sglang:cached_tokens_total",
    "sglang:hicache_backup_dropped",
    "mooncake_span_keys_total",
    "mooncake_span_bytes_total",
)
BACKUP_COUNTER = "sglang:backuped_tokens_total"
UNFULFILLED_COUNTER = "sglang:storage_prefetch_unfulfilled_tokens_total"
SAVE_FORMAT = "mooncake-span-validate/1"


@dataclass(frozen=True)
class ServerFacts:
    """What ``/server_info``, ``/model_info`` and ``/metrics`` say about one server."""

    url: str
    model: str
    page_tokens: int
    context_tokens: int
    device_pool_tokens: int
    # None when the server has no host pool, or does not say its size.
    host_pool_tokens: int | None
    # Where host_pool_tokens comes from, or why it is unknown.
    host_pool_source: str
    hierarchical_cache: bool
    max_input_tokens: int
    storage_backend: str | None
    prefetch_policy: str | None
    dtype: str

    @property
    def default_logprob_tolerance(self) -> float:
        """fp32 servers restore to float rounding; half precision gets a looser bound."""
        full = self.dtype in ("float32", "fp32")
        return oracle.LOGPROB_TOLERANCE if full else HALF_PRECISION_LOGPROB_TOLERANCE


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def server_facts(
    url: str,
    server_info: Mapping[str, Any],
    model_info: Mapping[str, Any],
    counters: Mapping[str, float],
) -> ServerFacts:
    """Read one server's facts; a field a server does not report gets a stated fallback."""
    device = _int(server_info.get("max_total_num_tokens")) or _int(
        server_info.get("max_total_tokens")
    )
    if device <= 0:
        raise ValueError(f"{url}: /server_info reports no KV pool size (max_total_num_tokens)")
    page = _int(server_info.get("page_size")) or 1
    context = _int(server_info.get("context_length")) or _int(model_info.get("context_length"))
    hierarchical = bool(server_info.get("enable_hierarchical_cache"))
    host, host_source = _host_pool(server_info, counters, device) if hierarchical else (0, "")
    backend = server_info.get("hicache_storage_backend") or None
    return ServerFacts(
        url=url,
        model=str(model_info.get("served_model_name") or model_info.get("model_path") or ""),
        page_tokens=page,
        context_tokens=context or device,
        device_pool_tokens=device,
        host_pool_tokens=host or None,
        host_pool_source=host_source or "no host pool (hierarchical cache off)",
        hierarchical_cache=hierarchical,
        max_input_tokens=_int(server_info.get("max_req_input_len")) or context or device,
        storage_backend=str(backend) if backend else None,
        prefetch_policy=server_info.get("hicache_storage_prefetch_policy") if backend else None,
        dtype=str(server_info.get("dtype") or "auto"),
    )


def _host_pool(
    server_info: Mapping[str, Any], counters: Mapping[str, float], device_tokens: int
) -> tuple[int, str]:
    """(host pool tokens or 0, where that figure comes from or why it is unknown)."""
    exported = _int(counters.get(HOST_TOTAL_GAUGE))
    if exported:
        return exported, f"{HOST_TOTAL_GAUGE} on /metrics"
    # --hicache-size (GB) overrides the ratio; GB to tokens needs bytes per token, not reported.
    size_gb = float(server_info.get("hicache_size") or 0.0)
    if size_gb > 0:
        return 0, (
            f"unknown: the server sizes it with --hicache-size {size_gb:g} GB and exports "
            f"no {HOST_TOTAL_GAUGE} (serve with --enable-metrics)"
        )
    ratio = float(server_info.get("hicache_ratio") or 0.0)
    if ratio > 0:
        return int(device_tokens * ratio), f"--hicache-ratio {ratio:g} x the device pool"
    return 0, f"unknown: no {HOST_TOTAL_GAUGE}, --hicache-size or --hicache-ratio reported"


def min_context_tokens(page_tokens: int) -> int:
    """The shortest probe whose restore sglang attempts, with room for the question."""
    return max(PREFETCH_THRESHOLD_TOKENS + 2 * page_tokens, MIN_PROBE_PAGES * page_tokens)


def choose_context_tokens(
    servers: Sequence[ServerFacts], override: int | None, answer_tokens: int
) -> tuple[int, str]:
    """(probe length in tokens, why that length), for every server of the run."""
    page = max(s.page_tokens for s in servers)
    floor = min_context_tokens(page)
    # A prompt of max_req_input_len tokens is one too many: the probes stop one short.
    ceiling = min(min(s.max_input_tokens - 1, s.context_tokens - answer_tokens) for s in servers)
    if override is not None:
        if override < floor:
            raise ValueError(
                f"--context-tokens {override} is too short: sglang restores whole "
                f"{page}-token pages, never the last one, and prefetches nothing under "
                f"{PREFETCH_THRESHOLD_TOKENS} tokens; use at least {floor}"
            )
        if override > ceiling:
            raise ValueError(
                f"--context-tokens {override} does not fit: the servers accept prompts of "
                f"at most {ceiling} tokens with a {answer_tokens}-token answer"
            )
        return override, "--context-tokens"
    pools = [s.device_pool_tokens for s in servers]
    pools += [s.host_pool_tokens for s in servers if s.host_pool_tokens]
    half_pool = min(pools) // 2
    tokens = min(DEFAULT_MAX_CONTEXT_TOKENS, half_pool, ceiling)
    if tokens == DEFAULT_MAX_CONTEXT_TOKENS:
        why = f"the default cap ({DEFAULT_MAX_CONTEXT_TOKENS}); --context-tokens for longer"
    elif tokens == half_pool:
        why = f"half the smallest memory pool the servers report ({min(pools)} tokens)"
    else:
        why = f"the longest prompt the servers accept with the answer ({ceiling} tokens)"
    if tokens < floor:
        raise ValueError(
            f"the servers leave room for {tokens}-token probes ({why}); a probe needs at "
            f"least {floor} tokens to be restorable from L3"
        )
    return tokens, why


def restorable_tokens(prompt_tokens: int, page_tokens: int) -> int:
    """Prompt tokens sglang can take from storage: whole pages, never the last token's."""
    return (prompt_tokens - 1) // page_tokens * page_tokens


@dataclass(frozen=True)
class ChurnPlan:
    """Unique traffic meant to push the probes out of device and host memory."""

    prompts: int
    prompt_tokens: int
    tokens: int
    # What the server's device and host pools hold together.
    pool_tokens: int
    why: str


def churn_plan(
    server: ServerFacts, prompt_tokens: int, override_tokens: int | None = None
) -> ChurnPlan:
    """How much unique traffic evicts the probes from ``server``'s memory, and why.
    ValueError for a host pool of unknown size without an override: a guess could
    leave the probes in host memory."""
    host = server.host_pool_tokens or 0
    if server.hierarchical_cache and not host and override_tokens is None:
        raise ValueError(
            f"{server.url}: cannot size churn eviction, the host pool size is "
            f"{server.host_pool_source}; give --churn-tokens (more than device + host pool tokens)"
        )
    pools = server.device_pool_tokens + host
    pools_said = (
        f"device pool {server.device_pool_tokens} + host pool {host} tokens "
        f"(host: {server.host_pool_source})"
        if server.hierarchical_cache
        else f"device pool {server.device_pool_tokens} tokens, no host pool"
    )
    if override_tokens is None:
        total = math.ceil(CHURN_FACTOR * pools)
        sized = f"{CHURN_FACTOR}x {pools_said}"
    else:
        total = override_tokens
        sized = f"--churn-tokens {override_tokens}; the server holds {pools_said}"
        if override_tokens <= pools:
            sized += ": too little to be sure the probes leave memory"
    prompts = math.ceil(total / prompt_tokens)
    sent = prompts * prompt_tokens
    why = f"{prompts} unique {prompt_tokens}-token prompts ({sent} tokens): {sized}"
    return ChurnPlan(prompts, prompt_tokens, sent, pools, why)


@dataclass(frozen=True)
class TokenPool:
    """Token ids a probe draws its filler and code from, all valid for the server's model."""

    ids: tuple[int, ...]
    # Each id's text where the server has a tokenizer (empty without one).
    texts: Mapping[int, str]
    source: str


def pool_from_texts(token_texts: Sequence[str]) -> TokenPool:
    """Tokens of a vocabulary scan (``token_texts[i]`` is id ``i``'s text alone): its plain
    words when there are enough, else every token that spells printable text alone (a
    byte-level tokenizer's); one id per text. ValueError below ``MIN_POOL_TOKENS``."""
    words: dict[str, int] = {}
    spelled: dict[str, int] = {}
    for token_id, text in enumerate(token_texts):
        word = text.strip()
        if 2 <= len(word) <= MAX_WORD_CHARS and word.isascii() and word.isalnum():
            words.setdefault(word, token_id)
        if text.strip() and text.isprintable() and "\ufffd" not in text:
            spelled.setdefault(text, token_id)
    if len(words) >= MIN_POOL_TOKENS:
        chosen, source = words, f"{len(words)} plain words of the server's vocabulary"
    elif len(spelled) >= MIN_POOL_TOKENS:
        chosen = spelled
        source = (
            f"{len(spelled)} printable tokens of the server's vocabulary "
            f"(it has {len(words)} plain words)"
        )
    else:
        raise ValueError(
            f"the tokenizer spells {len(spelled)} distinct printable tokens in the "
            f"{len(token_texts)} ids read; probes need {MIN_POOL_TOKENS}"
        )
    return TokenPool(tuple(chosen.values()), {i: token_texts[i] for i in chosen.values()}, source)


def pool_from_candidates(candidate_ids: Iterable[int]) -> TokenPool:
    """The ids a model proposed (top candidates of greedy answers), for a server without
    a tokenizer. ValueError when fewer than ``MIN_POOL_TOKENS`` are distinct."""
    ids = tuple(dict.fromkeys(int(i) for i in candidate_ids))
    if len(ids) < MIN_POOL_TOKENS:
        raise ValueError(
            f"the model proposed {len(ids)} distinct token ids; probes need {MIN_POOL_TOKENS}"
        )
    return TokenPool(ids, {}, f"{len(ids)} token ids the model proposed (no tokenizer)")


@dataclass(frozen=True)
class Frame:
    """A probe's fixed text as token ids from the server's tokenizer; all empty for a
    server without one, whose probes are filler and code alone."""

    # The chat template's opening (or the tokenizer's own start tokens).
    head: tuple[int, ...] = ()
    code_intro: tuple[int, ...] = ()
    code_outro: tuple[int, ...] = ()
    # The question, then the chat template's closing.
    tail: tuple[int, ...] = ()
    source: str = "token ids only (the server has no tokenizer)"

    @property
    def tokens(self) -> int:
        return len(self.head) + len(self.code_intro) + len(self.code_outro) + len(self.tail)


def _common_prefix(sequences: Sequence[Sequence[int]]) -> int:
    return sum(1 for _ in takewhile(lambda ids: len(set(ids)) == 1, zip(*sequences, strict=False)))


def chat_frame(
    chat_ids: Sequence[int], other_chat_ids: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(the template's opening, the rest) of a chat-templated prompt, from a second
    prompt of the same template with another message: the opening is what both start
    with, the rest the message as the template tokenized it and the template's
    closing. None where the two share no opening (no template around the message)."""
    shared = _common_prefix([chat_ids, other_chat_ids])
    if shared == 0 or shared == len(chat_ids):
        return None
    return tuple(chat_ids[:shared]), tuple(chat_ids[shared:])


def make_probe(
    depth: float, pool: TokenPool, frame: Frame, context_tokens: int, rng: random.Random
) -> Probe:
    """A probe of exactly ``context_tokens`` ids: filler drawn from the pool with a code
    of ``CODE_TOKENS`` pool ids at ``depth`` (in (0, 1): parse_depths) of it, in the frame."""
    filler_tokens = context_tokens - frame.tokens - CODE_TOKENS
    if filler_tokens < 2:
        raise ValueError(
            f"a {context_tokens}-token probe leaves no room for filler around its "
            f"{frame.tokens}-token frame and {CODE_TOKENS}-token code"
        )
    code = tuple(rng.choice(pool.ids) for _ in range(CODE_TOKENS))
    filler = [rng.choice(pool.ids) for _ in range(filler_tokens)]
    at = round(depth * filler_tokens)
    ids = (
        *frame.head,
        *filler[:at],
        *frame.code_intro,
        *code,
        *frame.code_outro,
        *filler[at:],
        *frame.tail,
    )
    return Probe(depth, "".join(pool.texts.get(t, "") for t in code), ids, code)


def _squashed(text: str) -> str:
    return "".join(re.findall(r"[a-z0-9]", text.lower()))


def code_found(answer: Answer, probe: Probe) -> bool:
    """Whether the answer says the probe's code: its letters and digits in order where
    both have text (a model may spell the code with other tokens), else its ids in a row."""
    wanted = _squashed(probe.code)
    if wanted and answer.text:
        return wanted in _squashed(answer.text)
    code, said = list(probe.code_ids), list(answer.output_ids)
    return bool(code) and any(
        said[i : i + len(code)] == code for i in range(len(said) - len(code) + 1)
    )


def shared_prefix_tokens(prompts: Sequence[Sequence[int]]) -> int:
    """Tokens every probe starts with (a chat template's opening), which memory may hold
    whatever the eviction did; 0 for a lone probe, whose whole prompt would count."""
    if len(prompts) < 2:
        return 0
    return _common_prefix(prompts)


def parse_depths(text: str) -> tuple[float, ...]:
    """``10,20,50`` or ``0.1,0.2,0.5`` (percent or fractions), each in (0, 1)."""
    values = []
    for part in text.split(","):
        part = part.strip().rstrip("%")
        if not part:
            continue
        value = float(part)
        value = value / 100.0 if value >= 1.0 else value
        if not 0.0 < value < 1.0:
            raise ValueError(f"a depth must lie strictly between 0 and 100%, got {part}")
        values.append(value)
    if not values:
        raise ValueError("no depths given")
    if len(set(values)) != len(values):
        raise ValueError(f"depths repeat: {text}")
    return tuple(values)


def depth_label(depth: float) -> str:
    return f"{depth * 100:g}%"


@dataclass(frozen=True)
class Answer:
    """One greedy answer and where the server says its prompt came from."""

    output_ids: tuple[int, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...]
    text: str
    prompt_tokens: int
    cached_tokens: int
    storage_tokens: int
    storage_backend: str | None
    # The split of the memory hits, where sglang reports it (0 otherwise).
    device_tokens: int = 0
    host_tokens: int = 0

    @property
    def memory_tokens(self) -> int:
        return max(self.cached_tokens - self.storage_tokens, 0)


def parse_answer(doc: Mapping[str, Any]) -> Answer:
    """An sglang ``/generate`` answer (``meta_info.cached_tokens_details`` for the source)."""
    meta = doc.get("meta_info") or {}
    details = meta.get("cached_tokens_details") or {}
    top = tuple(
        tuple((int(entry[1]), float(entry[0])) for entry in per_token)
        for per_token in meta.get("output_top_logprobs") or ()
    )
    return Answer(
        output_ids=tuple(int(t) for t in doc.get("output_ids") or ()),
        top_logprobs=top,
        text=str(doc.get("text") or ""),
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        cached_tokens=int(meta.get("cached_tokens", 0)),
        storage_tokens=int(details.get("storage", 0) or 0),
        storage_backend=details.get("storage_backend"),
        device_tokens=int(details.get("device", 0) or 0),
        host_tokens=int(details.get("host", 0) or 0),
    )


@dataclass(frozen=True)
class Probe:
    """A probe as sent: its depth, code (text where the server has a tokenizer, and
    token ids) and exact prompt tokens."""

    depth: float
    code: str
    input_ids: tuple[int, ...]
    code_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ProbeResult:
    probe: Probe
    cold: Answer
    l3: Answer
    page_tokens: int
    # Tokens every probe shares (a template's opening): memory may hold them.
    shared_tokens: int
    tolerance: float

    @property
    def verdict(self) -> oracle.Verdict:
        return oracle.compare(
            self.l3.output_ids,
            self.l3.top_logprobs,
            self.cold.output_ids,
            self.cold.top_logprobs,
            tolerance=self.tolerance,
        )

    @property
    def restorable_tokens(self) -> int:
        """What the L3 pass should take from storage: whole pages, less what memory
        may legitimately hold (the shared opening)."""
        whole = restorable_tokens(len(self.probe.input_ids), self.page_tokens)
        return max(whole - min(self.l3.memory_tokens, self.shared_tokens), 0)

    @property
    def evicted(self) -> bool:
        return self.l3.memory_tokens <= self.shared_tokens

    @property
    def restored_all(self) -> bool:
        return self.evicted and self.l3.storage_tokens >= self.restorable_tokens > 0

    @property
    def cold_found_code(self) -> bool:
        return code_found(self.cold, self.probe)

    @property
    def l3_found_code(self) -> bool:
        return code_found(self.l3, self.probe)

    @property
    def agrees(self) -> bool:
        code_kept = self.l3_found_code or not self.cold_found_code
        return self.verdict.agrees and code_kept

    @property
    def ok(self) -> bool:
        return self.restored_all and self.agrees

    def problem(self) -> str | None:
        """Why this probe failed, in one phrase (None when it passed)."""
        label = depth_label(self.probe.depth)
        if not self.evicted:
            l3 = self.l3
            split = f" (device {l3.device_tokens}, host {l3.host_tokens})"
            return (
                f"not evicted at depth {label}: {l3.memory_tokens} tokens"
                f"{split if l3.device_tokens or l3.host_tokens else ''} came from memory, "
                f"{l3.storage_tokens} from storage"
            )
        if not self.agrees:
            what = self.verdict.describe()
            if self.cold_found_code and not self.l3_found_code:
                what = f"code lost; {what}"
            return f"disagreement at depth {label} ({what})"
        if self.l3.storage_tokens == 0:
            return f"no storage hits at depth {label}"
        if not self.restored_all:
            return (
                f"partial restore at depth {label}: {self.l3.storage_tokens} of "
                f"{self.restorable_tokens} tokens from storage"
            )
        return None


def cold_problem(probe: Probe, cold: Answer, shared_tokens: int) -> str | None:
    """Why a cold answer cannot serve as the reference (None when it can): it must be
    computed, not taken from any cache beyond the shared opening."""
    if cold.storage_tokens or cold.cached_tokens > shared_tokens:
        return (
            f"the cold pass at depth {depth_label(probe.depth)} was not cold: "
            f"{cold.cached_tokens} tokens cached ({cold.storage_tokens} from storage); "
            "rerun (probes are new every run unless --seed repeats them)"
        )
    return None


def counter_deltas(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    return {
        name: after[name] - before.get(name, 0.0)
        for name in sorted(after)
        if name.startswith(COUNTER_PREFIXES) and after[name] != before.get(name, 0.0)
    }


def headline_deltas(deltas: Mapping[str, float]) -> dict[str, float]:
    """Family totals, their split by reason or cache source, and this backend's reads per
    pool: the deltas worth a line each (other labels, ranks and model, only repeat totals)."""
    return {
        name: value
        for name, value in deltas.items()
        if "{" not in name
        or name[name.index("{") + 1 :].startswith(("reason", "cache_source"))
        or (name.startswith("mooncake_span_") and '{operation="get",pool=' in name)
    }


def dropped_prefetches(deltas: Mapping[str, float]) -> dict[str, float]:
    """Prefetched tokens sglang dropped, by reason, from counter deltas."""
    prefix = UNFULFILLED_COUNTER + '{reason="'
    return {
        name[len(prefix) : -2]: value
        for name, value in deltas.items()
        if name.startswith(prefix) and value > 0
    }


@dataclass(frozen=True)
class Report:
    results: tuple[ProbeResult, ...]
    l3_deltas: Mapping[str, float] = field(default_factory=dict)
    # Problems found before any probe could be judged (cold pass not cold, ...).
    setup_problems: tuple[str, ...] = ()

    @property
    def probes(self) -> int:
        return len(self.results)

    @property
    def restored_tokens(self) -> int:
        return sum(min(r.l3.storage_tokens, r.restorable_tokens) for r in self.results)

    @property
    def restorable_tokens(self) -> int:
        return sum(r.restorable_tokens for r in self.results)

    @property
    def agreeing(self) -> int:
        return sum(1 for r in self.results if r.agrees)

    @property
    def failing_depths(self) -> list[float]:
        return [r.probe.depth for r in self.results if not r.ok]

    @property
    def ok(self) -> bool:
        return bool(self.results) and not self.setup_problems and not self.failing_depths

    def reasons(self) -> list[str]:
        """Why the run failed, most telling first (empty when it passed)."""
        reasons = list(self.setup_problems)
        if not self.results:
            return reasons or ["no probe was answered"]
        kept = sum(1 for r in self.results if not r.evicted)
        if kept:
            reasons.append(
                f"not evicted: {kept} of {self.probes} probes were served from device/host "
                "memory, not from storage; evict harder (/flush_cache, or churn that exceeds "
                "the device and host pools)"
            )
        # Probes still in memory say nothing of storage: not 'no storage hits'.
        nothing_stored = kept < self.probes and all(
            r.l3.storage_tokens == 0 for r in self.results if r.evicted
        )
        if nothing_stored:
            reasons.append("no storage hits: the L3 pass took nothing from storage")
        dropped = dropped_prefetches(self.l3_deltas)
        if dropped and any(not r.restored_all for r in self.results):
            said = ", ".join(f"{tokens:.0f} tokens ({why})" for why, tokens in dropped.items())
            reasons.append(f"prefetch dropped: sglang discarded {said}")
        problems = [p for r in self.results if (p := r.problem()) is not None]
        if nothing_stored:
            problems = [p for p in problems if not p.startswith("no storage hits at")]
        return reasons + problems

    def summary_line(self) -> str:
        line = (
            f"validate: {self.probes} probes, restored {self.restored_tokens} of "
            f"{self.restorable_tokens} restorable tokens, agree {self.agreeing} of {self.probes}"
        )
        if self.failing_depths:
            line += "; failing depths: " + ", ".join(depth_label(d) for d in self.failing_depths)
        return line


def format_table(report: Report) -> str:
    rows = [
        (
            "depth",
            "prompt",
            "from L3",
            "restorable",
            "memory",
            "greedy",
            "max dlogprob",
            "code cold/L3",
            "result",
        )
    ]
    for r in report.results:
        delta = r.verdict.max_logprob_delta
        rows.append(
            (
                depth_label(r.probe.depth),
                str(len(r.probe.input_ids)),
                str(r.l3.storage_tokens),
                str(r.restorable_tokens),
                str(r.l3.memory_tokens),
                "equal" if r.verdict.tokens_equal else "DIFFER",
                f"{delta:.1e}" if math.isfinite(delta) else ("differ" if delta > 0 else "-"),
                f"{'yes' if r.cold_found_code else 'no'}/{'yes' if r.l3_found_code else 'no'}",
                "ok" if r.ok else "FAIL",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
    )


def report_json(report: Report) -> dict[str, Any]:
    return {
        "ok": report.ok,
        "probes": report.probes,
        "restored_tokens": report.restored_tokens,
        "restorable_tokens": report.restorable_tokens,
        "agreeing": report.agreeing,
        "failing_depths": report.failing_depths,
        "reasons": report.reasons(),
        "summary": report.summary_line(),
        "l3_counter_deltas": headline_deltas(report.l3_deltas),
        "results": [
            {
                "depth": r.probe.depth,
                "code": r.probe.code,
                "prompt_tokens": len(r.probe.input_ids),
                "storage_tokens": r.l3.storage_tokens,
                "restorable_tokens": r.restorable_tokens,
                "memory_tokens": r.l3.memory_tokens,
                "device_tokens": r.l3.device_tokens,
                "host_tokens": r.l3.host_tokens,
                "storage_backend": r.l3.storage_backend,
                "tokens_equal": r.verdict.tokens_equal,
                "max_logprob_delta": _finite_or_none(r.verdict.max_logprob_delta),
                "candidates_differ": math.isinf(r.verdict.max_logprob_delta),
                "compared_tokens": r.verdict.compared_tokens,
                "tolerance": r.verdict.tolerance,
                "cold_found_code": r.cold_found_code,
                "l3_found_code": r.l3_found_code,
                "ok": r.ok,
                "problem": r.problem(),
            }
            for r in report.results
        ],
    }


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def saved_run(
    facts: ServerFacts, probes: Sequence[Probe], cold: Sequence[Answer], meta: Mapping[str, Any]
) -> dict[str, Any]:
    """The document ``--save`` writes: the probes as sent and the cold pass's answers."""
    return {
        "format": SAVE_FORMAT,
        "model": facts.model,
        "page_tokens": facts.page_tokens,
        **meta,
        "probes": [{**asdict(p), "cold": asdict(a)} for p, a in zip(probes, cold, strict=True)],
    }


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _from_json(cls: type[Saved], doc: Mapping[str, Any]) -> Saved:
    """A dataclass that ``asdict`` wrote, back from JSON: its lists as the tuples it
    holds; a field the document lacks (a save from before it existed) at its default."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: _tuples(v) for k, v in doc.items() if k in names})


def load_saved_run(doc: Mapping[str, Any]) -> tuple[list[Probe], list[Answer], dict[str, Any]]:
    """Probes, cold answers and the rest of a ``--save`` document (ValueError if malformed)."""
    if doc.get("format") != SAVE_FORMAT:
        raise ValueError(f"not a validate --save file (format {doc.get('format')!r})")
    try:
        probes = [_from_json(Probe, p) for p in doc["probes"]]
        answers = [_from_json(Answer, p["cold"]) for p in doc["probes"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed validate --save file: {exc!r}") from exc
    if not probes:
        raise ValueError("the validate --save file holds no probes")
    rest = {k: v for k, v in doc.items() if k != "probes"}
    return probes, answers, rest
