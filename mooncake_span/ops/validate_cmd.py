"""``mooncake-span validate``: does a running deployment's L3 restore correctly, at every depth?

The passes, the output and the exit codes: docs/operating.md, "Validating a
deployment". Progress goes to stderr, the table and verdict (or ``--json``) to stdout.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mooncake_span.ops import oracle
from mooncake_span.ops import validate as V
from mooncake_span.ops.cli_common import positive_int_arg
from mooncake_span.ops.validate_http import ServerRefused, ServerUnreachable, SglangHttp

# Token ids whose text is read for the token pool; smaller spans are tried when
# a tokenizer refuses ids past its vocabulary (a byte-level one has 256 and a few).
VOCAB_SCANS = (32768, 4096, 512, 256)
# A server without a tokenizer: the ids sglang's own start-up request sends it
# (any model has them) seed the answers whose top candidates become the pool.
PROPOSAL_SEED_IDS = (10, 11, 12)
PROPOSAL_TOKENS = 64
PROPOSAL_TOP = 20
PROPOSAL_ROUNDS = 4
BACKUP_SETTLE_S = 2.0
BACKUP_POLL_S = 0.5
UNMEASURED_BACKUP_WAIT_S = 5.0
FLUSH_TIMEOUT_S = 60.0


def _progress(message: str) -> None:
    print(f"validate: {message}", file=sys.stderr, flush=True)


@dataclass
class Server:
    http: SglangHttp
    facts: V.ServerFacts


def connect(url: str) -> Server:
    http = SglangHttp(url)
    info, model = http.server_info(), http.model_info()
    return Server(http, V.server_facts(http.url, info, model, http.metrics()))


def _proposed_pool(server: Server) -> V.TokenPool:
    """Ids the model proposes: top candidates over greedy answers, each seeding the next."""
    seen: dict[int, None] = {}
    seed = list(PROPOSAL_SEED_IDS)
    for _round in range(PROPOSAL_ROUNDS):
        body = server.http.generate(seed, PROPOSAL_TOKENS, PROPOSAL_TOP, ignore_eos=True)
        answer = V.parse_answer(body)
        for step in answer.top_logprobs:
            seen.update((token_id, None) for token_id, _logprob in step)
        if len(seen) >= V.MIN_POOL_TOKENS:
            break
        seed = list(answer.output_ids) or seed
    try:
        return V.pool_from_candidates(seen)
    except ValueError as exc:
        raise ValueError(f"{server.facts.url}: {exc}") from None


def token_pool(server: Server) -> V.TokenPool:
    """The ids probes draw from: the server's vocabulary (``/detokenize``), else what its
    model proposes."""
    for span in VOCAB_SCANS:
        try:
            texts = server.http.token_texts(range(span))
        except ServerRefused:
            continue  # ids past the vocabulary, or no tokenizer at all
        try:
            return V.pool_from_texts(texts)
        except ValueError:
            break  # a scan that fits is the whole vocabulary, or enough of it
    return _proposed_pool(server)


def probe_frame(server: Server) -> V.Frame:
    """The code line and the question in the server's tokens, inside its chat template
    where it has one; an empty frame for a server without a tokenizer."""
    http = server.http
    try:
        intro = tuple(http.tokenize_text(V.CODE_INTRO, special_tokens=False))
        outro = tuple(http.tokenize_text(V.CODE_OUTRO, special_tokens=False))
        question = tuple(http.tokenize_text(V.QUESTION, special_tokens=False))
    except ServerRefused:
        return V.Frame()
    try:
        framed = V.chat_frame(http.tokenize_chat(V.QUESTION), http.tokenize_chat(V.OTHER_MESSAGE))
    except ServerRefused:
        framed = None
    if framed is not None:
        head, rest = framed
        return V.Frame(head, intro, outro, (*outro, *rest), "the chat template")
    opening = tuple(http.tokenize_text("", special_tokens=True))
    return V.Frame(
        opening, intro, outro, (*outro, *question), "the tokenizer without a chat template"
    )


def warm_up(server: Server, pool: V.TokenPool, rng: random.Random) -> None:
    """One unique prompt long enough for an L3 lookup: a server's first lookup loads
    sglang's page-hash code, and under the ``timeout`` policy its prefetch is dropped."""
    length = V.min_context_tokens(server.facts.page_tokens)
    server.http.generate(rng.choices(pool.ids, k=length), 1, 0)


def wait_for_backups(server: Server, before: dict[str, float], tokens: int, limit_s: float) -> str:
    """Wait until the backup counter grew by ``tokens`` and settled; say how it ended."""
    if server.facts.storage_backend is None:
        return "no wait: the server reports no storage backend"
    # sglang exports the backup counter only from its first backup on; its
    # prefetch counters, from the start, say that the storage metrics are live.
    if V.UNFULFILLED_COUNTER not in before:
        time.sleep(UNMEASURED_BACKUP_WAIT_S)
        return (
            f"waited a fixed {UNMEASURED_BACKUP_WAIT_S:.0f}s: the server exports no storage "
            "metrics (serve with --enable-metrics for a measured wait)"
        )
    started = time.monotonic()
    base = before.get(V.BACKUP_COUNTER, 0.0)
    last, since = base, started
    while True:
        now = server.http.metrics().get(V.BACKUP_COUNTER, base)
        if now != last:
            last, since = now, time.monotonic()
        grown = last - base
        elapsed = time.monotonic() - started
        if grown >= tokens and time.monotonic() - since >= BACKUP_SETTLE_S:
            return (
                f"{V.BACKUP_COUNTER} grew by {grown:.0f} tokens (>= {tokens}) and settled "
                f"for {BACKUP_SETTLE_S:.0f}s, after {elapsed:.1f}s"
            )
        if elapsed > limit_s:
            return (
                f"gave up after {limit_s:.0f}s: {V.BACKUP_COUNTER} grew by {grown:.0f} of "
                f"{tokens} tokens (backups may be incomplete)"
            )
        time.sleep(BACKUP_POLL_S)


def evict(
    server: Server,
    args: argparse.Namespace,
    pool: V.TokenPool,
    context_tokens: int,
    notes: dict[str, Any],
) -> str:
    """Push the probes out of ``server``'s device and host memory; say how (a churn's
    plan also goes to ``notes['churn']``)."""
    if args.evict == "flush":
        try:
            server.http.flush_cache(FLUSH_TIMEOUT_S)
        except ServerRefused as exc:
            raise ValueError(
                f"{server.facts.url}: /flush_cache refused ({exc}); where flushing is not allowed, "
                "use --evict churn"
            ) from None
        said = "flushed the device and host caches (/flush_cache)"
        _progress(said)
        return said
    # Read the pools again: sglang sets its host pool gauge at its first
    # prefill, which came after connect().
    plan = V.churn_plan(connect(server.facts.url).facts, context_tokens, args.churn_tokens)
    notes["churn"] = {k: v for k, v in asdict(plan).items() if k != "why"}
    _progress(f"churn: {plan.why}")
    rng = random.Random()
    started = time.monotonic()
    for i in range(plan.prompts):
        _progress(f"churn {i + 1}/{plan.prompts}")
        server.http.generate(rng.choices(pool.ids, k=plan.prompt_tokens), 1, 0)
    notes["churn"]["seconds"] = round(time.monotonic() - started, 2)
    return f"churn: {plan.why}"


def _check_same_model(servers: Sequence[Server]) -> None:
    models = {s.facts.model for s in servers}
    pages = {s.facts.page_tokens for s in servers}
    if len(models) > 1 or len(pages) > 1:
        raise ValueError(
            "the servers differ: "
            + "; ".join(
                f"{s.facts.url} serves {s.facts.model} on {s.facts.page_tokens}-token pages"
                for s in servers
            )
        )


def _ask(
    server: Server,
    phase: str,
    probes: Sequence[V.Probe],
    answer_tokens: Sequence[int],
    args: argparse.Namespace,
    notes: dict[str, Any],
) -> list[V.Answer]:
    """Each probe's answer of its length from ``server``; the pass's time into ``notes``."""
    answers = []
    started = time.monotonic()
    for i, (probe, tokens) in enumerate(zip(probes, answer_tokens, strict=True)):
        _progress(f"{phase} pass {i + 1}/{len(probes)} (depth {V.depth_label(probe.depth)})")
        body = server.http.generate(probe.input_ids, tokens, args.top_logprobs)
        answers.append(V.parse_answer(body))
    notes[f"{phase.lower()}_pass_s"] = round(time.monotonic() - started, 2)
    return answers


def _l3_pass(
    server: Server,
    probes: Sequence[V.Probe],
    cold: Sequence[V.Answer],
    args: argparse.Namespace,
    notes: dict[str, Any],
    setup_problems: Sequence[str] = (),
) -> V.Report:
    shared = V.shared_prefix_tokens([p.input_ids for p in probes])
    tolerance = args.logprob_tolerance
    if tolerance is None:
        tolerance = server.facts.default_logprob_tolerance
    notes["tolerance"] = tolerance
    before = server.http.metrics()
    answers = _ask(server, "L3", probes, [len(c.output_ids) or 1 for c in cold], args, notes)
    results = [
        V.ProbeResult(probe, reference, answer, server.facts.page_tokens, shared, tolerance)
        for probe, reference, answer in zip(probes, cold, answers, strict=True)
    ]
    deltas = V.counter_deltas(before, server.http.metrics())
    return V.Report(tuple(results), deltas, tuple(setup_problems))


def run(args: argparse.Namespace) -> tuple[V.Report, dict[str, Any]]:
    """The report and what the run did (``--json`` prints both). A run that cannot be
    set up raises ValueError naming what is wrong (a flag, a server, a saved file)."""
    _check_args(args)
    servers = [connect(url) for url in args.server]
    _check_same_model(servers)
    notes: dict[str, Any] = {"servers": [asdict(s.facts) for s in servers]}
    for s in servers:
        _progress(
            f"{s.facts.url}: {s.facts.model}, {s.facts.page_tokens}-token pages, storage backend "
            f"{s.facts.storage_backend or 'none'}"
            + (f" (prefetch policy {s.facts.prefetch_policy})" if s.facts.storage_backend else "")
        )
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    rng = random.Random(seed)
    notes["seed"] = seed
    l3_server = servers[-1]
    pool = token_pool(servers[0])
    notes["token_pool"] = pool.source
    _progress(f"token pool: {pool.source}")

    if args.against is not None:
        try:
            probes, cold, saved = V.load_saved_run(json.loads(args.against.read_text()))
        except ValueError as exc:
            raise ValueError(f"{args.against}: {exc}") from None
        if saved.get("model") != l3_server.facts.model:
            raise ValueError(
                f"{args.against} was saved against model {saved.get('model')!r}; "
                f"{l3_server.facts.url} serves {l3_server.facts.model!r}"
            )
        if saved.get("page_tokens") != l3_server.facts.page_tokens:
            raise ValueError(
                f"{args.against} was saved on {saved.get('page_tokens')}-token pages; "
                f"{l3_server.facts.url} uses {l3_server.facts.page_tokens}"
            )
        notes["against"] = str(args.against)
        _progress(f"{len(probes)} saved probes from {args.against}; L3 pass only")
        warm_up(l3_server, pool, rng)
        notes["eviction"] = evict(l3_server, args, pool, len(probes[0].input_ids), notes)
        return _l3_pass(l3_server, probes, cold, args, notes), notes

    facts = [s.facts for s in servers]
    context, why = V.choose_context_tokens(facts, args.context_tokens, args.answer_tokens)
    _progress(f"probes of {context} tokens: {why}")
    frame = probe_frame(servers[0])
    probes = [V.make_probe(depth, pool, frame, context, rng) for depth in args.depths]
    notes.update(context_tokens=context, context_choice=why, framed_with=frame.source)
    _progress(f"{len(probes)} probes, framed with {frame.source}")
    for s in servers:
        warm_up(s, pool, rng)

    cold_server = servers[0]
    before = cold_server.http.metrics()
    shared = V.shared_prefix_tokens([p.input_ids for p in probes])
    cold = _ask(cold_server, "cold", probes, [args.answer_tokens] * len(probes), args, notes)
    problems = [V.cold_problem(p, answer, shared) for p, answer in zip(probes, cold, strict=True)]
    setup_problems = [problem for problem in problems if problem is not None]
    expected = sum(
        V.restorable_tokens(len(p.input_ids), cold_server.facts.page_tokens) for p in probes
    )
    notes["backup_wait"] = wait_for_backups(cold_server, before, expected, args.backup_wait_s)
    _progress(notes["backup_wait"])
    if args.save is not None:
        meta = {"seed": seed, "context_tokens": context, "servers": list(args.server)}
        args.save.write_text(json.dumps(V.saved_run(cold_server.facts, probes, cold, meta)))
        notes["saved"] = str(args.save)
        _progress(f"saved the probes and cold answers to {args.save}")
    if l3_server is cold_server:
        notes["eviction"] = evict(l3_server, args, pool, context, notes)
    else:
        notes["eviction"] = f"none: {l3_server.facts.url} never saw the probes"
        _progress(notes["eviction"])
    return _l3_pass(l3_server, probes, cold, args, notes, setup_problems), notes


def _depths_arg(text: str) -> tuple[float, ...]:
    try:
        return V.parse_depths(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "validate",
        help="check a running sglang deployment's L3 restore, by counters and content",
        description=(
            "Send probes (long contexts with a code at 10%..95% depth) to running sglang "
            "servers with a HiCache L3: a cold pass, a bounded wait for the backups, eviction "
            "from device and host memory, and an L3 pass (on a second server when given). Per "
            "depth: tokens served from storage, greedy tokens and top-k logprobs against the "
            "cold pass, the code. Exit 0 only when every probe was served from L3 and agreed. "
            "See docs/operating.md, 'Validating a deployment'."
        ),
    )
    parser.add_argument(
        "--server",
        action="append",
        required=True,
        metavar="URL",
        help="an sglang server, e.g. http://HOST:30000; a second one runs the L3 pass",
    )
    parser.add_argument(
        "--depths",
        type=_depths_arg,
        default=V.DEFAULT_DEPTHS,
        metavar="LIST",
        help="code depths in percent (default 10,20,...,90,95)",
    )
    parser.add_argument(
        "--context-tokens",
        type=positive_int_arg,
        metavar="N",
        help="probe length in tokens (default: half the smallest pool the servers report, "
        f"at most {V.DEFAULT_MAX_CONTEXT_TOKENS})",
    )
    parser.add_argument(
        "--answer-tokens",
        type=positive_int_arg,
        default=V.ANSWER_TOKENS,
        metavar="N",
        help=f"greedy answer length (default {V.ANSWER_TOKENS})",
    )
    parser.add_argument(
        "--top-logprobs",
        type=positive_int_arg,
        default=V.TOP_LOGPROBS,
        metavar="K",
        help=f"top candidates compared per answer token (default {V.TOP_LOGPROBS})",
    )
    parser.add_argument(
        "--logprob-tolerance",
        type=float,
        metavar="X",
        help=f"largest |logprob difference| that agrees (default {oracle.LOGPROB_TOLERANCE:g} "
        f"for float32 servers, {V.HALF_PRECISION_LOGPROB_TOLERANCE:g} otherwise)",
    )
    parser.add_argument(
        "--evict",
        choices=("flush", "churn"),
        default="flush",
        help="how probes leave device and host memory before the L3 pass on the same server: "
        "sglang's /flush_cache (default), or unique traffic sized from the server's pools",
    )
    parser.add_argument(
        "--churn-tokens",
        type=positive_int_arg,
        metavar="N",
        help=f"unique tokens --evict churn sends (default {V.CHURN_FACTOR}x the device and "
        "host pools the server reports; needed when it does not report its host pool)",
    )
    parser.add_argument(
        "--backup-wait-s",
        type=float,
        default=60.0,
        metavar="S",
        help="longest wait for the cold pass's backups to land (default 60)",
    )
    parser.add_argument("--save", type=Path, metavar="FILE", help="keep probes and cold answers")
    parser.add_argument(
        "--against",
        type=Path,
        metavar="FILE",
        help="run only the L3 pass against a --save file (after a restart)",
    )
    parser.add_argument("--seed", type=int, help="probe seed (default: random)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.set_defaults(func=run_validate_command)


def _check_args(args: argparse.Namespace) -> None:
    if len(args.server) > 2:
        raise ValueError("give one --server, or two (cold pass on the first, L3 on the second)")
    if args.against is not None and (len(args.server) != 1 or args.save is not None):
        raise ValueError("--against runs only the L3 pass: give one --server and no --save")
    if args.churn_tokens is not None and args.evict != "churn":
        raise ValueError("--churn-tokens sizes --evict churn; add --evict churn")
    if args.logprob_tolerance is not None and args.logprob_tolerance < 0:
        raise ValueError("--logprob-tolerance must be >= 0")


def run_validate_command(args: argparse.Namespace) -> int:
    try:
        report, notes = run(args)
    except (ValueError, ServerUnreachable, OSError) as exc:
        if args.json:
            print(json.dumps({"ok": False, "error": str(exc)}, indent=1))
        print(f"mooncake-span validate: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({**V.report_json(report), **notes}, indent=1))
    else:
        print(V.format_table(report))
        for name, delta in V.headline_deltas(report.l3_deltas).items():
            print(f"  {name} {delta:+g}")
        for reason in report.reasons():
            print(f"FAIL: {reason}")
        print(report.summary_line(), flush=True)
    return 0 if report.ok else 1
