"""The SSD tier on real masters and storage nodes (``--ssd-dir``), through the backend.

One cluster of two storage nodes with 16 MiB DRAM segments and an SSD tier is
shared by the module; its backends store 1 MiB span keys (K=4 MLA host pages
of 256 KiB) from real sglang host pools and compare every restored byte.

1. a working set of 4x the DRAM segments: every key restores byte-exact, part
   of them read from an owner's SSD (the read buffer is smaller than one
   owner's share of a read, so reads are asked again in halves);
3. a storage node SIGKILLed and restarted: while it is down every call is
   bounded by the transfer timeout and Mooncake's ~4.3 s owner RPC is paid
   once, not per key; hit queries stop offering its keys; the other node's keys
   still restore, and new backups land on it; after the restart (which waits
   for the master to drop the dead node) every key is found again, and the same
   after a graceful restart;
4. a disk cap smaller than the working set (a cluster of its own): evicted keys
   are clean misses, nothing restores wrong bytes, the directory stays near the cap.
(2, the whole-cluster restart with real servers, is tests/servers/test_ssd_restart.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mooncake_span.ops.cluster import ClusterSpec, LocalCluster
from mooncake_span.ops.master_http import iter_lines
from mooncake_span.store.serving_ssd import OWNER_DOWN_LABEL
from mooncake_span_tools.testing import pools as P
from tests.conftest import require_mooncake
from tests.span_helpers import make_storage_config, master_replicas, register_pools, slots_of

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

PAGE = 64
PAGES_PER_KEY = 4
# MLA page: layers * 64 tokens * (kv_lora_rank + rope) * 2 bytes = 256 KiB; a key 1 MiB.
MLA = {"layers": 8, "kv_lora_rank": 240, "rope_dim": 16}
KEY_BYTES = 1 << 20
SEGMENT_BYTES = 16 << 20  # the wheel refuses smaller segments
NODES = 2
WORKING_SET_KEYS = 4 * NODES * SEGMENT_BYTES // KEY_BYTES  # 4x the cluster's DRAM
# Longer than the ~4.3 s a read of a dead owner waits, so the test sees it down
# but not yet dropped by the master (what happens with the default 10 s).
CLIENT_TTL_S = 6
DOMAIN_BAD_TTL_S = 4.0
TRANSFER_TIMEOUT_S = 5
WRITE_DEADLINE_S = 90.0
BATCH_KEYS = 8


@pytest.fixture(autouse=True)
def _needs_mooncake() -> None:
    require_mooncake()


def _cluster(tmp: Path, name: str, **fields: Any) -> LocalCluster:
    ssd = tmp / f"{name}-ssd"
    ssd.mkdir()
    spec = ClusterSpec(
        storage_nodes=fields.pop("storage_nodes", NODES),
        storage_node_segment_bytes=SEGMENT_BYTES,
        ssd_dir=ssd,
        client_ttl_s=CLIENT_TTL_S,
        log_dir=tmp / f"{name}-logs",
        **fields,
    )
    return LocalCluster(spec).start()


@pytest.fixture(scope="module")
def ssd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    require_mooncake()
    # 4 MiB read buffer: one owner's share of an 8-key read (~4 keys) does not fit.
    cluster = _cluster(
        tmp_path_factory.mktemp("ssd"),
        "shared",
        ssd_size_bytes="128mb",
        ssd_read_buffer_bytes="4mb",
    )
    yield cluster
    cluster.stop()


class Keys:
    """``count`` span keys of random bytes in one MLA host pool, and a backend for them."""

    def __init__(self, cluster: LocalCluster, namespace: str, count: int) -> None:
        from sglang.srt.mem_cache.hicache_storage import PoolName

        self.kv = P.build_mla_host("page_first", host_pages=count * PAGES_PER_KEY, **MLA)
        config = {
            **cluster.client_config(),
            "storage_page_size": PAGE * PAGES_PER_KEY,
            "span_domain_bad_ttl_s": DOMAIN_BAD_TTL_S,
            # A key a failed read marked lost is a miss for this long, restart or not.
            "span_lost_key_ttl_s": DOMAIN_BAD_TTL_S,
            "span_transfer_timeout_s": TRANSFER_TIMEOUT_S,
        }
        self.store = self._backend(config, namespace)
        register_pools(self.store, {PoolName.KV: self.kv})
        self.names = [f"{namespace}-{i}" for i in range(count)]
        starts = [p * PAGE for p in range(count * PAGES_PER_KEY)]
        P.fill_random_pages(self.kv, starts, seed=31)
        self.expected = [P.page_bytes(self.kv, s) for s in starts]
        self.refused = 0
        assert len(self.expected[0]) * PAGES_PER_KEY == KEY_BYTES

    @staticmethod
    def _backend(config: dict[str, Any], namespace: str) -> Any:
        from mooncake_span.sglang_backend import MooncakeSpanStore

        return MooncakeSpanStore(make_storage_config(config, model_name=namespace), {})

    def slots(self, rows: list[int]) -> Any:
        return slots_of([r * PAGES_PER_KEY + p for r in rows for p in range(PAGES_PER_KEY)], PAGE)

    def write_all(self) -> int:
        """Back every key up as sglang would, again while Mooncake refuses some (offload
        back-pressure); returns how many puts were refused. No call may stall."""
        pending, refused = list(range(len(self.names))), 0
        deadline = time.monotonic() + WRITE_DEADLINE_S
        while pending:
            assert time.monotonic() < deadline, f"{len(pending)} keys never stored"
            batch, pending = pending[:BATCH_KEYS], pending[BATCH_KEYS:]
            started = time.monotonic()
            ok = self.store.batch_set_v1([self.names[r] for r in batch], self.slots(batch))
            assert time.monotonic() - started < TRANSFER_TIMEOUT_S, "a put call stalled"
            failed = [r for r, good in zip(batch, ok, strict=True) if not good]
            refused += len(failed)
            pending += failed
            if failed:
                time.sleep(0.3)
        self.refused += refused
        return refused

    def read(self, rows: list[int]) -> tuple[list[bool], list[bool], float]:
        """(hit, exact) per row and the call's seconds; the host pages are wiped first."""
        starts = [(r * PAGES_PER_KEY + p) * PAGE for r in rows for p in range(PAGES_PER_KEY)]
        P.wipe_pages(self.kv, starts)
        started = time.monotonic()
        hits = self.store.batch_get_v1([self.names[r] for r in rows], self.slots(rows))
        elapsed_s = time.monotonic() - started
        exact = [
            all(
                P.page_bytes(self.kv, (r * PAGES_PER_KEY + p) * PAGE)
                == self.expected[r * PAGES_PER_KEY + p]
                for p in range(PAGES_PER_KEY)
            )
            for r in rows
        ]
        return hits, exact, elapsed_s

    def read_all(self, batch_keys: int = BATCH_KEYS) -> tuple[list[bool], list[bool], list[float]]:
        """Every key, ``batch_keys`` per get (a get answers a prefix: after a miss, the
        rest of its call reads False)."""
        hits: list[bool] = []
        exact: list[bool] = []
        times: list[float] = []
        for start in range(0, len(self.names), batch_keys):
            rows = list(range(start, min(start + batch_keys, len(self.names))))
            h, e, t = self.read(rows)
            hits += h
            exact += e
            times.append(t)
        return hits, exact, times

    def assert_never_wrong(self, hits: list[bool], exact: list[bool]) -> None:
        wrong = [
            self.names[i] for i, (h, e) in enumerate(zip(hits, exact, strict=True)) if h and not e
        ]
        assert not wrong, f"keys restored with bytes that were not written for them: {wrong}"

    def errors(self) -> dict[str, int]:
        return self.store.client.stats()["error_counts"]


@pytest.fixture(scope="module")
def working_set(ssd_cluster: LocalCluster) -> Iterator[Keys]:
    keys = Keys(ssd_cluster, "ssd4x", WORKING_SET_KEYS)
    keys.write_all()
    yield keys
    keys.store.close()


def _disk_only_objects(cluster: LocalCluster) -> tuple[int, int]:
    """(objects with only a disk replica, all objects), as the master describes them."""
    keys = [k for k in iter_lines(f"{cluster.metrics_url}/get_all_keys", timeout_s=5.0) if k]
    found = master_replicas(cluster, keys)
    disk = sum(
        1 for reps in found.values() if reps and not any(r.is_memory_replica() for r in reps)
    )
    return disk, len(keys)


def test_four_times_dram_restores_every_key_byte_exact(working_set, ssd_cluster):
    disk_only, objects = _disk_only_objects(ssd_cluster)
    # DRAM holds at most a quarter of the objects; the rest are on an owner's SSD only.
    assert objects >= WORKING_SET_KEYS
    assert disk_only >= objects - NODES * SEGMENT_BYTES // KEY_BYTES, (disk_only, objects)
    before = working_set.store.client.stats()["ssd_read_rpcs"]
    hits, exact, _ = working_set.read_all()
    assert all(hits), [n for n, h in zip(working_set.names, hits, strict=True) if not h]
    assert all(exact)
    stats = working_set.store.client.stats()
    assert stats["ssd_read_rpcs"] > before  # Mooncake asked an SSD owner
    # The read buffer (4 MiB) is smaller than an owner's share of a read: halved, then read.
    assert stats["error_counts"].get("BUFFER_OVERFLOW", 0) > 0
    print(
        f"4x DRAM: {objects} objects, {disk_only} on SSD only, {working_set.refused} puts "
        f"refused under offload back-pressure and written again, "
        f"{stats['ssd_read_rpcs'] - before} SSD read RPCs"
    )


def test_storage_node_sigkill_bounded_misses_then_found_again(working_set, ssd_cluster):
    # A backend for new keys, started (its layout record published) while both nodes run.
    fresh = Keys(ssd_cluster, "while-down", 2 * BATCH_KEYS)
    ssd_cluster.kill_storage_node(0)
    killed_at = time.monotonic()
    hits, exact, times = working_set.read_all()
    working_set.assert_never_wrong(hits, exact)
    print(f"reads while a node is down: {sum(hits)}/{len(hits)} hits, get seconds {times}")
    assert max(times) <= TRANSFER_TIMEOUT_S + 1.0, times
    # Mooncake's owner RPC retries (~4.3 s) are paid once, then the owner is skipped.
    assert sum(t > 2.0 for t in times) <= 1, times
    assert 0 < sum(hits) < len(hits), "the surviving node's keys restore, the dead one's miss"
    assert working_set.errors().get(OWNER_DOWN_LABEL, 0) > 0
    started = time.monotonic()
    present = working_set.store.batch_exists(working_set.names)
    assert time.monotonic() - started < 1.0
    assert present < len(working_set.names), "hit queries still offer the dead node's keys"
    survivors = sum(hits)
    try:  # new backups while the node is down: no call past the transfer timeout
        fresh.write_all()
        hits, exact, times = fresh.read_all()
        assert all(hits) and all(exact) and max(times) <= TRANSFER_TIMEOUT_S
    finally:
        fresh.store.close()

    ssd_cluster.restart_storage_node(0)  # waits until the master dropped the dead node
    assert time.monotonic() - killed_at >= CLIENT_TTL_S
    time.sleep(max(0.0, DOMAIN_BAD_TTL_S - (time.monotonic() - killed_at)) + 0.5)
    hits, exact, _ = working_set.read_all()
    assert all(hits) and all(exact), f"{sum(hits)} of {len(hits)} found again ({survivors} before)"

    ssd_cluster.restart_storage_node(1)  # graceful: the disk segment is released first
    hits, exact, _ = working_set.read_all()
    assert all(hits) and all(exact), f"{sum(hits)} of {len(hits)} after a graceful restart"


def test_disk_cap_reached_clean_misses_nothing_corrupt(tmp_path):
    cap_bytes = SEGMENT_BYTES + SEGMENT_BYTES // 2
    cluster = _cluster(tmp_path, "capped", storage_nodes=1, ssd_size_bytes=cap_bytes)
    try:
        keys = Keys(cluster, "capped", 2 * cap_bytes // KEY_BYTES)
        try:
            keys.write_all()
            time.sleep(1.5)  # the last heartbeat writes the last objects
            hits, exact, _ = keys.read_all(batch_keys=1)
            keys.assert_never_wrong(hits, exact)
            # About a cap's worth (FIFO evicts down to 80% of it), plus what DRAM still holds.
            assert cap_bytes // 2 <= sum(hits) * KEY_BYTES <= cap_bytes + SEGMENT_BYTES, sum(hits)
            assert keys.errors().get("OBJECT_NOT_FOUND", 0) == len(hits) - sum(hits)
        finally:
            keys.store.close()
        usage = sum(f.stat().st_size for f in cluster.node_ssd_dir(0).rglob("*") if f.is_file())
        assert usage <= cap_bytes + KEY_BYTES, usage
    finally:
        cluster.stop()


def test_doctor_passes_an_ssd_tier_on_an_offload_master(ssd_cluster, tmp_path):
    argv = [
        sys.executable,
        "-m",
        "mooncake_span.ops.cli",
        "doctor",
        f"--master={ssd_cluster.master_address}",
        f"--metadata={ssd_cluster.metadata_server}",
        f"--admin-url={ssd_cluster.metrics_url}",
        f"--ssd-dir={tmp_path}",
        "--json",
    ]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    checks = {c["name"]: c["status"] for c in json.loads(result.stdout)["checks"]}
    assert checks["ssd tier"] == "PASS" and checks["ssd master"] == "PASS", result.stdout
    assert checks["round trip"] == "PASS", result.stdout
