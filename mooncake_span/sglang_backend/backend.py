"""``MooncakeSpanStore``: sglang HiCache L3 storage on Mooncake, K host pages per key.

The order in which sglang 0.5.23 constructs, registers and calls it, and why
the worker-thread methods never raise while set-up does: docs/architecture.md,
"How sglang 0.5.23 drives the backend". The data calls are mixed in from
``reads.py`` (``ReadPath``) and ``writes.py`` (``WritePath``).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from mooncake_span.config import SpanOptions, load_span_options
from mooncake_span.errors import ConfigError, RegistrationError
from mooncake_span.mooncake_settings import MooncakeSettings, RankInfo, load_mooncake_settings
from mooncake_span.sglang_backend.guard import (
    miss_count,
    miss_hit_result,
    miss_nothing,
    never_raise,
)
from mooncake_span.sglang_backend.hit_query import HitProber
from mooncake_span.sglang_backend.pool_layout import pool_name_str
from mooncake_span.sglang_backend.reads import ReadPath
from mooncake_span.sglang_backend.recording import CallRecorder
from mooncake_span.sglang_backend.registration import Registration
from mooncake_span.sglang_backend.stager import Stager
from mooncake_span.sglang_backend.stats import METRIC_WINDOW, UNPOLLED_WINDOW, SpanStorageMetrics
from mooncake_span.sglang_backend.stored_pool import StoredPool, chain_of, prefix_keys_of
from mooncake_span.sglang_backend.writes import ChainRecords, PerKeyNotice, StoredCheck, WritePath
from mooncake_span.span.geometry import KV_POOL, SpanGeometry
from mooncake_span.span.hit_rounds import KV_ROUNDS_ALONE, ProbeTally
from mooncake_span.span.keys import KeySchema, check_page_keys
from mooncake_span.span.object_layout import NamespaceFacts, describe_object_layout
from mooncake_span.store.arena import StagingArena
from mooncake_span.store.client import MooncakeClient, NativeBinding
from mooncake_span.store.layout_guard import namespace_key
from mooncake_span.store.native import SharedEngine, checksum_setting

logger = logging.getLogger(__name__)

# A start-up cost this large is worth a line in the server's log.
_REPORT_LOAD_S = 0.5


class MooncakeSpanStore(ReadPath, WritePath, HiCacheStorage):
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
        # The settings of the rank storage_config names (None: no rank, as upstream).
        self.settings = settings or load_mooncake_settings(
            extra, ranks=RankInfo.from_storage_config(storage_config)
        )
        if getattr(storage_config, "should_split_heads", False):
            raise RegistrationError(
                "heterogeneous-TP head splitting (page_head layout with tp_lcm_size) is not "
                "supported by mooncake-span; use one TP size for all nodes"
            )
        # The built-in "mooncake" path's host pool comes back in register_mem_pool_host().
        self.mem_pool_host = None
        self.client = MooncakeClient(self.settings, self.options, binding, shared_transfer_engine())
        self.client.connect()
        # Whether objects are sealed is decided at connect (the cluster's SSD tier).
        self.options = self.client.options
        metrics_on = getattr(storage_config, "enable_storage_metrics", False)
        self.recorder = CallRecorder(self.client, METRIC_WINDOW if metrics_on else UNPOLLED_WINDOW)
        arena = StagingArena(
            self.options.staging_buffer_size_bytes,
            self.client.register_buffer,
            float(self.options.transfer_timeout_s),
        )
        self.stager = Stager(arena)  # registered memory for unregistered bytes
        self.registration = Registration(storage_config, self.options, self.client, self.stager)
        self.prober = HitProber(self.client)
        self.stored_check = StoredCheck(
            self.client, self.registration, self.options.skip_unreachable
        )
        self.chain_records = ChainRecords(self.client, arena, self.options.chain_sample_every)
        self.per_key_notice = PerKeyNotice()

    # ---- the namespace (registration.py owns it) ------------------------------------

    @property
    def pools(self) -> dict[str, StoredPool]:
        return self.registration.pools

    @property
    def geometry(self) -> SpanGeometry | None:
        return self.registration.geometry

    @property
    def key_schema(self) -> KeySchema | None:
        return self.registration.key_schema

    @property
    def storage_page_size(self) -> int:
        """Tokens one storage key covers (0 before registration when nothing named it)."""
        if self.registration.geometry is not None:
            return self.registration.geometry.storage_page_tokens
        return self.registration.storage_page.choice.tokens or 0

    @storage_page_size.setter
    def storage_page_size(self, value: int) -> None:
        self.registration.assign_storage_page(value)

    @property
    def layout_guard_result(self) -> str | None:
        """The layout guard's last outcome: "off", "published", "matched", "deferred" or None."""
        return self.registration.layout_guard_result

    # ---- registration (control path: errors raise) -------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.registration.register_anchor(mem_pool_host)
        preload_page_hash(self.geometry.storage_page_tokens)

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
        self.registration.register_pool(name, host_pool)

    def on_host_pools_registered(self) -> None:
        self.registration.check_layout()

    # ---- hits (the data calls: gets in reads.py, puts in writes.py) ------------------------
    # Of sglang's extra_info only prefix_keys matter (stored_pool.chain_of).

    @never_raise(miss_count)
    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        self.registration.begin_io(moves_bytes=False)
        page_keys = check_page_keys(keys)
        kv = self.pools[KV_POOL]
        if kv.is_logical:
            return 0
        chain, prefix = self._chain(extra_info, page_keys)
        tally = ProbeTally()
        hits = self.prober.kv_prefix(
            self.key_schema, kv, page_keys, KV_ROUNDS_ALONE, tally, chain, prefix
        )
        self.recorder.hit_query(len(page_keys), hits, tally)
        return hits

    @never_raise(miss_hit_result)
    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        self.registration.begin_io(moves_bytes=False)
        page_keys = check_page_keys(keys)
        transfers = [
            (t, self.registration.registered(pool_name_str(t.name), "hit query"))
            for t in list(pool_transfers or [])
        ]
        tally = ProbeTally()
        chain, prefix = self._chain(extra_info, page_keys)
        kv = self.pools[KV_POOL]
        hit = self.prober.hits(self.key_schema, kv, page_keys, transfers, tally, chain, prefix)
        self.recorder.hit_query(len(page_keys), hit.kv_hit_pages, tally)
        names = {pool_name_str(t.name): t.name for t, _ in transfers}
        pool_hits = {names.get(n, PoolName.KV): v for n, v in hit.pool_hit_pages.items()}
        return PoolTransferResult(hit.kv_hit_pages, pool_hits, hit.restorable_prefix_pages)

    def _chain(self, extra_info: Any, page_keys: list[str]) -> tuple[Any, list[str]]:
        """A hit query's chain spot and the prefix keys whose leases it renews
        (``span_refresh_prefix``); (None, []) without prefix keys."""
        if not page_keys:
            return None, []
        chain = chain_of(extra_info, page_keys, self.key_schema, *self.registration.chain_keys)
        if chain is None or not self.options.refresh_prefix:
            return chain, []
        return chain, prefix_keys_of(extra_info)

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
        """Router-facing L3 layout: sglang MooncakeStore's fields plus the span geometry
        (``span.object_layout``) and whether restores verify Mooncake's checksums."""
        self.registration.require_ready()
        schema = self.key_schema
        record = self.registration.geometry_record()
        pools = [self.pools[name] for name in record.pools]
        layout = describe_object_layout(
            NamespaceFacts.from_schema(schema),
            record.pools,
            {pool.name: pool.kind for pool in pools},
            scopes={pool.name: tuple(c.scope.value for c in pool.components) for pool in pools},
            ranks=schema.ranks,
            is_mla=self.registration.is_mla,
            pp_rank=int(getattr(self.storage_config, "pp_rank", 0) or 0),
            pp_size=int(getattr(self.storage_config, "pp_size", 1) or 1),
            source="backend",
            layout_guard_key=namespace_key(schema.model, schema.tag),
        )
        layout["integrity"] = _integrity(self.options)
        return layout

    def get_stats(self) -> SpanStorageMetrics:
        return self.recorder.storage_metrics(self.geometry)

    def close(self) -> None:
        self.client.close()


def _integrity(options: SpanOptions) -> dict[str, Any]:
    """Whether restores are verified against Mooncake's per-object CRC-64, and why."""
    try:
        verify, source = checksum_setting(options, os.environ)
    except ConfigError as exc:  # the environment changed after setup
        return {"verify_checksums": None, "source": str(exc)}
    return {
        "verify_checksums": verify,
        "checksum": "crc64-ecma182" if verify else None,
        "source": source,
    }


def shared_transfer_engine() -> SharedEngine | None:
    """The Mooncake transfer engine sglang started in this process (its PD
    disaggregation does), or None. 0.5.23's ``MooncakeStore`` reuses it when it
    serves the same NIC, so memory is not registered and connections not opened
    twice; the client decides the match (``SharedEngine.serves``)."""
    try:
        from sglang.srt.distributed.parallel_state import get_mooncake_transfer_engine

        engine = get_mooncake_transfer_engine()
    except Exception:  # noqa: BLE001 - any failure means "no engine to reuse", as upstream
        logger.debug("mooncake-span: no shared Mooncake transfer engine to reuse", exc_info=True)
        return None
    if engine is None:
        return None
    return SharedEngine(
        session_id=str(engine.get_session_id()),
        ib_device=str(engine.get_ib_device() or ""),
        engine=engine.get_engine,
    )


def preload_page_hash(page_tokens: int) -> None:
    """Hash one page the way sglang's controller will, so that its JIT-loaded hash
    extension loads at start-up (why: docs/architecture.md, "How sglang 0.5.23
    drives the backend").

    A failure here is not fatal: the controller would hit the same error at its
    first hit query and handle it there, as it does without this backend."""
    started = time.monotonic()
    try:
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        get_storage_hash_str(list(range(page_tokens)), None, page_size=page_tokens)
    except Exception:  # noqa: BLE001 - any failure leaves the lazy load to sglang
        logger.warning(
            "mooncake-span: could not load sglang's page-hash function at start-up; the "
            "first hit query will load it, and a timeout prefetch policy may drop that prefetch",
            exc_info=True,
        )
        return
    elapsed_s = time.monotonic() - started
    if elapsed_s >= _REPORT_LOAD_S:
        logger.info(
            "mooncake-span: loaded sglang's page-hash extension in %.1fs at start-up "
            "(otherwise the first restore after a start would pay it)",
            elapsed_s,
        )
