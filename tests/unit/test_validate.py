"""``mooncake-span validate``'s pure logic: probes, facts, the per-probe and run verdicts.

The real-server cases are in ``tests/servers/test_validate.py``.
"""

from __future__ import annotations

import ast
import http.server
import json
import random
import socket
import threading
from pathlib import Path

import pytest

from mooncake_span.ops import cli
from mooncake_span.ops import validate as V

PAGE = 64


def test_pure_module_imports_no_io_library():
    source = Path(V.__file__).read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"urllib", "http", "socket", "subprocess", "os", "sglang", "torch"}


def test_pool_from_texts_prefers_plain_words():
    texts = [f"w{i}" for i in range(70)] + [" w1", "", "<unk>", "ñandu", "x" * 13, " ing", "w-2"]
    pool = V.pool_from_texts(texts)
    assert pool.ids[:3] == (0, 1, 2) and len(pool.ids) == 71  # w0..w69 and "ing"
    assert 70 not in pool.ids  # " w1" repeats w1
    assert pool.texts[75] == " ing" and "plain words" in pool.source


def test_pool_from_texts_takes_printable_tokens_of_a_byte_level_vocabulary():
    """A byte-level vocabulary has no plain words of two letters or more: its
    printable single characters are the pool; what decodes to nothing (special
    tokens), whitespace and partial UTF-8 are not."""
    texts = [chr(b) if 33 <= b < 127 else ("\ufffd" if b > 127 else "") for b in range(256)]
    texts[32] = " "
    pool = V.pool_from_texts(texts)
    assert sorted(pool.ids) == list(range(33, 127))
    assert "printable tokens" in pool.source
    with pytest.raises(ValueError, match="probes need 64"):
        V.pool_from_texts(texts[:80])


def test_pool_from_candidates_keeps_distinct_ids():
    pool = V.pool_from_candidates([5, 5, *range(100, 163), 7])
    assert pool.ids[0] == 5 and pool.ids[-1] == 7 and len(pool.ids) == 65
    assert pool.texts == {} and "proposed" in pool.source
    with pytest.raises(ValueError, match="proposed 63 distinct"):
        V.pool_from_candidates(range(63))


POOL = V.pool_from_candidates(range(1000, 1200))
FRAME = V.Frame(head=(1,), code_intro=(2, 3), code_outro=(4,), tail=(5, 6, 7), source="test")


def test_probe_is_exactly_as_long_as_asked_with_the_code_at_its_depth():
    rng = random.Random(3)
    probe = V.make_probe(0.3, POOL, FRAME, 1000, rng)
    ids = probe.input_ids
    assert len(ids) == 1000 and ids[0] == 1 and ids[-3:] == (5, 6, 7)
    filler = 1000 - FRAME.tokens - V.CODE_TOKENS
    at = 1 + round(0.3 * filler)
    assert ids[at : at + 2] == (2, 3)
    assert ids[at + 2 : at + 2 + V.CODE_TOKENS] == probe.code_ids
    assert ids[at + 2 + V.CODE_TOKENS] == 4
    assert set(probe.code_ids) <= set(POOL.ids) and probe.code == ""
    # Two probes of one run share no opening filler.
    other = V.make_probe(0.3, POOL, FRAME, 1000, rng)
    assert other.input_ids[1:9] != ids[1:9]


def test_probe_without_a_tokenizer_is_filler_and_code_alone():
    probe = V.make_probe(0.5, POOL, V.Frame(), 400, random.Random(1))
    assert len(probe.input_ids) == 400 and set(probe.input_ids) <= set(POOL.ids)
    assert probe.input_ids[198:201] == probe.code_ids


def test_probe_code_text_comes_from_the_pool():
    pool = V.pool_from_texts([f" w{i}" for i in range(100)])
    probe = V.make_probe(0.5, pool, V.Frame(), 400, random.Random(1))
    assert probe.code == "".join(f" w{i}" for i in probe.code_ids)


def test_probe_needs_room_for_filler():
    with pytest.raises(ValueError, match="no room for filler"):
        V.make_probe(0.5, POOL, FRAME, FRAME.tokens + V.CODE_TOKENS + 1, random.Random(0))


def test_chat_frame_parts_the_templates_opening_from_the_message():
    # <bos> <user> | message ... | <end> <assistant>
    assert V.chat_frame([1, 2, 30, 31, 32, 8, 9], [1, 2, 40, 8, 9]) == ((1, 2), (30, 31, 32, 8, 9))
    # A first message token merged with the template's last: the merged token is the rest's.
    assert V.chat_frame([1, 27, 31, 9], [1, 28, 9]) == ((1,), (27, 31, 9))
    assert V.chat_frame([30, 31], [40]) is None  # no template: nothing shared
    assert V.chat_frame([1, 2], [1, 2, 3]) is None  # nothing of the message left


def _said(text="", ids=()):
    return V.Answer(tuple(ids), (), text, 0, 0, 0, None)


def test_code_found_reads_text_in_order_else_ids():
    worded = V.Probe(0.5, " w3 w7 w9", (), (3, 7, 9))
    assert V.code_found(_said("The code: W3 w7, w9."), worded)
    assert V.code_found(_said("w3w7w9"), worded)  # spelled with other tokens
    assert not V.code_found(_said("w3 w9 w7"), worded)
    assert not V.code_found(_said("", (1, 2)), worded)
    # A server without a tokenizer answers ids only: the code's ids in a row.
    ids_only = V.Probe(0.5, "", (), (3, 7, 9))
    assert V.code_found(_said("", (1, 3, 7, 9, 2)), ids_only)
    assert not V.code_found(_said("", (3, 7, 2, 9)), ids_only)
    assert V.code_found(_said("x", (3, 7, 9)), ids_only)  # punctuation-only code text
    assert not V.code_found(_said(), V.Probe(0.5, "", (), ()))


def test_parse_depths_accepts_percent_and_fractions():
    assert V.parse_depths("10,50%,95") == (0.1, 0.5, 0.95)
    assert V.parse_depths("0.25, 0.75") == (0.25, 0.75)
    for bad in ("0", "100", "", "10,10"):
        with pytest.raises(ValueError):
            V.parse_depths(bad)


def test_shared_prefix_tokens():
    assert V.shared_prefix_tokens([(1, 2, 3, 4), (1, 2, 9), (1, 2, 3)]) == 2
    # A lone probe shares nothing (else its whole prompt could stay in memory).
    assert V.shared_prefix_tokens([(5, 6)]) == 0
    assert V.shared_prefix_tokens([(1,), (2,)]) == 0


def test_restorable_tokens_leaves_the_last_page():
    assert V.restorable_tokens(2048, 64) == 1984
    assert V.restorable_tokens(640, 64) == 576
    assert V.restorable_tokens(2049, 64) == 2048
    assert V.restorable_tokens(2048, 256) == 1792


SERVER_INFO = {
    "page_size": 64,
    "context_length": 16384,
    "max_total_num_tokens": 4096,
    "max_req_input_len": 4090,
    "enable_hierarchical_cache": True,
    "hicache_ratio": 2.0,
    "hicache_storage_backend": "dynamic",
    "hicache_storage_prefetch_policy": "timeout",
    "dtype": "float32",
}
MODEL_INFO = {"model_path": "/models/tiny", "served_model_name": "tiny"}


def facts(**changes):
    return V.server_facts("http://s", {**SERVER_INFO, **changes}, MODEL_INFO, {})


def test_server_facts_read_pools_and_backend():
    f = facts()
    assert (f.page_tokens, f.device_pool_tokens, f.host_pool_tokens) == (64, 4096, 8192)
    assert f.storage_backend == "dynamic" and f.prefetch_policy == "timeout"
    assert f.model == "tiny" and f.default_logprob_tolerance == V.oracle.LOGPROB_TOLERANCE
    assert f.host_pool_source == "--hicache-ratio 2 x the device pool"
    # The host pool the server exports wins over the ratio.
    exported = V.server_facts(
        "http://s", SERVER_INFO, MODEL_INFO, {"sglang:hicache_host_total_tokens": 5000.0}
    )
    assert exported.host_pool_tokens == 5000
    assert exported.host_pool_source.startswith("sglang:hicache_host_total_tokens")
    # --hicache-size (GB) overrides the ratio in sglang; GB to tokens is not reported.
    sized = facts(hicache_size=4)
    assert sized.host_pool_tokens is None and sized.hierarchical_cache
    assert "--hicache-size 4 GB" in sized.host_pool_source
    bare = facts(hicache_storage_backend=None, enable_hierarchical_cache=False, dtype="bfloat16")
    assert bare.storage_backend is None and bare.host_pool_tokens is None
    assert not bare.hierarchical_cache
    assert bare.default_logprob_tolerance == V.HALF_PRECISION_LOGPROB_TOLERANCE
    with pytest.raises(ValueError, match="KV pool"):
        V.server_facts("http://s", {"page_size": 64}, MODEL_INFO, {})


def test_context_defaults_to_half_the_smallest_pool():
    tokens, why = V.choose_context_tokens([facts()], None, 16)
    assert tokens == 2048 and "half the smallest memory pool" in why
    big = facts(max_total_num_tokens=10**6, max_req_input_len=10**6, context_length=131072)
    assert V.choose_context_tokens([big], None, 16)[0] == V.DEFAULT_MAX_CONTEXT_TOKENS
    assert V.choose_context_tokens([facts()], 1000, 16) == (1000, "--context-tokens")


def test_context_override_out_of_bounds_is_refused():
    with pytest.raises(ValueError, match="too short"):
        V.choose_context_tokens([facts()], 100, 16)
    with pytest.raises(ValueError, match="does not fit"):
        V.choose_context_tokens([facts()], 5000, 16)
    glm = facts(page_size=256)
    assert V.min_context_tokens(256) == 768
    with pytest.raises(ValueError, match="at least 768"):
        V.choose_context_tokens([glm], 600, 16)


def test_churn_covers_device_and_host_pools():
    plan = V.churn_plan(facts(), 2048)
    assert plan.prompt_tokens == 2048 and plan.pool_tokens == 4096 + 8192
    assert plan.tokens >= V.CHURN_FACTOR * (4096 + 8192) > (plan.prompts - 1) * 2048
    assert "device pool 4096 + host pool 8192" in plan.why and "--hicache-ratio 2" in plan.why
    exported = V.server_facts(
        "http://s", SERVER_INFO, MODEL_INFO, {"sglang:hicache_host_total_tokens": 8256.0}
    )
    assert V.churn_plan(exported, 1000).tokens >= V.CHURN_FACTOR * (4096 + 8256)
    no_host = V.churn_plan(facts(enable_hierarchical_cache=False), 1024)
    assert no_host.pool_tokens == 4096 and "no host pool" in no_host.why


def test_churn_needs_a_known_host_pool():
    sized = facts(hicache_size=4)
    with pytest.raises(ValueError, match="host pool size is unknown.*--churn-tokens"):
        V.churn_plan(sized, 2048)
    plan = V.churn_plan(sized, 2048, override_tokens=50000)
    assert plan.prompts == 25 and "--churn-tokens 50000" in plan.why


def test_churn_override_says_when_it_is_too_small():
    small = V.churn_plan(facts(), 2048, override_tokens=1)
    assert small.prompts == 1 and small.tokens == 2048
    assert "too little" in small.why and "device pool 4096 + host pool 8192" in small.why
    assert "too little" not in V.churn_plan(facts(), 2048, override_tokens=20000).why


def generate_answer(ids, top, storage=0, cached=0, text="w1 w2"):
    return {
        "text": text,
        "output_ids": list(ids),
        "meta_info": {
            "prompt_tokens": 2048,
            "cached_tokens": cached,
            "cached_tokens_details": {"device": 0, "host": 0, "storage": storage}
            if cached
            else None,
            "output_top_logprobs": [[[lp, tok, None] for tok, lp in step] for step in top],
        },
    }


TOP = [[(7, -0.5), (8, -1.5)], [(9, -0.1), (3, -2.5)], [(4, -0.7), (2, -0.9)]]
PROBE = V.Probe(0.4, "w5 w6 w7", tuple(range(2048)), (5, 6, 7))


def answers(l3_ids=(7, 9, 4), l3_top=TOP, storage=1984, cached=None, l3_text="x", cold_text="x"):
    cold = V.parse_answer(generate_answer((7, 9, 4), TOP, text=cold_text))
    cached = storage if cached is None else cached
    l3 = V.parse_answer(generate_answer(l3_ids, l3_top, storage, cached, l3_text))
    return cold, l3


def judged(**kwargs):
    cold, l3 = answers(**kwargs)
    return V.ProbeResult(PROBE, cold, l3, PAGE, 0, V.oracle.LOGPROB_TOLERANCE)


def test_parse_answer_reads_sources_and_logprobs():
    _cold, l3 = answers(storage=1984, cached=2000)
    assert l3.storage_tokens == 1984 and l3.memory_tokens == 16
    assert l3.top_logprobs[0] == ((7, -0.5), (8, -1.5))


def test_an_identical_full_restore_passes():
    result = judged()
    assert result.ok and result.problem() is None
    assert result.restorable_tokens == 1984


def test_a_corrupted_answer_fails():
    wrong_token = judged(l3_ids=(7, 9, 5))
    assert not wrong_token.ok and "disagreement at depth 40%" in wrong_token.problem()
    shifted = [[(t, lp + 0.01) for t, lp in step] for step in TOP]
    drifted = judged(l3_top=shifted)
    assert not drifted.ok and "disagreement" in drifted.problem()
    other_candidates = [[(7, -0.5), (1, -1.5)], *TOP[1:]]
    assert not judged(l3_top=other_candidates).ok


def test_a_lost_code_fails_where_the_cold_pass_found_it():
    lost = judged(cold_text="the code is w5 w6 w7", l3_text="w5 w6")
    assert not lost.ok and "code lost" in lost.problem()
    # A model that cannot answer is judged by tokens and logprobs alone.
    assert judged(cold_text="w1", l3_text="w2").ok


def test_restore_problems_are_named():
    assert judged(storage=0, cached=0).problem() == "no storage hits at depth 40%"
    partial = judged(storage=1024)
    assert not partial.ok and "partial restore at depth 40%: 1024 of 1984" in partial.problem()
    kept = judged(storage=0, cached=1984)
    assert not kept.ok and "not evicted" in kept.problem()


def test_probes_left_in_memory_fail_as_not_evicted():
    """Churn too small to evict: the L3 pass is served from host memory. That is no
    pass, and no storage failure either: the reason says eviction did not happen."""
    host_hit = {
        "text": "x",
        "output_ids": [7, 9, 4],
        "meta_info": {
            "prompt_tokens": 2048,
            "cached_tokens": 1984,
            "cached_tokens_details": {"device": 0, "host": 1984, "storage": 0},
            "output_top_logprobs": [[[lp, tok, None] for tok, lp in step] for step in TOP],
        },
    }
    cold, _ = answers()
    l3 = V.parse_answer(host_hit)
    assert (l3.device_tokens, l3.host_tokens, l3.memory_tokens) == (0, 1984, 1984)
    kept = [V.ProbeResult(PROBE, cold, l3, PAGE, 0, 1e-4) for _ in range(2)]
    assert kept[0].problem() == (
        "not evicted at depth 40%: 1984 tokens (device 0, host 1984) came from memory, "
        "0 from storage"
    )
    report = V.Report(tuple(kept))
    assert not report.ok and report.reasons()[0].startswith("not evicted: 2 of 2 probes")
    assert not any(r.startswith("no storage hits") for r in report.reasons())


def test_a_lone_probe_half_in_memory_fails():
    """One depth: the probe's head still in host memory, its tail from storage. Its
    prompt is no shared opening, so this is not a full restore from L3."""
    cold, l3 = answers(storage=960, cached=1984)
    shared = V.shared_prefix_tokens([PROBE.input_ids])
    result = V.ProbeResult(PROBE, cold, l3, PAGE, shared, 1e-4)
    assert not result.ok and "not evicted at depth 40%" in result.problem()
    assert not V.Report((result,)).ok


def test_the_shared_opening_may_stay_in_memory():
    cold, l3 = answers(storage=1980, cached=1984)
    result = V.ProbeResult(PROBE, cold, l3, 1, 4, 1e-4)
    assert result.evicted and result.restorable_tokens == 2047 - 4
    cold, l3 = answers(storage=2040, cached=2047)
    assert not V.ProbeResult(PROBE, cold, l3, 1, 4, 1e-4).evicted


def test_cold_answer_must_be_computed():
    cold, _ = answers()
    assert V.cold_problem(PROBE, cold, 0) is None
    _, restored = answers(storage=1984)
    assert "not cold" in V.cold_problem(PROBE, restored, 0)


def test_report_line_names_failing_depths_and_reasons():
    good = judged()
    bad = V.ProbeResult(
        V.Probe(0.9, "w1 w2 w3", PROBE.input_ids), *answers(l3_ids=(1, 2, 3)), PAGE, 0, 1e-4
    )
    report = V.Report((good, bad))
    assert report.summary_line() == (
        "validate: 2 probes, restored 3968 of 3968 restorable tokens, agree 1 of 2; "
        "failing depths: 90%"
    )
    assert not report.ok
    assert report.reasons() == [bad.problem()]
    assert V.Report((good,)).ok and V.Report((good,)).reasons() == []
    table = V.format_table(report).splitlines()
    assert table[0].split()[0] == "depth" and table[2].split()[-1] == "FAIL"


def test_no_storage_hits_and_dropped_prefetch_are_reasons():
    none = V.Report((judged(storage=0, cached=0), judged(storage=0, cached=0)))
    assert none.reasons() == ["no storage hits: the L3 pass took nothing from storage"]
    some = V.Report((judged(), judged(storage=0, cached=0)))
    assert some.reasons() == ["no storage hits at depth 40%"]
    deltas = {
        'sglang:storage_prefetch_unfulfilled_tokens_total{reason="deadline"}': 1984.0,
        "sglang:storage_prefetch_unfulfilled_tokens_total": 1984.0,
    }
    dropped = V.Report((judged(storage=0, cached=0),), deltas)
    assert "prefetch dropped: sglang discarded 1984 tokens (deadline)" in dropped.reasons()
    # A drop that cost no probe anything is not a failure.
    assert V.Report((judged(),), deltas).ok
    assert not V.Report(()).ok and V.Report(()).reasons() == ["no probe was answered"]
    assert not V.Report((judged(),), setup_problems=("cold pass not cold",)).ok


def test_counter_deltas_keep_storage_counters_that_moved():
    before = {"sglang:storage_prefetch_hit_tokens_total": 10.0, "sglang:num_requests_total": 1}
    after = {
        "sglang:storage_prefetch_hit_tokens_total": 2000.0,
        "sglang:num_requests_total": 9,
        'mooncake_span_keys_total{pool="kv"}': 31.0,
        "sglang:backuped_tokens_total": 0.0,
    }
    assert V.counter_deltas(before, after) == {
        'mooncake_span_keys_total{pool="kv"}': 31.0,
        "sglang:storage_prefetch_hit_tokens_total": 1990.0,
    }


def test_saved_run_round_trips(tmp_path):
    cold, _ = answers()
    doc = V.saved_run(facts(), [PROBE], [cold], {"seed": 5})
    probes, colds, rest = V.load_saved_run(json.loads(json.dumps(doc)))
    assert probes == [PROBE] and colds == [cold]
    assert rest["model"] == "tiny" and rest["page_tokens"] == 64 and rest["seed"] == 5
    with pytest.raises(ValueError, match="not a validate"):
        V.load_saved_run({"probes": []})
    with pytest.raises(ValueError, match="malformed"):
        V.load_saved_run({"format": V.SAVE_FORMAT, "probes": [{"depth": 0.5}]})


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_server_is_a_clear_error(capsys):
    url = f"http://127.0.0.1:{_closed_port()}"
    assert cli.main(["validate", "--server", url]) == 1
    err = capsys.readouterr().err
    assert f"{url} unreachable" in err and "Traceback" not in err
    assert cli.main(["validate", "--server", url, "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and "unreachable" in doc["error"]


class _TinyPoolServer(http.server.BaseHTTPRequestHandler):
    """An sglang API whose KV pool is too small for any probe."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        answers = {
            "/server_info": {"page_size": PAGE, "max_total_num_tokens": 100},
            "/model_info": {"served_model_name": "tiny"},
        }
        self._answer(answers.get(self.path))

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._answer({"text": [f"w{i}" for i, _ in enumerate(body["tokens"])]})

    def _answer(self, doc):
        raw = json.dumps(doc).encode()
        self.send_response(404 if doc is None else 200)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args):
        pass


def test_a_server_too_small_for_probes_is_a_clear_error(capsys):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _TinyPoolServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        code = cli.main(["validate", "--server", f"127.0.0.1:{server.server_address[1]}"])
    finally:
        server.shutdown()
        thread.join(timeout=10)
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert "mooncake-span validate: the servers leave room for 50-token probes" in err


def test_churn_tokens_go_with_churn_eviction(capsys):
    code = cli.main(["validate", "--server", "a:1", "--churn-tokens", "1000"])
    assert code == 1 and "add --evict churn" in capsys.readouterr().err


def test_against_takes_one_server(capsys, tmp_path):
    code = cli.main(
        ["validate", "--server", "a:1", "--server", "b:2", "--against", str(tmp_path / "f")]
    )
    assert code == 1 and "give one --server" in capsys.readouterr().err


def test_headline_deltas_drop_per_rank_repeats():
    deltas = {
        "sglang:cached_tokens_total": 4096.0,
        'sglang:cached_tokens_total{cache_source="storage"}': 4096.0,
        'sglang:cached_tokens_total{model_name="m"}': 4096.0,
        'sglang:storage_prefetch_unfulfilled_tokens_total{reason="deadline"}': 64.0,
        'mooncake_span_keys_total{operation="get",pool="kv",result="ok"}': 31.0,
        'mooncake_span_keys_total{pool="kv"}': 31.0,
    }
    assert set(V.headline_deltas(deltas)) == {
        "sglang:cached_tokens_total",
        'sglang:cached_tokens_total{cache_source="storage"}',
        'sglang:storage_prefetch_unfulfilled_tokens_total{reason="deadline"}',
        'mooncake_span_keys_total{operation="get",pool="kv",result="ok"}',
    }


def test_help_prints_single_percent_signs(capsys):
    with pytest.raises(SystemExit):
        cli.main(["validate", "--help"])
    out = capsys.readouterr().out
    assert "10%..95%" in out and "%%" not in out
