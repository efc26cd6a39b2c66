"""Two real sglang servers share the L3 through this backend.

Server A answers a prompt and backs it up (write-through); server B, a
separate process with empty caches, answers the same prompt and a prompt that
shares only its first pages. B's storage tokens come from
``meta_info.cached_tokens_details`` and its greedy tokens must equal a server
that recomputes. Covered: MHA (Llama) and MLA (DeepSeek-V2), the
``page_first_direct`` and ``layer_first`` host layouts, ``dynamic`` and
``--hicache-storage-backend mooncake`` with the plugin opt-in, and the
``timeout`` (sglang's default) and ``wait_complete`` prefetch policies
(``best_effort`` has a test of its own, beside sglang's ``MooncakeStore``). One
case also restarts both servers.
"""

from __future__ import annotations

import pytest

from mooncake_span_tools.lab.sglang_servers import ServerOptions, stop_together
from tests.servers.conftest import (
    ANSWER_TOKENS,
    PAGE_TOKENS,
    PROMPT_TOKENS,
    prompt,
    settled_key_count,
    stored_keys,
    wait_for_backup,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.servers,
    pytest.mark.slow,
    pytest.mark.timeout(600),
]

# The last page of a prompt is always computed, never restored.
FULL_RESTORE_TOKENS = PROMPT_TOKENS - PAGE_TOKENS
SHARED_PAGES = 6


CASES = [
    pytest.param("llama", "page_first_direct", "dynamic", "timeout", id="mha-pfd-dynamic-timeout"),
    pytest.param("llama", "layer_first", "mooncake", "timeout", id="mha-lf-plugin-timeout"),
    pytest.param(
        "deepseek_v2",
        "page_first_direct",
        "mooncake",
        "wait_complete",
        id="mla-pfd-plugin-wait_complete",
    ),
    pytest.param("deepseek_v2", "layer_first", "dynamic", "timeout", id="mla-lf-dynamic-timeout"),
]


@pytest.mark.parametrize(("architecture", "layout", "backend", "policy"), CASES)
def test_second_server_restores_from_l3(
    architecture, layout, backend, policy, tiny_model, launched, recompute_server
):
    cluster = launched.cluster(storage_nodes=1)
    options = ServerOptions(
        model_path=tiny_model(architecture),
        layout=layout,
        storage_backend=backend,
        plugin_opt_in=backend == "mooncake",
        storage_config=cluster.client_config(0),
        prefetch_policy=policy,
        env=cluster.client_env(),
    )
    writer, reader = launched.server("writer", options), launched.server("reader", options)
    recompute_server.prestart(architecture)
    launched.start(writer, reader)
    recompute = recompute_server(architecture)
    base = settled_key_count(lambda: len(stored_keys(cluster)))

    full, other = prompt(1), prompt(2)
    partial = other[: SHARED_PAGES * PAGE_TOKENS] + prompt(3, PROMPT_TOKENS // 2)
    expected = {name: recompute(p) for name, p in [("full", full), ("partial", partial)]}
    for p in (full, other):
        written = writer.generate(p, ANSWER_TOKENS)
        assert written.storage_tokens == 0
    assert writer.generate(full, ANSWER_TOKENS).output_ids == expected["full"].output_ids
    wait_for_backup(cluster, base + 2 * (PROMPT_TOKENS // PAGE_TOKENS))

    restored = reader.generate(full, ANSWER_TOKENS)
    assert restored.storage_tokens == FULL_RESTORE_TOKENS, restored.meta_info
    assert restored.meta_info["cached_tokens_details"]["storage_backend"] == "MooncakeSpanStore"
    assert restored.output_ids == expected["full"].output_ids

    shared = reader.generate(partial, ANSWER_TOKENS)
    assert shared.storage_tokens == SHARED_PAGES * PAGE_TOKENS, shared.meta_info
    assert shared.output_ids == expected["partial"].output_ids

    if architecture == "llama" and backend == "dynamic":
        # A restarted server finds its cache again, in its first request after the
        # start: nothing warmed it up, so the backend must have loaded what the
        # hit query needs (sglang's page hash) while the server started.
        stop_together([writer, reader])
        launched.start_cold(reader)
        again = reader.generate(full, ANSWER_TOKENS)
        assert again.storage_tokens == FULL_RESTORE_TOKENS, again.meta_info
        assert again.output_ids == expected["full"].output_ids


def sglang_mooncake_config(config):
    """The extra-config sglang's own MooncakeStore reads (our span_* options left out)."""
    return {k: v for k, v in config.items() if not k.startswith("span_")}


def test_best_effort_prefetch_beside_mooncake_store(tiny_model, launched, recompute_server):
    """``best_effort`` ends a prefetch at the scheduler's first look at the request.

    On an idle server that look comes right after the hit query, so the
    prefetch is cut before its transfer lands, for sglang's ``MooncakeStore``
    as for this backend (``_can_terminate_prefetch`` in
    ``mem_cache/unified_radix_cache.py`` returns True at once). Each server
    answers a prompt, backs it up, drops its own caches and answers it again.
    """
    cluster = launched.cluster(storage_nodes=1)
    config = cluster.client_config(0)
    arms = {
        "MooncakeSpanStore": ServerOptions(
            model_path=tiny_model("llama"),
            storage_config=config,
            prefetch_policy="best_effort",
            env=cluster.client_env(),
        ),
        "MooncakeStore": ServerOptions(
            model_path=tiny_model("llama"),
            storage_backend="mooncake",
            storage_config=sglang_mooncake_config(config),
            prefetch_policy="best_effort",
            env=cluster.client_env(),
        ),
    }
    servers = {name: launched.server(name, options) for name, options in arms.items()}
    recompute_server.prestart("llama")
    launched.start(*servers.values())
    recompute = recompute_server("llama")
    storage_tokens: dict[str, list[int]] = {name: [] for name in servers}
    for seed in range(40, 43):
        p = prompt(seed)
        expected = recompute(p)
        for name, server in servers.items():
            before = len(stored_keys(cluster))
            assert server.generate(p, ANSWER_TOKENS).output_ids == expected.output_ids
            wait_for_backup(cluster, before + PROMPT_TOKENS // PAGE_TOKENS - 1)
            server.flush_cache()
            again = server.generate(p, ANSWER_TOKENS)
            assert again.output_ids == expected.output_ids, (name, again.meta_info)
            storage_tokens[name].append(again.storage_tokens)
    print(f"best_effort storage tokens on an idle server: {storage_tokens}")
    # The same cut for both backends: what best_effort leaves is sglang's choice.
    assert sum(storage_tokens["MooncakeSpanStore"]) >= sum(storage_tokens["MooncakeStore"]) - (
        PAGE_TOKENS * len(storage_tokens["MooncakeStore"])
    )
