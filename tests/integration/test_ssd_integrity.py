"""Integrity across restarts on the SSD tier: real master, a real storage node with
``--ssd-dir``, the backend with real sglang host pools (K=4 MLA, 1 MiB keys).

Objects are changed on disk as rot or a power loss would leave them: bytes
flipped inside a ``.bucket`` file, or the file cut short. Every restored byte
is compared with what was written for its key.

1. rot after a graceful restart: with ``span_object_checksums`` (on by default
   wherever the cluster has an SSD tier) the rotted keys miss, 0 wrong
   bytes, the others restore; and the negative control: with it off the same
   rot IS restored as a hit with wrong bytes (Mooncake's own CRC is gone after
   a restart), so the test can fail;
2. a corrupt key caught before a restart stays gone after it (the node's check
   deletes its file before registering the directory);
3. torn files: one failed read (FILE_READ_FAIL), then no hit query offers the
   key, and after a restart neither;
4. a directory too small for one object is refused, naming the usable capacity;
5. the first read after a graceful restart's READY restores every object whose SSD
   replica the master listed before the stop (what the restart promises);
6. a graceful restart the moment the puts return keeps them all: the stop lets the
   offloads it accepted finish (with ``--ssd-stop-wait-s 0``, its control, they are lost);
   and so does a serving rank's close on its own tier (a process each, ``ssd_rank_process.py``).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncake_span.ops.cluster import ClusterSpec, LocalCluster
from mooncake_span.ops.launcher import ClusterStartError
from mooncake_span_tools.testing import pools as P
from tests.conftest import require_mooncake
from tests.integration.ssd_keys import (
    KEYS,
    PAGE,
    PAGES_PER_KEY,
    ROTTED,
    SEGMENT_BYTES,
    Keys,
    missed_and_wrong,
    node_log,
    node_with_ssd,
    rot,
    tear,
    wrong_rows,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(autouse=True)
def _needs_mooncake() -> None:
    require_mooncake()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    # The opt-in full check: the corrupt-key case needs the start-up scan that reads
    # seals (the default size check leaves rot to the read; test_ssd_defaults.py).
    spec = node_with_ssd(tmp_path, ssd_check="full")
    with LocalCluster(spec) as started:
        yield started


def test_rot_after_a_graceful_restart_misses_with_the_check_and_is_returned_without(cluster):
    sealed = Keys(cluster, "sealed")
    # Seals are on by default where a tier exists; turning them off takes the guard off too.
    plain = Keys(cluster, "plain", span_object_checksums=False, span_layout_guard="off")
    try:
        sealed.write_all()
        plain.write_all()
        cluster.restart_storage_node(0)  # graceful: every object comes back from disk only
        for keys in (sealed, plain):
            for row in ROTTED:
                rot(keys.bucket(row))
        sealed.fresh()
        plain.fresh()
        hits, exact = sealed.read_each()
        assert wrong_rows(sealed, hits, exact) == []
        assert [i for i in range(KEYS) if not hits[i]] == ROTTED, sealed.evidence()
        assert sealed.store.client.stats()["integrity_failures"] == {"SEAL_MISMATCH": len(ROTTED)}
        assert [i for i, o in enumerate(sealed.offered()) if not o] == ROTTED  # removed
        # Negative control: the same rot without the check is restored as a hit.
        hits, exact = plain.read_each()
        assert all(hits)
        assert [plain.names.index(n) for n in wrong_rows(plain, hits, exact)] == ROTTED
    finally:
        sealed.store.close()
        plain.store.close()


def test_a_corrupt_key_caught_before_a_restart_stays_gone_after_it(cluster):
    keys = Keys(cluster, "caught")
    try:
        keys.write_all()
        cluster.restart_storage_node(0)
        for row in ROTTED:
            rot(keys.bucket(row))
        keys.fresh()
        hits, exact = keys.read_each()
        assert wrong_rows(keys, hits, exact) == []
        assert [i for i in range(KEYS) if not hits[i]] == ROTTED, keys.evidence()
        keys.store.close()
        cluster.restart_storage_node(0)
        keys.store = keys.backend()
        assert [i for i, o in enumerate(keys.offered()) if not o] == ROTTED, keys.evidence()
        hits, exact = keys.read_each()
        assert wrong_rows(keys, hits, exact) == []
        assert [i for i in range(KEYS) if not hits[i]] == ROTTED, keys.evidence()
        assert keys.store.client.stats()["integrity_failures"] == {}  # not even read again
        assert "corrupt object(s)" in node_log(cluster)
    finally:
        keys.store.close()


def test_the_first_read_after_ready_restores_every_object_the_master_listed_on_ssd(cluster):
    """A graceful restart keeps every object whose SSD replica the master listed before
    the stop, and the node says READY only once it has registered them all: one get of
    every key, sent the moment the restart returns, restores each byte-exact."""
    keys = Keys(cluster, "ready")
    try:
        keys.write_all()  # waits for the master's SSD listing
        cluster.restart_storage_node(0)
        keys.fresh()
        rows = list(range(KEYS))
        starts = [p * PAGE for p in range(KEYS * PAGES_PER_KEY)]
        P.wipe_pages(keys.kv, starts)
        hits = keys.store.batch_get_v1(keys.names, keys.slots(rows))
        assert hits == [True] * KEYS, keys.evidence()
        assert [P.page_bytes(keys.kv, s) for s in starts] == keys.expected
    finally:
        keys.store.close()


@pytest.mark.parametrize("stop_wait_s", [None, 0.0], ids=["default", "control-no-wait"])
def test_a_graceful_restart_the_moment_the_puts_return_keeps_every_object(
    tmp_path: Path, stop_wait_s: float | None
):
    """Issue 49's loss: a node stopped before its offload heartbeat had written (or
    registered) what it accepted lost those objects, as the master refuses a disk
    replica registered after the stop unmounted the segment. The stop now waits for
    them; its control stops at once and must lose some."""
    waits = {} if stop_wait_s is None else {"MOONCAKE_SPAN_SSD_STOP_WAIT_S": "0"}
    with LocalCluster(node_with_ssd(tmp_path, env_overrides=waits)) as started:
        keys = Keys(started, "stopped")
        try:
            keys.write_all(wait_on_disk=False)
            started.restart_storage_node(0)
            keys.fresh()
            missed, wrong = missed_and_wrong(keys)
            assert wrong == []
            if stop_wait_s is None:
                assert missed == [], keys.evidence()
                assert "offloads written" in node_log(started)
            else:
                assert missed, (
                    "stopped at once, yet every object was on disk: the case proves nothing"
                )
        finally:
            keys.store.close()


@pytest.mark.parametrize("stop_wait_s", [None, "0"], ids=["default", "control-no-wait"])
def test_a_serving_rank_closed_the_moment_its_puts_return_finds_them_on_its_own_tier(
    tmp_path: Path, stop_wait_s: str | None
):
    """The same for a serving rank's own tier (sglang's ``enable_ssd_offload``): its
    close lets the offloads finish before it unmounts, and the next rank process on
    the same directory restores every key."""
    import json
    import os
    import sys

    from mooncake_span.store.ssd_tier import STOP_WAIT_ENV
    from tests.integration import ssd_rank_process as R

    spec = ClusterSpec(master_extra_args=("--enable_offload=true",), log_dir=tmp_path / "logs")
    with LocalCluster(spec) as started:
        env = {
            **os.environ,
            **started.client_env(),
            R.CLIENT_CONFIG_ENV: json.dumps(started.client_config()),
            R.DIRECTORY_ENV: str(tmp_path / "ssd"),
        }
        if stop_wait_s is not None:
            env[STOP_WAIT_ENV] = stop_wait_s
        runs = {
            role: subprocess.run(
                [sys.executable, "-m", "tests.integration.ssd_rank_process", role],
                env=env,
                capture_output=True,
                text=True,
                timeout=180,
            )
            for role in ("write", "read")
        }
    for role, run in runs.items():
        assert run.returncode == 0, f"{role}: {run.stderr[-3000:]}"
    (line,) = [x for x in runs["read"].stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    assert result["wrong"] == []
    if stop_wait_s is None:
        assert result["missed"] == [], runs["read"].stderr[-3000:]
    else:
        assert result["missed"], "closed at once, yet every object was on disk: proves nothing"


def test_torn_files_are_not_offered_after_one_failed_read_nor_after_a_restart(cluster):
    keys = Keys(cluster, "torn")
    try:
        keys.write_all()
        cluster.restart_storage_node(0)
        torn = [0, 5]
        for row in torn:
            tear(keys.bucket(row))
        keys.fresh()
        assert all(keys.offered())  # Mooncake registered them whole
        hits, exact = keys.read_each()
        assert wrong_rows(keys, hits, exact) == []
        assert [i for i in range(KEYS) if not hits[i]] == torn
        failures = keys.store.client.stats()["integrity_failures"]
        assert failures == {"FILE_READ_FAIL": len(torn)}, failures
        keys.fresh()  # another reader, nothing remembered: the master no longer has them
        assert [i for i, o in enumerate(keys.offered()) if not o] == torn
        keys.store.close()
        cluster.restart_storage_node(0)
        keys.store = keys.backend()
        assert [i for i, o in enumerate(keys.offered()) if not o] == torn
        assert "torn" in node_log(cluster)
    finally:
        keys.store.close()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB filesystem (tmpfs; needs root)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a 64 MiB tmpfs: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_64mib_directory_with_a_1gb_cap_is_refused_naming_the_usable_capacity(
    small_disk, tmp_path
):
    spec = ClusterSpec(
        storage_nodes=1,
        storage_node_segment_bytes=SEGMENT_BYTES,
        ssd_dir=small_disk,
        ssd_size_bytes="1gb",
        log_dir=tmp_path / "logs",
    )
    with pytest.raises(ClusterStartError, match=r"has 0 bytes usable.*256 MiB reserve"):
        LocalCluster(spec).start()
    assert list(small_disk.iterdir()) == []  # nothing created
