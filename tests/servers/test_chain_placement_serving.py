"""Prefix-chain placement seen from a real server: losing one of two storage nodes.

With ``hicache_storage_pass_prefix_keys`` on, sglang hands the backend each
conversation's prefix keys and every page of a prompt lands on one storage
node. After one of two nodes is SIGKILLed, a second server restores each
stored prompt whole or not at all, never a prefix cut at a random page, and
its greedy tokens equal recompute's either way.

How many prompts the killed node held is read off the master before the
kill (the segment of every object the prompts stored), so the reader must
restore exactly the survivor's prompts: not fewer (a healthy node's prompts
read as misses), not more. Placement is a hash of each conversation's root,
so the test writes more conversations until both nodes hold at least one,
instead of leaving the outcome to the odds of 12 coin flips.
"""

from __future__ import annotations

import collections
import json
import urllib.parse

import pytest

from mooncake_span.ops.master_http import get_text
from mooncake_span_tools.lab.sglang_servers import ServerOptions
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

CONVERSATIONS = 12
# Written in addition while one node holds every conversation (odds 2**-11 for
# the first 12, halved by each more one); a bound, so a placement that never
# spreads fails instead of looping.
MORE_CONVERSATIONS = 12
# Every page of a prompt but the last, which sglang computes: what a prompt stores at least.
STORED_PAGES = PROMPT_TOKENS // PAGE_TOKENS - 1
# Keys per /batch_query_keys request: they travel in the URL.
_QUERY_KEYS_PER_REQUEST = 32


def segments_of(cluster, keys: list[str]) -> dict[str, str]:
    """Per object key, the segment holding its one memory replica, as the master says."""
    out: dict[str, str] = {}
    for start in range(0, len(keys), _QUERY_KEYS_PER_REQUEST):
        chunk = urllib.parse.quote(",".join(keys[start : start + _QUERY_KEYS_PER_REQUEST]))
        answer = json.loads(get_text(f"{cluster.metrics_url}/batch_query_keys?keys={chunk}", 5.0))
        for key, item in answer["data"].items():
            (replica,) = item["values"]
            out[key] = replica["transport_endpoint_"]
    return out


def placement(cluster, warm_keys: set[str], prompts: int) -> dict[str, str]:
    """Per object the prompts stored (every key but ``warm_keys``), its segment, once
    the writer's asynchronous backups are all on the master."""
    wait_for_backup(cluster, len(warm_keys) + prompts * STORED_PAGES)
    settled_key_count(lambda: len(stored_keys(cluster)))
    return segments_of(cluster, sorted(set(stored_keys(cluster)) - warm_keys))


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
    settled_key_count(lambda: len(stored_keys(cluster)))
    warm_keys = set(stored_keys(cluster))
    victim = cluster.node_ready_fields(1)["segment"]

    prompts = [prompt(100 + i) for i in range(CONVERSATIONS)]
    for p in prompts:
        writer.generate(p, ANSWER_TOKENS)
    placed = placement(cluster, warm_keys, len(prompts))
    objects_on = collections.Counter(placed.values())
    while len(objects_on) < 2 and len(prompts) < CONVERSATIONS + MORE_CONVERSATIONS:
        prompts.append(prompt(100 + len(prompts)))
        writer.generate(prompts[-1], ANSWER_TOKENS)
        placed = placement(cluster, warm_keys, len(prompts))
        objects_on = collections.Counter(placed.values())
    assert len(objects_on) == 2, f"{len(prompts)} conversations all on {list(objects_on)}"
    objects_per_prompt = len(placed) // len(prompts)
    assert objects_per_prompt * len(prompts) == len(placed), (len(placed), len(prompts))
    assert victim in objects_on, f"node 1 is {victim}, objects are on {list(objects_on)}"
    surviving_objects = len(placed) - objects_on[victim]
    # Whole-prompt placement: each node holds whole prompts' objects.
    assert surviving_objects % objects_per_prompt == 0, (objects_on, objects_per_prompt)
    surviving_prompts = surviving_objects // objects_per_prompt

    cluster.kill_storage_node(1)
    restored_tokens = []
    for p in prompts:
        answer = reader.generate(p, ANSWER_TOKENS)
        assert answer.output_ids == recompute(p).output_ids
        restored_tokens.append(answer.storage_tokens)
    print(
        f"objects per node {dict(objects_on)} (killed {victim}); storage tokens per prompt "
        f"after losing 1 of 2: {restored_tokens}"
    )
    assert set(restored_tokens) <= {0, FULL_RESTORE_TOKENS}, restored_tokens
    assert restored_tokens.count(FULL_RESTORE_TOKENS) == surviving_prompts, (
        f"{surviving_prompts} prompts on the surviving node, restored: {restored_tokens}"
    )
