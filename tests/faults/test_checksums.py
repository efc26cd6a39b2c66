"""Integrity on restore, with real Mooncake: a byte flipped in a stored object.

The cluster has no storage node: the only segment is the one the backend
process itself contributes (``global_segment_size``), so the test can reach the
stored bytes (``get_replica_desc`` gives their address) and flip them in place,
as a bit flip in a storage node's memory would. Mooncake reads
MOONCAKE_STORE_CHECKSUM once per process at its first client setup (measured:
an export after setup, or before a second client's setup, changes nothing), so
each setting runs in its own process (checksum_worker.py).

Measured on Mooncake 0.3.13 (raw client, same flip): with the variable on,
``batch_get_into_multi_buffers``, ``get_into``, ``batch_get_into`` and ``get``
fail with CHECKSUM_MISMATCH (-801); ``get_into_ranges`` is never verified, not
even for a range covering the whole object; objects put by a process without the
variable carry no checksum and are returned unverified.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.faults import checksum_worker as W

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CORRUPT = W.KEYS[W.CORRUPT_INDEX]


def _run(cluster: Any, model: str, *, verify: bool, plain_writer: bool) -> dict[str, Any]:
    argv = [
        sys.executable,
        "-m",
        "tests.faults.checksum_worker",
        "corrupt",
        json.dumps(cluster.client_config()),
        model,
        "1" if verify else "0",
        "1" if plain_writer else "0",
    ]
    env = {**os.environ, **cluster.client_env()}
    env.pop("MOONCAKE_STORE_CHECKSUM", None)
    done = subprocess.run(
        argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check_flip_reached_the_stored_objects(out: dict[str, Any]) -> None:
    assert out["written"] == [True] * len(W.KEYS)
    assert out["hits_before"]["batch_exists"] == len(W.KEYS)
    flipped = out["flipped"]
    assert [f["object"].rsplit("__", 1)[1] for f in flipped] == ["k", "indexer"]
    assert all(CORRUPT in f["object"] and f["size"] > 0 for f in flipped)
    assert {f["endpoint"] for f in flipped} == set(out["stats"]["segments"])


def test_with_checksums_a_corrupt_key_misses_and_is_not_offered_again(fault_cluster, figures):
    cluster = fault_cluster(storage_nodes=0)
    out = _run(cluster, "t-ck-on", verify=True, plain_writer=True)
    _check_flip_reached_the_stored_objects(out)
    # The keys before it byte-exact, the corrupt key and every later one False
    # (sglang reads the flags as a prefix), no True with wrong bytes.
    assert out["restored"] == [True, True, False, False, False, False]
    assert out["corrupt_restores"] == []
    # The next hit queries stop before the corrupt key; its objects are gone.
    after = out["hits_after"]
    assert after["batch_exists"] == W.CORRUPT_INDEX
    assert after["batch_exists_v2_kv_hit_pages"] == W.CORRUPT_INDEX
    assert after["presence"][W.CORRUPT_INDEX] == [False, False]
    assert all(p == [True, True] for i, p in enumerate(after["presence"]) if i != W.CORRUPT_INDEX)
    stats = out["stats"]
    assert stats["integrity_failures"]["CHECKSUM_MISMATCH"] >= 1
    assert stats["integrity_removed"] == stats["integrity_failures"]["CHECKSUM_MISMATCH"]
    assert out["metric"] == stats["integrity_failures"]["CHECKSUM_MISMATCH"]
    assert stats["breaker_state"] == "closed"
    assert out["layout_integrity"]["verify_checksums"] is True
    # Keys written by a process without the option carry no checksum: still
    # readable here, and -- the limit of the option -- a flip in one of them
    # comes back as a hit with the wrong bytes.
    assert out["plain_written"] == [True] * len(W.PLAIN_KEYS)
    assert out["plain_restored"] == [True] * len(W.PLAIN_KEYS)
    assert out["plain_corrupt_restores"] == [f"kv:{W.PLAIN_KEYS[0]} bytes differ"]
    figures.update(
        restored=out["restored"], hits_after=after["batch_exists"], stats=stats["error_counts"]
    )


def test_without_checksums_the_same_flip_is_restored_silently(fault_cluster, figures):
    cluster = fault_cluster(storage_nodes=0)
    out = _run(cluster, "t-ck-off", verify=False, plain_writer=False)
    _check_flip_reached_the_stored_objects(out)
    # The backend reported the corrupt key True, KV and indexer, with wrong
    # bytes (SpanOracle records exactly the True flags whose digest differs).
    assert out["corrupt_restores"] == [
        f"kv:{CORRUPT} bytes differ",
        f"indexer:{CORRUPT} bytes differ",
    ]
    assert out["restored"] == [True, True, False, True, True, True]
    assert out["hits_after"]["batch_exists"] == len(W.KEYS)
    assert out["stats"]["integrity_failures"] == {}
    assert out["layout_integrity"]["verify_checksums"] is False
    figures.update(corrupt_restores=out["corrupt_restores"])
