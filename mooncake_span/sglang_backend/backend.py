"""``MooncakeSpanStore``: sglang HiCache L3 storage on Mooncake, K host pages per key.

How sglang 0.5.23 drives a storage backend (``HiCacheController`` /
``HybridCacheController``):

1. construction: ``cls(storage_config, {})`` for ``--hicache-storage-backend
   dynamic``, ``cls(storage_config, mem_pool_host)`` for the built-in
   ``mooncake`` name (served by our plugin when opted in);
2. ``register_mem_pool_host(anchor)``, then for hybrid stacks
   ``register_mem_host_pool_v2(pool, name)`` per host pool (``kv`` included),
   then ``on_host_pools_registered()`` once; sidecars added later arrive
   through ``register_mem_host_pool_v2`` only;
3. worker threads: backup = ``batch_set_v2`` (sidecars) then ``batch_set_v1``
   (KV, writer ranks only); hit query = ``batch_exists_v2`` (or
   ``batch_exists``); prefetch = ``batch_get_v1`` (+ ``batch_get_v2`` for
   KV-derived sidecars, in 128-key batches) then ``batch_get_v2`` for state
   pools once KV completed. Without ``interface_v1`` the generic
   ``batch_get`` / ``batch_set`` on flat page tensors replace the v1 calls.

Every method the worker threads call returns a result (per-key bools, a hit
count, a ``PoolTransferResult``) and never raises: bad input and cluster
failures become ``False`` / misses with a rate-limited log line naming the
pool, the key and the sizes. Construction and registration errors do raise,
so a misconfigured server fails at startup.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.observability.metrics_collector import StorageMetrics

from mooncake_span.config import (
    MooncakeSettings,
    SpanOptions,
    load_mooncake_settings,
    load_span_options,
)
from mooncake_span.errors import GeometryError, MooncakeSpanError, RegistrationError
from mooncake_span.sglang_backend.pool_layout import describe_pool, pool_name_str
from mooncake_span.span.geometry import (
    KV_POOL,
    PoolKind,
    SpanGeometry,
    classify_pool,
    derive_slots_per_key,
)
from mooncake_span.span.hits import (
    PoolHitQuery,
    clamp_after_first_failure,
    compute_hits,
    leading_run,
)
from mooncake_span.span.keys import ComponentSpec, KeySchema, RankTags, check_page_keys
from mooncake_span.span.plan import ObjectPlan, PageLayout, plan_objects, plan_objects_from_flat
from mooncake_span.store.client import MooncakeClient, NativeBinding
from mooncake_span.store.layout_guard import (
    EtcdRegistry,
    GeometryRecord,
    PoolGeometry,
    check_or_publish,
    namespace_key,
)

logger = logging.getLogger(__name__)

_LOG_INTERVAL_S = 10.0


class _RateLimitedLog:
    """At most one line per kind every few seconds, with a count of what was dropped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._dropped: dict[str, int] = {}

    def error(self, kind: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < _LOG_INTERVAL_S:
                self._dropped[kind] = self._dropped.get(kind, 0) + 1
                return
            self._last[kind] = now
            dropped = self._dropped.pop(kind, 0)
        if dropped:
            msg += " (%d similar messages suppressed)"
            args = (*args, dropped)
        logger.error(msg, *args)


@dataclass
class PoolBinding:
    """What the backend knows about one registered host pool."""

    name: str
    host_pool: Any
    kind: PoolKind
    page_tokens: int
    components: tuple[ComponentSpec, ...]
    layout: PageLayout | None  # None: a logical anchor without bytes
    staged: bool = False


@dataclass
class _Op:
    """One pool's part of a v1/v2 call, after validation."""

    binding: PoolBinding
    page_keys: list[str]
    key_pages: np.ndarray  # (n_keys, pages per key) host page numbers
    object_keys: list[str] = field(default_factory=list)
    # staged pools only: one flat page per (key, page), token order
    staging: torch.Tensor | None = None


@dataclass
class _Counters:
    lock: threading.Lock = field(default_factory=threading.Lock)
    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)
    prefetch_tokens: int = 0
    backup_tokens: int = 0
    rejected_calls: dict[str, int] = field(default_factory=dict)


class SpanStorageMetrics(StorageMetrics):
    """sglang's StorageMetrics plus span-aware token counts and fault counters.

    ``prefetch_pgs`` / ``backup_pgs`` count storage pages (keys); with K > 1
    each is ``storage_page_size`` tokens, as ``*_tokens`` reports.
    """

    def __init__(self, **extra: Any) -> None:
        super().__init__()
        self.prefetch_tokens: int = extra.pop("prefetch_tokens", 0)
        self.backup_tokens: int = extra.pop("backup_tokens", 0)
        self.pages_per_span: int = extra.pop("pages_per_span", 1)
        self.storage_page_tokens: int = extra.pop("storage_page_tokens", 0)
        self.error_counts: dict[str, int] = extra.pop("error_counts", {})
        self.rejected_calls: dict[str, int] = extra.pop("rejected_calls", {})
        self.breaker_state: str = extra.pop("breaker_state", "closed")
        self.breaker_times_opened: int = extra.pop("breaker_times_opened", 0)


def _read_storage_page_tokens(storage_config: Any, options: SpanOptions) -> int | None:
    """Tokens per storage key, or None for "the host page" (K=1).

    Span-aware sglang builds carry ``storage_page_size`` on the config and the
    controller slices host indices by it, so when the field exists it wins,
    0 included (0 = host page). sglang 0.5.23 has no such field; then the
    extra-config option applies.
    """
    if hasattr(storage_config, "storage_page_size"):
        value = storage_config.storage_page_size
    else:
        value = options.storage_page_size
    return int(value) if value else None


class MooncakeSpanStore(HiCacheStorage):
    """HiCache L3 backend on Mooncake; one object per (storage key, pool component)."""

    supports_page_spans = True

    def __init__(
        self,
        storage_config: HiCacheStorageConfig | None = None,
        kwargs_or_host_pool: Any = None,
        *,
        settings: MooncakeSettings | None = None,
        options: SpanOptions | None = None,
        binding: NativeBinding | None = None,
    ) -> None:
        self.storage_config = storage_config
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.options = options or load_span_options(extra)
        self.settings = settings or load_mooncake_settings(extra)
        if getattr(storage_config, "should_split_heads", False):
            raise RegistrationError(
                "heterogeneous-TP head splitting (page_head layout with tp_lcm_size) is not "
                "supported by mooncake-span; use one TP size for all nodes"
            )
        # The built-in "mooncake" path passes the host pool here; sglang still
        # calls register_mem_pool_host() right after, so only remember it.
        self._constructor_host_pool = (
            None if isinstance(kwargs_or_host_pool, dict) else kwargs_or_host_pool
        )
        self._extra_tag = extra.get("extra_backend_tag")
        self._log = _RateLimitedLog()
        self._counters = _Counters()
        self._bindings: dict[str, PoolBinding] = {}
        # Rebound, never mutated: worker threads read it without a lock.
        self._learned_kv_derived: frozenset[str] = frozenset()
        self.mem_pool_host = None
        self.geometry: SpanGeometry | None = None
        self.key_schema: KeySchema | None = None
        self.client = MooncakeClient(self.settings, self.options, binding)
        self.client.connect()

    # ---- registration (control path: errors raise) -------------------------------

    @property
    def is_mla(self) -> bool:
        return bool(getattr(self.storage_config, "is_mla_model", False))

    def _rank_tags(self) -> RankTags:
        cfg = self.storage_config
        if cfg is None:
            return RankTags.from_ranks(tp_rank=0)
        return RankTags.from_ranks(
            tp_rank=cfg.tp_rank,
            pp_rank=cfg.pp_rank,
            pp_size=cfg.pp_size,
            attn_cp_rank=cfg.attn_cp_rank,
            attn_cp_size=cfg.attn_cp_size,
            dcp_rank=getattr(cfg, "dcp_rank", 0),
            dcp_size=getattr(cfg, "dcp_size", 1),
        )

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        host_page = int(getattr(mem_pool_host, "page_size", 0) or 1)
        self.geometry = SpanGeometry.resolve(
            host_page, _read_storage_page_tokens(self.storage_config, self.options)
        )
        dtype = str(getattr(mem_pool_host, "dtype", "none")).removeprefix("torch.")
        model = getattr(self.storage_config, "model_name", None) or "model"
        self.key_schema = KeySchema(
            model=model,
            host_page_tokens=host_page,
            pages_per_span=self.geometry.pages_per_span,
            layout=str(getattr(mem_pool_host, "layout", "none")),
            kv_dtype=dtype,
            ranks=self._rank_tags(),
            tag=self._extra_tag,
        )
        self._bind(KV_POOL, mem_pool_host)
        for name, binding in list(self._bindings.items()):
            if binding.kind is PoolKind.KV_DERIVED:
                self.geometry.check_pool_page(name, binding.page_tokens)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = pool_name_str(host_pool_name)
        if name == KV_POOL:
            # The anchor arrives through register_mem_pool_host (as upstream).
            if host_pool is not self.mem_pool_host:
                logger.warning(
                    "mooncake-span: ignoring a 'kv' v2 registration that is not the anchor pool"
                )
            return
        self._bind(name, host_pool)

    def on_host_pools_registered(self) -> None:
        if self.key_schema is None:
            raise RegistrationError("on_host_pools_registered() before register_mem_pool_host()")
        self.layout_guard_result = self._check_layout_guard()
        logger.info(
            "mooncake-span ready: prefix %s, storage page %d tokens = %d x %d-token host pages, "
            "pools %s",
            self.key_schema.prefix,
            self.geometry.storage_page_tokens,
            self.geometry.pages_per_span,
            self.geometry.host_page_tokens,
            {n: [c.name for c in b.components] for n, b in self._bindings.items()},
        )

    def geometry_record(self) -> GeometryRecord:
        pools = {}
        for name, binding in sorted(self._bindings.items()):
            layout = binding.layout
            pools[name] = PoolGeometry(
                components=tuple(c.name for c in binding.components),
                bytes_per_page=tuple(layout.page_bytes(c) for c in range(len(layout.components)))
                if layout
                else (),
                page_tokens=binding.page_tokens,
            )
        return GeometryRecord(
            host_page_tokens=self.geometry.host_page_tokens,
            storage_page_tokens=self.geometry.storage_page_tokens,
            layout=self.key_schema.layout,
            kv_dtype=self.key_schema.kv_dtype,
            pools=pools,
        )

    def _check_layout_guard(self) -> str:
        mode = self.options.layout_guard
        if mode == "off":
            return "off"
        key = namespace_key(self.key_schema.model, self.key_schema.tag)
        if mode == "etcd":
            registry = EtcdRegistry(self.options.layout_guard_etcd)
            return check_or_publish(self.geometry_record(), key, registry.read, registry.create)

        def read(k: str) -> str | None:
            blob = self.client.read_blob(k)
            return None if blob is None else blob.decode()

        return check_or_publish(
            self.geometry_record(), key, read, lambda k, v: self.client.create_blob(k, v.encode())
        )

    def _bind(self, name: str, host_pool: Any) -> None:
        kind = classify_pool(name)
        shape = describe_pool(name, host_pool, is_mla=self.is_mla)
        binding = PoolBinding(
            name=name,
            host_pool=host_pool,
            kind=kind,
            page_tokens=shape.page_tokens,
            components=shape.components,
            layout=shape.layout,
            staged=shape.staged,
        )
        if kind is PoolKind.KV_DERIVED and self.geometry is not None:
            self.geometry.check_pool_page(name, binding.page_tokens)
        for ptr, size in shape.buffers:
            self.client.register_buffer(ptr, size)
        self._bindings[name] = binding

    # ---- per-call preparation ---------------------------------------------------------

    def _require_ready(self) -> None:
        if self.key_schema is None or self.geometry is None:
            raise RegistrationError(
                "no host pool registered yet (register_mem_pool_host was not called)"
            )

    def _prepare(
        self, name: str, keys: Any, host_indices: Any, *, kv_derived_hint: bool = False
    ) -> _Op:
        binding = self._bindings.get(name)
        if binding is None:
            raise GeometryError(
                f"pool {name!r} is not registered (registered: {sorted(self._bindings)})"
            )
        page_keys = check_page_keys(keys)
        if not page_keys:
            raise GeometryError(f"pool {name!r}: transfer has no keys")
        if host_indices is None:
            raise GeometryError(f"pool {name!r}: host_indices is None")
        if not isinstance(host_indices, torch.Tensor):
            raise GeometryError(
                f"pool {name!r}: host_indices must be a tensor, got {type(host_indices).__name__}"
            )
        if host_indices.device.type != "cpu":
            raise GeometryError(
                f"pool {name!r}: host_indices must be on the CPU, got {host_indices.device}"
            )
        if host_indices.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise GeometryError(
                f"pool {name!r}: host_indices must be integers, got {host_indices.dtype}"
            )
        if binding.layout is None:
            return _Op(binding, page_keys, np.zeros((len(page_keys), 0), dtype=np.int64))
        if (
            kv_derived_hint
            and binding.kind is PoolKind.STATE
            and name not in self._learned_kv_derived
        ):
            self._learned_kv_derived = self._learned_kv_derived | {name}
        kind = classify_pool(name, self._learned_kv_derived)
        slots = host_indices.reshape(-1).to(torch.int64)
        per_key = derive_slots_per_key(
            pool_name=name,
            kind=kind,
            num_slots=int(slots.numel()),
            num_keys=len(page_keys),
            pool_page_tokens=binding.page_tokens,
            storage_page_tokens=self.geometry.storage_page_tokens,
        )
        page = binding.page_tokens
        by_page = slots.view(-1, page)
        starts = by_page[:, 0]
        if bool((starts % page != 0).any()) or (
            page > 1
            and not torch.equal(by_page - starts[:, None], torch.arange(page).expand_as(by_page))
        ):
            raise GeometryError(f"pool {name!r}: host indices are not whole {page}-slot host pages")
        pages = (starts // page).numpy().reshape(len(page_keys), per_key // page)
        if pages.min() < 0 or pages.max() >= binding.layout.num_pages:
            raise GeometryError(
                f"pool {name!r}: host page out of range [{int(pages.min())}, {int(pages.max())}] "
                f"(pool has {binding.layout.num_pages} pages)"
            )
        op = _Op(binding, page_keys, pages)
        op.object_keys = self.key_schema.object_keys(page_keys, binding.components)
        return op

    def _reject(self, op_name: str, pool: str, exc: Exception) -> None:
        with self._counters.lock:
            label = type(exc).__name__
            self._counters.rejected_calls[label] = self._counters.rejected_calls.get(label, 0) + 1
        self._log.error(
            f"{op_name}:{pool}:{type(exc).__name__}",
            "mooncake-span %s rejected for pool %s: %s",
            op_name,
            pool,
            exc,
        )

    # ---- I/O core -------------------------------------------------------------------------

    def _run(self, ops: list[_Op], is_set: bool) -> list[list[bool]]:
        """Execute prepared ops as one logical operation; per-op per-key results."""
        physical = [op for op in ops if op.binding.layout is not None]
        all_keys = [k for op in physical for k in op.object_keys]
        if not all_keys:
            return [[True] * len(op.page_keys) if op.binding.layout is None else [] for op in ops]
        existing = self.client.exists(all_keys) if is_set else [False] * len(all_keys)
        io_keys: list[str] = []
        io_plans: list[ObjectPlan] = []
        io_groups: list[str] = []
        io_slots: list[int] = []
        offset = 0
        for op in physical:
            ncomp = len(op.binding.components)
            count = len(op.object_keys)
            flags = existing[offset : offset + count]
            if not any(flags):
                # Nothing stored yet (every get, most puts): all objects go.
                io_keys += op.object_keys
                io_plans += self._plan(op, list(range(len(op.page_keys))), is_set)
                if is_set:
                    io_groups += self.key_schema.group_ids(op.page_keys, ncomp)
                io_slots += range(offset, offset + count)
                offset += count
                continue
            need = [
                i for i in range(len(op.page_keys)) if not all(flags[i * ncomp : (i + 1) * ncomp])
            ]
            if need:
                plans = self._plan(op, need, is_set)
                for row, key_index in enumerate(need):
                    for c in range(ncomp):
                        obj = key_index * ncomp + c
                        if flags[obj]:
                            continue
                        io_keys.append(op.object_keys[obj])
                        io_plans.append(plans[row * ncomp + c])
                        io_groups.append(self.key_schema.group_id(op.page_keys[key_index]))
                        io_slots.append(offset + obj)
            offset += count
        done = list(existing)
        if io_keys:
            results = (
                self.client.put(io_keys, io_plans, io_groups)
                if is_set
                else self.client.get(io_keys, io_plans)
            )
            for slot, ok in zip(io_slots, results, strict=False):
                done[slot] = ok
        out: list[list[bool]] = []
        offset = 0
        for op in ops:
            if op.binding.layout is None:
                out.append([True] * len(op.page_keys))
                continue
            ncomp = len(op.binding.components)
            flags = done[offset : offset + len(op.object_keys)]
            offset += len(op.object_keys)
            per_key = clamp_after_first_failure(
                [all(flags[i * ncomp : (i + 1) * ncomp]) for i in range(len(op.page_keys))]
            )
            if op.staging is not None and not is_set:
                self._unstage(op, per_key)
            out.append(per_key)
        return out

    def _plan(self, op: _Op, need: list[int], is_set: bool) -> list[ObjectPlan]:
        """Object plans for keys ``need`` of ``op`` (all components of each)."""
        if not op.binding.staged:
            return plan_objects(op.binding.layout, op.key_pages[need])
        pool = op.binding.host_pool
        pages_per_key = op.key_pages.shape[1]
        flat_bytes = op.binding.layout.slot_bytes[0]
        op.staging = torch.empty((len(op.page_keys), pages_per_key, flat_bytes), dtype=torch.uint8)
        if is_set:
            for i in need:
                for j, page in enumerate(op.key_pages[i].tolist()):
                    data = pool.get_data_page(page * op.binding.page_tokens, flat=True)
                    op.staging[i, j].copy_(data.contiguous().view(torch.uint8).reshape(-1))
        row_bytes = pages_per_key * flat_bytes
        base = op.staging.data_ptr()
        return plan_objects_from_flat(
            op.binding.layout, [base + i * row_bytes for i in need], pages_per_key
        )

    def _unstage(self, op: _Op, per_key: list[bool]) -> None:
        pool = op.binding.host_pool
        dtype = pool.get_dummy_flat_data_page().dtype
        for i, ok in enumerate(per_key):
            if not ok:
                break
            for j, page in enumerate(op.key_pages[i].tolist()):
                pool.set_from_flat_data_page(
                    page * op.binding.page_tokens, op.staging[i, j].view(dtype)
                )

    def _moved_bytes(self, op: _Op, results: list[bool]) -> int:
        layout = op.binding.layout
        if layout is None:
            return 0
        per_key = layout.flat_page_bytes * op.key_pages.shape[1]
        return per_key * sum(results)

    def _account(self, is_set: bool, op: _Op, results: list[bool], elapsed_s: float) -> None:
        ok_keys = leading_run(results)
        tokens = ok_keys * self.geometry.storage_page_tokens
        gib = self._moved_bytes(op, results) / (1 << 30)
        with self._counters.lock:
            c = self._counters
            if is_set:
                c.backup_pgs.append(len(results))
                c.backup_tokens += tokens
                if elapsed_s > 0:
                    c.backup_bandwidth.append(gib / elapsed_s)
            else:
                c.prefetch_pgs.append(len(results))
                c.prefetch_tokens += tokens
                if elapsed_s > 0:
                    c.prefetch_bandwidth.append(gib / elapsed_s)

    def _v1(self, op_name: str, keys: list[str], host_indices: Any, is_set: bool) -> list[bool]:
        n = len(keys) if isinstance(keys, (list, tuple)) else 0
        try:
            self._require_ready()
            op = self._prepare(KV_POOL, keys, host_indices)
            started = time.perf_counter()
            (result,) = self._run([op], is_set)
            self._account(is_set, op, result, time.perf_counter() - started)
            return result
        except MooncakeSpanError as exc:
            self._reject(op_name, KV_POOL, exc)
        except Exception:  # a bug must not kill sglang's storage thread
            logger.exception("mooncake-span %s failed unexpectedly", op_name)
        return [False] * n

    def _v2(self, op_name: str, transfers: Any, is_set: bool) -> dict[Any, list[bool]]:
        results: dict[Any, list[bool]] = {}
        try:
            transfers = list(transfers or [])
        except TypeError:
            self._reject(
                op_name,
                "?",
                GeometryError(f"transfers must be a list, got {type(transfers).__name__}"),
            )
            return results
        ops: list[tuple[Any, _Op]] = []
        for transfer in transfers:
            name = pool_name_str(getattr(transfer, "name", None))
            keys = getattr(transfer, "keys", None)
            results[transfer.name] = [False] * (len(keys) if isinstance(keys, (list, tuple)) else 0)
            try:
                self._require_ready()
                hint = pool_name_str(getattr(transfer, "indices_from_pool", None)) == KV_POOL
                ops.append(
                    (
                        transfer.name,
                        self._prepare(name, keys, transfer.host_indices, kv_derived_hint=hint),
                    )
                )
            except MooncakeSpanError as exc:
                self._reject(op_name, name, exc)
        if not ops:
            return results
        try:
            outcome = self._run([op for _, op in ops], is_set)
        except MooncakeSpanError as exc:
            self._reject(op_name, ",".join(op.binding.name for _, op in ops), exc)
            return results
        except Exception:
            logger.exception("mooncake-span %s failed unexpectedly", op_name)
            return results
        for (key, _), flags in zip(ops, outcome, strict=False):
            results[key] = flags
        return results

    # ---- zero-copy API ------------------------------------------------------------------------

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        return self._v1("batch_get_v1", keys, host_indices, is_set=False)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        return self._v1("batch_set_v1", keys, host_indices, is_set=True)

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[Any, list[bool]]:
        return self._v2("batch_get_v2", transfers, is_set=False)

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[Any, list[bool]]:
        return self._v2("batch_set_v2", transfers, is_set=True)

    # ---- hits -----------------------------------------------------------------------------------

    def _kv_prefix(self, keys: list[str]) -> int:
        kv = self._bindings[KV_POOL]
        if kv.layout is None:
            return 0
        return leading_run(self._exists_many([kv], keys)[0])

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        try:
            self._require_ready()
            return self._kv_prefix(check_page_keys(keys))
        except MooncakeSpanError as exc:
            self._reject("batch_exists", KV_POOL, exc)
        except Exception:
            logger.exception("mooncake-span batch_exists failed unexpectedly")
        return 0

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        try:
            self._require_ready()
            page_keys = check_page_keys(keys)
            kv = self._bindings[KV_POOL]
            transfers = list(pool_transfers or [])
            bindings = []
            for transfer in transfers:
                name = pool_name_str(transfer.name)
                binding = self._bindings.get(name)
                if binding is None:
                    raise GeometryError(f"hit query names unregistered pool {name!r}")
                bindings.append(binding)
            # One existence RPC for KV and every pool: the pools' flags past the
            # KV prefix are wasted, but a second round trip costs more.
            groups = ([kv] if kv.layout is not None else []) + bindings
            flags = self._exists_many(groups, page_keys)
            # A logical anchor (DeepSeek-V4) stores no KV bytes: the sidecars decide.
            kv_pages = leading_run(flags.pop(0)) if kv.layout is not None else len(page_keys)
            queries = [
                PoolHitQuery(
                    name=pool_name_str(transfer.name),
                    policy=pool_name_str(transfer.hit_policy),
                    page_exists=page_exists[:kv_pages],
                    window_pages=len(transfer.keys) if transfer.keys else 1,
                    block_pages=int(getattr(transfer, "block_pages", 0) or 0),
                    group_pages=int(getattr(transfer, "group_pages", 0) or 0),
                )
                for transfer, page_exists in zip(transfers, flags, strict=False)
            ]
            hit = compute_hits(kv_pages, queries)
            names = {pool_name_str(t.name): t.name for t in transfers}
            pool_hits = {names.get(n, PoolName.KV): v for n, v in hit.pool_hit_pages.items()}
            return PoolTransferResult(hit.kv_hit_pages, pool_hits, hit.restorable_prefix_pages)
        except (MooncakeSpanError, ValueError) as exc:
            self._reject("batch_exists_v2", "*", exc)
        except Exception:
            logger.exception("mooncake-span batch_exists_v2 failed unexpectedly")
        return PoolTransferResult(0, {}, [])

    def _exists_many(self, bindings: list[PoolBinding], page_keys: list[str]) -> list[list[bool]]:
        """Per binding, per key: do all of the key's component objects exist?"""
        object_keys = [self.key_schema.object_keys(page_keys, b.components) for b in bindings]
        flat = self.client.exists([k for group in object_keys for k in group]) if page_keys else []
        out, offset = [], 0
        for binding, group in zip(bindings, object_keys, strict=False):
            ncomp = len(binding.components)
            chunk = flat[offset : offset + len(group)]
            offset += len(group)
            if ncomp == 1:
                out.append(chunk)
            else:
                out.append([all(chunk[i * ncomp : (i + 1) * ncomp]) for i in range(len(page_keys))])
        return out

    # ---- generic (non zero-copy) API: flat page tensors -------------------------------------

    def _flat_plans(self, tensors: Sequence[torch.Tensor]) -> list[ObjectPlan]:
        layout = self._bindings[KV_POOL].layout
        span_bytes = layout.flat_page_bytes * self.geometry.pages_per_span
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
                raise GeometryError(f"generic value #{i} must be a contiguous CPU tensor")
            if t.numel() * t.element_size() != span_bytes:
                raise GeometryError(
                    f"generic value #{i} holds {t.numel() * t.element_size()} bytes; "
                    f"a storage page is {span_bytes} bytes "
                    f"({self.geometry.pages_per_span} x {layout.flat_page_bytes})"
                )
        return plan_objects_from_flat(
            layout, [t.data_ptr() for t in tensors], self.geometry.pages_per_span
        )

    def _generic(self, keys: list[str], tensors: list[torch.Tensor], is_set: bool) -> list[bool]:
        self._require_ready()
        kv = self._bindings[KV_POOL]
        page_keys = check_page_keys(keys)
        if len(tensors) != len(page_keys):
            raise GeometryError(f"{len(page_keys)} keys but {len(tensors)} tensors")
        if kv.layout is None:
            return [True] * len(page_keys)
        plans = self._flat_plans(tensors)
        object_keys = self.key_schema.object_keys(page_keys, kv.components)
        ncomp = len(kv.components)
        if is_set:
            flags = self.client.exists(object_keys)
            todo = [i for i, f in enumerate(flags) if not f]
            if todo:
                groups = [self.key_schema.group_id(page_keys[i // ncomp]) for i in todo]
                for i, ok in zip(
                    todo,
                    self.client.put(
                        [object_keys[i] for i in todo], [plans[i] for i in todo], groups
                    ),
                    strict=False,
                ):
                    flags[i] = ok
        else:
            flags = self.client.get(object_keys, plans)
        return clamp_after_first_failure(
            [all(flags[i * ncomp : (i + 1) * ncomp]) for i in range(len(page_keys))]
        )

    def _span_dummy(self) -> torch.Tensor:
        flat_page = self._bindings[KV_POOL].layout.flat_page_bytes
        return torch.empty(flat_page * self.geometry.pages_per_span, dtype=torch.uint8)

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        n = len(keys) if isinstance(keys, (list, tuple)) else 0
        try:
            self._require_ready()
            targets = (
                list(target_locations)
                if target_locations is not None
                else [self._span_dummy() for _ in range(n)]
            )
            started = time.perf_counter()
            ok = self._generic(keys, targets, is_set=False)
            self._account_generic(False, ok, time.perf_counter() - started)
            return [t if good else None for t, good in zip(targets, ok, strict=False)]
        except MooncakeSpanError as exc:
            self._reject("batch_get", KV_POOL, exc)
        except Exception:
            logger.exception("mooncake-span batch_get failed unexpectedly")
        return [None] * n

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        try:
            if values is None:
                raise GeometryError("batch_set needs values (flat page tensors)")
            values = [v.contiguous() if isinstance(v, torch.Tensor) else v for v in values]
            started = time.perf_counter()
            ok = self._generic(keys, values, is_set=True)
            self._account_generic(True, ok, time.perf_counter() - started)
            return bool(ok) and all(ok)
        except MooncakeSpanError as exc:
            self._reject("batch_set", KV_POOL, exc)
        except Exception:
            logger.exception("mooncake-span batch_set failed unexpectedly")
        return False

    def _account_generic(self, is_set: bool, ok: list[bool], elapsed_s: float) -> None:
        kv = self._bindings[KV_POOL]
        op = _Op(kv, [], np.zeros((len(ok), self.geometry.pages_per_span), dtype=np.int64))
        self._account(is_set, op, ok, elapsed_s)

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], None if value is None else [value])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ---- admin -------------------------------------------------------------------------------

    def clear(self) -> None:
        """Remove this deployment's objects (its key prefix), not the whole cluster."""
        if self.key_schema is None:
            return
        try:
            removed = self.client.remove_prefix(self.key_schema.prefix + "_")
            logger.info(
                "mooncake-span clear: removed %d objects under %s", removed, self.key_schema.prefix
            )
        except MooncakeSpanError as exc:
            self._reject("clear", "*", exc)

    def get_stats(self) -> SpanStorageMetrics:
        client_stats = self.client.stats()
        with self._counters.lock:
            c = self._counters
            metrics = SpanStorageMetrics(
                prefetch_tokens=c.prefetch_tokens,
                backup_tokens=c.backup_tokens,
                pages_per_span=self.geometry.pages_per_span if self.geometry else 1,
                storage_page_tokens=self.geometry.storage_page_tokens if self.geometry else 0,
                error_counts=client_stats["error_counts"],
                rejected_calls=dict(c.rejected_calls),
                breaker_state=client_stats["breaker_state"],
                breaker_times_opened=client_stats["breaker_times_opened"],
            )
            metrics.prefetch_pgs.extend(c.prefetch_pgs)
            metrics.backup_pgs.extend(c.backup_pgs)
            metrics.prefetch_bandwidth.extend(c.prefetch_bandwidth)
            metrics.backup_bandwidth.extend(c.backup_bandwidth)
            c.prefetch_pgs.clear()
            c.backup_pgs.clear()
            c.prefetch_bandwidth.clear()
            c.backup_bandwidth.clear()
            c.prefetch_tokens = 0
            c.backup_tokens = 0
        return metrics

    def close(self) -> None:
        self.client.close()
