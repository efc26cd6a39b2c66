"""GLM-5.3-Flash prefill/decode on the shared L3, behind sglang-router.

As ``test_pd.py`` for Llama: prefill servers and a decode server with this
backend on one cluster; KV, indexer and KDA state move prefill -> decode over
the Mooncake transfer engine, and the prefill server writes the prompt's pages
(all three pools) to L3. Turn 2 goes to a fresh prefill process that never saw
turn 1, so what it finds of turn 1 can only come from L3, and its answer must
pass the content oracle against a server that recomputes.

Without decode-side offload: stock sglang 0.5.23 refuses it for this model
("Unsupported KV cache type for decode offload",
``disaggregation/decode_kvcache_offload_manager.py``: only MHA, MLA and SWA
pools have a decode offload; GLM-5.3-Flash's hybrid DSA + KDA pool has none),
so turn 1's answer is never in L3 and turn 2 restores turn 1's prompt.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from mooncake_span.ops import inspect_cmd
from mooncake_span.ops import launcher as L
from mooncake_span.ops.oracle import compare
from mooncake_span_tools.lab.sglang_servers import HOST, START_TIMEOUT_S, Router, ServerOptions
from mooncake_span_tools.testing.cpu_server.models import (
    GLM_PAGE_TOKENS,
    default_spec,
    serving_profile,
)
from tests.servers.conftest import prompt

pytestmark = [pytest.mark.integration, pytest.mark.servers, pytest.mark.slow]

ARCH = "glm5_next"
PAGE = GLM_PAGE_TOKENS
PROMPT_TOKENS = 8 * PAGE
ANSWER_TOKENS = 40
NEW_TOKENS = 64
TOP = 5
L3_WAIT_S = 60.0


def _stored_pages(cluster) -> int:
    namespaces, _guards, _total = inspect_cmd.scan_keys(cluster.metrics_url, 0)
    return sum(len(ns.page_keys) for ns in namespaces.values())


def _options(model_path, cluster, **pd_fields) -> ServerOptions:
    profile = serving_profile(default_spec(ARCH))
    return ServerOptions(
        model_path=model_path,
        storage_backend="dynamic",
        storage_config=cluster.client_config(0),
        prefetch_policy="wait_complete",
        **profile.server_fields(env=cluster.client_env()),
        **pd_fields,
    )


@pytest.mark.timeout(600)
def test_turn2_on_fresh_prefill_restores_turn1_from_l3(tiny_model, launched, recompute_server):
    model_path = tiny_model(ARCH)
    cluster = launched.cluster(storage_nodes=1)
    bootstraps = L.pick_free_ports(HOST, 2)
    prefills = [
        launched.server(
            f"prefill{i}",
            _options(model_path, cluster, disaggregation_mode="prefill", bootstrap_port=port),
        )
        for i, port in enumerate(bootstraps, 1)
    ]
    decode = launched.server("decode", _options(model_path, cluster, disaggregation_mode="decode"))
    routers = [
        launched.track(Router(f"router{i}", [(p, b)], [decode], launched.log_dir))
        for i, (p, b) in enumerate(zip(prefills, bootstraps, strict=True), 1)
    ]
    with ThreadPoolExecutor(1) as pool:
        reference_started = pool.submit(recompute_server, ARCH)
        launched.start(*prefills, decode, *routers)
        reference = reference_started.result(timeout=START_TIMEOUT_S)

    turn1_prompt = prompt(601, PROMPT_TOKENS)
    turn1 = routers[0].generate_until_served(turn1_prompt, ANSWER_TOKENS)
    assert turn1.storage_tokens == 0, turn1.meta_info
    turn1_l3_pages = PROMPT_TOKENS // PAGE  # the prompt's, written by the prefill server
    deadline = time.monotonic() + L3_WAIT_S
    while _stored_pages(cluster) < turn1_l3_pages:
        assert time.monotonic() < deadline, f"L3 never held turn 1's {turn1_l3_pages} pages"
        time.sleep(0.5)
    routers[0].stop()
    prefills[0].kill()

    turn2_prompt = [*turn1_prompt, *turn1.output_ids, *prompt(602, NEW_TOKENS)]
    turn2 = routers[1].generate_until_served(turn2_prompt, 8, top_logprobs=TOP)
    expected = reference(turn2_prompt, 8, top_logprobs=TOP)
    print(f"turn 2 restored {turn2.storage_tokens} tokens; turn 1 left {turn1_l3_pages} pages")
    assert turn2.storage_tokens == turn1_l3_pages * PAGE, turn2.meta_info
    verdict = compare(
        turn2.output_ids, turn2.top_logprobs, expected.output_ids, expected.top_logprobs
    )
    print(f"turn 2: {verdict.describe()}")
    assert verdict.agrees, verdict
    assert turn1.output_ids == reference(turn1_prompt, ANSWER_TOKENS).output_ids
