"""Adapter overhead: how much of a call is the adapter's own Python.

``mooncake-span bench --overhead`` drives every contender (span K=1/2/4/8,
sglang's upstream ``MooncakeStore`` and raw native calls) the way sglang's
controller does, against two native stores:

* ``NullStore``: the interface of ``MooncakeDistributedStore`` that the
  adapters call, doing no copies and answering success codes. The CPU time
  spent inside its methods is measured and subtracted, so what remains is the
  adapter's Python: what it would cost at RDMA line rate, where the native
  side is a few microseconds.
* the real store of an in-process cluster (``same`` topology), every native
  method timed, so wall time splits into "inside Mooncake" and "own Python".

Numbers are µs per host page and per storage key, with the garbage collector
enabled as in a server. Every contender moves the same host pages per call.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from mooncake_span.errors import ErrorCode
from mooncake_span.span.plan import plan_batch
from mooncake_span_tools.bench import contenders as C
from mooncake_span_tools.bench.pages import build_parts, host_pools
from mooncake_span_tools.bench.shared_native import TimedNativeStore, Topology
from mooncake_span_tools.bench.workloads import (
    HOST_PAGE_TOKENS,
    LARGE,
    MODELS,
    SMALL,
    BenchConfig,
    ContenderSpec,
)
from mooncake_span_tools.testing.backends import span_backend, storage_config, upstream_backend

_NOT_FOUND = int(ErrorCode.OBJECT_NOT_FOUND)


class NullReplicateConfig:
    """``ReplicateConfig`` with the fields the adapters set."""

    def __init__(self) -> None:
        self.replica_num = 1
        self.group_ids: list[str] = []
        self.with_hard_pin = False


def _self_timed(method: Callable[..., Any]) -> Callable[..., Any]:
    """Add the calling thread's CPU time inside ``method`` to ``self.inside_s``."""

    @functools.wraps(method)
    def timed(self: NullStore, *args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.inside_s += time.thread_time() - started

    return timed


class NullStore:
    """``MooncakeDistributedStore``'s data interface, doing nothing.

    Puts record the key (so existence queries and gets answer like a store
    that kept the object) and copy no bytes; gets report the planned byte
    count. The data and existence calls add their own CPU time to
    ``inside_s`` (a few passes over the keys), which the bench subtracts
    like the time inside a real store.
    """

    def __init__(self) -> None:
        self._keys: set[str] = set()
        self._values: dict[str, bytes] = {}
        self.inside_s = 0.0

    def setup(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def register_buffer(self, ptr: int, size: int) -> int:
        return 0 if size > 0 else int(ErrorCode.INVALID_PARAMS)

    def unregister_buffer(self, ptr: int) -> int:
        return 0

    def close(self) -> int:
        return 0

    @_self_timed
    def batch_is_exist(self, keys: list[str]) -> list[int]:
        known = self._keys
        return [1 if k in known else 0 for k in keys]

    def is_exist(self, key: str) -> int:
        return self.batch_is_exist([key])[0]

    def _put(self, keys: list[str]) -> list[int]:
        self._keys.update(keys)
        return [0] * len(keys)

    @_self_timed
    def batch_put_from_multi_buffers(
        self, keys: list[str], ptrs: Any, sizes: Any, config: Any = None
    ) -> list[int]:
        return self._put(keys)

    @_self_timed
    def batch_put_from(self, keys: list[str], ptrs: Any, sizes: Any, config: Any = None):
        return self._put(keys)

    @_self_timed
    def batch_get_into_multi_buffers(self, keys: list[str], ptrs: Any, sizes: Any) -> list[int]:
        known = self._keys
        return [sum(s) if k in known else _NOT_FOUND for k, s in zip(keys, sizes, strict=True)]

    def get_offload_rpc_read_count(self) -> int:
        return 0

    @_self_timed
    def batch_get_into(self, keys: list[str], ptrs: Any, sizes: Any) -> list[int]:
        known = self._keys
        return [s if k in known else _NOT_FOUND for k, s in zip(keys, sizes, strict=True)]

    # Small-value API (upstream's warm-up probe): these do keep the bytes.
    def put(self, key: str, value: bytes, config: Any = None) -> int:
        self._keys.add(key)
        self._values[key] = bytes(value)
        return 0

    def get(self, key: str) -> bytes:
        return self._values.get(key, b"")

    def get_size(self, key: str) -> int:
        return len(self._values.get(key, b"")) if key in self._keys else _NOT_FOUND

    def remove(self, key: str, force: bool = False) -> int:
        return 0 if self._keys.discard(key) is None else _NOT_FOUND

    def remove_all(self, force: bool = False) -> int:
        count = len(self._keys)
        self._keys.clear()
        self._values.clear()
        return count

    def remove_by_regex(self, pattern: str, force: bool = False) -> int:
        return 0


class _CpuClock:
    """CPU time of the calling thread: the machine may be shared, and with the
    do-nothing store the adapter's Python all runs on this thread, so time
    spent descheduled stays out. ``inside_s``: the do-nothing store's own."""

    now = staticmethod(time.thread_time)

    def __init__(self, store: NullStore) -> None:
        self.store = store

    @property
    def inside_s(self) -> float:
        return self.store.inside_s


class _NativeClock:
    """Wall time inside a real native store: ``TimedNativeStore``'s counters
    (native calls wait for Mooncake's own threads, so CPU time would miss them)."""

    now = staticmethod(time.perf_counter)

    def __init__(self, store: TimedNativeStore) -> None:
        self.store = store

    @property
    def inside_s(self) -> float:
        c = self.store.counters
        return c.io_s + c.exist_s


@contextlib.contextmanager
def _listening_port() -> Iterator[str]:
    """A loopback port that accepts connections: the client's reachability
    probe of the master succeeds, and nothing else ever talks to it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


@dataclass(frozen=True)
class Cell:
    """One (store, model, page size, pages per call) combination."""

    store: str  # "null" or "same" (real in-process Mooncake)
    family: str  # "mla" or "dsa"
    size: str  # SMALL or LARGE
    pages_per_call: int
    contenders: tuple[str, ...]
    # Storage segments the span client places keys on (null store only): each
    # put then ranks them per storage key, as on a cluster of that many nodes.
    segments: int = 0


def default_cells(quick: bool) -> list[Cell]:
    span = ("span-K1", "span-K2", "span-K4", "span-K8")
    small, large = SMALL, LARGE
    cells = [
        Cell("null", "mla", small, 512, (*span, "span-K4-nogroup", "upstream", "raw-K4")),
        Cell("null", "dsa", small, 512, ("span-K4", "span-K4-nogroup", "upstream", "raw-K4")),
        Cell("null", "mla", large, 512, ("span-K4", "upstream", "raw-K4")),
        Cell("null", "dsa", large, 512, ("span-K4", "upstream", "raw-K4")),
        Cell("null", "mla", small, 4096, ("span-K4", "span-K8", "upstream", "raw-K4")),
        Cell("null", "dsa", small, 4096, ("span-K4", "upstream", "raw-K4")),
        Cell("null", "mla", small, 512, ("span-K4", "upstream"), segments=8),
        Cell("null", "dsa", small, 512, ("span-K4", "upstream"), segments=8),
        Cell("same", "mla", small, 512, ("span-K4", "span-K4-nogroup", "upstream", "raw-K4")),
        Cell("same", "dsa", small, 512, ("span-K4", "upstream", "raw-K4")),
    ]
    if quick:
        cells = [c for c in cells if c.pages_per_call == 512 and c.size == small]
    return cells


@dataclass
class Sample:
    cell: Cell
    contender: str
    op: str
    keys_per_call: int
    wall_us: float  # per call
    inside_us: float  # per call, inside the native store

    @property
    def python_us(self) -> float:
        return self.wall_us - self.inside_us


class _Rig:
    """Pools, contenders and per-call closures of one cell."""

    def __init__(self, cell: Cell, native: Any, clock: Any, client_config: dict[str, Any]):
        self.cell = cell
        self.native = native
        self.clock = clock
        self.model = MODELS[(cell.family, cell.size)]
        self.dsa = cell.family == "dsa"
        p = cell.pages_per_call
        # src and dst sets of one call; Mamba has one state slot per call
        self.parts = build_parts(self.model, "page_first", 2 * p, 2)
        rng = np.random.default_rng(0)
        order = rng.permutation(2 * p)
        self.src, self.dst = order[:p], order[p:]
        self.client_config = client_config
        self.stores: dict[str, Any] = {}

    def close(self) -> None:
        for store in self.stores.values():
            with contextlib.suppress(Exception):
                store.close()
        self.parts.clear()

    def _extra(self, spec: ContenderSpec) -> dict[str, Any]:
        return {
            **self.client_config,
            "span_layout_guard": "off",
            "storage_page_size": HOST_PAGE_TOKENS * spec.pages_per_key,
            "span_group_ids": spec.group_ids,
            # The fake master's segment list (store_for) is read from here.
            "span_master_admin_url": "http://127.0.0.1:9003",
        }

    def store_for(self, spec: ContenderSpec) -> Any:
        if spec.name in self.stores:
            return self.stores[spec.name]
        if spec.kind == "span":
            config = storage_config(self._extra(spec), f"oh-{spec.name}", is_mla=self.model.is_mla)
            segments = [f"10.0.0.{i}:15000" for i in range(self.cell.segments)]
            store = span_backend(
                config,
                host_pools(self.parts),
                self.native,
                replicate_config=self._replicate_config,
                list_segments=lambda _url: list(segments),
            )
        else:
            config = storage_config(
                dict(self.client_config), "oh-upstream", is_mla=self.model.is_mla
            )
            store = upstream_backend(config, host_pools(self.parts), self.native)
        self.stores[spec.name] = store
        return store

    def _replicate_config(self) -> Any:
        if isinstance(self.native, NullStore):
            return NullReplicateConfig()
        from mooncake.store import ReplicateConfig

        return ReplicateConfig()

    def closures(self, name: str, rep: int) -> tuple[list[Callable[[], Any]], int]:
        """(put, get, exists) closures of one call of ``name``, and its keys per call."""
        spec = ContenderSpec.parse(name)
        k = spec.pages_per_key
        keys = C.page_keys(f"{name}/{rep}", len(self.src) // k)
        if spec.kind == "raw":
            return self._raw(keys, k), len(keys)
        store = self.store_for(spec)
        s_slots, d_slots = C.page_slots(self.src), C.page_slots(self.dst)
        put = C.backend_put(store, keys, s_slots, self.dsa, True, 0)
        get = C.backend_get(store, keys, d_slots, self.dsa, True, 1)
        exists = C.backend_exists(store, keys, self.dsa)
        return [put, get, exists], len(keys)

    def _raw(self, keys: list[str], k: int) -> list[Callable[[], Any]]:
        """The native calls span-K<k> issues (KV and per-key sidecars), built beforehand."""
        calls = []
        for part in self.parts:
            if not part.per_key:
                continue
            tag = str(part.name.value)
            okeys = [f"{key}_{tag}" for key in keys]
            src_plans = plan_batch(part.layout, self.src.reshape(-1, k)).plans()
            dst_plans = plan_batch(part.layout, self.dst.reshape(-1, k)).plans()
            calls.append((okeys, [p.ptrs for p in src_plans], [p.sizes for p in src_plans]))
            calls.append((okeys, [p.ptrs for p in dst_plans], [p.sizes for p in dst_plans]))
        native, config = self.native, self._replicate_config()

        def put() -> list[bool]:
            ok: list[bool] = []
            for okeys, ptrs, sizes in calls[0::2]:
                ok += [
                    c == 0 for c in native.batch_put_from_multi_buffers(okeys, ptrs, sizes, config)
                ]
            return ok

        def get() -> list[bool]:
            ok: list[bool] = []
            for okeys, ptrs, sizes in calls[1::2]:
                ok += [c >= 0 for c in native.batch_get_into_multi_buffers(okeys, ptrs, sizes)]
            return ok

        return [put, get, lambda: len(keys)]


def _measure(rig: _Rig, names: tuple[str, ...], reps: int, calls_per_rep: int) -> list[Sample]:
    """Median over ``reps`` of per-call wall and native time, per contender and op.

    Contenders take turns within each repetition, so a slow spell of a shared
    machine hits all of them and not one contender's whole block."""
    per_op: dict[tuple[str, str], list[tuple[float, float]]] = {}
    keys_per_call: dict[str, int] = {}
    for rep in range(reps + 1):  # rep 0 warms up
        for name in names:
            batches = []
            for c in range(calls_per_rep):
                fns, keys_per_call[name] = rig.closures(name, rep * calls_per_rep + c)
                batches.append(fns)
            for op, op_index in (("put", 0), ("exists", 2), ("get", 1)):
                before_inside = rig.clock.inside_s
                started = rig.clock.now()
                results = [fns[op_index]() for fns in batches]
                wall = rig.clock.now() - started
                inside = rig.clock.inside_s - before_inside
                _check(name, op, results, keys_per_call[name])
                if rep:
                    per_op.setdefault((name, op), []).append(
                        (wall / calls_per_rep, inside / calls_per_rep)
                    )
            rig.native.remove_all(True)
    return [
        Sample(
            rig.cell,
            name,
            op,
            keys_per_call[name],
            statistics.median(v[0] for v in values) * 1e6,
            statistics.median(v[1] for v in values) * 1e6,
        )
        for (name, op), values in per_op.items()
    ]


def _check(name: str, op: str, results: list[Any], keys_per_call: int) -> None:
    for result in results:
        good = result == keys_per_call if op == "exists" else all(result)
        if not good:
            raise RuntimeError(f"overhead bench: {name} {op} did not succeed: {result!r}")


def run_overhead(quick: bool = False, reps: int | None = None) -> dict[str, Any]:
    """Measure every default cell; returns rows for the JSON and the table."""
    reps = reps or (2 if quick else 5)
    rows: list[dict[str, Any]] = []
    gc.enable()
    with contextlib.ExitStack() as stack:
        port = stack.enter_context(_listening_port())
        null_config = {"master_server_address": port, "metadata_server": "P2PHANDSHAKE"}
        topology = None
        for cell in default_cells(quick):
            if cell.store == "null":
                native: Any = NullStore()
                clock, config = _CpuClock(native), null_config
            else:
                if topology is None:
                    topology = stack.enter_context(Topology("same", BenchConfig()))
                native, clock = topology.store, _NativeClock(topology.store)
                config = dict(topology.client_config)
            rig = _Rig(cell, native, clock, config)
            try:
                calls = max(1, 2048 // cell.pages_per_call)
                rows += [_row(s) for s in _measure(rig, cell.contenders, reps, calls)]
            finally:
                rig.close()
                if topology is not None:
                    topology.store.unregister_all()
            gc.collect()
    return {"reps": reps, "gc_enabled": True, "rows": rows}


def _row(s: Sample) -> dict[str, Any]:
    pages = s.cell.pages_per_call
    return {
        **asdict(s.cell),
        "contender": s.contender,
        "op": s.op,
        "keys_per_call": s.keys_per_call,
        "wall_us_per_call": round(s.wall_us, 2),
        "inside_us_per_call": round(s.inside_us, 2),
        "python_us_per_page": round(s.python_us / pages, 3),
        "python_us_per_key": round(s.python_us / s.keys_per_call, 3),
        "inside_us_per_page": round(s.inside_us / pages, 3),
    }


def format_overhead(result: dict[str, Any]) -> str:
    """Markdown table: own Python per host page / per key, and native time per page."""
    lines = [
        "| store (segments) | model | page | pages/call | contender | keys/call "
        "| put µs/page (µs/key) | get µs/page (µs/key) | exists µs/page "
        "| put native µs/page | get native µs/page |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    grouped: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = {}
    for row in result["rows"]:
        store = row["store"] + (f" ({row['segments']})" if row.get("segments") else "")
        key = (store, row["family"], row["size"], row["pages_per_call"], row["contender"])
        grouped.setdefault(key, {})[row["op"]] = row
    for (store, family, size, pages, name), ops in grouped.items():
        put, get, ex = ops["put"], ops["get"], ops["exists"]
        lines.append(
            f"| {store} | {family} | {size} | {pages} | {name} | {put['keys_per_call']} "
            f"| {put['python_us_per_page']:.2f} ({put['python_us_per_key']:.2f}) "
            f"| {get['python_us_per_page']:.2f} ({get['python_us_per_key']:.2f}) "
            f"| {ex['python_us_per_page']:.3f} "
            f"| {put['inside_us_per_page']:.2f} | {get['inside_us_per_page']:.2f} |"
        )
    return "\n".join(lines)


def run_overhead_command(quick: bool, reps: int | None, json_path: str | None) -> int:
    import json

    result = run_overhead(quick=quick, reps=reps)
    print(format_overhead(result), flush=True)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {json_path}", flush=True)
    return 0


def profile_cell(family: str, size: str, contender: str, calls: int = 50) -> Any:
    """cProfile of ``calls`` put+get calls of one contender on the null store."""
    import cProfile

    with _listening_port() as port:
        native = NullStore()
        config = {"master_server_address": port, "metadata_server": "P2PHANDSHAKE"}
        rig = _Rig(Cell("null", family, size, 512, (contender,)), native, _CpuClock(native), config)
        try:
            batches = [rig.closures(contender, i)[0] for i in range(calls)]
            profiler = cProfile.Profile()
            profiler.enable()
            for put, get, _ in batches:
                put()
                get()
            profiler.disable()
        finally:
            rig.close()
    return profiler
