"""GLM-5.3-Flash (``glm5_next``) through real sglang 0.5.23 servers sharing the L3.

The model this backend exists for: MLA KV, a compressed DSA indexer pool
(``index_kpool=4``) and KDA recurrent state (a Mamba-style pool), served
with 256-token pages (K=1) and the CPU stand-ins' real compute (the KDA
kernels, the indexer's pool writes and its top-k selection, which decides
what each DSA layer attends to). Every answer is held to the content oracle
(``mooncake_span.ops.oracle``): greedy tokens and the top logprobs of the
first answer tokens against a server that recomputes.

One module of servers, shared by the cases: a writer on the ``mooncake``
plugin path, a reader on the ``dynamic`` path (``FaultyRestoreStore``:
this backend plus a test hook that can spoil a restore on purpose; without a
fault it is the backend's own read path), sglang's default prefetch policy,
``page_first_direct`` (stock 0.5.23 refuses ``layer_first`` for this model:
``MambaPoolHost`` has no layer_first layout). The negative controls spoil
one page of one pool, or the state pool's restore, and must be caught; the
storage node dies last.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mooncake_span.ops import inspect_cmd
from mooncake_span.ops.launcher import http_get
from mooncake_span.ops.oracle import compare
from mooncake_span_tools.bench.serve_stats import parse_prometheus
from mooncake_span_tools.lab.sglang_servers import START_TIMEOUT_S, ServerOptions
from mooncake_span_tools.testing import restore_faults
from mooncake_span_tools.testing.cpu_server.models import (
    GLM_PAGE_TOKENS,
    default_spec,
    serving_profile,
)
from tests.servers.conftest import Launched, prompt

pytestmark = [pytest.mark.integration, pytest.mark.servers, pytest.mark.slow]

ARCH = "glm5_next"
PAGE = GLM_PAGE_TOKENS
PROMPT_TOKENS = 8 * PAGE
FULL_RESTORE = PROMPT_TOKENS - PAGE  # sglang computes the last page itself
ANSWER_TOKENS = 8
TOP = 5
POOLS = ("kv", "indexer", "mamba")
BACKUP_TIMEOUT_S = 60.0
FAULT_ANSWER_BOUND_S = 30.0


class Glm:
    """The module's servers and what the cases share."""

    def __init__(self, launched: Launched, cluster, writer, reader, recompute, fault_file: Path):
        self.launched, self.cluster = launched, cluster
        self.writer, self.reader, self.recompute = writer, reader, recompute
        self.fault_file = fault_file

    def reference(self, ids):
        return self.recompute(ids, ANSWER_TOKENS, top_logprobs=TOP)

    def write(self, ids) -> None:
        """The writer answers ``ids``; wait until L3 holds every page it backs up."""
        before = stored_pages(self.cluster)
        answer = self.writer.generate(ids, ANSWER_TOKENS)
        assert answer.storage_tokens == 0, answer.meta_info
        wait_stored_pages(self.cluster, before + (len(ids) + ANSWER_TOKENS - 1) // PAGE)

    def read(self, ids, fault=None):
        """The reader answers ``ids`` from L3 alone: (answer, keys read per pool)."""
        restore_faults.write_fault(self.fault_file, fault)
        self.reader.flush_cache()
        before = pool_reads(self.reader)
        answer = self.reader.generate(ids, ANSWER_TOKENS, top_logprobs=TOP)
        after = pool_reads(self.reader)
        restore_faults.write_fault(self.fault_file, None)
        return answer, {pool: after[pool] - before[pool] for pool in POOLS}


def stored_pages(cluster) -> int:
    namespaces, _guards, _total = inspect_cmd.scan_keys(cluster.metrics_url, 0)
    return sum(len(ns.page_keys) for ns in namespaces.values())


def wait_stored_pages(cluster, pages: int) -> None:
    deadline = time.monotonic() + BACKUP_TIMEOUT_S
    while stored_pages(cluster) < pages:
        assert time.monotonic() < deadline, f"L3 never held {pages} pages"
        time.sleep(0.5)


def pool_reads(server) -> dict[str, float]:
    """Keys the backend read successfully so far, per host pool (its /metrics)."""
    answer = http_get(f"{server.url}/metrics", timeout_s=10.0)
    assert answer is not None and answer[0] == 200, answer
    samples = parse_prometheus(answer[1])
    return {
        pool: samples.get(
            f'mooncake_span_keys_total{{operation="get",pool="{pool}",result="ok"}}', 0.0
        )
        for pool in POOLS
    }


@pytest.fixture(scope="module")
def glm(tmp_path_factory, tiny_model, recompute_server):
    root = tmp_path_factory.mktemp("glm5")
    model = tiny_model(ARCH)
    launched = Launched(root / "logs")
    fault_file = root / "restore-fault.json"
    restore_faults.write_fault(fault_file, None)
    try:
        cluster = launched.cluster(storage_nodes=1)
        profile = serving_profile(default_spec(ARCH))
        config = cluster.client_config(0)
        writer = launched.server(
            "writer",
            ServerOptions(
                model_path=model,
                storage_backend="mooncake",
                plugin_opt_in=True,
                storage_config=config,
                **profile.server_fields(env=cluster.client_env()),
            ),
        )
        reader = launched.server(
            "reader",
            ServerOptions(
                model_path=model,
                storage_backend="dynamic",
                storage_config={
                    **config,
                    "module_path": restore_faults.MODULE_PATH,
                    "class_name": restore_faults.CLASS_NAME,
                },
                **profile.server_fields(
                    ("--enable-metrics",),
                    {**cluster.client_env(), restore_faults.FAULT_FILE_ENV: str(fault_file)},
                ),
            ),
        )
        with ThreadPoolExecutor(1) as pool:
            reference = pool.submit(recompute_server, ARCH)
            launched.start(writer, reader)
            recompute = reference.result(timeout=START_TIMEOUT_S)
        yield Glm(launched, cluster, writer, reader, recompute, fault_file)
    finally:
        launched.stop_all()


def _agrees(answer, expected):
    return compare(
        answer.output_ids, answer.top_logprobs, expected.output_ids, expected.top_logprobs
    )


@pytest.mark.timeout(600)
def test_reader_restores_all_three_pools_at_every_depth(glm):
    """A 2,048-token prompt: every restorable key comes back with its KV, indexer and
    state objects, and the answer is recompute's. Probes sharing 2, 4 or 6 of its pages
    restore exactly those and agree too."""
    full = prompt(101, PROMPT_TOKENS)
    glm.write(full)
    answer, reads = glm.read(full)
    assert answer.storage_tokens == FULL_RESTORE, answer.meta_info
    assert answer.meta_info["cached_tokens_details"]["storage_backend"] == "FaultyRestoreStore"
    assert reads["kv"] == reads["indexer"] == FULL_RESTORE // PAGE, reads
    assert reads["mamba"] >= 1, reads  # the state at the restored prefix's end
    verdict = _agrees(answer, glm.reference(full))
    print(f"full restore: {verdict.describe()}")
    assert verdict.agrees, verdict

    for pages in (2, 4, 6):
        probe = full[: pages * PAGE] + prompt(200 + pages, PAGE // 4)
        answer, reads = glm.read(probe)
        assert answer.storage_tokens == pages * PAGE, answer.meta_info
        assert reads["kv"] == reads["indexer"] == pages and reads["mamba"] >= 1, reads
        verdict = _agrees(answer, glm.reference(probe))
        print(f"probe at {pages} pages: {verdict.describe()}")
        assert verdict.agrees, verdict


@pytest.mark.timeout(600)
def test_multi_turn_conversation_restores_each_turn_from_l3(glm):
    """Turn 1 on the writer; turns 2 and 3 on the reader, each after its caches were
    dropped: each turn restores everything earlier turns left in L3."""
    turn1 = prompt(301, PROMPT_TOKENS)
    before = stored_pages(glm.cluster)
    glm.write(turn1)
    first = glm.writer.generate(turn1, ANSWER_TOKENS)
    turn2 = [*turn1, *first.output_ids, *prompt(302, PAGE + 40)]
    answer2, reads = glm.read(turn2)
    # turn 1 left its prompt's 8 pages (the state after page 8 included)
    assert answer2.storage_tokens == PROMPT_TOKENS, answer2.meta_info
    assert reads["indexer"] == PROMPT_TOKENS // PAGE and reads["mamba"] >= 1, reads
    assert _agrees(answer2, glm.reference(turn2)).agrees
    # the reader backs up turn 2's own full pages (asynchronously)
    wait_stored_pages(glm.cluster, before + (len(turn2) + ANSWER_TOKENS - 1) // PAGE)
    turn3 = [*turn2, *answer2.output_ids, *prompt(303, 60)]
    answer3, reads = glm.read(turn3)
    restorable = (len(turn2) + ANSWER_TOKENS - 1) // PAGE * PAGE
    assert answer3.storage_tokens == restorable, answer3.meta_info
    verdict = _agrees(answer3, glm.reference(turn3))
    print(f"turn 3 ({answer3.storage_tokens} tokens from L3): {verdict.describe()}")
    assert verdict.agrees, verdict


NEGATIVE_CONTROLS = [
    pytest.param({"kind": "swap", "pool": "indexer", "first": 1, "second": 5}, id="indexer-page"),
    pytest.param({"kind": "swap", "pool": "kv", "first": 2, "second": 6}, id="kv-page"),
    pytest.param({"kind": "zero", "pool": "mamba"}, id="state-dropped-silently"),
    pytest.param({"kind": "miss", "pool": "mamba"}, id="state-reported-missing"),
]


@pytest.fixture(scope="module")
def restored_prompt(glm):
    """A prompt in L3 and recompute's answer to it, for the negative controls."""
    full = prompt(401, PROMPT_TOKENS)
    glm.write(full)
    return full, glm.reference(full)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fault", NEGATIVE_CONTROLS)
def test_a_wrong_restore_is_caught(glm, restored_prompt, fault):
    """One page of one pool restored wrong, or the state pool's restore dropped: the
    server recomputes, or the oracle flags the answer. A silent pass fails."""
    full, expected = restored_prompt
    applied_before = len(restore_faults.applied(glm.fault_file))
    answer, _reads = glm.read(full, fault)
    assert len(restore_faults.applied(glm.fault_file)) > applied_before, "the fault never fired"
    verdict = _agrees(answer, expected)
    print(f"{json.dumps(fault)}: {answer.storage_tokens} tokens from L3, {verdict.describe()}")
    recomputed = answer.storage_tokens == 0 and verdict.agrees
    assert recomputed or not verdict.agrees, f"silent pass: {verdict} {answer.meta_info}"
    if fault["kind"] == "miss":
        assert recomputed, verdict
    # without the fault, the same restore agrees again
    clean, _ = glm.read(full)
    assert clean.storage_tokens == FULL_RESTORE and _agrees(clean, expected).agrees


@pytest.mark.timeout(600)
def test_storage_node_killed_while_serving_recomputes(glm):
    """The only storage node dies after a backup: the reader answers within the bound,
    by recompute, and never with garbage."""
    doomed = prompt(501, PROMPT_TOKENS)
    glm.write(doomed)
    expected = glm.reference(doomed)
    glm.cluster.kill_storage_node(0)
    started = time.monotonic()
    answer, _reads = glm.read(doomed)
    assert time.monotonic() - started < FAULT_ANSWER_BOUND_S
    assert answer.storage_tokens == 0, answer.meta_info
    verdict = _agrees(answer, expected)
    assert verdict.agrees, verdict
