"""Fixtures and the content oracle shared by the fault-matrix tests.

* ``fault_cluster`` starts a private ``LocalCluster`` per test (tests here kill
  masters and storage nodes, which must never touch the shared session
  cluster) and checks after ``stop()`` that none of its processes is left.
* ``oracle_factory`` builds a ``MooncakeSpanStore`` over real sglang DSA host
  pools (MLA KV anchor + INDEXER sidecar) wrapped in a ``SpanOracle``: every
  write fills the key's host pages with fresh random bytes and remembers their
  digest; every read restores into other, zeroed host pages and compares the
  digest of each key the backend reported True. A True whose bytes differ is a
  *corrupt restore*; every test requires zero.
* ``figures`` collects what a test measured, prints it and writes it as JSON to
  ``tmp_path/figures.json`` (and to ``$MOONCAKE_SPAN_FIGURES_DIR`` when set, which
  is how docs/reliability.md gets its numbers).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from mooncake_span.ops.cluster import ClusterSpec, LocalCluster
from tests.span_helpers import make_storage_config, register_pools

FIGURES_DIR_ENV = "MOONCAKE_SPAN_FIGURES_DIR"
HOST_PAGE_TOKENS = 64  # DSA host pages are always 64 tokens

T = TypeVar("T")


# ---------------------------------------------------------------------------
# polling


def poll(
    predicate: Callable[[], T],
    timeout_s: float,
    *,
    interval_s: float = 0.1,
    what: str = "condition",
) -> T:
    """Call ``predicate`` until it returns something truthy; TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} not reached within {timeout_s:.1f}s")
        time.sleep(interval_s)


def _pid_alive(pid: int) -> bool:
    """True for a running process; zombies and vanished pids count as gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


# ---------------------------------------------------------------------------
# figures


class FigureLog:
    """What one test measured: printed and written as JSON at teardown (and on ``emit``)."""

    def __init__(self, name: str, path: Path) -> None:
        self.name = name
        self.path = path
        self.values: dict[str, Any] = {}

    def update(self, **values: Any) -> None:
        self.values.update(values)

    def emit(self) -> None:
        text = json.dumps({"test": self.name, **self.values}, indent=2, sort_keys=True, default=str)
        print(f"\n[figures] {self.name}\n{text}")
        self.path.write_text(text + "\n", encoding="utf-8")
        out_dir = os.environ.get(FIGURES_DIR_ENV)
        if out_dir:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.name)
            (Path(out_dir) / f"{safe}.json").write_text(text + "\n", encoding="utf-8")


@pytest.fixture
def figures(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FigureLog]:
    log = FigureLog(request.node.name, tmp_path / "figures.json")
    yield log
    log.emit()


# ---------------------------------------------------------------------------
# private clusters


@pytest.fixture
def fault_cluster(tmp_path: Path) -> Iterator[Callable[..., LocalCluster]]:
    """``start(**ClusterSpec fields)`` -> a running private LocalCluster.

    Teardown stops every cluster started and fails the test if one of their
    processes survived ``stop()``.
    """
    clusters: list[LocalCluster] = []

    def start(**spec_fields: Any) -> LocalCluster:
        spec_fields.setdefault("log_dir", tmp_path / f"cluster{len(clusters)}")
        cluster = LocalCluster(ClusterSpec(**spec_fields))
        clusters.append(cluster)
        return cluster.start()

    yield start
    seen: set[int] = set()
    for cluster in clusters:
        if cluster.started:
            seen.update(cluster.pids().values())
        cluster.stop()
    left = sorted(pid for pid in seen if _pid_alive(pid))
    assert not left, f"cluster processes still running after stop(): {left}"


# ---------------------------------------------------------------------------
# call log and content oracle


@dataclass
class CallLog:
    """Every backend call a test made: operation and wall time (thread-safe)."""

    calls: list[tuple[str, float]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, op: str, seconds: float) -> None:
        with self.lock:
            self.calls.append((op, seconds))

    def timed(self, op: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, its wall time recorded under ``op`` even when it raises."""
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.record(op, time.perf_counter() - started)

    def mark(self) -> int:
        with self.lock:
            return len(self.calls)

    def since(self, mark: int) -> list[tuple[str, float]]:
        with self.lock:
            return list(self.calls[mark:])

    @staticmethod
    def summary(calls: Sequence[tuple[str, float]]) -> dict[str, Any]:
        return {
            "calls": len(calls),
            "max_call_s": round(max((s for _, s in calls), default=0.0), 3),
        }


def _digest(chunks: Sequence[bytes]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


class SpanOracle:
    """A ``MooncakeSpanStore`` plus the bytes each key should hold.

    Writes go through ``batch_set_v2`` (indexer, slots taken from KV) then
    ``batch_set_v1`` (KV), reads through ``batch_get_v1`` then ``batch_get_v2``,
    as sglang's controller issues them. Each storage key covers
    ``pages_per_key`` 64-token host pages. Reads land in host pages other than
    the ones written (reversed order), zeroed first, so a True without a real
    transfer shows up as a digest mismatch.
    """

    def __init__(self, store: Any, pools: Any, pages_per_key: int, log: CallLog) -> None:
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

        from mooncake_span_tools.testing import pools as P

        self._P = P
        self._PoolName = PoolName
        self._PoolTransfer = PoolTransfer
        self.store = store
        self.kv = pools.kv
        self.indexer = pools.indexer
        self.k = pages_per_key
        self.log = log
        self.host_pages = self.kv.size // HOST_PAGE_TOKENS
        self.capacity_keys = self.host_pages // pages_per_key
        self.expected: dict[tuple[str, str], str] = {}
        self.corrupt: list[str] = []
        self.restored_keys = 0
        self.lock = threading.Lock()

    # -- plumbing ------------------------------------------------------------

    def _pages(self, n_keys: int, *, reverse: bool) -> list[int]:
        if n_keys > self.capacity_keys:
            raise ValueError(
                f"{n_keys} keys exceed the oracle's {self.capacity_keys}-key host pool"
            )
        pages = list(range(n_keys * self.k))
        return [self.host_pages - 1 - p for p in pages] if reverse else pages

    def _slots(self, pages: Sequence[int]) -> Any:
        import torch

        return torch.cat(
            [torch.arange(p * HOST_PAGE_TOKENS, (p + 1) * HOST_PAGE_TOKENS) for p in pages]
        )

    def _key_digest(self, pool: Any, pages: Sequence[int]) -> str:
        return _digest([self._P.page_bytes(pool, p * HOST_PAGE_TOKENS) for p in pages])

    def _remember(self, name: str, key: str, digest: str) -> None:
        with self.lock:
            old = self.expected.setdefault((name, key), digest)
        if old != digest:
            raise ValueError(f"test bug: key {key} written twice with different {name} bytes")

    def _check(self, name: str, key: str, digest: str) -> bool:
        with self.lock:
            want = self.expected.get((name, key))
            if want == digest:
                return True
            self.corrupt.append(
                f"{name}:{key} " + ("never written" if want is None else "bytes differ")
            )
            return False

    def adopt(self, other: SpanOracle) -> None:
        """Take over another oracle's expected digests (a reader of someone else's keys)."""
        with self.lock, other.lock:
            self.expected.update(other.expected)

    # -- operations ------------------------------------------------------------

    def fill(self, keys: Sequence[str], seed: int) -> Any:
        """Random bytes into the host pages of ``keys``; remembers their digests."""
        pages = self._pages(len(keys), reverse=False)
        starts = [p * HOST_PAGE_TOKENS for p in pages]
        self._P.fill_random_pages(self.kv, starts, seed=seed)
        self._P.fill_random_pages(self.indexer, starts, seed=seed + 1_000_003)
        for i, key in enumerate(keys):
            own = pages[i * self.k : (i + 1) * self.k]
            self._remember("kv", key, self._key_digest(self.kv, own))
            self._remember("indexer", key, self._key_digest(self.indexer, own))
        return self._slots(pages)

    def write(self, keys: Sequence[str], seed: int) -> list[bool]:
        """Back up ``keys`` (fresh random bytes from ``seed``); per key, both pools True."""
        keys = list(keys)
        slots = self.fill(keys, seed)
        PoolName, PoolTransfer = self._PoolName, self._PoolTransfer
        sidecar = self.log.timed(
            "batch_set_v2",
            self.store.batch_set_v2,
            [
                PoolTransfer(
                    PoolName.INDEXER, host_indices=slots, keys=keys, indices_from_pool=PoolName.KV
                )
            ],
        )
        kv = self.log.timed("batch_set_v1", self.store.batch_set_v1, keys, slots)
        idx = sidecar.get(PoolName.INDEXER, [False] * len(keys))
        assert len(kv) == len(keys) and len(idx) == len(keys), (kv, idx)
        return [bool(a) and bool(b) for a, b in zip(kv, idx, strict=True)]

    def read(self, keys: Sequence[str], *, single: bool = False) -> list[bool]:
        """Restore ``keys``; per key True when both pools were reported restored.

        Every reported-True pool page is compared with the written bytes; a
        mismatch is recorded in ``corrupt``. ``single`` reads one key per call,
        so one missing key does not clamp the keys after it.
        """
        keys = list(keys)
        if single:
            return [flag for key in keys for flag in self.read([key])]
        pages = self._pages(len(keys), reverse=True)
        starts = [p * HOST_PAGE_TOKENS for p in pages]
        self._P.wipe_pages(self.kv, starts)
        self._P.wipe_pages(self.indexer, starts)
        slots = self._slots(pages)
        PoolName, PoolTransfer = self._PoolName, self._PoolTransfer
        kv = self.log.timed("batch_get_v1", self.store.batch_get_v1, keys, slots)
        sidecar = self.log.timed(
            "batch_get_v2",
            self.store.batch_get_v2,
            [PoolTransfer(PoolName.INDEXER, host_indices=slots, keys=keys)],
        )
        idx = sidecar.get(PoolName.INDEXER, [False] * len(keys))
        assert len(kv) == len(keys) and len(idx) == len(keys), (kv, idx)
        out = []
        for i, key in enumerate(keys):
            own = pages[i * self.k : (i + 1) * self.k]
            kv_ok = bool(kv[i]) and self._check("kv", key, self._key_digest(self.kv, own))
            idx_ok = bool(idx[i]) and self._check(
                "indexer", key, self._key_digest(self.indexer, own)
            )
            out.append(kv_ok and idx_ok)
        with self.lock:
            self.restored_keys += sum(out)
        return out

    def hit(self, keys: Sequence[str]) -> int:
        """The backend's KV hit prefix (``batch_exists``), timed."""
        return self.log.timed("batch_exists", self.store.batch_exists, list(keys))

    def hit_v2(self, keys: Sequence[str]) -> Any:
        PoolName, PoolTransfer = self._PoolName, self._PoolTransfer
        return self.log.timed(
            "batch_exists_v2",
            self.store.batch_exists_v2,
            list(keys),
            [PoolTransfer(PoolName.INDEXER, keys=None, indices_from_pool=PoolName.KV)],
        )

    def object_presence(self, keys: Sequence[str]) -> list[tuple[bool, bool]]:
        """Per key: (KV objects all exist, indexer objects all exist), straight from Mooncake."""
        schema = self.store.key_schema
        out = []
        for key in keys:
            flags = []
            for name in ("kv", "indexer"):
                binding = self.store.pools[name]
                flags.append(
                    all(self.store.client.exists(schema.object_keys([key], binding.components)))
                )
            out.append((flags[0], flags[1]))
        return out


def build_dsa_pools(
    *,
    host_keys: int,
    pages_per_key: int,
    layers: int = 2,
    kv_lora_rank: int = 32,
    rope_dim: int = 16,
) -> Any:
    from mooncake_span_tools.testing import pools as P

    return P.build_dsa_pools(
        "page_first",
        layers=layers,
        host_pages=host_keys * pages_per_key,
        kv_lora_rank=kv_lora_rank,
        rope_dim=rope_dim,
        index_kpool=1,
    )


def open_span_store(
    client_config: dict[str, Any], pools: Any, *, pages_per_key: int, model_name: str, **extra: Any
) -> Any:
    """A MooncakeSpanStore registered like sglang does it: anchor, every pool v2, then done."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from mooncake_span.sglang_backend import MooncakeSpanStore

    config = dict(client_config)
    config["storage_page_size"] = HOST_PAGE_TOKENS * pages_per_key
    config.update(extra)
    store = MooncakeSpanStore(make_storage_config(config, model_name=model_name), {})
    try:
        register_pools(store, {PoolName.KV: pools.kv, PoolName.INDEXER: pools.indexer})
    except BaseException:
        store.close()
        raise
    return store


@pytest.fixture
def oracle_factory() -> Iterator[Callable[..., SpanOracle]]:
    """``make(cluster, model_name=..., pages_per_key=4, host_keys=8, log=None, **extra)``.

    ``extra`` goes into the extra-config (``span_*`` options). Every store is
    closed at teardown, before the private cluster fixture stops its cluster.
    """
    oracles: list[SpanOracle] = []

    def make(
        cluster: Any,
        *,
        model_name: str,
        pages_per_key: int = 4,
        host_keys: int = 8,
        log: CallLog | None = None,
        layers: int = 2,
        kv_lora_rank: int = 32,
        rope_dim: int = 16,
        **extra: Any,
    ) -> SpanOracle:
        pools = build_dsa_pools(
            host_keys=host_keys,
            pages_per_key=pages_per_key,
            layers=layers,
            kv_lora_rank=kv_lora_rank,
            rope_dim=rope_dim,
        )
        store = open_span_store(
            cluster.client_config(),
            pools,
            pages_per_key=pages_per_key,
            model_name=model_name,
            **extra,
        )
        oracle = SpanOracle(store, pools, pages_per_key, log or CallLog())
        oracles.append(oracle)
        return oracle

    yield make
    for oracle in oracles:
        oracle.store.close()


# ---------------------------------------------------------------------------
# network namespaces (partition tests; `require_netns` is in tests/conftest.py)


def wait_for_file(
    path: Path, timeout_s: float, *, alive: Callable[[], bool] = lambda: True
) -> Path:
    """Wait for ``path``; TimeoutError after ``timeout_s``, RuntimeError if ``alive()`` fails."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if not alive():
            raise RuntimeError(f"the process that should write {path.name} is gone")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:.0f}s")
        time.sleep(0.05)
    return path
