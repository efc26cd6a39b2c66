"""SSD-tier test keys: span keys of random bytes written through one backend (real
sglang host pools, K=4 MLA, 1 MiB keys) onto a real storage node with ``--ssd-dir``,
and the ways a disk spoils them (rot, a torn file). Shared by the SSD integrity tests."""

from __future__ import annotations

import json
import os
import time
import urllib.parse
from pathlib import Path
from typing import Any

from mooncake_span.ops.cluster import ClusterSpec, LocalCluster
from mooncake_span.ops.master_http import get_text, iter_lines
from mooncake_span_tools.testing import pools as P
from tests.span_helpers import make_storage_config, register_pools, slots_of

PAGE = 64
PAGES_PER_KEY = 4
MLA = {"layers": 8, "kv_lora_rank": 240, "rope_dim": 16}  # 256 KiB pages, 1 MiB keys
SEGMENT_BYTES = 16 << 20
KEYS = 8
OFFLOAD_WAIT_S = 60.0  # bound of the wait for the 1 s heartbeat to write every object
MASTER_HTTP_TIMEOUT_S = 10.0


def node_with_ssd(tmp_path: Path, **fields: Any) -> ClusterSpec:
    """One storage node with an SSD tier under ``tmp_path``."""
    (tmp_path / "ssd").mkdir(exist_ok=True)
    return ClusterSpec(
        storage_nodes=1,
        storage_node_segment_bytes=SEGMENT_BYTES,
        ssd_dir=tmp_path / "ssd",
        ssd_size_bytes="256mb",
        log_dir=tmp_path / "logs",
        **fields,
    )


class Keys:
    """``KEYS`` span keys of random bytes, written through one backend."""

    def __init__(
        self, cluster: LocalCluster, namespace: str, seed: int = 43, **options: Any
    ) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.options = options
        self.kv = P.build_mla_host("page_first", host_pages=KEYS * PAGES_PER_KEY, **MLA)
        self.names = [f"{namespace}-{i}" for i in range(KEYS)]
        starts = [p * PAGE for p in range(KEYS * PAGES_PER_KEY)]
        P.fill_random_pages(self.kv, starts, seed=seed)
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

    def write_all(self, wait_on_disk: bool = True) -> None:
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
        if wait_on_disk:
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
        log = node_log(self.cluster).splitlines()[-40:]
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


def wrong_rows(keys: Keys, hits: list[bool], exact: list[bool]) -> list[str]:
    return [keys.names[i] for i in range(KEYS) if hits[i] and not exact[i]]


def rot(path: Path) -> None:
    """Flip 4 bytes in the middle of the object (past the key at the file's start)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for at in range(middle, middle + 4):
        data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def tear(path: Path) -> None:
    with open(path, "r+b") as file:
        file.truncate(os.path.getsize(path) // 3)


ROTTED = [1, 4, 6]


def node_log(cluster: LocalCluster) -> str:
    return "\n".join(p.read_text(errors="replace") for p in cluster.log_dir.glob("node0*"))


def missed_and_wrong(keys: Keys) -> tuple[list[int], list[int]]:
    """(rows missed, rows hit with wrong bytes) of one ``read_each``."""
    hits, exact = keys.read_each()
    missed = [i for i in range(KEYS) if not hits[i]]
    return missed, [i for i in range(KEYS) if hits[i] and not exact[i]]
