"""Prefill/decode disaggregation on the shared L3, with real sglang servers (CPU).

A prefill server and a decode server, both with this project's backend on one
cluster, sit behind sglang-router; KV moves prefill -> decode over the Mooncake
transfer engine (TCP). The prefill server writes the prompt's pages to L3, and
the decode server (``--disaggregation-decode-enable-offload-kvcache``) writes
the pages its answer fills. Turn 2 of the conversation then goes to a fresh
prefill process, which can only find turn 1 in L3: it must restore the prompt
*and* the answer pages, and answer exactly as a server without an L3.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from mooncake_span.ops import inspect_cmd
from mooncake_span.ops import launcher as L
from mooncake_span.ops.cluster import LocalCluster
from mooncake_span_tools.lab.sglang_servers import (
    HOST,
    START_TIMEOUT_S,
    Router,
    ServerOptions,
    SglangServer,
)
from tests.servers.conftest import PAGE_TOKENS, PROMPT_TOKENS, prompt

pytestmark = [pytest.mark.slow, pytest.mark.servers]

# 96 answer tokens fill one page past the prompt: decode offloads prompt +
# answer minus the last output token (its KV is never computed), in whole pages.
ANSWER_TOKENS = 96
NEW_TOKENS = PAGE_TOKENS
L3_WAIT_S = 30.0


def _l3_options(model_path, cluster: LocalCluster, **pd_fields) -> ServerOptions:
    return ServerOptions(
        model_path=model_path,
        storage_backend="dynamic",
        storage_config=cluster.client_config(0),
        # wait_complete: a prefetch that is slow on a busy box is waited for,
        # not dropped, so the storage-token count is deterministic.
        prefetch_policy="wait_complete",
        env=cluster.client_env(),
        **pd_fields,
    )


def _prefill(launched, name: str, model_path, cluster: LocalCluster) -> tuple[SglangServer, int]:
    bootstrap_port = L.pick_free_ports(HOST, 1)[0]
    options = _l3_options(
        model_path, cluster, disaggregation_mode="prefill", bootstrap_port=bootstrap_port
    )
    return launched.server(name, options), bootstrap_port


def _stored_pages(cluster: LocalCluster) -> int:
    namespaces, _guards, _total = inspect_cmd.scan_keys(cluster.metrics_url, 0)
    return sum(len(ns.page_keys) for ns in namespaces.values())


def _wait_stored_pages(cluster: LocalCluster, pages: int, timeout_s: float) -> int:
    """Decode offload and prefill backup are asynchronous: wait until L3 holds ``pages``."""
    deadline = time.monotonic() + timeout_s
    while (stored := _stored_pages(cluster)) < pages:
        if time.monotonic() > deadline:
            raise AssertionError(f"L3 holds {stored} pages after {timeout_s:.0f}s, want {pages}")
        time.sleep(0.5)
    return stored


# Four sglang servers and two routers start at once; on a busy 2-core box
# that alone took 2.5 minutes (~25 s each on an idle one).
@pytest.mark.timeout(480)
def test_turn2_on_fresh_prefill_restores_prompt_and_answer(
    tiny_model, launched, recompute_server
) -> None:
    model_path = tiny_model("llama")
    cluster = launched.cluster(storage_nodes=1)
    prefill1, bootstrap1 = _prefill(launched, "prefill1", model_path, cluster)
    # prefill2 starts now, to overlap its start-up with the others', but serves
    # nothing before turn 2: its device and host caches never see turn 1.
    prefill2, bootstrap2 = _prefill(launched, "prefill2", model_path, cluster)
    decode_opts = _l3_options(
        model_path, cluster, disaggregation_mode="decode", decode_offload=True
    )
    decode = launched.server("decode", decode_opts)
    # A router registers its workers in the background, retrying until they
    # serve, so routers start with the servers instead of after them.
    router1 = Router("router1", [(prefill1, bootstrap1)], [decode], launched.log_dir)
    router2 = Router("router2", [(prefill2, bootstrap2)], [decode], launched.log_dir)
    launched.track(router1)
    launched.track(router2)
    with ThreadPoolExecutor(1) as pool:
        # The reference server (session-scoped) starts alongside ours.
        reference_started = pool.submit(recompute_server, "llama")
        launched.start(prefill1, prefill2, decode, router1, router2)
        reference = reference_started.result(timeout=START_TIMEOUT_S)

    turn1_prompt = prompt(seed=7, n_tokens=PROMPT_TOKENS)
    turn1 = router1.generate_until_served(turn1_prompt, ANSWER_TOKENS)
    assert len(turn1.output_ids) == ANSWER_TOKENS
    assert turn1.storage_tokens == 0, turn1.meta_info

    # Prefill writes the prompt's whole pages; decode writes the whole pages
    # that prompt + answer (less the last output token) fill beyond them.
    turn1_l3_pages = (len(turn1_prompt) + ANSWER_TOKENS - 1) // PAGE_TOKENS
    assert turn1_l3_pages > len(turn1_prompt) // PAGE_TOKENS
    _wait_stored_pages(cluster, turn1_l3_pages, L3_WAIT_S)
    # The process that wrote turn 1's prompt is gone before turn 2 (router2
    # never knew it): what turn 2 finds of turn 1 can only be in L3.
    router1.stop()
    # SIGKILL, not SIGTERM: sglang spends ~5 s of a SIGTERM in crash
    # diagnostics, and the pages it wrote are in L3 already (waited for above).
    prefill1.kill()

    turn2_prompt = [*turn1_prompt, *turn1.output_ids, *prompt(seed=8, n_tokens=NEW_TOKENS)]
    turn2 = router2.generate_until_served(turn2_prompt, ANSWER_TOKENS)
    # All of turn 1 in L3 is restorable except what sglang's last-page rule
    # keeps for compute (a match covers at most len - 1 tokens, in whole pages);
    # the new tokens were never stored. So exactly this much comes from L3:
    # the prompt's pages and the answer's, more than the prompt alone.
    restorable = min(turn1_l3_pages, (len(turn2_prompt) - 1) // PAGE_TOKENS) * PAGE_TOKENS
    assert turn2.storage_tokens == restorable, turn2.meta_info
    assert turn2.cached_tokens == turn2.storage_tokens, turn2.meta_info

    assert turn1.output_ids == reference(turn1_prompt, ANSWER_TOKENS).output_ids
    assert turn2.output_ids == reference(turn2_prompt, ANSWER_TOKENS).output_ids
