"""Prefix-chain placement seen from a real server: losing one of two storage nodes.

With ``hicache_storage_pass_prefix_keys`` on, sglang hands the backend each
conversation's prefix keys and every page of a prompt lands on one storage
node. After one of two nodes is SIGKILLed, a second server restores each
stored prompt whole or not at all, never a prefix cut at a random page, and
its greedy tokens equal recompute's either way.
"""

from __future__ import annotations

import pytest

from mooncake_span.lab.sglang_servers import ServerOptions
from tests.servers.conftest import (
    ANSWER_TOKENS,
    PAGE_TOKENS,
    PROMPT_TOKENS,
    prompt,
    settled_key_count,
    stored_keys,
    wait_for_backup,
)
from tests.servers.test_two_servers import FULL_RESTORE_TOKENS

pytestmark = [
    pytest.mark.integration,
    pytest.mark.servers,
    pytest.mark.slow,
    pytest.mark.timeout(600),
]

# All of them on the killed node has odds 2**-12.
CONVERSATIONS = 12


def test_one_of_two_nodes_lost_costs_whole_prompts(tiny_model, launched, recompute_server):
    cluster = launched.cluster(storage_nodes=2)
    options = ServerOptions(
        model_path=tiny_model("llama"),
        storage_config={**cluster.client_config(0), "hicache_storage_pass_prefix_keys": True},
        # wait_complete: what the reader gets depends on placement alone.
        prefetch_policy="wait_complete",
        env=cluster.client_env(),
    )
    writer, reader = launched.server("writer", options), launched.server("reader", options)
    recompute_server.prestart("llama")
    launched.start(writer, reader)
    recompute = recompute_server("llama")
    prompts = [prompt(100 + i) for i in range(CONVERSATIONS)]
    base = settled_key_count(lambda: len(stored_keys(cluster)))
    for p in prompts:
        writer.generate(p, ANSWER_TOKENS)
    wait_for_backup(cluster, base + CONVERSATIONS * (PROMPT_TOKENS // PAGE_TOKENS - 1))
    stored = len(stored_keys(cluster))

    cluster.kill_storage_node(1)
    restored_tokens = []
    for p in prompts:
        answer = reader.generate(p, ANSWER_TOKENS)
        assert answer.output_ids == recompute(p).output_ids
        restored_tokens.append(answer.storage_tokens)
    print(f"stored keys {stored}; storage tokens per prompt after losing 1 of 2: {restored_tokens}")
    assert set(restored_tokens) <= {0, FULL_RESTORE_TOKENS}, restored_tokens
    assert FULL_RESTORE_TOKENS in restored_tokens, restored_tokens
