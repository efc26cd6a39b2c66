"""The SSD tier with default settings: a real master, a real storage node with
``--ssd-dir``, the backend with real sglang host pools (K=4 MLA, 1 MiB keys),
and no ``span_object_checksums`` in the client config (``cluster up`` prints
none any more).

1. rot after a restart misses, 0 wrong bytes: the client sealed without being
   told, because the node published the cluster's SSD-tier marker
   (store/ssd_marker.py); the negative control, a client that turned seals and
   the guard off, is served the same rot as wrong bytes;
2. ``span_object_checksums: false`` on that cluster is refused in one line;
3. the node's check is metadata only by default (a torn file is deleted at
   the next start, a rotted one kept and still never served), and
   ``MOONCAKE_SPAN_SSD_CHECK`` reaches the node ``LocalCluster`` starts
   (``full`` deletes the rotted file), under ``ssd_check`` when both are set.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mooncake_span.errors import ConfigError
from mooncake_span.ops.cluster import ClusterSpec, LocalCluster
from mooncake_span.store.ssd_marker import MARKER_KEY
from mooncake_span_tools.testing import pools as P
from tests.conftest import require_mooncake
from tests.span_helpers import make_storage_config, register_pools, slots_of

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

PAGE = 64
PAGES_PER_KEY = 4
MLA = {"layers": 8, "kv_lora_rank": 240, "rope_dim": 16}  # 256 KiB pages, 1 MiB keys
SEGMENT_BYTES = 16 << 20
KEYS = 8
ROTTED = [1, 4, 6]
TORN = [2]
OFFLOAD_WAIT_S = 60.0


@pytest.fixture(autouse=True)
def _needs_mooncake() -> None:
    require_mooncake()


def _cluster(tmp_path: Path, **spec: Any) -> LocalCluster:
    (tmp_path / "ssd").mkdir(exist_ok=True)
    return LocalCluster(
        ClusterSpec(
            storage_nodes=1,
            storage_node_segment_bytes=SEGMENT_BYTES,
            ssd_dir=tmp_path / "ssd",
            ssd_size_bytes="256mb",
            log_dir=tmp_path / "logs",
            **spec,
        )
    )


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with _cluster(tmp_path) as started:
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
        P.fill_random_pages(self.kv, starts, seed=47)
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
        self.store.close()
        self.store = self.backend()

    def slots(self, rows: list[int]) -> Any:
        return slots_of([r * PAGES_PER_KEY + p for r in rows for p in range(PAGES_PER_KEY)], PAGE)

    def write_all(self) -> None:
        """Every key, again while Mooncake refuses some, then until each is on disk."""
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
        key_bytes = len(self.expected[0]) * PAGES_PER_KEY
        deadline = time.monotonic() + OFFLOAD_WAIT_S
        while [n for n in self.names if not self._bucket(n, key_bytes)]:
            assert time.monotonic() < deadline, "never written to disk"
            time.sleep(0.1)

    def _bucket(self, name: str, at_least: int = 0) -> Path | None:
        for path in self.cluster.node_ssd_dir(0).glob("*.bucket"):
            try:
                with open(path, "rb") as file:
                    head, size = file.read(512), os.fstat(file.fileno()).st_size
            except FileNotFoundError:
                continue
            if f"_{name}_".encode() in head and size >= at_least:
                return path
        return None

    def bucket(self, row: int) -> Path:
        found = self._bucket(self.names[row])
        assert found is not None, self.names[row]
        return found

    def read_each(self) -> tuple[list[int], list[int]]:
        """(rows missed, rows hit with wrong bytes), one key per get, pages wiped first."""
        missed, wrong = [], []
        for r in range(KEYS):
            starts = [(r * PAGES_PER_KEY + p) * PAGE for p in range(PAGES_PER_KEY)]
            P.wipe_pages(self.kv, starts)
            hit = self.store.batch_get_v1([self.names[r]], self.slots([r]))[0]
            exact = all(
                P.page_bytes(self.kv, s) == self.expected[r * PAGES_PER_KEY + p]
                for p, s in enumerate(starts)
            )
            if not hit:
                missed.append(r)
            elif not exact:
                wrong.append(r)
        return missed, wrong


def _rot(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for at in range(len(data) // 2, len(data) // 2 + 4):
        data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _tear(path: Path) -> None:
    with open(path, "r+b") as file:
        file.truncate(os.path.getsize(path) // 3)


def _node_log(cluster: LocalCluster) -> str:
    return "\n".join(p.read_text(errors="replace") for p in cluster.log_dir.glob("node0*"))


def test_rot_after_a_restart_misses_with_default_settings_and_is_served_without_seals(cluster):
    assert "span_object_checksums" not in cluster.client_config()
    default = Keys(cluster, "default")
    unsealed = Keys(cluster, "unsealed", span_object_checksums=False, span_layout_guard="off")
    try:
        assert default.store.client.options.object_checksums is True
        default.write_all()
        unsealed.write_all()
        cluster.restart_storage_node(0)  # graceful: every object comes back from disk only
        for keys in (default, unsealed):
            for row in ROTTED:
                _rot(keys.bucket(row))
            keys.fresh()
        assert default.read_each() == (ROTTED, [])
        assert default.store.client.stats()["integrity_failures"] == {"SEAL_MISMATCH": 3}
        # Negative control: without seals the same rot is a hit with wrong bytes.
        assert unsealed.read_each() == ([], ROTTED)
    finally:
        default.store.close()
        unsealed.store.close()


def test_a_client_that_would_not_seal_is_refused_in_one_line(cluster):
    with pytest.raises(ConfigError, match="span_object_checksums is false but") as refused:
        Keys(cluster, "refused", span_object_checksums=False)
    assert "\n" not in str(refused.value) and MARKER_KEY in str(refused.value)


def test_the_default_check_reads_metadata_only_and_rot_is_still_never_served(cluster):
    keys = Keys(cluster, "meta")
    try:
        keys.write_all()
        keys.store.close()
        cluster.restart_storage_node(0)
        for row in ROTTED:
            _rot(keys.bucket(row))
        for row in TORN:
            _tear(keys.bucket(row))
        cluster.restart_storage_node(0)  # the size check: the torn file goes, rot stays
        log = _node_log(cluster)
        assert "SSD check size (from the default)" in log
        assert "deleted 1 torn and 0 corrupt" in log
        assert all(keys._bucket(keys.names[r]) for r in ROTTED)
        assert keys._bucket(keys.names[TORN[0]]) is None
        keys.store = keys.backend()
        assert keys.read_each() == (sorted(ROTTED + TORN), [])
    finally:
        keys.store.close()


def test_the_environment_reaches_the_node_and_the_flag_wins_over_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MOONCAKE_SPAN_SSD_CHECK", "full")
    with _cluster(tmp_path) as cluster:
        keys = Keys(cluster, "envcheck")
        try:
            keys.write_all()
            keys.store.close()
            cluster.restart_storage_node(0)
            for row in ROTTED:
                _rot(keys.bucket(row))
            cluster.restart_storage_node(0)
            log = _node_log(cluster)
            assert "SSD check full (from MOONCAKE_SPAN_SSD_CHECK)" in log
            assert "deleted 0 torn and 3 corrupt" in log
            assert not any(keys._bucket(keys.names[r]) for r in ROTTED)
        finally:
            keys.store.close()
    with _cluster(tmp_path, ssd_check="off") as cluster:
        assert "SSD check off (from --ssd-check)" in _node_log(cluster)
