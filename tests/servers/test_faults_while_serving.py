"""Faults while two real servers serve: every request completes with recompute's tokens.

One cluster, one storage node, a writer and a reader server with
``span_verify_checksums`` on. In turn: a stored object is corrupted in the
storage node's memory, the storage node is SIGKILLed, the master is
SIGKILLed. Each request after a fault must answer (no error reaches the
client) within ``FAULT_ANSWER_BOUND_S`` and with the tokens of a server that
recomputes. After the master and node are restarted, L3 hits come back within
``HEAL_BOUND_S``.
"""

from __future__ import annotations

import time

import pytest

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

pytestmark = [
    pytest.mark.integration,
    pytest.mark.servers,
    pytest.mark.slow,
    pytest.mark.timeout(600),
]

# A request after a fault may wait for one failed transfer or RPC timeout
# before it recomputes; sglang's prefetch timeout bounds the wait.
FAULT_ANSWER_BOUND_S = 30.0
HEAL_BOUND_S = 90.0
PAGES_PER_PROMPT = PROMPT_TOKENS // PAGE_TOKENS


def object_extents(cluster, keys: list[str]) -> list[tuple[int, int]]:
    """(address, size) of each object's replica in the storage node's memory."""
    from mooncake.store import MooncakeDistributedStore

    config = cluster.client_config(0)
    store = MooncakeDistributedStore()
    rc = store.setup(
        local_hostname="127.0.0.1",
        metadata_server=config["metadata_server"],
        global_segment_size=0,
        local_buffer_size=16 << 20,
        protocol="tcp",
        rdma_devices="",
        master_server_addr=config["master_server_address"],
    )
    assert rc == 0, f"setup returned {rc}"
    try:
        extents = []
        for key in keys:
            for replica in store.get_replica_desc(key):
                desc = replica.get_memory_descriptor().buffer_descriptor
                extents.append((desc.buffer_address, desc.size))
        return extents
    finally:
        store.close()


def flip_bytes(pid: int, extents: list[tuple[int, int]]) -> None:
    """Flip one byte in the middle of each extent of process ``pid`` (root, /proc/PID/mem)."""
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as memory:
        for address, size in extents:
            memory.seek(address + size // 2)
            old = memory.read(1)[0]
            memory.seek(address + size // 2)
            memory.write(bytes([old ^ 0xFF]))


def answer_within_bound(server, input_ids, expected):
    started = time.monotonic()
    answer = server.generate(input_ids, ANSWER_TOKENS, timeout_s=FAULT_ANSWER_BOUND_S)
    elapsed_s = time.monotonic() - started
    assert answer.output_ids == expected.output_ids, (server.name, answer.meta_info)
    assert elapsed_s < FAULT_ANSWER_BOUND_S
    return answer


def test_faults_while_serving(tiny_model, launched, recompute_server):
    cluster = launched.cluster(storage_nodes=1)
    options = ServerOptions(
        model_path=tiny_model("llama"),
        storage_config={**cluster.client_config(0), "span_verify_checksums": True},
        env=cluster.client_env(),
    )
    writer, reader = launched.server("writer", options), launched.server("reader", options)
    recompute_server.prestart("llama")
    launched.start(writer, reader)
    recompute = recompute_server("llama")
    prompts = {name: prompt(seed) for seed, name in enumerate(["corrupt", "node", "master"], 10)}
    expected = {name: recompute(p) for name, p in prompts.items()}

    # 1. A corrupted object is a miss under checksums, never wrong bytes.
    before = settled_key_count(lambda: len(stored_keys(cluster)))
    writer.generate(prompts["corrupt"], ANSWER_TOKENS)
    wait_for_backup(cluster, before + PAGES_PER_PROMPT - 1)
    flip_bytes(cluster.pids()["node0"], object_extents(cluster, stored_keys(cluster)))
    corrupt = answer_within_bound(reader, prompts["corrupt"], expected["corrupt"])
    assert corrupt.storage_tokens == 0, corrupt.meta_info
    assert "failed their integrity check" in reader.log_text()

    # 2. The only storage node dies between the backup and the read.
    before = len(stored_keys(cluster))
    writer.generate(prompts["node"], ANSWER_TOKENS)
    wait_for_backup(cluster, before + PAGES_PER_PROMPT - 1)
    cluster.kill_storage_node(0)
    answer_within_bound(reader, prompts["node"], expected["node"])
    answer_within_bound(writer, prompt(20), recompute(prompt(20)))

    # 3. The master dies too.
    cluster.kill_master(0)
    answer_within_bound(reader, prompts["master"], expected["master"])
    answer_within_bound(writer, prompt(21), recompute(prompt(21)))

    # 4. Healed: a fresh prompt written now is restored from L3 again.
    cluster.restart_master(0)
    cluster.restart_storage_node(0)
    deadline = time.monotonic() + HEAL_BOUND_S
    for seed in range(30, 60):
        fresh = prompt(seed)
        writer.generate(fresh, ANSWER_TOKENS)
        time.sleep(2.0)
        restored = answer_within_bound(reader, fresh, recompute(fresh))
        if restored.storage_tokens == PROMPT_TOKENS - PAGE_TOKENS:
            break
        assert time.monotonic() < deadline, "no L3 hit after the master and node came back"
