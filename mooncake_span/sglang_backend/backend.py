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

Every method the worker threads call is wrapped in ``guard.never_raise``: it
returns a result (per-key bools, a hit count, a ``PoolTransferResult``) and
never raises; bad input and cluster failures become ``False`` / misses with a
rate-limited log line naming the pool, the key and the sizes. Construction
and registration errors do raise, so a misconfigured server fails at startup.
Each registered pool is a ``StoredPool`` that owns its object keys, buffer
plans, group ids and per-key fold; this module only sequences them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
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

from mooncake_span.config import MooncakeSettings, SpanOptions, load_span_options
from mooncake_span.errors import InvalidRequestError, MooncakeSpanError, RegistrationError
from mooncake_span.sglang_backend.connection import rank_settings, shared_transfer_engine
from mooncake_span.sglang_backend.guard import (
    miss_count,
    miss_flag,
    miss_hit_result,
    miss_none_per_key,
    miss_nothing,
    miss_per_key,
    miss_per_transfer,
    never_raise,
)
from mooncake_span.sglang_backend.hit_query import HitProber
from mooncake_span.sglang_backend.observability import CallObserver, describe_layout
from mooncake_span.sglang_backend.pool_layout import describe_pool, pool_name_str
from mooncake_span.sglang_backend.staging import Stager
from mooncake_span.sglang_backend.stats import (
    METRIC_WINDOW,
    UNPOLLED_WINDOW,
    CallCounters,
    RateLimitedLog,
    SpanStorageMetrics,
)
from mooncake_span.sglang_backend.storage_page import resolve_storage_page_tokens
from mooncake_span.sglang_backend.stored_pool import (
    PoolBatch,
    StagedPool,
    StoredPool,
    Transfer,
    check_host_indices,
    flat_base,
    geometry_record,
)
from mooncake_span.span.geometry import KV_POOL, PoolKind, SpanGeometry, classify_pool
from mooncake_span.span.hits import leading_run
from mooncake_span.span.keys import KeySchema, RankTags, check_page_keys
from mooncake_span.span.plan import PlanBatch
from mooncake_span.span.probe import KV_ROUNDS_ALONE, ProbeTally
from mooncake_span.store.client import MooncakeClient, NativeBinding
from mooncake_span.store.layout_guard import GeometryRecord, check_layout_guard
from mooncake_span.store.staging import StagingArena

logger = logging.getLogger(__name__)

Tensor = torch.Tensor
# Per-key results of a v2 call, keyed by the transfers' pool names.
TransferResults = dict[Any, list[bool]]


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
        self.settings = settings or rank_settings(extra, storage_config)
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
        self._log = RateLimitedLog()
        self._counters = CallCounters(
            METRIC_WINDOW
            if getattr(storage_config, "enable_storage_metrics", False)
            else UNPOLLED_WINDOW
        )
        self.pools: dict[str, StoredPool] = {}
        # Eviction group ids cost Mooncake time per object; they only matter
        # when a key owns more than one object (set at each registration):
        # MHA's k and v share one object, so only multi-pool stacks send them.
        self._group_ids = False
        # Rebound, never mutated: worker threads read it without a lock.
        self._learned_kv_derived: frozenset[str] = frozenset()
        self.mem_pool_host = None
        self.geometry: SpanGeometry | None = None
        self.key_schema: KeySchema | None = None
        self.client = MooncakeClient(self.settings, self.options, binding, shared_transfer_engine())
        self.client.connect()
        arena = StagingArena(
            self.options.staging_buffer_size_bytes,
            self.client.register_buffer,
            float(self.options.transfer_timeout_s),
        )
        self.stager = Stager(self.client, arena)  # registered memory for unregistered bytes
        self.observer = CallObserver(self.client)  # mooncake_span_* Prometheus metrics
        self.prober = HitProber(self.client)

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
            host_page, resolve_storage_page_tokens(self.storage_config, self.options, host_page)
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
        # Failure domains (store/domains.py): one segment per storage key.
        self.client.router.domain_of = self.key_schema.domain_of
        self._bind(KV_POOL, mem_pool_host)
        for name, pool in list(self.pools.items()):
            if pool.kind is PoolKind.KV_DERIVED:
                self.geometry.check_pool_page(name, pool.page_tokens)

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
        self.layout_guard_result = check_layout_guard(
            self.options, self.key_schema, self.geometry_record(), self.client, self.stager.arena
        )
        logger.info(
            "mooncake-span ready: prefix %s, storage page %d tokens = %d x %d-token host pages, "
            "pools %s",
            self.key_schema.prefix,
            self.geometry.storage_page_tokens,
            self.geometry.pages_per_span,
            self.geometry.host_page_tokens,
            {n: [c.name for c in pool.components] for n, pool in self.pools.items()},
        )

    def geometry_record(self) -> GeometryRecord:
        return geometry_record(self.geometry, self.key_schema, self.pools)

    def _bind(self, name: str, host_pool: Any) -> None:
        kind = classify_pool(name)
        shape = describe_pool(name, host_pool, is_mla=self.is_mla)
        pool_class = StagedPool if shape.staged else StoredPool
        pool = pool_class(name, host_pool, kind, shape.page_tokens, shape.components, shape.layout)
        if kind is PoolKind.KV_DERIVED and self.geometry is not None:
            self.geometry.check_pool_page(name, pool.page_tokens)
        if (pool.staged or name == KV_POOL) and not pool.is_logical and self.geometry:
            pages_per_key = self.geometry.storage_page_tokens // pool.page_tokens
            self.stager.check_row(name, pool.layout.flat_page_bytes * pages_per_key, pool.staged)
        for ptr, size in shape.buffers:
            self.client.register_buffer(ptr, size)
        self.pools[name] = pool
        objects_per_key = sum(p.num_components for p in self.pools.values() if not p.is_logical)
        self._group_ids = objects_per_key > 1

    # ---- per-call preparation ---------------------------------------------------------

    def _require_ready(self) -> None:
        if self.key_schema is None or self.geometry is None:
            raise RegistrationError(
                "no host pool registered yet (register_mem_pool_host was not called)"
            )

    def _registered(self, name: str, what: str) -> StoredPool:
        pool = self.pools.get(name)
        if pool is None:
            raise InvalidRequestError(
                f"{what} names unregistered pool {name!r} (registered: {sorted(self.pools)})"
            )
        return pool

    def _batch(
        self, name: str, keys: Any, host_indices: Any, *, kv_derived_hint: bool = False
    ) -> PoolBatch:
        pool = self._registered(name, "transfer")
        page_keys = check_page_keys(keys)
        if not page_keys:
            raise InvalidRequestError(f"pool {name!r}: transfer has no keys")
        if pool.is_logical:
            check_host_indices(name, host_indices)
            no_pages = np.zeros((len(page_keys), 0), dtype=np.int64)
            return pool.batch(self.key_schema, page_keys, no_pages)
        if kv_derived_hint and pool.kind is PoolKind.STATE and name not in self._learned_kv_derived:
            self._learned_kv_derived = self._learned_kv_derived | {name}
        kind = classify_pool(name, self._learned_kv_derived)
        pages = pool.host_pages(kind, len(page_keys), host_indices, self.geometry)
        return pool.batch(self.key_schema, page_keys, pages)

    def _reject(self, op_name: str, exc: Exception) -> None:
        label = type(exc).__name__
        with self._counters.lock:
            self._counters.rejected_calls[label] = self._counters.rejected_calls.get(label, 0) + 1
        self._log.error(f"{op_name}:{label}", "mooncake-span %s rejected: %s", op_name, exc)

    # ---- I/O core -------------------------------------------------------------------------

    def _run(self, batches: list[PoolBatch], is_set: bool) -> list[list[bool]]:
        """Execute prepared batches as one logical operation; per-batch per-key results."""
        physical = [b for b in batches if not b.pool.is_logical]
        if len(physical) == 1:
            object_keys = physical[0].object_keys
        else:
            object_keys = [k for b in physical for k in b.object_keys]
        if is_set and object_keys and not self.client.pressure.cooling:
            # A key already stored (by another rank or node) is not written twice.
            stored = self.client.exists(object_keys)
        else:
            stored = [False] * len(object_keys)
        done = self._move(physical, object_keys, stored, is_set)
        out, offset = [], 0
        for batch in batches:
            count = len(batch.object_keys)
            per_key = batch.pool.per_key_results(batch, done[offset : offset + count])
            offset += count
            out.append(per_key)
        self.observer.moved(is_set, batches, out)
        return out

    def _move(
        self, batches: list[PoolBatch], object_keys: list[str], stored: list[bool], is_set: bool
    ) -> list[bool]:
        """One put or get for every object not yet stored; per-object results."""
        schema, groups = self.key_schema, self._group_ids
        todos, offset = [], 0
        for batch in batches:
            count = len(batch.object_keys)
            todos.append(
                batch.pool.transfer(batch, stored[offset : offset + count], is_set, schema, groups)
            )
            offset += count
        if any(b.staged for b in batches):
            return self.stager.move(batches, todos, stored, is_set, self._io)
        if all(t.object_indices is None for t in todos):
            # Every object moves, in order: no per-object bookkeeping.
            return self._io(object_keys, todos, is_set) if object_keys else []
        io_keys: list[str] = []
        io_slots: list[int] = []
        offset = 0
        for batch, todo in zip(batches, todos, strict=True):
            count = len(batch.object_keys)
            indices = range(count) if todo.object_indices is None else todo.object_indices
            io_keys += [batch.object_keys[i] for i in indices]
            io_slots += [offset + i for i in indices]
            offset += count
        done = list(stored)
        if io_keys:
            for slot, ok in zip(io_slots, self._io(io_keys, todos, is_set), strict=True):
                done[slot] = ok
        return done

    def _io(self, keys: list[str], todos: list[Transfer], is_set: bool) -> list[bool]:
        plans = PlanBatch.concat([t.plans for t in todos])
        if not is_set:
            return self.client.get(keys, plans)
        groups = None
        if any(t.group_ids is not None for t in todos):
            groups = [g for t in todos for g in t.group_ids or ()]
        if len(todos) == 1:
            domains = todos[0].domains
        else:
            domains = [d for t in todos for d in t.domains or ()]
        return self.client.put(keys, plans, groups, domains=domains)

    def _account(
        self, is_set: bool, batch: PoolBatch, results: list[bool], elapsed_s: float
    ) -> None:
        ok_keys = leading_run(results)
        tokens = ok_keys * self.geometry.storage_page_tokens
        gib = batch.pool.moved_bytes(batch, results) / (1 << 30)
        self._counters.record(is_set, len(results), tokens, gib / elapsed_s if elapsed_s else None)

    def _timed_run(self, batch: PoolBatch, is_set: bool) -> list[bool]:
        started = time.perf_counter()
        (result,) = self._run([batch], is_set)
        self._account(is_set, batch, result, time.perf_counter() - started)
        return result

    def _v1(self, keys: Any, host_indices: Any, is_set: bool) -> list[bool]:
        self._require_ready()
        return self._timed_run(self._batch(KV_POOL, keys, host_indices), is_set)

    def _v2(self, op_name: str, transfers: Any, is_set: bool) -> TransferResults:
        self._require_ready()
        try:
            transfers = list(transfers or [])
        except TypeError as exc:
            raise InvalidRequestError(
                f"transfers must be a list of PoolTransfer, got {type(transfers).__name__}"
            ) from exc
        results = miss_per_transfer(transfers)
        prepared: list[tuple[Any, PoolBatch]] = []
        for transfer in transfers:
            name = pool_name_str(getattr(transfer, "name", None))
            hint = pool_name_str(getattr(transfer, "indices_from_pool", None)) == KV_POOL
            try:
                batch = self._batch(
                    name,
                    getattr(transfer, "keys", None),
                    getattr(transfer, "host_indices", None),
                    kv_derived_hint=hint,
                )
            except MooncakeSpanError as exc:
                # One bad transfer is refused alone; the others still move.
                self._reject(op_name, exc)
                continue
            prepared.append((transfer.name, batch))
        if prepared:
            outcome = self._run([batch for _, batch in prepared], is_set)
            for (key, _), flags in zip(prepared, outcome, strict=True):
                results[key] = flags
        return results

    # ---- zero-copy API ------------------------------------------------------------------------

    # sglang passes extra_info (HiCacheStorageExtraInfo) for tracing only; it is ignored here.

    @never_raise(miss_per_key)
    def batch_get_v1(self, keys: list[str], host_indices: Tensor, extra_info=None) -> list[bool]:
        return self._v1(keys, host_indices, is_set=False)

    @never_raise(miss_per_key)
    def batch_set_v1(self, keys: list[str], host_indices: Tensor, extra_info=None) -> list[bool]:
        return self._v1(keys, host_indices, is_set=True)

    @never_raise(miss_per_transfer)
    def batch_get_v2(self, transfers: list[PoolTransfer], extra_info=None) -> TransferResults:
        return self._v2("batch_get_v2", transfers, is_set=False)

    @never_raise(miss_per_transfer)
    def batch_set_v2(self, transfers: list[PoolTransfer], extra_info=None) -> TransferResults:
        return self._v2("batch_set_v2", transfers, is_set=True)

    # ---- hits -----------------------------------------------------------------------------------

    def _hit_query_done(self, queried_keys: int, hit_keys: int, tally: ProbeTally) -> None:
        self._counters.record_hit_query(tally.rpcs, tally.objects)
        self.observer.hit_query(queried_keys, hit_keys, tally)

    @never_raise(miss_count)
    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        self._require_ready()
        page_keys = check_page_keys(keys)
        kv = self.pools[KV_POOL]
        if kv.is_logical:
            return 0
        tally = ProbeTally()
        hits = self.prober.kv_prefix(self.key_schema, kv, page_keys, KV_ROUNDS_ALONE, tally)
        self._hit_query_done(len(page_keys), hits, tally)
        return hits

    @never_raise(miss_hit_result)
    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        self._require_ready()
        page_keys = check_page_keys(keys)
        transfers = [
            (t, self._registered(pool_name_str(t.name), "hit query"))
            for t in list(pool_transfers or [])
        ]
        tally = ProbeTally()
        hit = self.prober.hits(self.key_schema, self.pools[KV_POOL], page_keys, transfers, tally)
        self._hit_query_done(len(page_keys), hit.kv_hit_pages, tally)
        names = {pool_name_str(t.name): t.name for t, _ in transfers}
        pool_hits = {names.get(n, PoolName.KV): v for n, v in hit.pool_hit_pages.items()}
        return PoolTransferResult(hit.kv_hit_pages, pool_hits, hit.restorable_prefix_pages)

    # ---- generic (non zero-copy) API: flat page tensors -------------------------------------

    def _flat_batch(self, keys: Any, tensors: Sequence[Any]) -> PoolBatch:
        """A KV batch whose objects come from one flat span tensor per key."""
        self._require_ready()
        kv = self.pools[KV_POOL]
        page_keys = check_page_keys(keys)
        if len(tensors) != len(page_keys):
            raise InvalidRequestError(f"{len(page_keys)} keys but {len(tensors)} tensors")
        pages = np.zeros((len(page_keys), self.geometry.pages_per_span), dtype=np.int64)
        batch = kv.batch(self.key_schema, page_keys, pages)
        if not kv.is_logical:
            span_bytes = kv.layout.flat_page_bytes * self.geometry.pages_per_span
            batch.flat_bases = [flat_base(i, t, span_bytes) for i, t in enumerate(tensors)]
        return batch

    @never_raise(miss_none_per_key)
    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        self._require_ready()
        if target_locations is not None:
            targets = list(target_locations)
        else:
            span_bytes = self.pools[KV_POOL].layout.flat_page_bytes * self.geometry.pages_per_span
            targets = [torch.empty(span_bytes, dtype=torch.uint8) for _ in keys]
        ok = self._timed_run(self._flat_batch(keys, targets), is_set=False)
        return [t if good else None for t, good in zip(targets, ok, strict=True)]

    @never_raise(miss_flag)
    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        if values is None:
            raise InvalidRequestError("batch_set needs values (flat page tensors)")
        values = [v.contiguous() if isinstance(v, torch.Tensor) else v for v in values]
        ok = self._timed_run(self._flat_batch(keys, values), is_set=True)
        return bool(ok) and all(ok)

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

    @never_raise(miss_nothing)
    def clear(self) -> None:
        """Remove this deployment's objects (its key prefix), not the whole cluster."""
        if self.key_schema is None:
            return
        removed = self.client.remove_prefix(self.key_schema.prefix + "_")
        logger.info(
            "mooncake-span clear: removed %d objects under %s", removed, self.key_schema.prefix
        )

    def describe_l3_object_layout(self, **_sglang_kwargs: Any) -> dict[str, Any]:
        """Router-facing L3 layout: sglang MooncakeStore's fields plus span geometry."""
        self._require_ready()
        return describe_layout(self)

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
                dropped_metric_records=c.dropped_records,
            )
            c.drain_into(metrics)
        return metrics

    def close(self) -> None:
        self.client.close()
