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
   replica the master listed before the stop (what the restart promises).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mooncake_span.ops.cluster import ClusterSpec, LocalCluster
from mooncake_span.ops.launcher import ClusterStartError
from mooncake_span.ops.master_http import get_text, iter_lines
from mooncake_span_tools.testing import pools as P
from tests.conftest import require_mooncake
from tests.span_helpers import make_storage_config, register_pools, slots_of

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

PAGE = 64
PAGES_PER_KEY = 4
MLA = {"layers": 8, "kv_lora_rank": 240, "rope_dim": 16}  # 256 KiB pages, 1 MiB keys
SEGMENT_BYTES = 16 << 20
KEYS = 8
OFFLOAD_WAIT_S = 60.0  # bound of the wait for the 1 s heartbeat to write every object
MASTER_HTTP_TIMEOUT_S = 10.0


@pytest.fixture(autouse=True)
def _needs_mooncake() -> None:
    require_mooncake()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    (tmp_path / "ssd").mkdir()
    spec = ClusterSpec(
        storage_nodes=1,
        storage_node_segment_bytes=SEGMENT_BYTES,
        ssd_dir=tmp_path / "ssd",
        ssd_size_bytes="256mb",
        # The opt-in full check: the corrupt-key case needs the start-up scan that reads
        # seals (the default size check leaves rot to the read; test_ssd_defaults.py).
        ssd_check="full",
        log_dir=tmp_path / "logs",
    )
    with LocalCluster(spec) as started:
        yield started


class Keys:
    """``KEYS`` span keys of random bytes, written through one backend."""

    def __init__(self, cluster: LocalCluster, namespace: str, **options: Any) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.options = options
        self.kv = P.build_mla_host("page_first", host_pages=KEYS * PAGES_PER_KEY, **MLA)
        self.names = [f"{namespace}-{i}" for i in range(KEYS)]
        starts = [p * PAGE for p in range(KEYS * PAGES_PER_KEY)]
        P.fill_random_pages(self.kv, starts, seed=43)
        self.expected = [P.page_bytes(self.kv, s) for s in starts]
        self.store = self.backend()

    def backend(self) -> Any:
        from sglang.srt.mem_cache.hicache_storage import PoolName

        from mooncake_span.sglang_backend import MooncakeSpanStore

        config = {
            **self.cluster.client_config(),
            "storage_page_size": PAGE * PAGES_PER_KEY,
            "span_lost_key_ttl_s": 1.0,
            **self.options,
        }
        store = MooncakeSpanStore(make_storage_config(config, model_name=self.namespace), {})
        register_pools(store, {PoolName.KV: self.kv})
        return store

    def fresh(self) -> None:
        """A new backend (as after a serving process restart): nothing remembered."""
        self.store.close()
        self.store = self.backend()

    def slots(self, rows: list[int]) -> Any:
        return slots_of([r * PAGES_PER_KEY + p for r in rows for p in range(PAGES_PER_KEY)], PAGE)

    def write_all(self) -> None:
        """Every key, again while Mooncake refuses some (each copy stays pinned in
        DRAM until the offload heartbeat has written it)."""
        pending = list(range(KEYS))
        deadline = time.monotonic() + 60.0
        while pending:
            assert time.monotonic() < deadline, f"{len(pending)} keys never stored"
            batch, pending = pending[:2], pending[2:]
            ok = self.store.batch_set_v1([self.names[r] for r in batch], self.slots(batch))
            failed = [r for r, good in zip(batch, ok, strict=True) if not good]
            if failed:
                pending += failed
                time.sleep(0.5)
        self.wait_on_disk()

    def wait_on_disk(self) -> None:
        """Until the master lists an SSD replica of every key's object and its ``.bucket``
        file is there: what a graceful restart keeps (docs/reliability.md). A complete
        ``.bucket`` file alone is not that: Mooncake writes its ``.meta`` and registers
        the replica after it."""
        deadline = time.monotonic() + OFFLOAD_WAIT_S
        while True:
            files = self._bucket_files()
            listed = self.disk_listed()
            missing = [n for n in self.names if not (files[n] and listed.get(n))]
            if not missing:
                return
            assert time.monotonic() < deadline, f"never on disk: {missing}; {self.evidence()}"
            time.sleep(0.1)

    def object_keys(self) -> dict[str, list[str]]:
        """Per key name, the object keys the master holds for it."""
        listed = iter_lines(f"{self.cluster.metrics_url}/get_all_keys", MASTER_HTTP_TIMEOUT_S)
        found: dict[str, list[str]] = {name: [] for name in self.names}
        for key in listed:
            for name in self.names:
                if f"_{name}_" in key:
                    found[name].append(key)
        return found

    def disk_listed(self) -> dict[str, bool]:
        """Per key name: the master lists an SSD replica of each of its objects."""
        objects = self.object_keys()
        keys = [k for ks in objects.values() for k in ks]
        on_disk: dict[str, bool] = {}
        for start in range(0, len(keys), 32):  # the keys travel in the URL
            chunk = urllib.parse.quote(",".join(keys[start : start + 32]))
            url = f"{self.cluster.metrics_url}/batch_query_keys?keys={chunk}"
            for key, item in json.loads(get_text(url, MASTER_HTTP_TIMEOUT_S))["data"].items():
                on_disk[key] = bool((item or {}).get("local_disk_values"))
        return {n: bool(ks) and all(on_disk.get(k) for k in ks) for n, ks in objects.items()}

    def evidence(self) -> str:
        """What a failed expectation is read against: the master's SSD listing, the
        files, the reader's counters and the node's last log lines."""
        files = {n: [(p.name, b) for p, b in f] for n, f in self._bucket_files().items()}
        stats = self.store.client.stats()
        counters = {k: stats.get(k) for k in ("error_counts", "integrity_failures")}
        log = _node_log(self.cluster).splitlines()[-40:]
        return (
            f"master lists on SSD: {self.disk_listed()}; bucket files: {files}; "
            f"reader: {counters}; node log tail:\n" + "\n".join(log)
        )

    def _bucket_files(self) -> dict[str, list[tuple[Path, int]]]:
        """Per key, the ``.bucket`` files whose head names it, with their sizes in bytes."""
        found: dict[str, list[tuple[Path, int]]] = {name: [] for name in self.names}
        for path in self.cluster.node_ssd_dir(0).glob("*.bucket"):
            try:
                with open(path, "rb") as file:
                    head, size = file.read(512), os.fstat(file.fileno()).st_size
            except FileNotFoundError:  # renamed or removed since the listing
                continue
            for name in self.names:
                if f"_{name}_".encode() in head:
                    found[name].append((path, size))
        return found

    def read_each(self) -> tuple[list[bool], list[bool]]:
        """(hit, exact) per key, one key per get; the host pages are wiped first."""
        hits, exact = [], []
        for r in range(KEYS):
            starts = [(r * PAGES_PER_KEY + p) * PAGE for p in range(PAGES_PER_KEY)]
            P.wipe_pages(self.kv, starts)
            hits += self.store.batch_get_v1([self.names[r]], self.slots([r]))
            exact.append(
                all(
                    P.page_bytes(self.kv, s) == self.expected[r * PAGES_PER_KEY + p]
                    for p, s in enumerate(starts)
                )
            )
        return hits, exact

    def offered(self) -> list[bool]:
        """Per key, whether a hit query offers it (one key per query: no prefix clamp)."""
        return [self.store.batch_exists([name]) == 1 for name in self.names]

    def bucket(self, row: int) -> Path:
        """The ``.bucket`` file holding key ``row``'s object."""
        found = [path for path, _ in self._bucket_files()[self.names[row]]]
        assert len(found) == 1, (self.names[row], found)
        return found[0]


def _wrong(keys: Keys, hits: list[bool], exact: list[bool]) -> list[str]:
    return [keys.names[i] for i in range(KEYS) if hits[i] and not exact[i]]


def _rot(path: Path) -> None:
    """Flip 4 bytes in the middle of the object (past the key at the file's start)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for at in range(middle, middle + 4):
        data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _tear(path: Path) -> None:
    with open(path, "r+b") as file:
        file.truncate(os.path.getsize(path) // 3)


ROTTED = [1, 4, 6]


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
                _rot(keys.bucket(row))
        sealed.fresh()
        plain.fresh()
        hits, exact = sealed.read_each()
        assert _wrong(sealed, hits, exact) == []
        assert [i for i in range(KEYS) if not hits[i]] == ROTTED, sealed.evidence()
        assert sealed.store.client.stats()["integrity_failures"] == {"SEAL_MISMATCH": len(ROTTED)}
        assert [i for i, o in enumerate(sealed.offered()) if not o] == ROTTED  # removed
        # Negative control: the same rot without the check is restored as a hit.
        hits, exact = plain.read_each()
        assert all(hits)
        assert [plain.names.index(n) for n in _wrong(plain, hits, exact)] == ROTTED
    finally:
        sealed.store.close()
        plain.store.close()


def test_a_corrupt_key_caught_before_a_restart_stays_gone_after_it(cluster):
    keys = Keys(cluster, "caught")
    try:
        keys.write_all()
        cluster.restart_storage_node(0)
        for row in ROTTED:
            _rot(keys.bucket(row))
        keys.fresh()
        hits, exact = keys.read_each()
        assert _wrong(keys, hits, exact) == []
        assert [i for i in range(KEYS) if not hits[i]] == ROTTED, keys.evidence()
        keys.store.close()
        cluster.restart_storage_node(0)
        keys.store = keys.backend()
        assert [i for i, o in enumerate(keys.offered()) if not o] == ROTTED, keys.evidence()
        hits, exact = keys.read_each()
        assert _wrong(keys, hits, exact) == []
        assert [i for i in range(KEYS) if not hits[i]] == ROTTED, keys.evidence()
        assert keys.store.client.stats()["integrity_failures"] == {}  # not even read again
        assert "corrupt object(s)" in _node_log(cluster)
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


def test_torn_files_are_not_offered_after_one_failed_read_nor_after_a_restart(cluster):
    keys = Keys(cluster, "torn")
    try:
        keys.write_all()
        cluster.restart_storage_node(0)
        torn = [0, 5]
        for row in torn:
            _tear(keys.bucket(row))
        keys.fresh()
        assert all(keys.offered())  # Mooncake registered them whole
        hits, exact = keys.read_each()
        assert _wrong(keys, hits, exact) == []
        assert [i for i in range(KEYS) if not hits[i]] == torn
        failures = keys.store.client.stats()["integrity_failures"]
        assert failures == {"FILE_READ_FAIL": len(torn)}, failures
        keys.fresh()  # another reader, nothing remembered: the master no longer has them
        assert [i for i, o in enumerate(keys.offered()) if not o] == torn
        keys.store.close()
        cluster.restart_storage_node(0)
        keys.store = keys.backend()
        assert [i for i, o in enumerate(keys.offered()) if not o] == torn
        assert "torn" in _node_log(cluster)
    finally:
        keys.store.close()


def _node_log(cluster: LocalCluster) -> str:
    return "\n".join(p.read_text(errors="replace") for p in cluster.log_dir.glob("node0*"))


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
