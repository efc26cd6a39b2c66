"""The namespace a backend serves: its geometry, key schema and registered pools.

Registration is the control path: errors raise, so a misconfigured server
fails at startup (the steps: docs/architecture.md, "Set-up"). Every data
call's arguments are checked and turned into ``PoolBatch`` es here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mooncake_span.config import SpanOptions
from mooncake_span.errors import InvalidRequestError, MooncakeSpanError, RegistrationError
from mooncake_span.sglang_backend.guard import miss_per_transfer
from mooncake_span.sglang_backend.pool_layout import describe_pool, pool_name_str
from mooncake_span.sglang_backend.stager import Stager
from mooncake_span.sglang_backend.storage_page import (
    PageChoice,
    StoragePage,
    check_assignable,
    declared_page,
    warn_if_inconsistent,
)
from mooncake_span.sglang_backend.stored_pool import (
    PoolBatch,
    StagedPool,
    StoredPool,
    chain_of,
    check_host_indices,
    prefix_keys_of,
)
from mooncake_span.span.geometry import KV_POOL, PoolKind, SpanGeometry, classify_pool
from mooncake_span.span.keys import KeySchema, RankTags, check_page_keys
from mooncake_span.store.client import MooncakeClient
from mooncake_span.store.layout_guard import (
    GeometryRecord,
    PoolGeometry,
    check_layout_guard,
)

logger = logging.getLogger(__name__)


def rank_tags(storage_config: Any) -> RankTags:
    """The key tags of the rank ``storage_config`` describes (None: rank 0 alone)."""
    cfg = storage_config
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


class Registration:
    """The registered pools of one backend and the namespace they are stored under."""

    def __init__(
        self, storage_config: Any, options: SpanOptions, client: MooncakeClient, stager: Stager
    ) -> None:
        self._config = storage_config
        self._options = options
        self._client = client
        self._stager = stager
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self._extra_tag = extra.get("extra_backend_tag")
        self.pools: dict[str, StoredPool] = {}
        self.geometry: SpanGeometry | None = None
        self.key_schema: KeySchema | None = None
        # Whether puts carry eviction group ids, decided here alone (at each
        # registration): only while a key owns several objects and span_group_ids
        # is on (their cost: docs/span-format.md, "Group ids").
        self.group_ids = False
        # Rebound, never mutated: worker threads read it without a lock.
        self.learned_kv_derived: frozenset[str] = frozenset()
        # The chain window and stripe in storage keys (domains.ChainSpot), set with
        # the geometry; one value, so a reader never sees one of them new.
        self.chain_keys = (1, 0)
        # Open until the first data call; the geometry, schema and guard follow it.
        self.storage_page = StoragePage(declared_page(storage_config, options))
        self._anchor: Any = None
        self._guard_record: GeometryRecord | None = None  # what the guard last checked
        self.layout_guard_result: str | None = None
        self._io_ready = False  # the page is fixed and the geometry follows it
        self._io_lock = threading.Lock()
        self._io_refusal: MooncakeSpanError | None = None

    @property
    def is_mla(self) -> bool:
        return bool(getattr(self._config, "is_mla_model", False))

    def register_anchor(self, mem_pool_host: Any) -> None:
        """The KV pool: it fixes the host page, the span geometry and the key schema."""
        host_page = int(getattr(mem_pool_host, "page_size", 0) or 1)
        warn_if_inconsistent(self._config, self._options, host_page)
        self._anchor = mem_pool_host
        self._use_geometry(SpanGeometry.resolve(host_page, self.storage_page.choice.tokens))
        self.register_pool(KV_POOL, mem_pool_host)

    def _use_geometry(self, geometry: SpanGeometry) -> None:
        """Check ``geometry`` against the registered pools, then serve the
        namespace it names (the key schema carries K)."""
        for name, pool in self.pools.items():
            self._check_pool(name, pool, geometry)
        anchor = self._anchor
        self.geometry = geometry
        self.key_schema = KeySchema(
            model=getattr(self._config, "model_name", None) or "model",
            host_page_tokens=geometry.host_page_tokens,
            pages_per_span=geometry.pages_per_span,
            layout=str(getattr(anchor, "layout", "none")),
            kv_dtype=str(getattr(anchor, "dtype", "none")).removeprefix("torch."),
            ranks=rank_tags(self._config),
            tag=self._extra_tag,
        )
        # Failure domains (store/domains.py): one segment per storage key, or
        # per chain window when sglang passes prefix keys (stored_pool.chain_of).
        self._client.place_by(self.key_schema.domain_of)
        page_tokens = geometry.storage_page_tokens
        stripe_tokens = self._options.chain_stripe_tokens
        self.chain_keys = (
            max(1, self._options.chain_window_tokens // page_tokens),
            max(1, stripe_tokens // page_tokens) if stripe_tokens else 0,  # 0: the window's
        )

    def _check_pool(self, name: str, pool: StoredPool, geometry: SpanGeometry) -> None:
        if pool.kind is PoolKind.KV_DERIVED:
            geometry.check_pool_page(name, pool.page_tokens)
        if (pool.staged or name == KV_POOL) and not pool.is_logical:
            pages_per_key = geometry.storage_page_tokens // pool.page_tokens
            self._stager.check_row(name, pool.layout.flat_page_bytes * pages_per_key, pool.staged)

    def register_pool(self, name: str, host_pool: Any) -> None:
        kind = classify_pool(name)
        shape = describe_pool(name, host_pool, is_mla=self.is_mla)
        pool_class = StagedPool if shape.staged else StoredPool
        pool = pool_class(name, host_pool, kind, shape.page_tokens, shape.components, shape.layout)
        if self.geometry is not None:
            self._check_pool(name, pool, self.geometry)
        for ptr, size in shape.buffers:
            self._client.register_buffer(ptr, size)
        self.pools[name] = pool
        objects_per_key = sum(p.num_components for p in self.pools.values() if not p.is_logical)
        self.group_ids = self._options.group_ids and objects_per_key > 1

    def check_layout(self) -> str:
        """Publish this namespace's geometry record or check it against the published one:
        the guard's outcome ("off", "published", "matched", or "deferred" while the
        build may still hand another storage page)."""
        if self.key_schema is None:
            raise RegistrationError("on_host_pools_registered() before register_mem_pool_host()")
        record = self.geometry_record()
        result = self._guard(record, page_open=self.storage_page.open)
        self._guard_record = None if result == "deferred" else record
        self.layout_guard_result = result
        logger.info(
            "mooncake-span ready: prefix %s, storage page %d tokens = %d x %d-token host pages "
            "(from %s%s), pools %s",
            self.key_schema.prefix,
            self.geometry.storage_page_tokens,
            self.geometry.pages_per_span,
            self.geometry.host_page_tokens,
            self.storage_page.choice.source.value,
            "" if self._io_ready else "; it may change until the first data call",
            {n: [c.name for c in pool.components] for n, pool in self.pools.items()},
        )
        return result

    def _guard(self, record: GeometryRecord, **where: Any) -> str:
        return check_layout_guard(
            self._options, self.key_schema, record, self._client, self._stager.arena, **where
        )

    # ---- the storage page: settled at the first data call -----------------------------

    def assign_storage_page(self, value: Any) -> None:
        """The build assigns ``storage_page_size`` on the live backend (the span
        fork does at startup, after the pools registered). Control path: raises."""
        tokens = check_assignable(value)
        page = self.storage_page
        with self._io_lock:
            host_page = None if self.geometry is None else self.geometry.host_page_tokens
            if host_page is not None and not (page.settled or page.io_started):
                # Refuse a page the pools cannot tile before anything changes.
                candidate = SpanGeometry.resolve(host_page, tokens or None)
                for name, pool in self.pools.items():
                    self._check_pool(name, pool, candidate)
            choice = page.assign(tokens, host_page)
            if choice is not None and host_page is not None:
                self._change_page(choice)

    def _change_page(self, choice: PageChoice) -> None:
        before = self.geometry
        self._use_geometry(SpanGeometry.resolve(before.host_page_tokens, choice.tokens))
        logger.info(
            "mooncake-span: storage page %d -> %d tokens (K %d -> %d), from %s; prefix %s",
            before.storage_page_tokens,
            self.geometry.storage_page_tokens,
            before.pages_per_span,
            self.geometry.pages_per_span,
            choice.source.value,
            self.key_schema.prefix,
        )
        if self._guard_record is not None:
            record = self.geometry_record()
            self.layout_guard_result = self._guard(record, previous=self._guard_record)
            self._guard_record = record
        elif self.layout_guard_result == "deferred":
            self.check_layout()

    def begin_io(self, kv_slots_per_key: int | None = None, *, moves_bytes: bool = True) -> None:
        """Every data call starts here. The first one fixes the storage page
        (a build that named none: from ``kv_slots_per_key``, the call's KV stride);
        a hit query that cannot tell the page answers under the current one."""
        self.require_ready()
        if self._io_ready:
            return
        with self._io_lock:
            if self._io_refusal is not None:
                raise self._io_refusal
            if self._io_ready:
                return
            page = self.storage_page
            if not moves_bytes and page.derives:
                page.io_started = True
                return
            try:
                choice = page.settle(kv_slots_per_key, self.geometry.host_page_tokens)
                if choice is not None:
                    self._change_page(choice)
                elif self.layout_guard_result == "deferred":
                    self.check_layout()  # the page is fixed now: a conflict refuses L3
            except MooncakeSpanError as exc:
                # Fixed for good: every later call is refused the same way.
                self._io_refusal = exc
                logger.error("mooncake-span: L3 refused for this server: %s", exc)
                raise
            self._io_ready = True

    def geometry_record(self) -> GeometryRecord:
        """What the layout guard publishes: the namespace's span geometry and pool shapes."""
        shapes = {}
        for name, pool in sorted(self.pools.items()):
            layout = pool.layout
            per_page = (
                ()
                if layout is None
                else tuple(map(layout.page_bytes, range(len(layout.components))))
            )
            shapes[name] = PoolGeometry(
                components=tuple(c.name for c in pool.components),
                bytes_per_page=per_page,
                page_tokens=pool.page_tokens,
            )
        return GeometryRecord(
            host_page_tokens=self.geometry.host_page_tokens,
            storage_page_tokens=self.geometry.storage_page_tokens,
            layout=self.key_schema.layout,
            kv_dtype=self.key_schema.kv_dtype,
            pools=shapes,
        )

    # ---- per call: sglang's arguments as batches (a bad one: InvalidRequestError) ----

    def require_ready(self) -> None:
        if self.key_schema is None or self.geometry is None:
            raise RegistrationError(
                "no host pool registered yet (register_mem_pool_host was not called)"
            )

    def registered(self, name: str, what: str) -> StoredPool:
        pool = self.pools.get(name)
        if pool is None:
            raise InvalidRequestError(
                f"{what} names unregistered pool {name!r} (registered: {sorted(self.pools)})"
            )
        return pool

    def pool_batch(
        self,
        name: str,
        keys: Any,
        host_indices: Any,
        *,
        extra_info: Any = None,
    ) -> PoolBatch:
        """One pool's part of a zero-copy call: its keys, host pages and, when
        ``extra_info`` carries prefix keys, where the keys sit in their chain."""
        # Only the first data call's stride can fix the storage page.
        self.begin_io(None if self._io_ready else _stride(keys, host_indices))
        return self._pool_batch(name, keys, host_indices, False, extra_info)

    def _pool_batch(
        self, name: str, keys: Any, host_indices: Any, kv_derived_hint: bool, extra_info: Any
    ) -> PoolBatch:
        pool = self.registered(name, "transfer")
        page_keys = check_page_keys(keys)
        if not page_keys:
            raise InvalidRequestError(f"pool {name!r}: transfer has no keys")
        chain = chain_of(extra_info, page_keys, self.key_schema, *self.chain_keys)
        kind = PoolKind.STATE  # a logical pool has no objects to renew
        if pool.is_logical:
            check_host_indices(name, host_indices)
            pages = np.zeros((len(page_keys), 0), dtype=np.int64)
        else:
            learned = self.learned_kv_derived
            if kv_derived_hint and pool.kind is PoolKind.STATE and name not in learned:
                self.learned_kv_derived = learned = learned | {name}
            kind = classify_pool(name, learned)
            try:
                pages = pool.host_pages(kind, len(page_keys), host_indices, self.geometry)
            except InvalidRequestError:
                stride = _stride(page_keys, host_indices)
                if kind is not PoolKind.STATE and stride is not None:
                    self.storage_page.contradiction(name, stride, self.geometry.host_page_tokens)
                raise
        batch = PoolBatch(pool, page_keys, pages, pool.object_keys(self.key_schema, page_keys))
        batch.chain = chain
        if chain is not None and kind is not PoolKind.STATE and self._options.refresh_prefix:
            # A state pool's hit needs only the state at the prefix's end.
            batch.prefix_keys = prefix_keys_of(extra_info)
        return batch

    def transfer_batches(self, transfers: Any, extra_info: Any = None) -> TransferBatches:
        """A v2 call's transfers as batches. A transfer refused here is left out
        with its error in ``refused`` (it stays a miss; the others still move).
        ``extra_info``'s prefix keys precede each transfer's own keys (sglang
        groups trailing transfers so). The first KV-derived transfer (the
        indexer's, before the KV call) can fix the storage page."""
        self.require_ready()
        try:
            transfers = list(transfers or [])
        except TypeError as exc:
            raise InvalidRequestError(
                f"transfers must be a list of PoolTransfer, got {type(transfers).__name__}"
            ) from exc
        # Per transfer: pool name, keys, host indices, indexed by KV slots?
        parts = [
            (
                pool_name_str(getattr(t, "name", None)),
                getattr(t, "keys", None),
                getattr(t, "host_indices", None),
                pool_name_str(getattr(t, "indices_from_pool", None)) == KV_POOL,
            )
            for t in transfers
        ]
        learned = self.learned_kv_derived
        strides = (
            _stride(keys, host_indices)
            for name, keys, host_indices, by_kv in parts
            if by_kv or classify_pool(name, learned) is not PoolKind.STATE
        )
        self.begin_io(None if self._io_ready else next((s for s in strides if s is not None), None))
        out = TransferBatches(miss_per_transfer(transfers))
        for transfer, part in zip(transfers, parts, strict=True):
            try:
                batch = self._pool_batch(*part, extra_info)
            except MooncakeSpanError as exc:
                out.refused.append(exc)
                continue
            out.names.append(transfer.name)
            out.batches.append(batch)
        return out

    @property
    def span_bytes(self) -> int:
        """Bytes of one storage key's KV: a generic value's size."""
        return self.pools[KV_POOL].layout.flat_page_bytes * self.geometry.pages_per_span

    def flat_batch(self, keys: Any, tensors: Sequence[Any]) -> PoolBatch:
        """A KV batch whose objects come from one flat span tensor per key (generic path)."""
        self.require_ready()
        kv = self.pools[KV_POOL]
        if kv.is_logical:
            raise InvalidRequestError(
                "the generic path (batch_get / batch_set on flat pages) moves KV bytes, and "
                "pool 'kv' is a logical anchor that holds none: serve with interface_v1"
            )
        self.begin_io(_flat_stride(tensors, kv.layout.flat_page_bytes, kv.page_tokens))
        page_keys = check_page_keys(keys)
        if len(tensors) != len(page_keys):
            raise InvalidRequestError(f"{len(page_keys)} keys but {len(tensors)} tensors")
        pages = np.zeros((len(page_keys), self.geometry.pages_per_span), dtype=np.int64)
        batch = PoolBatch(kv, page_keys, pages, kv.object_keys(self.key_schema, page_keys))
        size = self.span_bytes
        batch.flat_bases = [_flat_base(i, t, size) for i, t in enumerate(tensors)]
        return batch


@dataclass
class TransferBatches:
    """A v2 call's transfers as batches; ``results`` starts as a miss for every transfer."""

    results: dict[Any, list[bool]]
    names: list[Any] = field(default_factory=list)  # the result key of each batch
    batches: list[PoolBatch] = field(default_factory=list)
    refused: list[MooncakeSpanError] = field(default_factory=list)

    def answer(self, moved: list[list[bool]]) -> None:
        self.results.update(zip(self.names, moved, strict=True))


def _flat_base(index: int, tensor: Any, span_bytes: int) -> int:
    """Address of one generic value: a contiguous CPU tensor of exactly one storage page."""
    if (
        not isinstance(tensor, torch.Tensor)
        or tensor.device.type != "cpu"
        or not tensor.is_contiguous()
    ):
        raise InvalidRequestError(f"generic value #{index} must be a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes != span_bytes:
        raise InvalidRequestError(
            f"generic value #{index} holds {nbytes} bytes; a storage page is {span_bytes} bytes"
        )
    return tensor.data_ptr()


def _stride(keys: Any, host_indices: Any) -> int | None:
    """Host slots per key of a transfer, None when it cannot say."""
    if host_indices is None or not isinstance(keys, (list, tuple)):
        return None
    try:
        slots = int(host_indices.numel()) if hasattr(host_indices, "numel") else len(host_indices)
    except TypeError:
        return None
    if not keys or slots < 1 or slots % len(keys):
        return None
    return slots // len(keys)


def _flat_stride(tensors: Sequence[Any], page_bytes: int, page_tokens: int) -> int | None:
    """Tokens per key of the generic path's flat values (whole host pages each)."""
    sizes = {t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)}
    if len(sizes) != 1 or page_bytes < 1:
        return None
    (size,) = sizes
    return size // page_bytes * page_tokens if size % page_bytes == 0 else None
