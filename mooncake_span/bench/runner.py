"""``mooncake-span bench``: span mode against upstream MooncakeStore, raw Mooncake and memcpy.

Every contender moves the *same host pages* of the *same real sglang host
pools* in the same run:

* ``span-K<k>``: ``MooncakeSpanStore`` with ``storage_page_size = 64*k``
  (``batch_set_v1``/``batch_get_v1``, plus ``batch_set_v2``/``batch_get_v2``
  for the DSA indexer and Mamba sidecars, the way sglang's controller calls it);
* ``upstream``: sglang 0.5.23's own ``MooncakeStore`` on the same pools, one
  object per 64-token host page (its ``batch_set_v1``/``batch_get_v1``/
  ``batch_exists_v2``), the per-page baseline;
* ``raw-K<k>``: the native ``batch_put_from_multi_buffers`` /
  ``batch_get_into_multi_buffers`` calls the span backend issues, with keys
  and pointer lists built before the clock starts (the floor for the backend);
* ``raw-1buf``: ``batch_put_from`` / ``batch_get_into`` with one buffer per
  page object (page_first only), the floor for the upstream baseline;
* ``memcpy``: single-thread ``numpy.copyto`` of the same page slices, one copy
  per page buffer, into a pre-faulted staging area (the physical limit of the
  same-process path, which is one memcpy worker thread in Mooncake).

Fairness rules (see docs/benchmarks.md):

* one native Mooncake client per topology, shared by every contender through
  ``_TimedStore`` (so the same-process topology really has one global segment
  and nothing else mounted, and every native call is timed the same way);
* host pages are the same for every contender of a workload; keys are unique
  per contender and repetition, and every object is removed after each run,
  so Mooncake's keep-the-old-value ``put`` never turns a put into a no-op;
* contenders alternate inside each repetition (the order rotates), the first
  repetition is a warm-up, ratios are paired per repetition, and we report the
  best and the median;
* every get goes into wiped destination pages and every byte is compared with
  the source pages afterwards.

Topologies: ``same`` (the client owns a global segment and no other segment is
mounted, so Mooncake takes its local memcpy path) and ``tcp`` (a client with
``global_segment_size=0`` and one storage node process, over TCP loopback).
With ``--master``/``--metadata`` the client joins an existing cluster instead
(topology ``remote``), which is how ``--protocol rdma --device ...`` is run.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any
from unittest import mock

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)

from mooncake_span.bench import pools as P
from mooncake_span.config import SpanOptions
from mooncake_span.ops.cluster import ClusterSpec, LocalCluster
from mooncake_span.ops.native_log import native_stderr_to
from mooncake_span.sglang_backend.backend import MooncakeSpanStore
from mooncake_span.sglang_backend.pool_layout import describe_pool
from mooncake_span.span.plan import PageLayout, plan_objects, split_calls
from mooncake_span.store.client import NativeBinding, native_env_defaults

logger = logging.getLogger(__name__)

SCHEMA = "mooncake-span-bench/1"
HOST_PAGE_TOKENS = 64
# The TCP transport queues 1024 transfers per peer plus 1024 admissions; a call
# past 2048 buffers to one peer fails partly (perf-anchors §2c).
TCP_BUFFERS_PER_CALL = 2048
_VERIFY_CHUNK_BYTES = 64 << 20
_MiB = 1 << 20

SECTIONS = ("grid", "batch", "coalesce", "chunks")
TOPOLOGIES = ("same", "tcp")


# ---------------------------------------------------------------------------
# what to run


@dataclass(frozen=True)
class ModelShape:
    """Host pool dimensions of one model family; page bytes follow from them."""

    family: str  # "dsa" (MLA KV + DSA indexer + Mamba), "mla" or "mha"
    size: str  # label of the KV page size
    layers: int
    kv_lora_rank: int = 0
    rope_dim: int = 0
    heads: int = 0
    head_dim: int = 0
    mamba_layers: int = 2

    @property
    def is_mla(self) -> bool:
        return self.family != "mha"

    @property
    def label(self) -> str:
        return f"{self.family}-{self.size}"

    @property
    def kv_page_bytes(self) -> int:
        if self.is_mla:
            return self.layers * HOST_PAGE_TOKENS * (self.kv_lora_rank + self.rope_dim) * 2
        return 2 * self.layers * HOST_PAGE_TOKENS * self.heads * self.head_dim * 2


SMALL, LARGE, TINY_LAYERS = "64KiB", "2.5MiB", "78x2KiB"

# bf16 everywhere. Small pages are 1 KiB/token (64 KiB per 64-token page);
# large ones use DeepSeek-V3 MLA dims (512 + 64) over 35 layers and a
# 40-layer MHA with 2 KV heads of 128 per rank (a GQA model at TP4). The
# 78-layer shape is a GLM-5-sized layer_first MLA pool with 2 KiB per-layer
# buffers: K=4 scattered pages make 4 * 78 = 312 buffers per key.
MODELS: dict[tuple[str, str], ModelShape] = {
    ("dsa", SMALL): ModelShape("dsa", SMALL, layers=4, kv_lora_rank=112, rope_dim=16),
    ("dsa", LARGE): ModelShape("dsa", LARGE, layers=35, kv_lora_rank=512, rope_dim=64),
    ("mla", SMALL): ModelShape("mla", SMALL, layers=4, kv_lora_rank=112, rope_dim=16),
    ("mla", LARGE): ModelShape("mla", LARGE, layers=35, kv_lora_rank=512, rope_dim=64),
    ("mha", SMALL): ModelShape("mha", SMALL, layers=4, heads=1, head_dim=64),
    ("mha", LARGE): ModelShape("mha", LARGE, layers=40, heads=2, head_dim=128),
    ("mla", TINY_LAYERS): ModelShape("mla", TINY_LAYERS, layers=78, kv_lora_rank=8, rope_dim=8),
}
# The compressed DSA model's radix (storage) page is 64 * index_kpool tokens.
DSA_INDEX_KPOOL = 4


@dataclass(frozen=True)
class ContenderSpec:
    """Parsed contender name: ``memcpy``, ``raw-1buf``, ``raw-K4``, ``upstream``,
    ``span-K4``, ``span-K4-mb512`` (span_max_buffers_per_call), ``span-K4-nogroup``
    (span_group_ids=false), and a ``@consec`` suffix for consecutive host pages
    (default: scattered)."""

    name: str
    kind: str
    pages_per_key: int = 1
    max_buffers_per_call: int = TCP_BUFFERS_PER_CALL
    placement: str = "scattered"
    group_ids: bool = True

    @classmethod
    def parse(cls, name: str) -> ContenderSpec:
        base, _, placement_code = name.partition("@")
        placements = {"": "scattered", "consec": "consecutive"}
        if placement_code not in placements:
            raise ValueError(f"unknown placement in contender {name!r}")
        placement = placements[placement_code]
        if base in ("memcpy", "raw-1buf", "upstream"):
            return cls(name, base, 1, placement=placement)
        kind, *tokens = base.split("-")
        if (
            kind not in ("raw", "span")
            or not tokens
            or not tokens[0].startswith("K")
            or not tokens[0][1:].isdigit()
        ):
            raise ValueError(f"unknown contender {name!r}")
        spec = cls(name, kind, int(tokens[0][1:]), placement=placement)
        for token in tokens[1:]:
            if token.startswith("mb") and token[2:].isdigit():
                spec = replace(spec, max_buffers_per_call=int(token[2:]))
            elif token == "nogroup" and kind == "span":
                spec = replace(spec, group_ids=False)
            else:
                raise ValueError(f"unknown option {token!r} in contender {name!r}")
        return spec


@dataclass(frozen=True)
class Workload:
    section: str
    topology: str
    model: ModelShape
    layout: str
    pages_per_run: int
    pages_per_call: int
    contenders: tuple[str, ...]
    # contenders whose failure is the point of the row (past the TCP limit)
    expected_failures: tuple[str, ...] = ()
    # None: the run's defaults
    warmup: int | None = None
    reps: int | None = None
    # run last, on a native client of its own (it may break the client)
    isolated: bool = False

    @property
    def name(self) -> str:
        return (
            f"{self.section}/{self.topology}/{self.model.label}/{self.layout}/"
            f"P{self.pages_per_call}"
        )

    def __post_init__(self) -> None:
        for c in self.contenders:
            spec = ContenderSpec.parse(c)
            if self.pages_per_call % spec.pages_per_key or self.pages_per_run % self.pages_per_call:
                raise ValueError(f"{self.name}: {c} does not divide the pages evenly")


@dataclass(frozen=True)
class BenchConfig:
    quick: bool = False
    reps: int = 4  # timed repetitions, after `warmup` untimed ones
    warmup: int = 1
    topologies: tuple[str, ...] = TOPOLOGIES
    sections: tuple[str, ...] = SECTIONS
    protocol: str = "tcp"
    device: str = ""
    master_server_address: str | None = None
    metadata_server: str | None = None
    segment_bytes: int = 1536 * _MiB
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.reps < 1 or self.warmup < 0:
            raise ValueError("reps must be >= 1 and warmup >= 0")
        for t in self.topologies:
            if t not in (*TOPOLOGIES, "remote"):
                raise ValueError(f"unknown topology {t!r}")
        for s in self.sections:
            if s not in SECTIONS:
                raise ValueError(f"unknown section {s!r}; choose from {SECTIONS}")
        if (self.master_server_address is None) != (self.metadata_server is None):
            raise ValueError("an existing cluster needs both --master and --metadata")
        if self.protocol != "tcp" and self.master_server_address is None:
            raise ValueError(
                f"--protocol {self.protocol} needs an existing cluster (--master/--metadata): "
                "the embedded cluster's storage node speaks TCP"
            )


@dataclass(frozen=True)
class _Sizes:
    """Pages per run / per call of each section (full and --quick)."""

    small_run: int
    small_call: int
    large_run: int
    large_call: int
    batch_run: int
    batch_calls: tuple[int, ...]
    coalesce_run: int
    chunk_keys: int
    families: tuple[str, ...]
    spans: tuple[str, ...]
    limit_probe: bool


FULL_SIZES = _Sizes(
    small_run=2048,
    small_call=512,
    large_run=128,
    large_call=64,
    batch_run=4096,
    batch_calls=(64, 256, 1024, 4096),
    coalesce_run=256,
    chunk_keys=1024,
    families=("dsa", "mla", "mha"),
    spans=("span-K1", "span-K2", "span-K4", "span-K8"),
    limit_probe=True,
)
QUICK_SIZES = _Sizes(
    small_run=256,
    small_call=128,
    large_run=16,
    large_call=16,
    batch_run=512,
    batch_calls=(64, 512),
    coalesce_run=64,
    chunk_keys=16,
    families=("dsa", "mla"),
    spans=("span-K1", "span-K4"),
    limit_probe=False,
)


def plan_workloads(config: BenchConfig) -> list[Workload]:
    """The workloads of a run, grouped by topology, each topology's isolated ones last."""
    z = QUICK_SIZES if config.quick else FULL_SIZES
    topologies = ("remote",) if config.master_server_address else config.topologies
    out: list[Workload] = []
    for topo in topologies:
        local = topo == "same"
        if "grid" in config.sections:
            for family in z.families:
                sizes = ((SMALL, z.small_run, z.small_call),)
                if not config.quick or family == "mla":
                    sizes += ((LARGE, z.large_run, z.large_call),)
                for size, run, call in sizes:
                    # The DSA indexer has no layer_first zero-copy pointers in sglang.
                    layouts = ("page_first",) if family == "dsa" else ("page_first", "layer_first")
                    if config.quick and not local:
                        layouts = ("page_first",)
                    for layout in layouts:
                        page_first = layout == "page_first"
                        spans = ("span-K4",) if family == "dsa" else z.spans
                        # upstream refuses MHA layer_first ("use page_first for MHA").
                        upstream = () if family == "mha" and not page_first else ("upstream",)
                        # Mooncake group ids cost grows faster than linearly
                        # with keys per call: show the span backend without them
                        # where per-object costs matter most.
                        nogroup = ("span-K4-nogroup",) if size == SMALL and local else ()
                        contenders = (
                            *(("memcpy",) if local else ()),
                            *(("raw-1buf",) if page_first else ()),
                            "raw-K4",
                            *spans,
                            *nogroup,
                            *upstream,
                        )
                        out.append(
                            Workload(
                                "grid", topo, MODELS[(family, size)], layout, run, call, contenders
                            )
                        )
        if "batch" in config.sections and (local or not config.quick):
            for call in z.batch_calls:
                out.append(
                    Workload(
                        "batch",
                        topo,
                        MODELS[("mla", SMALL)],
                        "page_first",
                        z.batch_run,
                        call,
                        ("raw-K4", "span-K4", "upstream"),
                    )
                )
        if "coalesce" in config.sections:
            out.append(
                Workload(
                    "coalesce",
                    topo,
                    MODELS[("mla", TINY_LAYERS)],
                    "layer_first",
                    z.coalesce_run,
                    z.coalesce_run,
                    ("raw-K4", "span-K4", "raw-K4@consec", "span-K4@consec", "upstream"),
                )
            )
        if "chunks" in config.sections and not local:
            pages = 4 * z.chunk_keys
            sweep = tuple(f"span-K4-mb{mb}" for mb in (512, 1024, 2048))
            # One call of chunk_keys keys x 312 buffers; no warm-up, the
            # segment is warm by now and each run is long.
            out.append(
                Workload(
                    "chunks",
                    topo,
                    MODELS[("mla", TINY_LAYERS)],
                    "layer_first",
                    pages,
                    pages,
                    sweep,
                    warmup=0,
                    reps=min(config.reps, 3),
                )
            )
            if z.limit_probe and topo == "tcp":
                # Past 2048 buffers per peer the TCP lane rejects transfers, the
                # call stalls for Mooncake's 60 s transfer timeout and the
                # client stays broken afterwards: run it once, last, on a
                # client of its own.
                out.append(
                    Workload(
                        "chunks",
                        topo,
                        MODELS[("mla", TINY_LAYERS)],
                        "layer_first",
                        64,
                        64,
                        ("span-K4-mb4096",),
                        expected_failures=("span-K4-mb4096",),
                        warmup=0,
                        reps=1,
                        isolated=True,
                    )
                )
    return out


# ---------------------------------------------------------------------------
# the shared native client


@dataclass
class NativeCounters:
    io_s: float = 0.0
    io_calls: int = 0
    io_objects: int = 0
    io_buffers: int = 0
    exist_s: float = 0.0
    exist_calls: int = 0
    exist_keys: int = 0

    def minus(self, other: NativeCounters) -> NativeCounters:
        return NativeCounters(**{k: getattr(self, k) - getattr(other, k) for k in asdict(self)})


class _TimedStore:
    """The one ``MooncakeDistributedStore`` of a topology, handed to every contender.

    ``setup``/``close`` are no-ops (the harness owns the client's lifetime), a
    buffer is registered once however many contenders register it, and every
    data and existence call is timed, so "Python time" = wall - native time is
    measured the same way for every contender.
    """

    def __init__(self, store: Any) -> None:
        self._store = store
        self.counters = NativeCounters()
        self._registered: dict[int, int] = {}

    def snapshot(self) -> NativeCounters:
        return NativeCounters(**asdict(self.counters))

    def setup(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def close(self) -> int:
        return 0

    def register_buffer(self, ptr: int, size: int) -> int:
        if self._registered.get(ptr, -1) >= size:
            return 0
        rc = self._store.register_buffer(ptr, size)
        if rc == 0:
            self._registered[ptr] = size
        return rc

    def unregister_all(self) -> None:
        for ptr in list(self._registered):
            self._store.unregister_buffer(ptr)
        self._registered.clear()

    def _io(
        self, fn: Callable[..., list[int]], keys: Sequence[str], buffers: int, *args: Any
    ) -> list[int]:
        started = time.perf_counter()
        result = fn(keys, *args)
        c = self.counters
        c.io_s += time.perf_counter() - started
        c.io_calls += 1
        c.io_objects += len(keys)
        c.io_buffers += buffers
        return result

    def batch_put_from_multi_buffers(
        self, keys: Any, ptrs: Any, sizes: Any, *rest: Any
    ) -> list[int]:
        n = sum(map(len, ptrs))
        return self._io(self._store.batch_put_from_multi_buffers, keys, n, ptrs, sizes, *rest)

    def batch_get_into_multi_buffers(
        self, keys: Any, ptrs: Any, sizes: Any, *rest: Any
    ) -> list[int]:
        n = sum(map(len, ptrs))
        return self._io(self._store.batch_get_into_multi_buffers, keys, n, ptrs, sizes, *rest)

    def batch_put_from(self, keys: Any, ptrs: Any, sizes: Any, *rest: Any) -> list[int]:
        return self._io(self._store.batch_put_from, keys, len(ptrs), ptrs, sizes, *rest)

    def batch_get_into(self, keys: Any, ptrs: Any, sizes: Any) -> list[int]:
        return self._io(self._store.batch_get_into, keys, len(ptrs), ptrs, sizes)

    def batch_is_exist(self, keys: Any) -> list[int]:
        started = time.perf_counter()
        result = self._store.batch_is_exist(keys)
        c = self.counters
        c.exist_s += time.perf_counter() - started
        c.exist_calls += 1
        c.exist_keys += len(keys)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


class Topology:
    """A cluster plus the one native client every contender of a topology shares."""

    def __init__(self, kind: str, config: BenchConfig) -> None:
        self.kind = kind
        self.config = config
        self.cluster: LocalCluster | None = None
        self.native: Any = None
        self.store: _TimedStore | None = None
        self.client_config: dict[str, Any] = {}

    def __enter__(self) -> Topology:
        cfg = self.config
        if self.kind == "remote":
            self.client_config = {
                "master_server_address": cfg.master_server_address,
                "metadata_server": cfg.metadata_server,
                "local_hostname": os.environ.get("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1"),
                "global_segment_size": 0,
            }
        else:
            nodes = 0 if self.kind == "same" else 1
            spec = ClusterSpec(storage_nodes=nodes, storage_node_segment_bytes=cfg.segment_bytes)
            self.cluster = LocalCluster(spec).start()
            segment = cfg.segment_bytes if self.kind == "same" else 0
            self.client_config = dict(self.cluster.client_config(segment))
        self.client_config.update(protocol=cfg.protocol, device_name=cfg.device)
        try:
            self._connect()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _connect(self) -> None:
        from mooncake.store import MooncakeDistributedStore

        cfg, c = self.config, self.client_config
        # The same environment a backend-created client would get.
        for name, value in native_env_defaults(SpanOptions()).items():
            os.environ.setdefault(name, value)
        native = MooncakeDistributedStore()
        rc = native.setup(
            c["local_hostname"],
            c["metadata_server"],
            int(c["global_segment_size"]),
            16 * _MiB,
            cfg.protocol,
            cfg.device,
            c["master_server_address"],
        )
        if rc != 0:
            raise RuntimeError(f"Mooncake setup failed with {rc} for topology {self.kind}")
        self.native = native
        self.store = _TimedStore(native)

    def _disconnect(self) -> None:
        if self.native is not None:
            with contextlib.suppress(Exception):
                self.native.remove_all(True)
            self.native.close()
            self.native = None

    @contextlib.contextmanager
    def own_client(self) -> Iterator[Topology]:
        """A second client on this topology's cluster, without a segment of its own."""
        other = Topology(self.kind, self.config)
        other.client_config = {**self.client_config, "global_segment_size": 0}
        other._connect()
        try:
            yield other
        finally:
            other._disconnect()

    def __exit__(self, *exc: object) -> None:
        self._disconnect()
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None


# ---------------------------------------------------------------------------
# host pools and page views


@dataclass
class PoolPart:
    """One host pool of a workload as the harness addresses it."""

    name: PoolName
    pool: Any
    layout: PageLayout
    per_key: bool  # True: K host pages per key; False: one state slot per call (Mamba)
    views: list[np.ndarray] = field(default_factory=list)  # one (pages, slot bytes) view per slot

    @property
    def page_bytes(self) -> int:
        return self.layout.flat_page_bytes


def _slot_views(layout: PageLayout) -> list[np.ndarray]:
    """Strided uint8 views ``view[page] = bytes of (page, slot)`` over the pool's memory."""
    views = []
    for b in sorted({s for comp in layout.components for s in comp}):
        size, stride = layout.slot_bytes[b], layout.page_stride_bytes[b]
        extent = (layout.num_pages - 1) * stride + size
        flat = np.frombuffer(
            (ctypes.c_uint8 * extent).from_address(layout.base_ptrs[b]), dtype=np.uint8
        )
        views.append(np.lib.stride_tricks.as_strided(flat, (layout.num_pages, size), (stride, 1)))
    return views


def build_parts(
    model: ModelShape, layout: str, host_pages: int, state_slots: int
) -> list[PoolPart]:
    if model.family == "dsa":
        pools = P.build_compressed_hybrid_dsa(
            layout,
            layers=model.layers,
            host_pages=host_pages,
            mamba_layers=model.mamba_layers,
            mamba_slots=state_slots,
            kv_lora_rank=model.kv_lora_rank,
            rope_dim=model.rope_dim,
            index_kpool=DSA_INDEX_KPOOL,
        ).pools
        named = [
            (PoolName.KV, pools[PoolName.KV], True),
            (PoolName.INDEXER, pools[PoolName.INDEXER], True),
            (PoolName.MAMBA, pools[PoolName.MAMBA], False),
        ]
    elif model.family == "mla":
        kv = P.build_mla_host(
            layout,
            layers=model.layers,
            page_tokens=HOST_PAGE_TOKENS,
            host_pages=host_pages,
            kv_lora_rank=model.kv_lora_rank,
            rope_dim=model.rope_dim,
        )
        named = [(PoolName.KV, kv, True)]
    else:
        kv = P.build_mha_host(
            layout,
            layers=model.layers,
            page_tokens=HOST_PAGE_TOKENS,
            host_pages=host_pages,
            heads=model.heads,
            head_dim=model.head_dim,
        )
        named = [(PoolName.KV, kv, True)]
    parts = []
    for name, pool, per_key in named:
        shape = describe_pool(str(name.value), pool, is_mla=model.is_mla)
        if shape.staged or shape.layout is None:
            raise ValueError(f"{model.label}/{layout}: pool {name} has no zero-copy pointers")
        parts.append(PoolPart(name, pool, shape.layout, per_key, _slot_views(shape.layout)))
    return parts


@dataclass(frozen=True)
class Placement:
    """Source and destination host pages of a workload, in two orders.

    ``src``/``dst`` are the same page *sets* for both orders: ``scattered`` is
    a random permutation (the K pages of a key are almost never adjacent);
    ``consecutive`` lists random 8-page-aligned blocks in ascending page order,
    so every key of K <= 8 pages covers adjacent host pages.
    """

    scattered: tuple[np.ndarray, np.ndarray]
    consecutive: tuple[np.ndarray, np.ndarray]
    state_src: np.ndarray
    state_dst: np.ndarray

    @classmethod
    def make(cls, pages: int, calls: int, rng: np.random.Generator) -> Placement:
        block = 8
        blocks = rng.permutation(2 * pages // block)
        src_b, dst_b = blocks[: pages // block], blocks[pages // block :]
        expand = lambda b: (b[:, None] * block + np.arange(block)).reshape(-1)  # noqa: E731
        src_c, dst_c = expand(src_b), expand(dst_b)
        states = rng.permutation(2 * calls)
        return cls(
            scattered=(rng.permutation(src_c), rng.permutation(dst_c)),
            consecutive=(src_c, dst_c),
            state_src=states[:calls],
            state_dst=states[calls:],
        )

    def pages(self, placement: str) -> tuple[np.ndarray, np.ndarray]:
        return self.consecutive if placement == "consecutive" else self.scattered


def _fill_random(parts: list[PoolPart], placement: Placement, rng: np.random.Generator) -> None:
    for part in parts:
        rows = placement.scattered[0] if part.per_key else placement.state_src
        for view in part.views:
            for chunk in _row_chunks(rows, view.shape[1]):
                view[chunk] = rng.integers(0, 256, size=(len(chunk), view.shape[1]), dtype=np.uint8)


def _row_chunks(rows: np.ndarray, row_bytes: int) -> Iterator[np.ndarray]:
    step = max(1, _VERIFY_CHUNK_BYTES // max(row_bytes, 1))
    for start in range(0, len(rows), step):
        yield rows[start : start + step]


_libc = ctypes.CDLL(None)
_memcmp = _libc.memcmp
_memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_memcmp.restype = ctypes.c_int


def _slot_addresses(layout: PageLayout, rows: np.ndarray) -> Iterator[tuple[list[int], int]]:
    for b in sorted({s for comp in layout.components for s in comp}):
        addrs = layout.base_ptrs[b] + rows.astype(np.int64) * layout.page_stride_bytes[b]
        yield addrs.tolist(), layout.slot_bytes[b]


def _wipe(parts: list[PoolPart], dst: np.ndarray, state_dst: np.ndarray) -> None:
    for part in parts:
        for addrs, size in _slot_addresses(part.layout, dst if part.per_key else state_dst):
            for addr in addrs:
                ctypes.memset(addr, 0, size)


def _rows_equal(layout: PageLayout, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row: are all slots of page ``a[i]`` byte-equal to those of ``b[i]`` (memcmp)."""
    out = np.ones(len(a), dtype=bool)
    for (xs, size), (ys, _) in zip(
        _slot_addresses(layout, a), _slot_addresses(layout, b), strict=True
    ):
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            if _memcmp(x, y, size):
                out[i] = False
    return out


# ---------------------------------------------------------------------------
# contenders


def _page_keys(tag: str, count: int) -> list[str]:
    # sglang's keys are 64-hex sha256 strings; unique per contender and run.
    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(count)]


def _slots(pages: np.ndarray, page_tokens: int = HOST_PAGE_TOKENS) -> torch.Tensor:
    return torch.from_numpy(
        (pages[:, None] * page_tokens + np.arange(page_tokens)).reshape(-1).astype(np.int64)
    )


@dataclass
class PreparedRun:
    """Closures of one contender run, built before the clock starts. Each call
    closure returns per-key ok flags; exists closures return hit keys."""

    put: list[Callable[[], list[bool]]]
    get: list[Callable[[], list[bool]]]
    exists: list[Callable[[], int]]
    # one batch_exists_v2 over every key of the run (a long prefix query)
    exists_all: Callable[[], int] | None
    keys: int
    pages_per_key: int
    src: np.ndarray
    dst: np.ndarray


def _storage_config(model: ModelShape, extra: dict[str, Any], name: str) -> Any:
    return P.single_rank_storage_config(
        extra, model_name=name, is_mla=model.is_mla, enable_storage_metrics=False
    )


def _register(store: Any, parts: list[PoolPart]) -> None:
    store.register_mem_pool_host(parts[0].pool)
    for part in parts:
        store.register_mem_host_pool_v2(part.pool, part.name)


class WorkloadRunner:
    """Pools, stores and per-run preparation for one workload."""

    def __init__(self, workload: Workload, topology: Topology, seed: int) -> None:
        self.w = workload
        self.topology = topology
        self.store: _TimedStore = topology.store
        self.calls = workload.pages_per_run // workload.pages_per_call
        self.rng = np.random.default_rng(seed)
        self.parts = build_parts(
            workload.model, workload.layout, 2 * workload.pages_per_run, 2 * self.calls
        )
        self.placement = Placement.make(workload.pages_per_run, self.calls, self.rng)
        _fill_random(self.parts, self.placement, self.rng)
        self.specs = {c: ContenderSpec.parse(c) for c in workload.contenders}
        self.backends: dict[str, Any] = {}
        self.staging: np.ndarray | None = None
        self.nonce = f"{seed}-{time.time_ns()}"
        for name, spec in self.specs.items():
            if spec.kind == "span":
                self.backends[name] = self._make_span(spec)
            elif spec.kind == "upstream":
                self.backends[name] = self._make_upstream()
            elif spec.kind == "memcpy":
                total = workload.pages_per_run * sum(p.page_bytes for p in self.parts if p.per_key)
                total += self.calls * sum(p.page_bytes for p in self.parts if not p.per_key)
                # Pre-faulted: first-touch page faults would cost 3x (anchors §1a).
                self.staging = np.ones(total, dtype=np.uint8)

    @property
    def storage_page_tokens(self) -> int:
        return HOST_PAGE_TOKENS * (DSA_INDEX_KPOOL if self.w.model.family == "dsa" else 1)

    def _extra(self) -> dict[str, Any]:
        return {**self.topology.client_config, "span_layout_guard": "off"}

    def _make_span(self, spec: ContenderSpec) -> MooncakeSpanStore:
        if self.w.model.family == "dsa" and spec.pages_per_key != DSA_INDEX_KPOOL:
            raise ValueError("the compressed DSA model's storage page is 4 host pages")
        from mooncake.store import ReplicateConfig

        extra = {
            **self._extra(),
            "storage_page_size": HOST_PAGE_TOKENS * spec.pages_per_key,
            "span_max_buffers_per_call": spec.max_buffers_per_call,
            "span_group_ids": spec.group_ids,
        }
        binding = NativeBinding(lambda: self.store, ReplicateConfig)
        store = MooncakeSpanStore(
            _storage_config(self.w.model, extra, f"bench-{self.nonce}"), {}, binding=binding
        )
        _register(store, self.parts)
        store.on_host_pools_registered()
        return store

    def _make_upstream(self) -> Any:
        from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

        store_proxy = self.store
        config = _storage_config(self.w.model, self._extra(), f"bench-up-{self.nonce}")
        # The real upstream class, constructed as sglang does; only the native
        # client it creates is the topology's shared one.
        with mock.patch.object(
            MooncakeStore, "_import_mooncake_store", lambda _self: lambda: store_proxy
        ):
            store = MooncakeStore(config, self.parts[0].pool)
        _register(store, self.parts)
        return store

    def close(self) -> None:
        for store in self.backends.values():
            with contextlib.suppress(Exception):
                store.close()
        self.backends.clear()
        self.store.unregister_all()
        self.parts.clear()
        self.staging = None

    # ---- per-run preparation ------------------------------------------------

    def prepare(self, name: str, rep: int) -> PreparedRun:
        spec = self.specs[name]
        src, dst = self.placement.pages(spec.placement)
        k = spec.pages_per_key
        keys = _page_keys(f"{self.nonce}/{name}/{rep}", len(src) // k)
        builder = {
            "memcpy": self._prep_memcpy,
            "raw-1buf": self._prep_raw,
            "raw": self._prep_raw,
            "span": self._prep_backend,
            "upstream": self._prep_backend,
        }[spec.kind]
        put, get, exists = builder(spec, keys, src, dst)
        exists_all = None
        if spec.kind in ("span", "upstream"):
            exists_all = _backend_exists(self.backends[name], keys, self.w.model.family == "dsa")
        return PreparedRun(put, get, exists, exists_all, len(keys), k, src, dst)

    def _call_pages(self, pages: np.ndarray, c: int) -> np.ndarray:
        p = self.w.pages_per_call
        return pages[c * p : (c + 1) * p]

    def _prep_memcpy(self, spec: ContenderSpec, keys: list[str], src: np.ndarray, dst: np.ndarray):
        assert self.staging is not None
        puts, gets = [], []
        offset = 0
        for c in range(self.calls):
            pairs_put, pairs_get = [], []
            for part in self.parts:
                if part.per_key:
                    rows = zip(self._call_pages(src, c), self._call_pages(dst, c), strict=True)
                else:
                    rows = [(self.placement.state_src[c], self.placement.state_dst[c])]
                for s_row, d_row in rows:
                    for view in part.views:
                        n = view.shape[1]
                        stage = self.staging[offset : offset + n]
                        offset += n
                        pairs_put.append((stage, view[s_row]))
                        pairs_get.append((view[d_row], stage))
            n_keys = self.w.pages_per_call
            puts.append(_copy_closure(pairs_put, n_keys))
            gets.append(_copy_closure(pairs_get, n_keys))
        return puts, gets, []

    def _prep_raw(self, spec: ContenderSpec, keys: list[str], src: np.ndarray, dst: np.ndarray):
        from mooncake.store import ReplicateConfig

        k = spec.pages_per_key
        kpc = self.w.pages_per_call // k
        single = spec.kind == "raw-1buf"
        config = ReplicateConfig()
        store = self.store
        puts, gets = [], []
        for c in range(self.calls):
            call_keys = keys[c * kpc : (c + 1) * kpc]
            put_calls: list[tuple[Callable[[], list[int]], list[int], list[int] | None]] = []
            get_calls: list[tuple[Callable[[], list[int]], list[int], list[int] | None]] = []
            for part in self.parts:
                if part.per_key:
                    s_pages = self._call_pages(src, c).reshape(kpc, k)
                    d_pages = self._call_pages(dst, c).reshape(kpc, k)
                    owners = list(range(kpc))
                    part_keys = call_keys
                else:
                    s_pages = np.array([[self.placement.state_src[c]]])
                    d_pages = np.array([[self.placement.state_dst[c]]])
                    owners = [kpc - 1]
                    part_keys = [call_keys[-1]]
                s_plans = plan_objects(part.layout, s_pages)
                d_plans = plan_objects(part.layout, d_pages)
                ncomp = len(part.layout.components)
                obj_keys = [
                    f"{key}_{part.name.value}_{j}" for key in part_keys for j in range(ncomp)
                ]
                obj_owner = [owners[i // ncomp] for i in range(len(obj_keys))]
                if single and any(len(p.ptrs) != 1 for p in s_plans + d_plans):
                    raise ValueError(
                        f"{spec.name}: {part.name} page objects are not single buffers"
                    )
                for call in split_calls([len(p.ptrs) for p in s_plans], spec.max_buffers_per_call):
                    idx = list(call)
                    ck, own = [obj_keys[i] for i in idx], [obj_owner[i] for i in idx]
                    if single:
                        fn = _bind(
                            store.batch_put_from,
                            ck,
                            [s_plans[i].ptrs[0] for i in idx],
                            [s_plans[i].sizes[0] for i in idx],
                            config,
                        )
                    else:
                        fn = _bind(
                            store.batch_put_from_multi_buffers,
                            ck,
                            [s_plans[i].ptrs for i in idx],
                            [s_plans[i].sizes for i in idx],
                            config,
                        )
                    put_calls.append((fn, own, None))
                # Split the get by its own buffer counts: a source key whose
                # pages happen to be adjacent coalesces, its destination may not.
                for call in split_calls([len(p.ptrs) for p in d_plans], spec.max_buffers_per_call):
                    idx = list(call)
                    ck, own = [obj_keys[i] for i in idx], [obj_owner[i] for i in idx]
                    nbytes = [d_plans[i].nbytes for i in idx]
                    if single:
                        fn = _bind(
                            store.batch_get_into,
                            ck,
                            [d_plans[i].ptrs[0] for i in idx],
                            [d_plans[i].sizes[0] for i in idx],
                        )
                    else:
                        fn = _bind(
                            store.batch_get_into_multi_buffers,
                            ck,
                            [d_plans[i].ptrs for i in idx],
                            [d_plans[i].sizes for i in idx],
                        )
                    get_calls.append((fn, own, nbytes))
            puts.append(_raw_closure(put_calls, kpc, is_put=True))
            gets.append(_raw_closure(get_calls, kpc, is_put=False))
        return puts, gets, []

    def _upstream_pages_per_call(self) -> int:
        """Pages per upstream call that stay within the TCP per-peer limit.

        Upstream MooncakeStore sends one native call per v1/v2 call and never
        splits it; past 2048 buffers to one peer the TCP transport fails the
        call (anchors §2c). The harness therefore cuts upstream's batches so it
        can be measured at all over TCP (a concession; sglang's controller
        sends 128 keys per call, which fails for layer_first models with
        more than 16 layers). The memcpy path has no such limit.
        """
        if self.topology.kind == "same":
            return self.w.pages_per_call
        per_page = max(len(p.layout.slot_bytes) for p in self.parts if p.per_key)
        return max(1, min(self.w.pages_per_call, TCP_BUFFERS_PER_CALL // per_page))

    def _prep_backend(self, spec: ContenderSpec, keys: list[str], src: np.ndarray, dst: np.ndarray):
        store = self.backends[spec.name]
        k = spec.pages_per_key
        step_pages = (
            self.w.pages_per_call if spec.kind == "span" else self._upstream_pages_per_call()
        )
        dsa = self.w.model.family == "dsa"
        puts, gets, exists = [], [], []
        for c in range(self.calls):
            s_call, d_call = self._call_pages(src, c), self._call_pages(dst, c)
            kpc = self.w.pages_per_call // k
            call_keys = keys[c * kpc : (c + 1) * kpc]
            put_steps, get_steps = [], []
            for lo in range(0, len(s_call), step_pages):
                sub_keys = call_keys[lo // k : (lo + step_pages) // k]
                s_slots, d_slots = (
                    _slots(s_call[lo : lo + step_pages]),
                    _slots(d_call[lo : lo + step_pages]),
                )
                last = lo + step_pages >= len(s_call)
                put_steps.append(
                    _backend_put(
                        store, sub_keys, s_slots, dsa, last, int(self.placement.state_src[c])
                    )
                )
                get_steps.append(
                    _backend_get(
                        store, sub_keys, d_slots, dsa, last, int(self.placement.state_dst[c])
                    )
                )
            puts.append(_chain(put_steps))
            gets.append(_chain(get_steps))
            exists.append(_backend_exists(store, call_keys, dsa))
        return puts, gets, exists

    def plan_seconds(self, name: str) -> float | None:
        """Pure planning time per call of a span contender: ``plan_objects`` on its pages."""
        spec = self.specs[name]
        if spec.kind != "span":
            return None
        src, _ = self.placement.pages(spec.placement)
        k = spec.pages_per_key
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            for c in range(self.calls):
                pages = self._call_pages(src, c).reshape(-1, k)
                for part in self.parts:
                    if part.per_key:
                        plan_objects(part.layout, pages)
            best = min(best, time.perf_counter() - started)
        return best / self.calls

    def pointers_per_key(self, name: str) -> float:
        """Buffers per key (all pools) the contender's objects carry, from the planner."""
        spec = self.specs[name]
        if spec.kind == "memcpy":
            return float(sum(len(p.views) for p in self.parts if p.per_key))
        src, _ = self.placement.pages(spec.placement)
        k = spec.pages_per_key
        pages = src[: 64 * k].reshape(-1, k)
        total = sum(
            sum(len(pl.ptrs) for pl in plan_objects(p.layout, pages))
            for p in self.parts
            if p.per_key
        )
        return total / len(pages)

    # ---- verification -------------------------------------------------------------

    def wipe(self, run: PreparedRun) -> None:
        _wipe(self.parts, run.dst, self.placement.state_dst)

    def verify(self, run: PreparedRun, key_ok: np.ndarray) -> tuple[bool, int]:
        """(every page of every key reported ok is byte-exact, pages compared)."""
        page_ok = np.repeat(key_ok, run.pages_per_key)
        src, dst = run.src[page_ok], run.dst[page_ok]
        good = True
        for part in self.parts:
            if part.per_key:
                good &= bool(_rows_equal(part.layout, src, dst).all())
            else:
                # the state of call c belongs to the call's last key
                call_ok = key_ok.reshape(self.calls, -1)[:, -1]
                s = self.placement.state_src[call_ok]
                d = self.placement.state_dst[call_ok]
                good &= bool(_rows_equal(part.layout, s, d).all())
        return good, int(page_ok.sum())

    def remove_all(self) -> None:
        self.topology.native.remove_all(True)


def _bind(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    return lambda: fn(*args)


def _copy_closure(
    pairs: list[tuple[np.ndarray, np.ndarray]], n_keys: int
) -> Callable[[], list[bool]]:
    copyto = np.copyto

    def run() -> list[bool]:
        for d, s in pairs:
            copyto(d, s)
        return [True] * n_keys

    return run


def _raw_closure(
    calls: list[tuple[Callable[[], list[int]], list[int], Any]], n_keys: int, *, is_put: bool
):
    def run() -> list[bool]:
        ok = [True] * n_keys
        for fn, owners, expect in calls:
            codes = fn()
            if is_put:
                for owner, code in zip(owners, codes, strict=True):
                    if code != 0:
                        ok[owner] = False
            else:
                for owner, code, nbytes in zip(owners, codes, expect, strict=True):
                    if code != nbytes:
                        ok[owner] = False
        return ok

    return run


def _chain(steps: list[Callable[[], list[bool]]]) -> Callable[[], list[bool]]:
    def run() -> list[bool]:
        out: list[bool] = []
        for step in steps:
            out += step()
        return out

    return run


def _and(flags: list[bool], other: list[bool]) -> list[bool]:
    return (
        [a and b for a, b in zip(flags, other, strict=True)]
        if len(other) == len(flags)
        else [False] * len(flags)
    )


def _backend_put(
    store: Any, keys: list[str], slots: torch.Tensor, dsa: bool, last: bool, state: int
):
    if not dsa:
        return lambda: list(store.batch_set_v1(keys, slots))
    sidecars = [
        PoolTransfer(PoolName.INDEXER, host_indices=slots, keys=keys, indices_from_pool=PoolName.KV)
    ]
    if last:
        sidecars.append(
            PoolTransfer(
                PoolName.MAMBA,
                host_indices=torch.tensor([state]),
                keys=[keys[-1]],
                hit_policy=PoolHitPolicy.TRAILING_PAGES,
            )
        )

    def run() -> list[bool]:
        # sglang's HybridCacheController: sidecars first, then KV.
        side = store.batch_set_v2(sidecars)
        ok = _and(list(store.batch_set_v1(keys, slots)), list(side[PoolName.INDEXER]))
        if last:
            ok[-1] = ok[-1] and bool(side[PoolName.MAMBA][0])
        return ok

    return run


def _backend_get(
    store: Any, keys: list[str], slots: torch.Tensor, dsa: bool, last: bool, state: int
):
    if not dsa:
        return lambda: list(store.batch_get_v1(keys, slots))
    indexer = [
        PoolTransfer(PoolName.INDEXER, host_indices=slots, keys=keys, indices_from_pool=PoolName.KV)
    ]
    mamba = [
        PoolTransfer(
            PoolName.MAMBA,
            host_indices=torch.tensor([state]),
            keys=[keys[-1]],
            hit_policy=PoolHitPolicy.TRAILING_PAGES,
        )
    ]

    def run() -> list[bool]:
        ok = _and(
            list(store.batch_get_v1(keys, slots)),
            list(store.batch_get_v2(indexer)[PoolName.INDEXER]),
        )
        if last:
            ok[-1] = ok[-1] and bool(store.batch_get_v2(mamba)[PoolName.MAMBA][0])
        return ok

    return run


def _backend_exists(store: Any, keys: list[str], dsa: bool) -> Callable[[], int]:
    transfers = None
    if dsa:
        transfers = [
            PoolTransfer(PoolName.INDEXER, keys=None, indices_from_pool=PoolName.KV),
            PoolTransfer(
                PoolName.MAMBA, keys=["placeholder"], hit_policy=PoolHitPolicy.TRAILING_PAGES
            ),
        ]
    return lambda: int(store.batch_exists_v2(keys, transfers).kv_hit_pages)


# ---------------------------------------------------------------------------
# measurement


@dataclass
class RunRecord:
    rep: int
    warmup: bool
    put_s: float
    get_s: float
    exists_s: float | None
    exists_all_s: float | None
    put_native: dict[str, float]
    get_native: dict[str, float]
    exists_native: dict[str, float] | None
    keys_ok_put: int
    keys_ok_get: int
    keys: int
    exists_hits: int | None
    verified: bool
    complete: bool
    pages_compared: int


def _timed(
    calls: Sequence[Callable[[], Any]], store: _TimedStore
) -> tuple[float, list[Any], NativeCounters]:
    before = store.snapshot()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        started = time.perf_counter()
        results = [fn() for fn in calls]
        elapsed = time.perf_counter() - started
    finally:
        if gc_was_enabled:
            gc.enable()
    return elapsed, results, store.snapshot().minus(before)


def run_contender(runner: WorkloadRunner, name: str, rep: int, warmup: bool) -> RunRecord:
    run = runner.prepare(name, rep)
    runner.wipe(run)
    put_s, put_res, put_native = _timed(run.put, runner.store)
    put_ok = np.array([f for call in put_res for f in call], dtype=bool)
    exists_s = exists_native = hits = None
    if run.exists:
        exists_s, hit_list, ex_native = _timed(run.exists, runner.store)
        hits, exists_native = int(sum(hit_list)), asdict(ex_native)
    exists_all_s = None
    if run.exists_all is not None:
        # best of 3: a single short call is at the mercy of the scheduler
        tries = [_timed([run.exists_all], runner.store) for _ in range(3)]
        exists_all_s = min(t[0] for t in tries)
        if any(t[1][0] != run.keys for t in tries):
            hits = -1
    get_s, get_res, get_native = _timed(run.get, runner.store)
    get_ok = np.array([f for call in get_res for f in call], dtype=bool)
    key_ok = get_ok & put_ok if len(get_ok) == len(put_ok) else np.zeros(run.keys, dtype=bool)
    verified, compared = runner.verify(run, key_ok)
    runner.remove_all()
    return RunRecord(
        rep=rep,
        warmup=warmup,
        put_s=put_s,
        get_s=get_s,
        exists_s=exists_s,
        exists_all_s=exists_all_s,
        put_native=asdict(put_native),
        get_native=asdict(get_native),
        exists_native=exists_native,
        keys_ok_put=int(put_ok.sum()),
        keys_ok_get=int(get_ok.sum()),
        keys=run.keys,
        exists_hits=hits,
        verified=verified,
        complete=bool(key_ok.all()) and len(key_ok) == run.keys,
        pages_compared=compared,
    )


def _stats(values: Sequence[float]) -> dict[str, float | None]:
    vals = [v for v in values if v is not None and v > 0]
    if not vals:
        return {"best": None, "median": None}
    return {"best": max(vals), "median": statistics.median(vals)}


def _lat_stats(values: Sequence[float]) -> dict[str, float | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"min": None, "median": None}
    return {"min": min(vals), "median": statistics.median(vals)}


def summarize(
    workload: Workload, runner_info: dict[str, Any], name: str, records: list[RunRecord]
) -> dict[str, Any]:
    spec = ContenderSpec.parse(name)
    timed = [r for r in records if not r.warmup]
    bytes_per_run = runner_info["bytes_per_run"]
    pages = workload.pages_per_run
    keys = pages // spec.pages_per_key
    calls = workload.pages_per_run // workload.pages_per_call
    tokens = pages * HOST_PAGE_TOKENS
    out: dict[str, Any] = {
        "pages_per_key": spec.pages_per_key,
        "keys_per_run": keys,
        "keys_per_call": workload.pages_per_call // spec.pages_per_key,
        "placement": spec.placement,
        "put_gbps": _stats([bytes_per_run / r.put_s / 1e9 for r in timed if r.complete]),
        "get_gbps": _stats([bytes_per_run / r.get_s / 1e9 for r in timed if r.complete]),
        "put_pages_per_s": _stats([pages / r.put_s for r in timed if r.complete]),
        "get_pages_per_s": _stats([pages / r.get_s for r in timed if r.complete]),
        "put_keys_per_s": _stats([keys / r.put_s for r in timed if r.complete]),
        "get_keys_per_s": _stats([keys / r.get_s for r in timed if r.complete]),
        # wall time minus time inside native Mooncake calls (memcpy has none)
        "put_python_ms_per_call": _lat_stats(
            [
                (r.put_s - r.put_native["io_s"] - r.put_native["exist_s"]) / calls * 1e3
                for r in timed
                if spec.kind != "memcpy"
            ]
        ),
        "get_python_ms_per_call": _lat_stats(
            [
                (r.get_s - r.get_native["io_s"] - r.get_native["exist_s"]) / calls * 1e3
                for r in timed
                if spec.kind != "memcpy"
            ]
        ),
        "put_native_ms_per_call": _lat_stats(
            [
                (r.put_native["io_s"] + r.put_native["exist_s"]) / calls * 1e3
                for r in timed
                if spec.kind != "memcpy"
            ]
        ),
        "get_native_ms_per_call": _lat_stats(
            [
                (r.get_native["io_s"] + r.get_native["exist_s"]) / calls * 1e3
                for r in timed
                if spec.kind != "memcpy"
            ]
        ),
        "exists_python_ms_per_call": _lat_stats(
            [(r.exists_s - r.exists_native["exist_s"]) / calls * 1e3 for r in timed if r.exists_s]
        ),
        "native_calls_per_run": {
            "put": timed[0].put_native["io_calls"],
            "get": timed[0].get_native["io_calls"],
        }
        if timed
        else None,
        "buffers_per_native_call": (
            timed[0].put_native["io_buffers"] / max(1, timed[0].put_native["io_calls"])
        )
        if timed
        else None,
        "pointers_per_key": runner_info["pointers_per_key"].get(name),
        "plan_us_per_call": (runner_info["plan_s"].get(name) or 0) * 1e6
        if runner_info["plan_s"].get(name)
        else None,
        "exists_us_per_ktoken": _lat_stats(
            [r.exists_s / tokens * 1e3 * 1e6 for r in timed if r.exists_s]
        ),
        "exists_ms_per_call": _lat_stats([r.exists_s / calls * 1e3 for r in timed if r.exists_s]),
        # one query over all keys of the run (pages_per_run pages)
        "exists_all_us_per_ktoken": _lat_stats(
            [r.exists_all_s / tokens * 1e9 for r in timed if r.exists_all_s]
        ),
        "exists_all_ms": _lat_stats([r.exists_all_s * 1e3 for r in timed if r.exists_all_s]),
        "verified_byte_exact": all(r.verified for r in records),
        "complete": all(r.complete for r in records),
        "failed_keys_max": max((r.keys - min(r.keys_ok_put, r.keys_ok_get)) for r in records)
        if records
        else 0,
        "expected_failure": name in workload.expected_failures,
    }
    return out


def throughput_ratio(a: list[RunRecord], b: list[RunRecord], attr: str) -> dict[str, float | None]:
    """Throughput of a / throughput of b on the same bytes (a faster -> > 1).

    ``median``: median over timed repetitions of the per-repetition ratio
    (a and b ran back to back in that repetition); ``best``: best run of a
    against best run of b.
    """
    times_b = {r.rep: getattr(r, attr) for r in b if not r.warmup and r.complete}
    pairs = [
        times_b[r.rep] / getattr(r, attr)
        for r in a
        if not r.warmup and r.complete and r.rep in times_b
    ]
    best_a = min((getattr(r, attr) for r in a if not r.warmup and r.complete), default=None)
    best_b = min(times_b.values(), default=None)
    return {
        "median": statistics.median(pairs) if pairs else None,
        "best": (best_b / best_a) if best_a and best_b else None,
        "n": len(pairs),
    }


# ---------------------------------------------------------------------------
# driver


def _machine() -> dict[str, Any]:
    info: dict[str, Any] = {"nproc": os.cpu_count(), "platform": platform.platform()}
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError):
        for line in open("/proc/meminfo", encoding="utf-8"):
            if line.startswith("MemTotal"):
                info["mem_total_gib"] = round(int(line.split()[1]) / (1 << 20), 1)
    with contextlib.suppress(OSError):
        info["loadavg_start"] = os.getloadavg()
    return info


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in (
        "torch",
        "numpy",
        "sglang",
        "mooncake-transfer-engine-non-cuda",
        "mooncake-transfer-engine",
    ):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    with contextlib.suppress(Exception):
        out["git_commit"] = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                timeout=5,
                cwd=os.path.dirname(__file__),
            ).stdout.strip()
            or None
        )
    return out


class _Progress:
    def __init__(self, total: int, enabled: bool, stream: Any) -> None:
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(
                    total=total, file=stream, unit="run", dynamic_ncols=True, leave=True
                )
            except ImportError:
                self._bar = None
        self._stream = stream if enabled else None
        self._done, self._total = 0, total

    def step(self, label: str) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.set_description_str(label[:48], refresh=False)
            self._bar.update(1)
        elif self._stream is not None:
            self._stream.write(f"\r[{self._done}/{self._total}] {label[:60]:<60}")
            self._stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._stream is not None:
            self._stream.write("\n")


def run_bench(
    config: BenchConfig,
    *,
    native_log: str | None = None,
    workloads: Sequence[Workload] | None = None,
) -> dict[str, Any]:
    """Run every workload of ``config`` (or ``workloads``); return the result document."""
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    started = time.time()
    workloads = list(workloads) if workloads is not None else plan_workloads(config)
    total = sum(len(w.contenders) * _reps(w, config)[1] for w in workloads)
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "machine": _machine(),
        "versions": _versions(),
        "env": {
            k: os.environ.get(k)
            for k in (
                "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER",
                "MC_TCP_STATUS_TIMEOUT_SEC",
                "MC_TCP_BIND_ADDRESS",
                "MC_STORE_MEMCPY",
            )
        },
        "config": {k: v for k, v in asdict(config).items() if k != "progress"},
        "workloads": [],
    }
    by_topology: dict[str, list[Workload]] = {}
    for w in workloads:
        by_topology.setdefault(w.topology, []).append(w)
    with native_stderr_to(native_log) as err:
        progress = _Progress(total, config.progress, err)
        try:
            for topo_name, items in by_topology.items():
                with Topology(topo_name, config) as topology:
                    ordered = [w for w in items if not w.isolated] + [
                        w for w in items if w.isolated
                    ]
                    for index, workload in enumerate(ordered):
                        with contextlib.ExitStack() as stack:
                            client = (
                                stack.enter_context(topology.own_client())
                                if workload.isolated
                                else topology
                            )
                            result["workloads"].append(
                                _run_workload(
                                    workload, client, config, config.seed + index, progress
                                )
                            )
                        gc.collect()
        finally:
            progress.close()
    result["targets"] = evaluate_targets(result)
    result["verified_byte_exact"] = all(
        c["summary"]["verified_byte_exact"] for w in result["workloads"] for c in w["contenders"]
    )
    result["all_complete_except_expected"] = all(
        c["summary"]["complete"] or c["summary"]["expected_failure"]
        for w in result["workloads"]
        for c in w["contenders"]
    )
    with contextlib.suppress(OSError):
        result["machine"]["loadavg_end"] = os.getloadavg()
    result["elapsed_s"] = round(time.time() - started, 1)
    return result


def _reps(workload: Workload, config: BenchConfig) -> tuple[int, int]:
    """(warm-up repetitions, all repetitions) of a workload."""
    warmup = config.warmup if workload.warmup is None else workload.warmup
    reps = config.reps if workload.reps is None else workload.reps
    return warmup, warmup + reps


def _run_workload(
    workload: Workload, topology: Topology, config: BenchConfig, seed: int, progress: _Progress
) -> dict[str, Any]:
    runner = WorkloadRunner(workload, topology, seed)
    try:
        names = list(workload.contenders)
        bytes_per_run = workload.pages_per_run * sum(
            p.page_bytes for p in runner.parts if p.per_key
        )
        bytes_per_run += runner.calls * sum(p.page_bytes for p in runner.parts if not p.per_key)
        info = {
            "bytes_per_run": bytes_per_run,
            "pointers_per_key": {n: runner.pointers_per_key(n) for n in names},
            "plan_s": {n: runner.plan_seconds(n) for n in names},
        }
        records: dict[str, list[RunRecord]] = {n: [] for n in names}
        runner.remove_all()
        warmup, total_reps = _reps(workload, config)
        started = time.perf_counter()
        for rep in range(total_reps):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                records[name].append(run_contender(runner, name, rep, warmup=rep < warmup))
                progress.step(
                    f"{workload.topology} {workload.model.label} {workload.layout[:5]} {name}"
                )
        return {
            "name": workload.name,
            "section": workload.section,
            "topology": workload.topology,
            "model": asdict(workload.model),
            "layout": workload.layout,
            "pages_per_run": workload.pages_per_run,
            "pages_per_call": workload.pages_per_call,
            "kv_page_bytes": runner.parts[0].page_bytes,
            "page_bytes_all_pools": sum(p.page_bytes for p in runner.parts if p.per_key),
            "layers": workload.model.layers,
            "bytes_per_run": bytes_per_run,
            "upstream_pages_per_native_call": runner._upstream_pages_per_call()
            if "upstream" in names
            else None,
            "isolated_client": workload.isolated,
            "elapsed_s": round(time.perf_counter() - started, 2),
            "contenders": [
                {
                    "name": n,
                    "summary": summarize(workload, info, n, records[n]),
                    "runs": [asdict(r) for r in records[n]],
                }
                for n in names
            ],
        }
    finally:
        runner.close()


# ---------------------------------------------------------------------------
# targets


def _records(w: dict[str, Any], name: str) -> list[RunRecord] | None:
    for c in w["contenders"]:
        if c["name"] == name:
            return [RunRecord(**r) for r in c["runs"]]
    return None


def _summary(w: dict[str, Any], name: str) -> dict[str, Any] | None:
    for c in w["contenders"]:
        if c["name"] == name:
            return c["summary"]
    return None


def _ratio_rows(
    result: dict[str, Any], section: str, a: str, b: str, where: Callable[[dict[str, Any]], bool]
) -> list[dict[str, Any]]:
    """a/b throughput ratios (a faster -> > 1) for every matching workload."""
    rows = []
    for w in result["workloads"]:
        if w["section"] != section or not where(w):
            continue
        ra, rb = _records(w, a), _records(w, b)
        if ra is None or rb is None:
            continue
        rows.append(
            {
                "workload": w["name"],
                "put": throughput_ratio(ra, rb, "put_s"),
                "get": throughput_ratio(ra, rb, "get_s"),
            }
        )
    return rows


def _worst(rows: list[dict[str, Any]], key: str = "median") -> float | None:
    vals = [r[d][key] for r in rows for d in ("put", "get") if r[d][key] is not None]
    return min(vals) if vals else None


def evaluate_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    targets: list[dict[str, Any]] = []

    def add(
        tid: str,
        text: str,
        goal: float,
        rows: list[dict[str, Any]],
        extra: dict[str, Any] | None = None,
        achieved: float | None = None,
    ) -> None:
        value = achieved if achieved is not None else _worst(rows)
        targets.append(
            {
                "id": tid,
                "description": text,
                "target": goal,
                "achieved_worst_median": value,
                "achieved_worst_best": _worst(rows, "best") if rows else None,
                "passed": None if value is None else value >= goal,
                "rows": rows,
                **(extra or {}),
            }
        )

    local = lambda w: w["topology"] == "same"  # noqa: E731
    remote = lambda w: w["topology"] != "same"  # noqa: E731
    add(
        "backend_overhead",
        "span-K4 throughput / raw Mooncake calls on the same objects (K=4)",
        0.90,
        _ratio_rows(result, "grid", "span-K4", "raw-K4", lambda w: True),
    )
    add(
        "k4_vs_upstream_small_local",
        "span-K4 / upstream MooncakeStore pages/s, 64 KiB pages, one process",
        1.5,
        _ratio_rows(
            result,
            "grid",
            "span-K4",
            "upstream",
            lambda w: local(w) and w["model"]["size"] == SMALL,
        ),
    )
    add(
        "k4_vs_upstream_large_local",
        "span-K4 / upstream pages/s, 2.5 MiB pages, one process",
        1.0,
        _ratio_rows(
            result,
            "grid",
            "span-K4",
            "upstream",
            lambda w: local(w) and w["model"]["size"] == LARGE,
        ),
    )
    add(
        "k4_vs_upstream_tcp",
        "span-K4 / upstream pages/s over TCP (all page sizes)",
        1.0,
        _ratio_rows(result, "grid", "span-K4", "upstream", remote),
    )
    add(
        "memcpy_fraction",
        "span-K4 throughput / chunked single-thread memcpy, one process",
        0.80,
        _ratio_rows(result, "grid", "span-K4", "memcpy", local),
    )

    # exists: per-token latency upstream / span, per call (sglang-sized batches)
    # and for one query over the whole run
    ex_rows = []
    for w in result["workloads"]:
        if w["section"] not in ("grid", "batch"):
            continue
        s, u = _summary(w, "span-K4"), _summary(w, "upstream")
        if not (
            s and u and s["exists_us_per_ktoken"]["median"] and u["exists_us_per_ktoken"]["median"]
        ):
            continue
        row = {
            "workload": w["name"],
            "span_us_per_ktoken": s["exists_us_per_ktoken"]["median"],
            "upstream_us_per_ktoken": u["exists_us_per_ktoken"]["median"],
            "speedup_median": u["exists_us_per_ktoken"]["median"]
            / s["exists_us_per_ktoken"]["median"],
            "speedup_best": u["exists_us_per_ktoken"]["min"] / s["exists_us_per_ktoken"]["min"],
            "tokens_per_query": w["pages_per_call"] * HOST_PAGE_TOKENS,
        }
        if s["exists_all_us_per_ktoken"]["median"] and u["exists_all_us_per_ktoken"]["median"]:
            row["whole_run_speedup_median"] = (
                u["exists_all_us_per_ktoken"]["median"] / s["exists_all_us_per_ktoken"]["median"]
            )
            row["whole_run_tokens"] = w["pages_per_run"] * HOST_PAGE_TOKENS
        ex_rows.append(row)
    per_call = [r["speedup_median"] for r in ex_rows if r["workload"].startswith("grid/")]
    whole = [r["whole_run_speedup_median"] for r in ex_rows if "whole_run_speedup_median" in r]
    targets.append(
        {
            "id": "exists_per_token",
            "description": "batch_exists_v2 latency per token, upstream / span-K4 (per call at "
            "the workload's "
            "batch; whole_run = one query over every key of the run)",
            "target": 3.0,
            "achieved_worst_median": min(per_call, default=None),
            "achieved_worst_best": min(
                (r["speedup_best"] for r in ex_rows if r["workload"].startswith("grid/")),
                default=None,
            ),
            "whole_run_worst_median": min(whole, default=None),
            "passed": None if not per_call else min(per_call) >= 3.0,
            "rows": ex_rows,
        }
    )

    # coalescing: pointers per key <= L with consecutive pages, and the gain
    co_rows = []
    for w in result["workloads"]:
        if w["section"] != "coalesce":
            continue
        cons, scat = _summary(w, "span-K4@consec"), _summary(w, "span-K4")
        ratio = _ratio_rows(
            result, "coalesce", "span-K4@consec", "span-K4", lambda x, n=w["name"]: x["name"] == n
        )
        co_rows.append(
            {
                "workload": w["name"],
                "layers": w["layers"],
                "pointers_per_key_consecutive": cons["pointers_per_key"] if cons else None,
                "pointers_per_key_scattered": scat["pointers_per_key"] if scat else None,
                "gain": ratio[0] if ratio else None,
            }
        )
    ok_ptrs = (
        all(
            r["pointers_per_key_consecutive"] is not None
            and r["pointers_per_key_consecutive"] <= r["layers"]
            for r in co_rows
        )
        if co_rows
        else None
    )
    tcp_gain = [r["gain"] for r in co_rows if "/same/" not in r["workload"] and r["gain"]]
    targets.append(
        {
            "id": "coalescing",
            "description": "layer_first, consecutive pages: pointers/key <= L; gain vs scattered",
            "target": "ptrs/key <= L",
            "passed": ok_ptrs,
            "achieved_worst_median": _worst(tcp_gain) if tcp_gain else None,
            "achieved_worst_best": _worst(tcp_gain, "best") if tcp_gain else None,
            "rows": co_rows,
        }
    )

    # chunk sweep: the default (2048) succeeds and is within 10% of the best
    ch_rows = []
    for w in result["workloads"]:
        if w["section"] != "chunks":
            continue
        sums = {c["name"]: c["summary"] for c in w["contenders"]}
        default = f"span-K4-mb{TCP_BUFFERS_PER_CALL}"
        ok = {n: s for n, s in sums.items() if s["complete"] and s["put_gbps"]["median"]}
        row: dict[str, Any] = {
            "workload": w["name"],
            "default_complete": sums.get(default, {}).get("complete"),
            "per_chunk": {
                n: {
                    "complete": s["complete"],
                    "failed_keys_max": s["failed_keys_max"],
                    "put_gbps": s["put_gbps"],
                    "get_gbps": s["get_gbps"],
                }
                for n, s in sums.items()
            },
        }
        if default in ok:
            for d in ("put", "get"):
                best = max(s[f"{d}_gbps"]["median"] for s in ok.values())
                row[f"{d}_fraction_of_best"] = ok[default][f"{d}_gbps"]["median"] / best
        ch_rows.append(row)
    fractions = [r.get(f"{d}_fraction_of_best") for r in ch_rows for d in ("put", "get")]
    fractions = [f for f in fractions if f is not None]
    sweeps = [r for r in ch_rows if r["default_complete"] is not None]
    targets.append(
        {
            "id": "chunked_calls",
            "description": "N keys x 312 buffers over TCP: the default split (2048) succeeds "
            "and is within 10% "
            "of the best span_max_buffers_per_call",
            "target": 0.90,
            "achieved_worst_median": min(fractions) if fractions else None,
            "passed": (all(r["default_complete"] for r in sweeps) and min(fractions) >= 0.90)
            if fractions
            else None,
            "rows": ch_rows,
        }
    )
    return targets


# ---------------------------------------------------------------------------
# reporting


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def format_table(result: dict[str, Any]) -> str:
    lines = []
    m = result["machine"]
    lines.append(
        f"mooncake-span bench {result['date_utc']}  {m.get('nproc')} CPUs "
        f"({m.get('cpu_model', '?')}), {m.get('mem_total_gib', '?')} GiB; timed reps "
        f"{result['config']['reps']} (+{result['config']['warmup']} warm-up); "
        "GB/s = 1e9 B/s, best/median"
    )
    header = (
        f"  {'contender':<16}{'keys/call':>9}{'ptrs/key':>9}{'put GB/s':>14}{'get GB/s':>14}"
        f"{'put kpg/s':>10}{'get kpg/s':>10}{'py ms/call':>12}{'exist us/ktok':>14}  ok"
    )
    for w in result["workloads"]:
        lines.append("")
        lines.append(
            f"[{w['name']}] {w['model']['layers']} layers, KV page "
            f"{w['kv_page_bytes'] / 1024:.0f} KiB (all pools "
            f"{w['page_bytes_all_pools'] / 1024:.0f} KiB/page), {w['pages_per_run']} pages = "
            f"{w['bytes_per_run'] / _MiB:.0f} MiB per run, {w['pages_per_call']} pages/call"
            + (
                f", upstream {w['upstream_pages_per_native_call']} pages/native call"
                if w.get("upstream_pages_per_native_call") not in (None, w["pages_per_call"])
                else ""
            )
        )
        lines.append(header)
        for c in w["contenders"]:
            s = c["summary"]
            ok = ("yes" if s["verified_byte_exact"] else "NO") + (
                ""
                if s["complete"]
                else (" (expected fail)" if s["expected_failure"] else " INCOMPLETE")
            )
            py_put = _fmt(s["put_python_ms_per_call"]["median"])
            py = f"{py_put}/{_fmt(s['get_python_ms_per_call']['median'])}"
            lines.append(
                f"  {c['name']:<16}{s['keys_per_call']:>9}{_fmt(s['pointers_per_key'], '.1f'):>9}"
                f"{_fmt(s['put_gbps']['best']) + '/' + _fmt(s['put_gbps']['median']):>14}"
                f"{_fmt(s['get_gbps']['best']) + '/' + _fmt(s['get_gbps']['median']):>14}"
                f"{_fmt((s['put_pages_per_s']['median'] or 0) / 1e3 or None, '.1f'):>10}"
                f"{_fmt((s['get_pages_per_s']['median'] or 0) / 1e3 or None, '.1f'):>10}"
                f"{py:>12}{_fmt(s['exists_us_per_ktoken']['median'], '.1f'):>14}  {ok}"
            )
    lines.append("")
    lines.append(
        "targets (paired per-repetition ratios; worst workload, median of pairs / best-vs-best):"
    )
    for t in result["targets"]:
        verdict = {True: "PASS", False: "MISS", None: "n/a"}[t["passed"]]
        lines.append(
            f"  {verdict:<5}{t['id']:<28} target {t['target']}: worst median "
            f"{_fmt(t.get('achieved_worst_median'))}"
            f", worst best {_fmt(t.get('achieved_worst_best'))}"
        )
        for row in t["rows"]:
            lines.append("         " + _row_text(row))
    lines.append("")
    lines.append(
        f"every get verified byte-exact: {result['verified_byte_exact']}; "
        f"complete (except expected failures): {result['all_complete_except_expected']}; "
        f"elapsed {result['elapsed_s']} s"
    )
    return "\n".join(lines)


def _row_text(row: dict[str, Any]) -> str:
    if "put" in row and isinstance(row["put"], dict):
        return (
            f"{row['workload']}: put {_fmt(row['put']['median'])} ({_fmt(row['put']['best'])}), "
            f"get {_fmt(row['get']['median'])} ({_fmt(row['get']['best'])})"
        )
    if "speedup_median" in row:
        whole = row.get("whole_run_speedup_median")
        return (
            f"{row['workload']}: span {row['span_us_per_ktoken']:.1f} vs upstream "
            f"{row['upstream_us_per_ktoken']:.1f} us/ktoken -> {row['speedup_median']:.2f}x per "
            f"{row['tokens_per_query']}-token call"
            + (f"; {whole:.2f}x for one {row['whole_run_tokens']}-token query" if whole else "")
        )
    if "pointers_per_key_consecutive" in row:
        g = row.get("gain") or {}
        return (
            f"{row['workload']}: ptrs/key consecutive "
            f"{_fmt(row['pointers_per_key_consecutive'], '.0f')} "
            f"vs scattered {_fmt(row['pointers_per_key_scattered'], '.0f')} (L={row['layers']}); "
            f"consecutive/scattered put {_fmt((g.get('put') or {}).get('median'))}, "
            f"get {_fmt((g.get('get') or {}).get('median'))}"
        )
    if "per_chunk" in row:
        parts = [
            f"{n.rsplit('-', 1)[-1]}: "
            f"{'ok' if s['complete'] else 'FAIL(' + str(s['failed_keys_max']) + ' keys)'} "
            f"{_fmt(s['put_gbps']['median'], '.3f')}/{_fmt(s['get_gbps']['median'], '.3f')}"
            for n, s in row["per_chunk"].items()
        ]
        return f"{row['workload']}: " + "; ".join(parts)
    return json.dumps(row)


def write_plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(16, 11))
    colors = {
        "memcpy": "#999999",
        "raw-1buf": "#bbbbdd",
        "raw-K4": "#7777bb",
        "upstream": "#d62728",
        "span-K1": "#c7e9c0",
        "span-K2": "#a1d99b",
        "span-K4": "#31a354",
        "span-K8": "#006d2c",
        "span-K4-nogroup": "#fdae6b",
    }
    for ax, topo in zip(axes[0], ("same", "tcp"), strict=True):
        grid = [
            w
            for w in result["workloads"]
            if w["section"] == "grid"
            and w["topology"] in (topo, "remote" if topo == "tcp" else topo)
        ]
        names = [n for n in colors if any(_summary(w, n) for w in grid)]
        width = 0.8 / max(1, len(names))
        for i, n in enumerate(names):
            xs, ys = [], []
            for j, w in enumerate(grid):
                s = _summary(w, n)
                ref = _summary(w, "upstream") or _summary(w, "raw-K4")
                if (
                    s
                    and ref
                    and s["get_pages_per_s"]["median"]
                    and ref["get_pages_per_s"]["median"]
                ):
                    both = (s["put_pages_per_s"]["median"] or 0) + s["get_pages_per_s"]["median"]
                    xs.append(j + i * width)
                    ys.append(
                        both
                        / (
                            (ref["put_pages_per_s"]["median"] or 0)
                            + ref["get_pages_per_s"]["median"]
                        )
                    )
            ax.bar(xs, ys, width, label=n, color=colors[n])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(grid))])
        ax.set_xticklabels(
            [f"{w['model']['family'] + '-' + w['model']['size']}\n{w['layout']}" for w in grid],
            fontsize=7,
        )
        ax.set_ylabel(
            "put+get pages/s relative to upstream MooncakeStore\n"
            "(median; raw-K4 where upstream n/a)"
        )
        ax.set_title(f"{topo}: throughput vs upstream (per-page objects)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, ncol=4)
    ax = axes[1][0]
    for topo, style in (("same", "-"), ("tcp", "--"), ("remote", "--")):
        batch = [
            w for w in result["workloads"] if w["section"] == "batch" and w["topology"] == topo
        ]
        for n in ("span-K4", "raw-K4", "upstream"):
            pts = [(w["pages_per_call"], _summary(w, n)) for w in batch]
            pts = [(p, s) for p, s in pts if s and s["get_gbps"]["median"]]
            if pts:
                ax.plot(
                    [p for p, _ in pts],
                    [s["get_gbps"]["median"] for _, s in pts],
                    style,
                    marker="o",
                    color=colors[n],
                    label=f"{topo} {n} get",
                )
                ax.plot(
                    [p for p, _ in pts],
                    [s["put_gbps"]["median"] or 0 for _, s in pts],
                    style,
                    marker="x",
                    color=colors[n],
                    alpha=0.5,
                    label=f"{topo} {n} put",
                )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("host pages per call (64 KiB pages; span keys/call = pages/4)")
    ax.set_ylabel("GB/s (median)")
    ax.set_title("batch size sweep, MLA 64 KiB page_first")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6, ncol=2)
    ax = axes[1][1]
    labels, puts, gets = [], [], []
    for w in result["workloads"]:
        if w["section"] in ("chunks", "coalesce"):
            for c in w["contenders"]:
                s = c["summary"]
                labels.append(
                    f"{w['section']}/{w['topology']}\n{c['name']}"
                    + ("" if s["complete"] else "\n(FAILED)")
                )
                # a failed row has no throughput: no bar (log scale)
                puts.append(s["put_gbps"]["median"] or np.nan)
                gets.append(s["get_gbps"]["median"] or np.nan)
    xs = np.arange(len(labels))
    ax.bar(xs - 0.2, puts, 0.4, label="put", color="#6baed6")
    ax.bar(xs + 0.2, gets, 0.4, label="get", color="#08519c")
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, fontsize=6, rotation=60, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("GB/s (median, log scale)")
    ax.set_title("layer_first 78 x 2 KiB buffers: coalescing and call splitting")
    ax.legend(fontsize=7)
    m = result["machine"]
    fig.suptitle(
        f"mooncake-span bench {result['date_utc']} - {m.get('nproc')} x {m.get('cpu_model', '?')}, "
        f"{m.get('mem_total_gib', '?')} GiB",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_GRID_COLUMNS = (
    "memcpy",
    "raw-1buf",
    "raw-K4",
    "span-K1",
    "span-K2",
    "span-K4",
    "span-K8",
    "span-K4-nogroup",
    "upstream",
)


def format_markdown(result: dict[str, Any]) -> str:
    """Markdown tables of a result document (for docs/benchmarks.md)."""
    out: list[str] = []
    grid = [w for w in result["workloads"] if w["section"] == "grid"]
    if grid:
        out.append("| topology | model | layout | KV page | " + " | ".join(_GRID_COLUMNS) + " |")
        out.append("|---|---|---|---:|" + "---:|" * len(_GRID_COLUMNS))
        for w in grid:
            cells = []
            for name in _GRID_COLUMNS:
                s = _summary(w, name)
                cells.append(
                    ""
                    if s is None
                    else f"{_fmt(s['put_gbps']['median'])} / {_fmt(s['get_gbps']['median'])}"
                )
            out.append(
                f"| {w['topology']} | {w['model']['family']}-{w['model']['size']} | "
                f"{w['layout']} | "
                f"{w['kv_page_bytes'] / 1024:.0f} KiB | " + " | ".join(cells) + " |"
            )
        out.append("")
    details = [w for w in result["workloads"] if w["section"] != "grid"]
    if details:
        out.append(
            "| workload | contender | keys/call | ptrs/key | put GB/s best / med "
            "| get GB/s best / med "
            "| put / get kpages/s (med) | Python ms/call put / get | exists µs/ktoken | verified |"
        )
        out.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
        for w in details:
            for c in w["contenders"]:
                s = c["summary"]
                status = "yes" if s["verified_byte_exact"] else "NO"
                if not s["complete"]:
                    status += f", FAILED ({s['failed_keys_max']} keys)"
                out.append(
                    f"| {w['name']} | {c['name']} | {s['keys_per_call']} | "
                    f"{_fmt(s['pointers_per_key'], '.0f')} | "
                    f"{_fmt(s['put_gbps']['best'])} / {_fmt(s['put_gbps']['median'])} | "
                    f"{_fmt(s['get_gbps']['best'])} / {_fmt(s['get_gbps']['median'])} | "
                    f"{_fmt((s['put_pages_per_s']['median'] or 0) / 1e3 or None, '.1f')} / "
                    f"{_fmt((s['get_pages_per_s']['median'] or 0) / 1e3 or None, '.1f')} | "
                    f"{_fmt(s['put_python_ms_per_call']['median'])} / "
                    f"{_fmt(s['get_python_ms_per_call']['median'])} | "
                    f"{_fmt(s['exists_us_per_ktoken']['median'], '.1f')} | {status} |"
                )
        out.append("")
    out.append(
        "| target | goal | worst workload: median of paired ratios (best vs best) | verdict |"
    )
    out.append("|---|---:|---:|---|")
    for t in result["targets"]:
        verdict = {True: "met", False: "**missed**", None: "n/a"}[t["passed"]]
        out.append(
            f"| {t['id']} | {t['target']} | {_fmt(t.get('achieved_worst_median'))} "
            f"({_fmt(t.get('achieved_worst_best'))}) | {verdict} |"
        )
    return "\n".join(out) + "\n"
