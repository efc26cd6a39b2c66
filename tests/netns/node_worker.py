"""One sglang node's L3 traffic, as a separate process: write, read, probe, failover.

Run inside a host of a ``mooncake_span_tools.lab.netns`` topology (or anywhere)::

    python -m tests.netns.node_worker write --master HOST:PORT \\
        --metadata http://HOST:PORT/metadata --requests 0-3
    python -m tests.netns.node_worker read  ... --requests 0-3

The worker builds REAL sglang host pools shaped like a compressed hybrid DSA
model (MLA KV anchor + DSA indexer with ``index_kpool=4`` + Mamba state;
64-token host pages, 256-token storage pages, so K=4 host pages per key) and
drives ``MooncakeSpanStore`` with the call sequence of sglang's
HybridCacheController:

* ``write``: per request ``batch_set_v2`` (indexer, plus the Mamba checkpoint
  at the request's last key) then ``batch_set_v1`` (KV);
* ``read``: ``batch_exists_v2`` (KV + indexer + Mamba hit query), then
  ``batch_get_v1`` + ``batch_get_v2`` (indexer) and, for a full hit,
  ``batch_get_v2`` (Mamba), into its own fresh pools at other host pages,
  and compares every byte;
* ``probe``: only start (connect, register pools, layout guard) and report;
  with ``--variant`` it starts several nodes one after the other instead,
  each with its own pools and client and some fields changed (layer count,
  storage page, guard mode ...), and reports each;
* ``failover``: write, then keep doing exists/get/set rounds while a master
  is killed, and report when calls fail and when they work again.

Content is a pure function of (seed, request tokens, page): a request's
tokens come from ``(seed, request id)`` (the first ``--shared-prefix-keys``
storage pages from ``seed`` alone, so several writers can share a prefix),
its keys are sglang's chained page hashes of those tokens, and each host page
holds bytes drawn from a generator seeded by (seed, pool, key, page index).
Any process can therefore verify what another one wrote, with no shared
memory; two writers of the same prefix write identical bytes, as two servers
computing the same prefix would.

Output: one JSON object on stdout (the last line); logs go to stderr. Exit
codes: 0 ok, 1 verification failed (mismatched bytes or incomplete writes),
2 bad arguments, 3 refused by the layout guard, 4 setup failed, 5 a marker
file did not appear in time. ``--exit sigkill`` flushes the JSON and then
kills the process with SIGKILL (no close, no atexit), ``--exit fast`` skips the
native client's teardown (``os._exit``), ``--exit close`` closes it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from mooncake_span.units import parse_size_bytes
from mooncake_span_tools.bench.timing import TimedProxy

logger = logging.getLogger(__name__)

HOST_PAGE_TOKENS = 64
INDEX_KPOOL = 4
MAMBA_LAYERS = 2
_POLL_INTERVAL_S = 0.05
# Writers released by one go file start within this much of each other.
_GO_POLL_INTERVAL_S = 0.002

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_USAGE = 2
EXIT_REFUSED = 3
EXIT_SETUP = 4
EXIT_MARKER_TIMEOUT = 5

_MODES = ("write", "read", "probe", "failover")
_EXIT_MODES = ("close", "fast", "sigkill")
_STARTED_WALL_S = time.time()
_DEFAULT_LOCAL_BUFFER_BYTES = 16 << 20


# ---------------------------------------------------------------------------
# configuration


def parse_request_ids(text: str) -> tuple[int, ...]:
    """``"0-3,10,12-13"`` -> (0, 1, 2, 3, 10, 12, 13); order kept, duplicates refused."""
    ids: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        first, sep, last = part.partition("-")
        try:
            lo = int(first)
            hi = int(last) if sep else lo
        except ValueError:
            raise ValueError(f"bad request range {part!r}: expected N or N-M") from None
        if lo < 0 or hi < lo:
            raise ValueError(f"bad request range {part!r}: need 0 <= N <= M")
        ids.extend(range(lo, hi + 1))
    if not ids:
        raise ValueError(f"no request ids in {text!r}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"request ids {text!r} repeat an id")
    return tuple(ids)


@dataclass(frozen=True)
class Geometry:
    """The model shape a node serves; the layout guard compares it across nodes."""

    model: str = "cluster-l3/glm-5.3-flash-like"
    layers: int = 4
    storage_page_tokens: int = HOST_PAGE_TOKENS * INDEX_KPOOL
    kv_lora_rank: int = 512
    rope_dim: int = 64
    layout: str = "page_first"

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must not be empty")
        for name in ("layers", "kv_lora_rank", "rope_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if (
            self.storage_page_tokens < HOST_PAGE_TOKENS
            or self.storage_page_tokens % HOST_PAGE_TOKENS
        ):
            raise ValueError(
                f"storage_page_tokens must be a positive multiple of the {HOST_PAGE_TOKENS}-token "
                f"host page, got {self.storage_page_tokens}"
            )
        if self.layout not in ("page_first", "page_first_direct"):
            # The DSA indexer host pool has no layer_first page metadata.
            raise ValueError(f"layout must be page_first or page_first_direct, got {self.layout!r}")

    @property
    def pages_per_key(self) -> int:
        return self.storage_page_tokens // HOST_PAGE_TOKENS


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one worker run does; built from the command line, validated here."""

    mode: str
    master: str
    metadata: str
    local_hostname: str
    segment_bytes: int = 0
    local_buffer_bytes: int = _DEFAULT_LOCAL_BUFFER_BYTES
    layout_guard: str = "store"
    layout_guard_etcd: str | None = None
    geometry: Geometry = field(default_factory=Geometry)
    seed: int = 0
    request_ids: tuple[int, ...] = (0, 1, 2, 3)
    keys_per_request: int = 4
    shared_prefix_keys: int = 0
    placement_seed: int = 1
    exit_mode: str = "close"
    wait_for: Path | None = None
    connected_file: Path | None = None
    go_file: Path | None = None
    ready_file: Path | None = None
    hold_file: Path | None = None
    marker_timeout_s: float = 120.0
    # failover mode
    kill_marker: Path | None = None
    round_interval_s: float = 0.2
    settle_s: float = 4.0
    failover_deadline_s: float = 60.0
    round_keys: int = 2
    # probe mode: nodes to start one after the other, e.g. ("layers=3", "")
    variants: tuple[str, ...] = ()
    # read mode: after the first pass, wait for this file and read again
    again_after: Path | None = None

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {self.mode!r}")
        if self.exit_mode not in _EXIT_MODES:
            raise ValueError(f"exit mode must be one of {_EXIT_MODES}, got {self.exit_mode!r}")
        if self.keys_per_request < 1:
            raise ValueError(f"keys_per_request must be >= 1, got {self.keys_per_request}")
        if not 0 <= self.shared_prefix_keys <= self.keys_per_request:
            raise ValueError(
                f"shared_prefix_keys must be in 0..keys_per_request ({self.keys_per_request}), "
                f"got {self.shared_prefix_keys}"
            )
        if self.segment_bytes < 0 or self.local_buffer_bytes <= 0:
            raise ValueError("segment_bytes must be >= 0 and local_buffer_bytes > 0")
        if self.mode == "failover" and self.kill_marker is None:
            raise ValueError(
                "failover mode needs --kill-marker (the file the test writes the kill time to)"
            )
        for name in ("marker_timeout_s", "round_interval_s", "settle_s", "failover_deadline_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.round_keys < 1:
            raise ValueError(f"round_keys must be >= 1, got {self.round_keys}")
        if self.variants and self.mode != "probe":
            raise ValueError("--variant is for probe mode only")
        if self.layout_guard not in ("off", "store", "etcd"):
            raise ValueError(f"layout_guard must be off, store or etcd, got {self.layout_guard!r}")
        if self.again_after is not None and self.mode != "read":
            raise ValueError("--again-after is for read mode only")
        for text in self.variants:
            node_variant(self, text)

    def extra_config(self) -> dict[str, Any]:
        """The sglang ``--hicache-storage-backend-extra-config`` this node would run with."""
        extra: dict[str, Any] = {
            "master_server_address": self.master,
            "metadata_server": self.metadata,
            "protocol": "tcp",
            "local_hostname": self.local_hostname,
            "global_segment_size": self.segment_bytes,
            # The worker plays a span-aware controller (K host pages per key)
            # on stock sglang 0.5.23, whose config has no storage_page_size.
            "storage_page_size": self.geometry.storage_page_tokens,
            "span_layout_guard": self.layout_guard,
        }
        if self.layout_guard_etcd:
            extra["span_layout_guard_etcd"] = self.layout_guard_etcd
        if self.local_buffer_bytes != _DEFAULT_LOCAL_BUFFER_BYTES:
            # Only when asked for: the backend reads the key but its option
            # check also warns about it as unknown.
            extra["local_buffer_size"] = self.local_buffer_bytes
        return extra


_VARIANT_GEOMETRY_FIELDS = {
    "model": str,
    "layers": int,
    "storage_page_tokens": int,
    "kv_lora_rank": int,
    "rope_dim": int,
    "layout": str,
}
_VARIANT_FIELDS = {**_VARIANT_GEOMETRY_FIELDS, "layout_guard": str}


def node_variant(config: WorkerConfig, text: str) -> WorkerConfig:
    """``config`` with ``"layers=3,layout_guard=etcd"`` applied; ``""`` is ``config`` itself."""
    geometry: dict[str, Any] = {}
    other: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in _VARIANT_FIELDS:
            raise ValueError(
                f"bad variant item {item!r}: expected one of {sorted(_VARIANT_FIELDS)}=VALUE"
            )
        try:
            parsed = _VARIANT_FIELDS[name](value)
        except ValueError:
            raise ValueError(
                f"bad variant item {item!r}: {value!r} is not a {_VARIANT_FIELDS[name].__name__}"
            ) from None
        (geometry if name in _VARIANT_GEOMETRY_FIELDS else other)[name] = parsed
    return replace(config, geometry=replace(config.geometry, **geometry), variants=(), **other)


class MarkerTimeout(RuntimeError):
    pass


def _wait_file(
    path: Path | None, timeout_s: float, what: str, poll_s: float = _POLL_INTERVAL_S
) -> None:
    if path is None:
        return
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() >= deadline:
            raise MarkerTimeout(f"{what} file {path} did not appear within {timeout_s:.0f}s")
        time.sleep(poll_s)


def _touch(path: Path | None, text: str = "") -> None:
    if path is None:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


# ---------------------------------------------------------------------------
# deterministic content


def request_tokens(
    seed: int, request_id: int, geometry: Geometry, keys: int, shared_keys: int
) -> list[int]:
    page = geometry.storage_page_tokens
    # str seeds are hashed with SHA-512 by random.Random: stable across
    # processes and interpreter runs (unlike hash()).
    shared = random.Random(f"span-worker|{seed}|prefix")
    own = random.Random(f"span-worker|{seed}|request|{request_id}")
    tokens = [shared.randrange(1 << 20) for _ in range(shared_keys * page)]
    tokens += [own.randrange(1 << 20) for _ in range((keys - shared_keys) * page)]
    return tokens


def page_seed(seed: int, pool: str, key: str, page_index: int) -> int:
    digest = hashlib.sha256(f"{seed}|{pool}|{key}|{page_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def page_content(page_seed_value: int, nbytes: int) -> bytes:
    """``nbytes`` pseudo-random bytes, identical in every process for the same seed."""
    import numpy as np

    # PCG64 is specified bit for bit by numpy; bytes() is fast for page-sized draws.
    return np.random.Generator(np.random.PCG64(page_seed_value)).bytes(nbytes)


# ---------------------------------------------------------------------------
# the node


@dataclass
class RequestResult:
    id: int
    keys: int
    written_keys: int = 0
    mamba_written: bool = False
    hit_keys: int = 0
    restorable_keys: int = 0
    restored_keys: int = 0
    mamba_restored: bool = False
    mismatched_pages: int = 0


class Node:
    """Host pools + MooncakeSpanStore of one sglang node (single TP rank)."""

    def __init__(self, config: WorkerConfig, request_ids: tuple[int, ...], scratch_keys: int = 0):
        # sglang is imported here, not at module import, so --help stays fast
        # and the JSON can report how long the import took.
        import torch
        from sglang.srt.mem_cache.hicache_storage import (
            STORAGE_BATCH_SIZE,
            PoolHitPolicy,
            PoolName,
            PoolTransfer,
        )
        from sglang.srt.mem_cache.utils import get_hash_str

        from mooncake_span_tools.testing import pools as P

        self.import_s = time.time() - _STARTED_WALL_S
        self.torch = torch
        self.P = P
        self.PoolName = PoolName
        self.PoolTransfer = PoolTransfer
        self.PoolHitPolicy = PoolHitPolicy
        self.batch_keys = STORAGE_BATCH_SIZE
        self.config = config
        g = config.geometry
        self.k = g.pages_per_key
        self.request_ids = request_ids
        self.keys: dict[int, list[str]] = {}
        for rid in request_ids:
            tokens = request_tokens(
                config.seed, rid, g, config.keys_per_request, config.shared_prefix_keys
            )
            self.keys[rid] = list(get_hash_str(tokens, None, page_size=g.storage_page_tokens))
        total_pages = (len(request_ids) * config.keys_per_request + scratch_keys) * self.k
        # Slack pages and a per-worker permutation: a reader restores into
        # other host pages than the writer used.
        self.host_pages = total_pages + self.k
        started = time.perf_counter()
        self.pools = P.build_compressed_hybrid_dsa(
            g.layout,
            layers=g.layers,
            host_pages=self.host_pages,
            mamba_layers=MAMBA_LAYERS,
            mamba_slots=len(request_ids) + 1,
            kv_lora_rank=g.kv_lora_rank,
            rope_dim=g.rope_dim,
            index_kpool=INDEX_KPOOL,
        )
        self.build_s = time.perf_counter() - started
        self.kv = self.pools[PoolName.KV]
        self.indexer = self.pools[PoolName.INDEXER]
        self.mamba = self.pools[PoolName.MAMBA]
        order = list(range(self.host_pages))
        random.Random(f"placement|{config.placement_seed}").shuffle(order)
        self.page_of: dict[tuple[int, int, int], int] = {}
        cursor = 0
        for rid in request_ids:
            for i in range(config.keys_per_request):
                for j in range(self.k):
                    self.page_of[(rid, i, j)] = order[cursor]
                    cursor += 1
        # Host pages reused by every extra request (failover rounds).
        self.scratch_pages = order[cursor : cursor + scratch_keys * self.k]
        # The Mamba pool has one slot more than requests; rotating by the
        # placement seed puts a reader's states in other slots than the writer's.
        mamba_slots = len(request_ids) + 1
        self.mamba_slot = {
            rid: (n + config.placement_seed) % mamba_slots for n, rid in enumerate(request_ids)
        }
        self.spare_mamba_slot = (len(request_ids) + config.placement_seed) % mamba_slots
        self.store: Any = None

    # -- helpers ------------------------------------------------------------------

    def _slots(self, pages: list[int]) -> Any:
        torch = self.torch
        return torch.cat(
            [torch.arange(p * HOST_PAGE_TOKENS, (p + 1) * HOST_PAGE_TOKENS) for p in pages]
        )

    def _pages(self, rid: int, first_key: int, count: int) -> list[int]:
        count = min(count, len(self.keys[rid]) - first_key)
        return [
            self.page_of[(rid, i, j)]
            for i in range(first_key, first_key + count)
            for j in range(self.k)
        ]

    def _expected(self, pool: Any, label: str, key: str, page_index: int) -> bytes:
        nbytes = pool.get_dummy_flat_data_page().nbytes
        return page_content(page_seed(self.config.seed, label, key, page_index), nbytes)

    def _fill(self, pool: Any, label: str, key: str, page_index: int, slot: int) -> None:
        torch = self.torch
        template = pool.get_dummy_flat_data_page()
        raw = torch.frombuffer(
            bytearray(self._expected(pool, label, key, page_index)), dtype=torch.uint8
        )
        pool.set_from_flat_data_page(slot, raw.view(template.dtype))

    def key_bytes(self) -> int:
        """Bytes one storage key moves (KV + indexer, all K host pages)."""
        kv = self.kv.get_dummy_flat_data_page().nbytes
        idx = self.indexer.get_dummy_flat_data_page().nbytes
        return self.k * (kv + idx)

    def mamba_bytes(self) -> int:
        return self.mamba.get_dummy_flat_data_page().nbytes

    # -- lifecycle -----------------------------------------------------------------------

    def connect(self) -> float:
        """Create the backend and register the pools as sglang does; returns seconds taken.

        Raises LayoutConflictError when the layout guard refuses this node.
        """
        from mooncake_span.sglang_backend.backend import MooncakeSpanStore
        from mooncake_span_tools.testing.pools import single_rank_storage_config

        started = time.perf_counter()
        storage_config = single_rank_storage_config(
            self.config.extra_config(), model_name=self.config.geometry.model
        )
        store = MooncakeSpanStore(storage_config, {})
        self.store = store
        store.register_mem_pool_host(self.kv)
        for name, pool in self.pools.pools.items():
            store.register_mem_host_pool_v2(pool, name)
        store.on_host_pools_registered()
        return time.perf_counter() - started

    def add_scratch_request(self, rid: int, keys: int) -> None:
        """A request of ``keys`` keys placed on the scratch pages, filled with its content."""
        if keys * self.k > len(self.scratch_pages):
            raise ValueError(f"{keys} keys do not fit the {len(self.scratch_pages)} scratch pages")
        g = self.config.geometry
        from sglang.srt.mem_cache.utils import get_hash_str

        tokens = request_tokens(self.config.seed, rid, g, keys, 0)
        self.keys[rid] = list(get_hash_str(tokens, None, page_size=g.storage_page_tokens))
        for i in range(keys):
            for j in range(self.k):
                self.page_of[(rid, i, j)] = self.scratch_pages[i * self.k + j]
        self.mamba_slot[rid] = self.spare_mamba_slot
        self.fill_request(rid)

    def fill_all(self) -> None:
        for rid in self.request_ids:
            self.fill_request(rid)

    def fill_request(self, rid: int) -> None:
        keys = self.keys[rid]
        for i, key in enumerate(keys):
            for j in range(self.k):
                slot = self.page_of[(rid, i, j)] * HOST_PAGE_TOKENS
                self._fill(self.kv, "kv", key, j, slot)
                self._fill(self.indexer, "indexer", key, j, slot)
        self._fill(self.mamba, "mamba", keys[-1], 0, self.mamba_slot[rid])

    # -- sglang call sequences --------------------------------------------------------------

    def write_request(self, rid: int, result: RequestResult) -> None:
        PoolName, PoolTransfer, PoolHitPolicy = self.PoolName, self.PoolTransfer, self.PoolHitPolicy
        keys = self.keys[rid]
        ok_keys: list[bool] = []
        for b in range(0, len(keys), self.batch_keys):
            batch = keys[b : b + self.batch_keys]
            slots = self._slots(self._pages(rid, b, len(batch)))
            sidecars = [
                PoolTransfer(
                    PoolName.INDEXER, host_indices=slots, keys=batch, indices_from_pool=PoolName.KV
                )
            ]
            last = b + len(batch) == len(keys)
            if last:
                sidecars.append(
                    PoolTransfer(
                        PoolName.MAMBA,
                        host_indices=self.torch.tensor([self.mamba_slot[rid]]),
                        keys=[keys[-1]],
                        hit_policy=PoolHitPolicy.TRAILING_PAGES,
                    )
                )
            side = self.store.batch_set_v2(sidecars)
            kv_ok = self.store.batch_set_v1(batch, slots)
            indexer_ok = side.get(PoolName.INDEXER, [False] * len(batch))
            ok_keys += [bool(a and b_) for a, b_ in zip(kv_ok, indexer_ok, strict=False)] + [
                False
            ] * (len(batch) - len(kv_ok))
            if last:
                mamba_ok = side.get(PoolName.MAMBA, [False])
                result.mamba_written = bool(mamba_ok and mamba_ok[0])
        result.written_keys = sum(ok_keys)

    def hit_query(self, rid: int) -> Any:
        PoolName, PoolTransfer, PoolHitPolicy = self.PoolName, self.PoolTransfer, self.PoolHitPolicy
        return self.store.batch_exists_v2(
            self.keys[rid],
            [
                PoolTransfer(PoolName.INDEXER, keys=None, indices_from_pool=PoolName.KV),
                PoolTransfer(
                    PoolName.MAMBA,
                    keys=["__placeholder__"],
                    hit_policy=PoolHitPolicy.TRAILING_PAGES,
                ),
            ],
        )

    def read_request(self, rid: int, result: RequestResult) -> None:
        PoolName, PoolTransfer, PoolHitPolicy = self.PoolName, self.PoolTransfer, self.PoolHitPolicy
        keys = self.keys[rid]
        hit = self.hit_query(rid)
        result.hit_keys = int(hit.kv_hit_pages)
        result.restorable_keys = max(hit.restorable_prefix_pages or [0])
        got = 0
        for b in range(0, result.hit_keys, self.batch_keys):
            batch = keys[b : min(b + self.batch_keys, result.hit_keys)]
            slots = self._slots(self._pages(rid, b, len(batch)))
            kv_ok = self.store.batch_get_v1(batch, slots)
            side = self.store.batch_get_v2(
                [PoolTransfer(PoolName.INDEXER, host_indices=slots, keys=batch)]
            )
            indexer_ok = side.get(PoolName.INDEXER, [])
            run = 0
            # A short answer (a rejected call) ends the restorable run.
            for a, c in zip(kv_ok, indexer_ok, strict=False):
                if not (a and c):
                    break
                run += 1
            got += run
            if run < len(batch):
                break
        if got == len(keys):
            state = self.store.batch_get_v2(
                [
                    PoolTransfer(
                        PoolName.MAMBA,
                        host_indices=self.torch.tensor([self.mamba_slot[rid]]),
                        keys=[keys[-1]],
                        hit_policy=PoolHitPolicy.TRAILING_PAGES,
                    )
                ]
            )
            flags = state.get(PoolName.MAMBA, [False])
            result.mamba_restored = bool(flags and flags[0])
        result.restored_keys = got
        result.mismatched_pages = self.verify(rid, got, result.mamba_restored)

    def verify(self, rid: int, restored_keys: int, mamba: bool) -> int:
        P = self.P
        keys = self.keys[rid]
        bad = 0
        for i in range(restored_keys):
            for j in range(self.k):
                slot = self.page_of[(rid, i, j)] * HOST_PAGE_TOKENS
                bad += P.page_bytes(self.kv, slot) != self._expected(self.kv, "kv", keys[i], j)
                bad += P.page_bytes(self.indexer, slot) != self._expected(
                    self.indexer, "indexer", keys[i], j
                )
        if mamba:
            bad += P.page_bytes(self.mamba, self.mamba_slot[rid]) != self._expected(
                self.mamba, "mamba", keys[-1], 0
            )
        return bad

    def wipe_request(self, rid: int) -> None:
        starts = [p * HOST_PAGE_TOKENS for p in self._pages(rid, 0, len(self.keys[rid]))]
        self.P.wipe_pages(self.kv, starts)
        self.P.wipe_pages(self.indexer, starts)
        self.P.wipe_pages(self.mamba, [self.mamba_slot[rid]])


# ---------------------------------------------------------------------------
# call timing


_TIMED_CALLS = ("batch_exists_v2", "batch_get_v1", "batch_get_v2", "batch_set_v1", "batch_set_v2")


class TimedStore(TimedProxy):
    """Wraps the backend: records each sglang-facing call's duration and any exception.

    The backend promises to answer misses, never to raise, on the worker-thread
    calls; an exception is recorded here (and re-raised) so a test can assert
    there were none.
    """

    def __init__(self, store: Any) -> None:
        super().__init__(store, _TIMED_CALLS, self._record)
        self.calls: list[tuple[str, float, float]] = []  # (name, wall start, seconds)
        self.exceptions: list[str] = []

    def _record(
        self, name: str, args: tuple, wall_s: float, seconds: float, error: BaseException | None
    ) -> None:
        if isinstance(error, Exception):
            self.exceptions.append(f"{name}: {error!r}")
        self.calls.append((name, wall_s, seconds))

    def max_call_s(self, since_wall: float | None = None) -> float:
        durations = [d for _, w, d in self.calls if since_wall is None or w >= since_wall]
        return max(durations, default=0.0)

    def slowest(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, _, duration in self.calls:
            out[name] = max(out.get(name, 0.0), duration)
        return {k: round(v, 3) for k, v in out.items()}


# ---------------------------------------------------------------------------
# modes


_ROUND_REQUEST_BASE = 1_000_000


def _summarize(results: list[RequestResult], node: Node) -> dict[str, Any]:
    key_bytes = node.key_bytes()
    return {
        "keys": sum(r.keys for r in results),
        "written_keys": sum(r.written_keys for r in results),
        "hit_keys": sum(r.hit_keys for r in results),
        "restorable_keys": sum(r.restorable_keys for r in results),
        "restored_keys": sum(r.restored_keys for r in results),
        "mamba_written": sum(r.mamba_written for r in results),
        "mamba_restored": sum(r.mamba_restored for r in results),
        "mismatched_pages": sum(r.mismatched_pages for r in results),
        "bytes_written": sum(r.written_keys for r in results) * key_bytes
        + sum(r.mamba_written for r in results) * node.mamba_bytes(),
        "bytes_read": sum(r.restored_keys for r in results) * key_bytes
        + sum(r.mamba_restored for r in results) * node.mamba_bytes(),
    }


def _write(node: Node, report: dict[str, Any]) -> int:
    results = [RequestResult(rid, len(node.keys[rid])) for rid in node.request_ids]
    window = [time.time(), 0.0]
    started = time.perf_counter()
    for result in results:
        node.write_request(result.id, result)
    report["times"]["write_s"] = round(time.perf_counter() - started, 4)
    report["times"]["write_io_s"] = _io_s(node, window[0])
    window[1] = time.time()
    report["write_window"] = window
    report["requests"] = [asdict(r) for r in results]
    report.update(_summarize(results, node))
    complete = all(r.written_keys == r.keys and r.mamba_written for r in results)
    return EXIT_OK if complete else EXIT_MISMATCH


def _io_s(node: Node, since_wall: float) -> float:
    """Seconds spent inside backend calls since ``since_wall`` (excludes verification)."""
    return round(sum(d for _, w, d in node.store.calls if w >= since_wall), 4)


def _read(node: Node, report: dict[str, Any]) -> int:
    results = [RequestResult(rid, len(node.keys[rid])) for rid in node.request_ids]
    window = [time.time(), 0.0]
    started = time.perf_counter()
    for result in results:
        node.wipe_request(result.id)
        node.read_request(result.id, result)
    report["times"]["read_s"] = round(time.perf_counter() - started, 4)
    report["times"]["read_io_s"] = _io_s(node, window[0])
    window[1] = time.time()
    report["read_window"] = window
    report["requests"] = [asdict(r) for r in results]
    report.update(_summarize(results, node))
    return EXIT_MISMATCH if report["mismatched_pages"] else EXIT_OK


def _failover(node: Node, config: WorkerConfig, report: dict[str, Any]) -> int:
    """Write, then exists/get/set rounds until the cluster served again after the kill."""
    code = _write(node, report)
    _touch(config.ready_file, str(time.time()))
    old = node.request_ids[0]
    assert config.kill_marker is not None  # checked by WorkerConfig
    store: TimedStore = node.store
    kill_wall: float | None = None
    marker_deadline = time.monotonic() + config.marker_timeout_s
    failover_deadline: float | None = None
    first_failure_s = resume_s = old_visible_s = None
    outage_rounds = rounds = 0
    resumed_rounds: list[int] = []
    trace: list[dict[str, Any]] = []
    round_no = 0
    while True:
        if kill_wall is None and config.kill_marker.exists():
            kill_wall = float(config.kill_marker.read_text().strip() or time.time())
            failover_deadline = time.monotonic() + config.failover_deadline_s
        if kill_wall is None and time.monotonic() > marker_deadline:
            raise MarkerTimeout(f"kill marker {config.kill_marker} did not appear")
        round_no += 1
        rid = _ROUND_REQUEST_BASE + round_no
        node.add_scratch_request(rid, config.round_keys)
        round_start = time.time()
        old_result = RequestResult(old, len(node.keys[old]))
        new_result = RequestResult(rid, config.round_keys)
        try:
            node.wipe_request(old)
            node.read_request(old, old_result)
            node.write_request(rid, new_result)
        except Exception:  # recorded by TimedStore; the round counts as failed
            logger.exception("round %d raised", round_no)
        set_ok = new_result.written_keys == config.round_keys and new_result.mamba_written
        set_done = time.time()
        rounds += 1
        if kill_wall is None and config.kill_marker.exists():
            # The kill landed while this round ran: it is the first to feel it.
            kill_wall = float(config.kill_marker.read_text().strip() or time.time())
            failover_deadline = time.monotonic() + config.failover_deadline_s
        # A round counts once it ends after the kill: the one in flight when
        # the master died is the first to feel it.
        after_kill = kill_wall is not None and set_done >= kill_wall
        if after_kill:
            end_s = round(set_done - kill_wall, 3)
            trace.append(
                {
                    "t_s": round(round_start - kill_wall, 3),
                    "round_s": round(set_done - round_start, 3),
                    "old_hit": old_result.hit_keys,
                    "old_restored": old_result.restored_keys,
                    "set_ok": set_ok,
                }
            )
            if not set_ok:
                outage_rounds += 1
                if first_failure_s is None:
                    first_failure_s = end_s
            elif resume_s is None and first_failure_s is not None:
                resume_s = end_s
            if resume_s is not None and set_ok:
                resumed_rounds.append(rid)
            if (
                resume_s is not None
                and old_visible_s is None
                and old_result.restored_keys == old_result.keys
                and old_result.mismatched_pages == 0
            ):
                old_visible_s = end_s
        if old_result.mismatched_pages:
            report.setdefault("round_mismatches", 0)
            report["round_mismatches"] += old_result.mismatched_pages
        if resume_s is not None and (
            old_visible_s is not None or set_done - kill_wall - resume_s >= config.settle_s
        ):
            break
        if failover_deadline is not None and time.monotonic() > failover_deadline:
            logger.error(
                "the cluster did not serve again within %.0fs of the kill",
                config.failover_deadline_s,
            )
            break
        time.sleep(config.round_interval_s)

    # After the failover: every pre-failover request, and the last requests
    # written after the resume, read back into wiped pages and compared.
    old_results = [RequestResult(r, len(node.keys[r])) for r in node.request_ids]
    for result in old_results:
        node.wipe_request(result.id)
        node.read_request(result.id, result)
    new_results = [RequestResult(r, len(node.keys[r])) for r in resumed_rounds[-3:]]
    for result in new_results:
        # Scratch pages are shared: refill nothing, wipe and read each in turn.
        node.wipe_request(result.id)
        node.read_request(result.id, result)
    report["failover"] = {
        "kill_wall_s": kill_wall,
        "rounds": rounds,
        "outage_rounds": outage_rounds,
        "first_failure_s": first_failure_s,
        "resume_s": resume_s,
        "old_visible_s": old_visible_s,
        "max_call_s": round(store.max_call_s(), 3),
        "max_call_after_kill_s": round(store.max_call_s(kill_wall), 3) if kill_wall else None,
        "calls_after_kill": sum(1 for _, w, _ in store.calls if kill_wall and w >= kill_wall),
        "old_after": _summarize(old_results, node),
        "new_after": _summarize(new_results, node),
        "trace": trace[:80],
    }
    mismatched = (
        report["failover"]["old_after"]["mismatched_pages"]
        + report["failover"]["new_after"]["mismatched_pages"]
        + report.get("round_mismatches", 0)
    )
    if mismatched:
        return EXIT_MISMATCH
    return code


def _start_node(config: WorkerConfig, report: dict[str, Any]) -> tuple[int | None, Node]:
    """Build pools, connect, register (layout guard). Returns (exit code if it failed, node)."""
    from mooncake_span.errors import LayoutConflictError, MooncakeSpanError

    report["times"] = {}
    scratch = 2 * config.round_keys if config.mode == "failover" else 0
    node = Node(config, config.request_ids, scratch_keys=scratch)
    report["times"]["import_s"] = round(node.import_s, 3)
    report["times"]["build_s"] = round(node.build_s, 4)
    report["key_bytes"] = node.key_bytes()
    report["pages_per_key"] = node.k
    started = time.perf_counter()
    if config.mode in ("write", "failover"):
        node.fill_all()
    report["times"]["fill_s"] = round(time.perf_counter() - started, 4)
    _wait_file(config.wait_for, config.marker_timeout_s, "--wait-for")
    try:
        report["times"]["connect_s"] = round(node.connect(), 4)
    except LayoutConflictError as exc:
        report["refused"] = True
        report["error"] = str(exc)
        return EXIT_REFUSED, node
    except MooncakeSpanError as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        return EXIT_SETUP, node
    report["refused"] = False
    report["layout_guard"] = getattr(node.store, "layout_guard_result", None)
    node.store = TimedStore(node.store)
    return None, node


def _probe_variants(config: WorkerConfig, report: dict[str, Any]) -> int:
    """Start one node per variant, one after the other (each with its own pools and client)."""
    nodes = []
    code = EXIT_OK
    for text in config.variants:
        variant = node_variant(config, text)
        part: dict[str, Any] = {
            "variant": text,
            "geometry": asdict(variant.geometry),
            "layout_guard_mode": variant.layout_guard,
            "error": None,
        }
        failed, node = _start_node(variant, part)
        if failed is not None:
            code = max(code, failed)
        if node.store is not None:
            node.store.close()
        nodes.append(part)
    report["nodes"] = nodes
    return code


def run(config: WorkerConfig, report: dict[str, Any]) -> tuple[int, Node | None]:
    """Run one mode; fills ``report``. Returns (exit code, node for the exit step)."""
    if config.mode == "probe" and config.variants:
        _wait_file(config.wait_for, config.marker_timeout_s, "--wait-for")
        code = _probe_variants(replace(config, wait_for=None), report)
        _touch(config.ready_file, str(time.time()))
        return code, None
    failed, node = _start_node(config, report)
    if failed is not None:
        return failed, node
    _touch(config.connected_file, str(time.time()))
    _wait_file(config.go_file, config.marker_timeout_s, "--go-file", poll_s=_GO_POLL_INTERVAL_S)
    if config.mode == "write":
        code = _write(node, report)
    elif config.mode == "read":
        code = _read(node, report)
        if config.again_after is not None:
            _touch(config.ready_file, str(time.time()))
            _wait_file(config.again_after, config.marker_timeout_s, "--again-after")
            again: dict[str, Any] = {"times": {}}
            code = max(code, _read(node, again))
            report["again"] = again
    elif config.mode == "failover":
        code = _failover(node, config, report)
    else:
        code = EXIT_OK
    if config.mode != "failover":
        _touch(config.ready_file, str(time.time()))
    timed: TimedStore = node.store
    report["calls"] = len(timed.calls)
    report["slowest_call_s"] = timed.slowest()
    report["exceptions"] = timed.exceptions
    stats = timed.get_stats()
    report["stats"] = {
        "error_counts": dict(stats.error_counts),
        "rejected_calls": dict(stats.rejected_calls),
        "breaker_state": stats.breaker_state,
        "breaker_times_opened": stats.breaker_times_opened,
    }
    _wait_file(config.hold_file, config.marker_timeout_s, "--hold-file")
    return code, node


# ---------------------------------------------------------------------------
# command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tests.netns.node_worker",
        description=(
            "Drive MooncakeSpanStore like one sglang node (compressed hybrid DSA pools: MLA KV + "
            "DSA indexer + Mamba, 64-token host pages, K=4) and print a JSON report on stdout. "
            "Exit codes: 0 ok, 1 verification failed, 2 usage, 3 layout guard refused, "
            "4 setup failed, 5 marker timeout."
        ),
    )
    parser.add_argument("mode", choices=_MODES, help="what this node does")
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument(
        "--master", required=True, help="HOST:PORT, or etcd://HOST:PORT for HA masters"
    )
    cluster.add_argument(
        "--metadata", required=True, help="http://HOST:PORT/metadata or etcd://HOST:PORT"
    )
    cluster.add_argument(
        "--local-hostname",
        default=None,
        help="address this node advertises "
        "(default: $MOONCAKE_LOCAL_HOSTNAME, else $MC_TCP_BIND_ADDRESS, else 127.0.0.1)",
    )
    cluster.add_argument(
        "--segment-bytes",
        default="0",
        help="global segment inside this process "
        "(default 0: a pure client, the data lives on storage nodes)",
    )
    cluster.add_argument(
        "--local-buffer-bytes", default="16mb", help="client transfer buffer (default 16mb)"
    )
    cluster.add_argument("--layout-guard", choices=("off", "store", "etcd"), default="store")
    cluster.add_argument(
        "--layout-guard-etcd", default=None, help="HOST:PORT of etcd for --layout-guard etcd"
    )
    model = parser.add_argument_group("model geometry")
    model.add_argument(
        "--model", default=Geometry.model, help="model name (the layout guard's namespace)"
    )
    model.add_argument("--layers", type=int, default=Geometry.layers)
    model.add_argument("--storage-page-tokens", type=int, default=Geometry.storage_page_tokens)
    model.add_argument("--kv-lora-rank", type=int, default=Geometry.kv_lora_rank)
    model.add_argument("--rope-dim", type=int, default=Geometry.rope_dim)
    model.add_argument(
        "--layout", default=Geometry.layout, choices=("page_first", "page_first_direct")
    )
    work = parser.add_argument_group("requests")
    work.add_argument(
        "--seed", type=int, default=0, help="content seed shared by writers and readers"
    )
    work.add_argument(
        "--requests", default="0-3", help="request ids, e.g. 0-3 or 0-3,100-101 (default 0-3)"
    )
    work.add_argument(
        "--keys-per-request", type=int, default=4, help="storage keys per request (default 4)"
    )
    work.add_argument(
        "--shared-prefix-keys",
        type=int,
        default=0,
        help="leading keys every request shares (same tokens for all request ids)",
    )
    work.add_argument(
        "--placement-seed",
        type=int,
        default=None,
        help="host page placement (default: 1 for writers, 2 for readers)",
    )
    flow = parser.add_argument_group("process flow")
    flow.add_argument(
        "--exit",
        dest="exit_mode",
        choices=_EXIT_MODES,
        default="close",
        help="close the client (default), skip its teardown (fast), or SIGKILL itself",
    )
    flow.add_argument(
        "--wait-for", type=Path, default=None, help="wait for this file before connecting"
    )
    flow.add_argument(
        "--connected-file", type=Path, default=None, help="create this file once connected"
    )
    flow.add_argument(
        "--go-file", type=Path, default=None, help="after connecting, wait for this file"
    )
    flow.add_argument(
        "--ready-file", type=Path, default=None, help="create this file when the work is done"
    )
    flow.add_argument(
        "--hold-file", type=Path, default=None, help="before exiting, wait for this file"
    )
    flow.add_argument(
        "--again-after",
        type=Path,
        default=None,
        help="read mode: after the first pass (and --ready-file), wait for this file and read "
        "again (the report's 'again' object)",
    )
    flow.add_argument(
        "--marker-timeout-s", type=float, default=120.0, help="bound for every wait (default 120)"
    )
    fo = parser.add_argument_group("failover mode")
    fo.add_argument(
        "--kill-marker",
        type=Path,
        default=None,
        help="file in which the orchestrator writes the wall time of the master kill",
    )
    fo.add_argument("--round-interval-s", type=float, default=0.2)
    fo.add_argument(
        "--settle-s",
        type=float,
        default=4.0,
        help="after writes resume, how long to wait for old keys to come back",
    )
    fo.add_argument("--failover-deadline-s", type=float, default=60.0)
    fo.add_argument("--round-keys", type=int, default=2)
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="FIELD=VALUE[,...]",
        help="probe mode: instead of one node, start one node per --variant (one after the other, "
        "each with its own pools and client) with these fields changed: model, layers, "
        "storage_page_tokens, kv_lora_rank, rope_dim, layout, layout_guard; '' = unchanged",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    local = (
        args.local_hostname
        or os.environ.get("MOONCAKE_LOCAL_HOSTNAME")
        or os.environ.get("MC_TCP_BIND_ADDRESS")
        or "127.0.0.1"
    )
    placement = args.placement_seed
    if placement is None:
        placement = 2 if args.mode == "read" else 1
    return WorkerConfig(
        mode=args.mode,
        master=args.master,
        metadata=args.metadata,
        local_hostname=local,
        segment_bytes=parse_size_bytes(args.segment_bytes),
        local_buffer_bytes=parse_size_bytes(args.local_buffer_bytes),
        layout_guard=args.layout_guard,
        layout_guard_etcd=args.layout_guard_etcd,
        geometry=Geometry(
            model=args.model,
            layers=args.layers,
            storage_page_tokens=args.storage_page_tokens,
            kv_lora_rank=args.kv_lora_rank,
            rope_dim=args.rope_dim,
            layout=args.layout,
        ),
        seed=args.seed,
        request_ids=parse_request_ids(args.requests),
        keys_per_request=args.keys_per_request,
        shared_prefix_keys=args.shared_prefix_keys,
        placement_seed=placement,
        exit_mode=args.exit_mode,
        wait_for=args.wait_for,
        connected_file=args.connected_file,
        go_file=args.go_file,
        ready_file=args.ready_file,
        hold_file=args.hold_file,
        marker_timeout_s=args.marker_timeout_s,
        kill_marker=args.kill_marker,
        round_interval_s=args.round_interval_s,
        settle_s=args.settle_s,
        failover_deadline_s=args.failover_deadline_s,
        round_keys=args.round_keys,
        variants=tuple(args.variant),
        again_after=args.again_after,
    )


def _finish(config: WorkerConfig, node: Node | None, code: int) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    if config.exit_mode == "sigkill":
        # The report is on disk (stdout is a file or pipe); now die the way a
        # crashed or OOM-killed server does: no close, no atexit, no flush.
        os.kill(os.getpid(), signal.SIGKILL)
    if config.exit_mode == "fast":
        # With etcd:// masters the native close() waits up to 30 s on an etcd
        # watch; a server being torn down does not wait either.
        os._exit(code)
    store = getattr(node, "store", None) if node is not None else None
    if store is not None:
        started = time.perf_counter()
        store.close()
        logger.info("store closed in %.2fs", time.perf_counter() - started)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s node_worker[%(process)d] %(name)s: %(message)s",
    )
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    report: dict[str, Any] = {
        "mode": config.mode,
        "host": config.local_hostname,
        "pid": os.getpid(),
        "model": config.geometry.model,
        "geometry": asdict(config.geometry),
        "request_ids": list(config.request_ids),
        "segment_bytes": config.segment_bytes,
        "exit_mode": config.exit_mode,
        "error": None,
    }
    node: Node | None = None
    try:
        code, node = run(config, report)
    except MarkerTimeout as exc:
        report["error"] = str(exc)
        code = EXIT_MARKER_TIMEOUT
    report["exit_code"] = code
    report["wall_s"] = round(time.time() - _STARTED_WALL_S, 3)
    print(json.dumps(report), flush=True)
    return _finish(config, node, code)


if __name__ == "__main__":
    sys.exit(main())
