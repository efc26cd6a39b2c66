"""A whole-cluster restart finds the cache again: the SSD tier with real sglang servers.

A cluster whose storage node has an SSD tier (``--ssd-dir``), and two real
servers: the writer answers a prompt and backs it up, the reader restores it
from L3. Then everything stops -- both servers, the storage node, the master
-- and only the SSD directory stays. A new cluster on new ports over the same
directory, and a new server, restore the same prompt: the same storage-hit
tokens as the reader before the restart, every page from the node's SSD, and
the greedy answer of a server that recomputes.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from mooncake_span.ops.cluster import LocalCluster
from mooncake_span_tools.lab.sglang_servers import ServerOptions, stop_together
from tests.servers.conftest import (
    ANSWER_TOKENS,
    PAGE_TOKENS,
    PROMPT_TOKENS,
    prompt,
    settled_key_count,
    stored_keys,
    wait_for_backup,
    wait_until,
)
from tests.span_helpers import master_replicas

pytestmark = [
    pytest.mark.integration,
    pytest.mark.servers,
    pytest.mark.slow,
    pytest.mark.timeout(600),
]

FULL_RESTORE_TOKENS = PROMPT_TOKENS - PAGE_TOKENS
OFFLOAD_TIMEOUT_S = 20.0


def _on_disk(cluster: LocalCluster) -> tuple[int, int]:
    """(objects with a replica on an owner's SSD, all objects), as the master describes them."""
    keys = stored_keys(cluster)
    found = master_replicas(cluster, keys)
    disk = sum(1 for reps in found.values() if any(r.is_local_disk_replica() for r in reps))
    return disk, len(keys)


def test_whole_cluster_restart_restores_the_same_tokens(
    tiny_model, launched, recompute_server, tmp_path
):
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    spec = {"storage_nodes": 1, "storage_node_segment_bytes": 64 << 20, "ssd_dir": ssd}
    cluster = launched.cluster(**spec)
    options = ServerOptions(
        model_path=tiny_model("llama"),
        storage_config=cluster.client_config(0),
        env=cluster.client_env(),
    )
    writer, reader = launched.server("writer", options), launched.server("reader", options)
    recompute_server.prestart("llama")
    launched.start(writer, reader)
    recompute = recompute_server("llama")
    p = prompt(31)
    expected = recompute(p)
    base = settled_key_count(lambda: len(stored_keys(cluster)))
    assert writer.generate(p, ANSWER_TOKENS).output_ids == expected.output_ids
    wait_for_backup(cluster, base + PROMPT_TOKENS // PAGE_TOKENS - 1)
    before = reader.generate(p, ANSWER_TOKENS)
    assert before.storage_tokens == FULL_RESTORE_TOKENS, before.meta_info
    assert before.output_ids == expected.output_ids
    # Offload is one heartbeat behind the put: stop only once every object is on disk.
    wait_until(lambda: len(set(_on_disk(cluster))) == 1, OFFLOAD_TIMEOUT_S, "every object on SSD")
    objects = _on_disk(cluster)[1]
    old_master = cluster.master_address

    stop_together([writer, reader])
    cluster.stop()
    started = time.monotonic()
    again = launched.cluster(**spec)  # new master, new node, new ports; the same directory
    assert again.master_address != old_master
    assert _on_disk(again) == (objects, objects), "the new cluster did not find every object"
    fresh = launched.server(
        "after-restart",
        dataclasses.replace(options, storage_config=again.client_config(0), env=again.client_env()),
    )
    launched.start(fresh)
    after = fresh.generate(p, ANSWER_TOKENS)
    print(
        f"whole-cluster restart: {objects} objects found again; storage tokens "
        f"{before.storage_tokens} before, {after.storage_tokens} after; new cluster and server "
        f"ready in {time.monotonic() - started:.1f} s"
    )
    assert after.storage_tokens == before.storage_tokens, after.meta_info
    assert after.output_ids == expected.output_ids
