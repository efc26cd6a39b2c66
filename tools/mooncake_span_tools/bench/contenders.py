"""The contenders: how each one moves a workload's pages.

The span backend, sglang's upstream MooncakeStore, raw Mooncake batch calls and memcpy.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mooncake_span.span.plan import ObjectPlan, plan_batch, split_calls
from mooncake_span_tools.bench.pages import Placement, build_parts, host_pools
from mooncake_span_tools.bench.shared_native import TimedNativeStore, Topology
from mooncake_span_tools.bench.workloads import (
    DSA_INDEX_KPOOL,
    HOST_PAGE_TOKENS,
    TCP_BUFFERS_PER_CALL,
    ContenderSpec,
    Workload,
)
from mooncake_span_tools.testing import controller as sg
from mooncake_span_tools.testing import page_io
from mooncake_span_tools.testing.backends import span_backend, storage_config, upstream_backend

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------
# contenders


def page_keys(tag: str, count: int) -> list[str]:
    # sglang's keys are 64-hex sha256 strings; unique per contender and run.
    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(count)]


def page_slots(pages: np.ndarray, page_tokens: int = HOST_PAGE_TOKENS) -> torch.Tensor:
    return torch.from_numpy(
        (pages[:, None] * page_tokens + np.arange(page_tokens)).reshape(-1).astype(np.int64)
    )


def _one_buffer_objects(
    contender: str,
    pool: Any,
    s_plans: list[ObjectPlan],
    d_plans: list[ObjectPlan],
    keys: list[str],
    owners: list[int],
) -> tuple[list[ObjectPlan], list[ObjectPlan], list[str], list[int]]:
    """raw-1buf stores one object per page buffer, as upstream does (an MHA
    page's k and v are two objects there, one ``kv`` object in the backend)."""
    out_s, out_d, out_keys, out_owners = [], [], [], []
    for s, d, key, owner in zip(s_plans, d_plans, keys, owners, strict=True):
        if len(s.ptrs) != len(d.ptrs):
            raise ValueError(f"{contender}: {pool} source and destination buffers differ")
        for b, (sp, ss, dp, ds) in enumerate(zip(s.ptrs, s.sizes, d.ptrs, d.sizes, strict=True)):
            out_s.append(ObjectPlan([sp], [ss]))
            out_d.append(ObjectPlan([dp], [ds]))
            out_keys.append(f"{key}_{b}")
            out_owners.append(owner)
    return out_s, out_d, out_keys, out_owners


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


class WorkloadRunner:
    """Pools, stores and per-run preparation for one workload."""

    def __init__(self, workload: Workload, topology: Topology, seed: int) -> None:
        self.w = workload
        self.topology = topology
        self.store: TimedNativeStore = topology.store
        self.calls = workload.pages_per_run // workload.pages_per_call
        self.rng = np.random.default_rng(seed)
        self.parts = build_parts(
            workload.model, workload.layout, 2 * workload.pages_per_run, 2 * self.calls
        )
        self.placement = Placement.make(workload.pages_per_run, self.calls, self.rng)
        for part in self.parts:
            rows = self.placement.scattered[0] if part.per_key else self.placement.state_src
            page_io.fill_random_rows(part.views, rows, self.rng)
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
        return self.w.model.page_tokens * (DSA_INDEX_KPOOL if self.w.model.family == "dsa" else 1)

    def _extra(self) -> dict[str, Any]:
        return {**self.topology.client_config, "span_layout_guard": "off"}

    def _make_span(self, spec: ContenderSpec) -> Any:
        model = self.w.model
        if model.family == "dsa" and spec.pages_per_key != DSA_INDEX_KPOOL:
            raise ValueError("the compressed DSA model's storage page is 4 host pages")
        if model.family == "dsa-stock" and spec.pages_per_key != 1:
            raise ValueError("stock sglang 0.5.23 stores one 256-token host page per key")
        extra = {
            **self._extra(),
            "span_max_buffers_per_call": spec.max_buffers_per_call,
            "span_group_ids": spec.group_ids,
        }
        config = storage_config(extra, f"bench-{self.nonce}", is_mla=model.is_mla)
        # K=1 is configured as a stock deployment is (no storage_page_size
        # anywhere); K>1 as a span-aware build hands it over, on the config.
        if spec.pages_per_key > 1:
            config.storage_page_size = model.page_tokens * spec.pages_per_key
        return span_backend(config, host_pools(self.parts), self.store)

    def _make_upstream(self) -> Any:
        name = f"bench-up-{self.nonce}"
        config = storage_config(self._extra(), name, is_mla=self.w.model.is_mla)
        return upstream_backend(config, host_pools(self.parts), self.store)

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
        keys = page_keys(f"{self.nonce}/{name}/{rep}", len(src) // k)
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
            exists_all = backend_exists(self.backends[name], keys, self.w.model.has_sidecars)
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
                s_plans = plan_batch(part.layout, s_pages).plans()
                d_plans = plan_batch(part.layout, d_pages).plans()
                ncomp = len(part.layout.components)
                obj_keys = [
                    f"{key}_{part.name.value}_{j}" for key in part_keys for j in range(ncomp)
                ]
                obj_owner = [owners[i // ncomp] for i in range(len(obj_keys))]
                if single:
                    s_plans, d_plans, obj_keys, obj_owner = _one_buffer_objects(
                        spec.name, part.name, s_plans, d_plans, obj_keys, obj_owner
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
                    nbytes = [sum(d_plans[i].sizes) for i in idx]
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

    def upstream_pages_per_call(self) -> int:
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
            self.w.pages_per_call if spec.kind == "span" else self.upstream_pages_per_call()
        )
        dsa = self.w.model.has_sidecars
        page_tokens = self.w.model.page_tokens
        puts, gets, exists = [], [], []
        for c in range(self.calls):
            s_call, d_call = self._call_pages(src, c), self._call_pages(dst, c)
            kpc = self.w.pages_per_call // k
            call_keys = keys[c * kpc : (c + 1) * kpc]
            put_steps, get_steps = [], []
            for lo in range(0, len(s_call), step_pages):
                sub_keys = call_keys[lo // k : (lo + step_pages) // k]
                s_slots, d_slots = (
                    page_slots(s_call[lo : lo + step_pages], page_tokens),
                    page_slots(d_call[lo : lo + step_pages], page_tokens),
                )
                last = lo + step_pages >= len(s_call)
                put_steps.append(
                    backend_put(
                        store, sub_keys, s_slots, dsa, last, int(self.placement.state_src[c])
                    )
                )
                get_steps.append(
                    backend_get(
                        store, sub_keys, d_slots, dsa, last, int(self.placement.state_dst[c])
                    )
                )
            puts.append(_chain(put_steps))
            gets.append(_chain(get_steps))
            exists.append(backend_exists(store, call_keys, dsa))
        return puts, gets, exists

    def plan_seconds(self, name: str) -> float | None:
        """Pure planning time per call of a span contender: ``plan_batch`` on its pages."""
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
                        plan_batch(part.layout, pages).plans()
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
            sum(len(pl.ptrs) for pl in plan_batch(p.layout, pages).plans())
            for p in self.parts
            if p.per_key
        )
        return total / len(pages)

    # ---- verification -------------------------------------------------------------

    def wipe(self, run: PreparedRun) -> None:
        for part in self.parts:
            page_io.wipe_rows(part.layout, run.dst if part.per_key else self.placement.state_dst)

    def verify(self, run: PreparedRun, key_ok: np.ndarray) -> tuple[bool, int]:
        """(every page of every key reported ok is byte-exact, pages compared)."""
        page_ok = np.repeat(key_ok, run.pages_per_key)
        src, dst = run.src[page_ok], run.dst[page_ok]
        good = True
        for part in self.parts:
            if part.per_key:
                good &= bool(page_io.rows_equal(part.layout, src, dst).all())
            else:
                # the state of call c belongs to the call's last key
                call_ok = key_ok.reshape(self.calls, -1)[:, -1]
                s = self.placement.state_src[call_ok]
                d = self.placement.state_dst[call_ok]
                good &= bool(page_io.rows_equal(part.layout, s, d).all())
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


def _sidecars(keys: list[str], slots: torch.Tensor, state: int) -> tuple[Any, Any]:
    """The DSA indexer transfer (the KV's slots) and the Mamba state of the last key."""
    return sg.indexer(keys, slots), sg.state([keys[-1]], torch.tensor([state]))


def backend_put(
    store: Any, keys: list[str], slots: torch.Tensor, dsa: bool, last: bool, state: int
):
    if not dsa:
        return lambda: list(store.batch_set_v1(keys, slots))
    indexer, mamba = _sidecars(keys, slots, state)
    sidecars = [indexer, mamba] if last else [indexer]

    def run() -> list[bool]:
        # sglang's HybridCacheController: sidecars first, then KV.
        side = store.batch_set_v2(sidecars)
        ok = _and(list(store.batch_set_v1(keys, slots)), list(side[sg.INDEXER]))
        if last:
            ok[-1] = ok[-1] and bool(side[sg.MAMBA][0])
        return ok

    return run


def backend_get(
    store: Any, keys: list[str], slots: torch.Tensor, dsa: bool, last: bool, state: int
):
    if not dsa:
        return lambda: list(store.batch_get_v1(keys, slots))
    indexer_transfer, mamba_transfer = _sidecars(keys, slots, state)
    indexer, mamba = [indexer_transfer], [mamba_transfer]

    def run() -> list[bool]:
        ok = _and(
            list(store.batch_get_v1(keys, slots)),
            list(store.batch_get_v2(indexer)[sg.INDEXER]),
        )
        if last:
            ok[-1] = ok[-1] and bool(store.batch_get_v2(mamba)[sg.MAMBA][0])
        return ok

    return run


def backend_exists(store: Any, keys: list[str], dsa: bool) -> Callable[[], int]:
    transfers = sg.hit_query("placeholder") if dsa else None
    return lambda: int(store.batch_exists_v2(keys, transfers).kv_hit_pages)
