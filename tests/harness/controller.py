"""sglang 0.5.23's real ``HybridCacheController`` on CPU, driven like
``UnifiedRadixCache`` drives it, against any L3 backend.

The backend is whatever ``storage_backend="dynamic"`` loads from the caller's
``extra_config`` (``backend_name``/``module_path``/``class_name`` plus the
backend's own keys), so the in-memory test backend and the real Mooncake span
backend go through the same construction, registration and I/O calls as in a
server. Three pool sets:

* ``build_dsa_harness``: MLA KV anchor + DSA INDEXER sidecar, assembled by
  sglang's own ``prepare_host_pool_config`` / ``build_host_pool_group``;
* ``build_mamba_swa_harness``: MHA KV anchor + SWA + MAMBA, hand-built as
  ``HostPoolGroup`` entries the way ``build_hybrid_mamba_swa_stack`` lays
  them out;
* ``build_compressed_dsa_harness``: MLA KV + compressed DSA INDEXER + MAMBA
  (the GLM-5.3-Flash pool set of ``build_hybrid_mamba_stack``), optionally in
  span mode: one storage key per ``64 * index_kpool``-token tree page, i.e.
  ``index_kpool`` host pages per key (see ``_SpanHybridCacheController``);
* ``build_stock_glm_harness``: the same model as stock 0.5.23 runs it
  (``mooncake_span_tools.testing.stock_glm``): 256-token pages everywhere, KDA state,
  MTP draft layers packed into KV and INDEXER, K=1; built by sglang's own
  ``build_hybrid_mamba_stack`` (controller included) where it runs.

Each harness runs a backup (``write_storage`` + backup ack), a hit query
(``_storage_hit_query`` + ``_sync_prefetch_hit_query``, as the prefetch thread
does) and a prefetch (``_page_transfer`` into freshly allocated, zeroed host
pages, acks drained through the controller's own sync thread). Results carry
page bytes keyed by storage key, so a test compares a restore with a backup
byte for byte.

A harness owns process-global state (a single-rank gloo process group and the
sglang runtime context), so build one at a time and close it (or use it as a
context manager); sequential harnesses in one process are fine.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import torch
import torch.distributed as dist
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.hybrid_cache.host_pool_config import prepare_host_pool_config
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
    HybridCacheController,
    PrefetchOperation,
)
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
    build_host_pool_group,
    build_hybrid_mamba_stack,
    build_pool_entry,
)
from sglang.srt.mem_cache.pool_host import HostPoolGroup
from sglang.srt.mem_cache.utils import get_storage_hash_str

from mooncake_span_tools.testing.pools import (
    DSA_PAGE_TOKENS,
    MAMBA_LAYOUTS,
    alloc_pages,
    fill_random_pages,
    make_dsa_device_pool,
    make_mamba_device_pool,
    make_mha_device_pool,
    mamba_host_from_device,
    mha_host_from_device,
    page_bytes,
    page_starts,
    sglang_cpu_runtime,
    wipe_pages,
)
from mooncake_span_tools.testing.stock_glm import (
    STOCK_INDEX_KPOOL,
    StockGlmDevice,
    build_stock_glm_group,
    make_stock_glm_device,
    mamba_layout_for,
)

logger = logging.getLogger(__name__)

__all__ = [
    "BackupResult",
    "ControllerHarness",
    "HitQuery",
    "PrefetchResult",
    "build_compressed_dsa_harness",
    "build_dsa_harness",
    "build_mamba_swa_harness",
    "build_stock_glm_harness",
]

# The trailing-page placeholder UnifiedRadixCache puts in SWA/MAMBA prefetch
# transfers until the hit is known (unified_cache/components/{swa,mamba}.py).
PLACEHOLDER_KEY = "__placeholder__"

# Generous: a backend call in CI can stall on a busy 2-core machine.
_ACK_TIMEOUT_S = 60.0

# Token ids start well above small literals a test might use on its own.
_FIRST_TOKEN_ID = 10_000


# ---------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BackupResult:
    """One ``write_storage`` as the backup thread acknowledged it.

    ``pages`` holds, per pool, the flat page bytes that were on the host when
    the backup was queued, keyed by storage key (the concatenated host pages
    of the key, in slot order, when one key spans several).
    """

    token_ids: tuple[int, ...]
    keys: tuple[str, ...]
    completed_tokens: int
    pool_write_pages: Mapping[str, int]
    pages: Mapping[PoolName, Mapping[str, bytes]]


@dataclass(frozen=True)
class HitQuery:
    """A hit query, rank-synced; ``operation`` feeds ``prefetch``."""

    operation: PrefetchOperation
    hit_pages: int
    hit_tokens: int
    keys: tuple[str, ...]
    query_pool_hit_pages: Mapping[str, int]
    restorable_prefix_pages: tuple[int, ...] | None


@dataclass(frozen=True)
class PrefetchResult:
    """What a prefetch restored, read back from the host pools right after
    the transfer (then the host pages are freed).

    ``pages`` maps pool -> storage key -> restored flat page bytes, for the
    KV pages the controller reported complete and the trailing keys each
    sidecar was asked for.
    """

    completed_tokens: int
    pool_hits: Mapping[str, int]
    pages: Mapping[PoolName, Mapping[str, bytes]]
    sidecar_keys: Mapping[PoolName, tuple[str, ...]] = field(default_factory=dict)


# ---------------------------------------------------------------------------
# process group
# ---------------------------------------------------------------------------


@contextmanager
def _single_rank_process_group() -> Iterator[dist.ProcessGroup]:
    """A one-rank gloo world; reuses one that already exists (and then leaves
    it alone), otherwise creates one and destroys it on exit so the next
    harness can create its own."""
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    # A fresh rendezvous file per group: gloo's FileStore must not see the
    # previous group's leftovers.
    rendezvous_dir = tempfile.mkdtemp(prefix="mooncake-span-gloo-")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{os.path.join(rendezvous_dir, 'store')}",
            rank=0,
            world_size=1,
        )
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()
    finally:
        shutil.rmtree(rendezvous_dir, ignore_errors=True)


# ---------------------------------------------------------------------------
# harness
# ---------------------------------------------------------------------------


SidecarPlan = Callable[["ControllerHarness", list[str]], list[PoolTransfer]]
QueryPlan = Callable[["ControllerHarness", int], list[PoolTransfer]]


class _SpanHybridCacheController(HybridCacheController):
    """0.5.23's controller run at a storage page of several host pages.

    Constructed with ``page_size`` = the storage (tree) page, 0.5.23's
    controller already hashes, queries, slices host indices, fills v1 and
    KV-derived v2 transfers and counts completed tokens at that page, which
    is what the span-mode branch's controller does. Its generic (non-v1) KV
    path is not span-aware (one host page per key), so span harnesses need
    ``interface_v1``. Like the branch's ``_generate_storage_config``, this
    hands the backend ``storage_config.storage_page_size``.
    """

    def __init__(self, *args: Any, storage_page_size: int, **kwargs: Any):
        # Set before super().__init__: the startup backend is attached there.
        self.storage_page_size = storage_page_size
        super().__init__(*args, **kwargs)

    def _generate_storage_config(self, model_name=None, storage_backend_extra_config=None):
        config = super()._generate_storage_config(model_name, storage_backend_extra_config)
        config.storage_page_size = self.storage_page_size
        return config


class _ForkStartupController(HybridCacheController):
    """The span fork's startup order (``UnifiedRadixCache.init_hicache``):
    the controller builds its startup backend and registers the host pools
    with ``storage_page_size`` still at the host page; then, once the gate
    (``backend_supports_page_spans``) lets the backend through, it assigns the
    tree page on the controller and on the live backend object.

    Constructed with ``page_size`` = the tree page, 0.5.23's controller hashes,
    slices and acks at it, which is what the fork's controller does at
    ``storage_page_size`` after that assignment."""

    def __init__(self, *args: Any, host_page_size: int, storage_page_size: int, **kwargs: Any):
        self.storage_page_size = host_page_size
        super().__init__(*args, **kwargs)
        name = kwargs.get("storage_backend")
        if not fork_backend_supports_page_spans(name):
            raise ValueError(
                f"Compressed DSA currently supports L2 HiCache only ({name!r} does not "
                "declare supports_page_spans through the factory registry)"
            )
        self.storage_page_size = storage_page_size
        self.storage_backend.storage_page_size = storage_page_size

    def _generate_storage_config(self, model_name=None, storage_backend_extra_config=None):
        config = super()._generate_storage_config(model_name, storage_backend_extra_config)
        config.storage_page_size = self.storage_page_size
        return config


class _RankedController:
    """Mixed in before a controller class: it runs as TP rank ``tp_rank_override``
    of ``tp_size_override`` (an MLA rank above 0 is no storage writer, so its
    backups skip KV: ``backup_skip``)."""

    tp_rank_override = 0
    tp_size_override = 1

    def _generate_storage_config(self, model_name=None, storage_backend_extra_config=None):
        config = super()._generate_storage_config(model_name, storage_backend_extra_config)
        config.tp_rank, config.tp_size = self.tp_rank_override, self.tp_size_override
        return config


def fork_backend_supports_page_spans(name: str | None) -> bool:
    """The span fork's gate, ``StorageBackendFactory.backend_supports_page_spans``:
    the name's registry entry, loaded, declares ``supports_page_spans``; an
    unregistered name (``dynamic`` is never registered) or a failed import is False."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    entry = StorageBackendFactory._registry.get(name or "")
    if entry is None:
        return False
    try:
        backend_class = entry["loader"]()
    except Exception:  # noqa: BLE001 - the fork answers False on any import failure
        return False
    return bool(getattr(backend_class, "supports_page_spans", False))


class ControllerHarness:
    """One live ``HybridCacheController`` plus the requests a radix cache
    would send it. Build with ``build_dsa_harness``,
    ``build_mamba_swa_harness`` or ``build_compressed_dsa_harness``."""

    def __init__(
        self,
        *,
        stack: ExitStack,
        controller: HybridCacheController,
        group: HostPoolGroup,
        page_tokens: int,
        kv_derived_pools: frozenset[PoolName],
        backup_sidecars: SidecarPlan,
        query_sidecars: QueryPlan,
        tree_page_tokens: int | None = None,
        indexer_first_page_only: bool = False,
    ):
        self._stack = stack
        self.controller = controller
        self.group = group
        # Tokens per storage key: the controller's page (the tree page).
        self.page_tokens = page_tokens
        # KV host pages per storage key: 1, or K in span mode.
        self.host_pages_per_key = page_tokens // group.get_pool(PoolName.KV).page_size
        # Pools whose pages sit at the KV anchor's host slots (KV itself and
        # the DSA indexer): backed up and restored page for page with KV.
        self.kv_derived_pools = kv_derived_pools
        self._backup_sidecars = backup_sidecars
        self._query_sidecars = query_sidecars
        # Transfer-page hashing: keys at the host page under a wider radix-tree
        # page, so a storage hit is trimmed down to whole tree pages.
        self.tree_page_tokens = tree_page_tokens or page_tokens
        # The span fork's index layout: only the first host page of each
        # storage key's group carries compressed index rows.
        self.indexer_first_page_only = indexer_first_page_only
        self._next_token = count(_FIRST_TOKEN_ID)
        self._request_ids = count()
        self._closed = False
        logger.debug(
            "harness: pools=%s, %d tokens (%d KV host pages) per storage key, backend %s",
            [str(n) for n in self.pool_names],
            page_tokens,
            self.host_pages_per_key,
            type(controller.storage_backend).__name__,
        )

    # -- context ------------------------------------------------------------

    def __enter__(self) -> ControllerHarness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Detach the backend (stops the storage threads, calls its close())
        and release the process-global state."""
        if self._closed:
            return
        self._closed = True
        try:
            self.controller.detach_storage_backend()
        finally:
            self._stack.close()

    # -- accessors ------------------------------------------------------------

    @property
    def backend(self) -> Any:
        """The backend instance the controller built and talks to."""
        return self.controller.storage_backend

    @property
    def pool_names(self) -> tuple[PoolName, ...]:
        return tuple(entry.name for entry in self.group.entries)

    def pool(self, name: PoolName) -> Any:
        return self.group.get_pool(name)

    def fresh_tokens(self, keys: int) -> list[int]:
        """Token ids for ``keys`` storage pages that no earlier call produced."""
        return [next(self._next_token) for _ in range(keys * self.page_tokens)]

    def keys_for(self, token_ids: Sequence[int], last_hash: str | None = None) -> list[str]:
        """The storage keys the controller derives for ``token_ids``."""
        return list(get_storage_hash_str(list(token_ids), last_hash, page_size=self.page_tokens))

    # -- backup -------------------------------------------------------------

    def backup(
        self,
        keys: int | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        last_hash: str | None = None,
        seed: int = 0,
        prefix_keys: Sequence[str] | None = None,
    ) -> BackupResult:
        """Fill host pages with random bytes and back them up to L3.

        Either ``keys`` fresh storage pages, or the pages of ``token_ids``
        (whole pages, chained after ``last_hash``). KV-derived sidecars cover
        every page; trailing sidecars their window, like UnifiedRadixCache's
        ``write_backup_storage``. ``prefix_keys``: the chain's keys before
        these, as a radix cache with ``hicache_storage_pass_prefix_keys`` passes
        them (``[]`` for a chain's first backup; None: the knob is off).
        Returns once the backup thread acked.
        """
        if token_ids is None:
            if keys is None:
                raise ValueError("give keys or token_ids")
            token_ids = self.fresh_tokens(keys)
        token_ids = list(token_ids)
        if not token_ids or len(token_ids) % self.page_tokens:
            raise ValueError(f"{len(token_ids)} tokens is not whole {self.page_tokens}-token pages")
        hashes = self.keys_for(token_ids, last_hash)
        kv_slots = alloc_pages(self.pool(PoolName.KV), len(hashes) * self.host_pages_per_key)
        sidecars: list[PoolTransfer] = []
        try:
            sidecars = self._backup_sidecars(self, hashes)
            snapshot = self._fill(PoolName.KV, kv_slots, hashes, seed)
            for transfer in sidecars:
                if transfer.indices_from_pool == PoolName.KV:
                    snapshot |= self._fill(transfer.name, kv_slots, hashes, seed)
                else:
                    snapshot |= self._fill(
                        transfer.name, transfer.host_indices, transfer.keys, seed
                    )
            self.controller.write_storage(
                kv_slots,
                token_ids,
                hash_value=hashes,
                prefix_keys=None if prefix_keys is None else list(prefix_keys),
                extra_pools=sidecars or None,
            )
            operation = _get_ack(self.controller.ack_backup_queue, "backup")
        finally:
            self._free(PoolName.KV, kv_slots)
            for transfer in sidecars:
                if transfer.indices_from_pool is None:
                    self._free(transfer.name, transfer.host_indices)
        pool_results = operation.pool_storage_result.extra_pool_hit_pages
        return BackupResult(
            token_ids=tuple(token_ids),
            keys=tuple(hashes),
            completed_tokens=int(operation.completed_tokens),
            pool_write_pages={str(k): int(v) for k, v in pool_results.items()},
            pages=snapshot,
        )

    def _key_bytes(
        self, name: PoolName, slots: torch.Tensor, keys: Sequence[str]
    ) -> dict[str, bytes]:
        """Per key, the flat bytes of the host pages it covers, in slot order."""
        pool = self.pool(name)
        starts = page_starts(pool, slots)
        per_key = len(starts) // len(keys) if keys else 0
        return {
            key: b"".join(page_bytes(pool, s) for s in starts[i * per_key : (i + 1) * per_key])
            for i, key in enumerate(keys)
        }

    def _fill(
        self, name: PoolName, slots: torch.Tensor, keys: Sequence[str], seed: int
    ) -> dict[PoolName, dict[str, bytes]]:
        pool = self.pool(name)
        # Different pools of one key get different bytes, so a restore into
        # the wrong pool is caught too.
        starts = page_starts(pool, slots)
        fill_random_pages(pool, starts, seed=seed * 64 + list(PoolName).index(name))
        if name == PoolName.INDEXER and self.indexer_first_page_only:
            per_key = len(starts) // max(1, len(keys))
            wipe_pages(pool, [p for i, p in enumerate(starts) if i % per_key])
        return {name: self._key_bytes(name, slots, keys)}

    def _free(self, name: PoolName, slots: torch.Tensor | None) -> None:
        if slots is not None and slots.numel():
            self.pool(name).free(slots)

    # -- hit query ------------------------------------------------------------

    def hit_query(
        self,
        token_ids: Sequence[int],
        *,
        last_hash: str | None = None,
        prefix_keys: Sequence[str] | None = None,
    ) -> HitQuery:
        """Ask the backend how much of ``token_ids`` L3 can restore, with the
        PoolTransfers ``UnifiedRadixCache.prefetch_from_storage`` sends
        (``prefix_keys`` as for ``backup``; the prefetch carries them too)."""
        token_ids = list(token_ids)
        keys = len(token_ids) // self.page_tokens
        operation = PrefetchOperation(
            CacheRequestHandle(f"harness-{next(self._request_ids)}", 0),
            token_ids[: keys * self.page_tokens],
            last_hash,
            prefix_keys=None if prefix_keys is None else list(prefix_keys),
            pool_transfers=self._query_sidecars(self, keys) or None,
        )
        hashes, hit_tokens = self.controller._storage_hit_query(operation)
        hit_tokens = self.controller._sync_prefetch_hit_query(operation, hit_tokens)
        hit_tokens -= hit_tokens % self.tree_page_tokens
        # What prefetch_thread_func does with the synced count.
        operation.hash_value = hashes[: hit_tokens // self.page_tokens]
        operation.storage_hit_count = hit_tokens
        restorable = operation.pool_storage_result.restorable_prefix_pages
        return HitQuery(
            operation=operation,
            hit_pages=len(operation.hash_value),
            hit_tokens=hit_tokens,
            keys=tuple(operation.hash_value),
            query_pool_hit_pages={str(k): v for k, v in operation.query_pool_hit_pages.items()},
            restorable_prefix_pages=None if restorable is None else tuple(restorable),
        )

    # -- prefetch -------------------------------------------------------------

    def prefetch(self, query: HitQuery) -> PrefetchResult:
        """Restore the hit of ``query`` into freshly allocated, zeroed host
        pages through the controller's ``_page_transfer``, and read them back."""
        operation = query.operation
        hit_keys = len(operation.hash_value)
        if hit_keys == 0:
            # The radix cache revokes an empty hit; nothing is transferred.
            return PrefetchResult(completed_tokens=0, pool_hits={}, pages={})
        kv_slots = alloc_pages(self.pool(PoolName.KV), hit_keys * self.host_pages_per_key)
        operation.host_indices = kv_slots
        staged: list[PoolTransfer] = []
        try:
            for name in self.kv_derived_pools:
                wipe_pages(self.pool(name), page_starts(self.pool(name), kv_slots))
            for transfer in operation.pool_transfers or ():
                if transfer.indices_from_pool is not None or transfer.host_indices is not None:
                    continue
                # _alloc_prefetch_aux_staging: the trailing window, capped by the hit.
                staging_pages = min(len(transfer.keys or ()), hit_keys)
                if staging_pages == 0:
                    continue
                pool = self.pool(transfer.name)
                transfer.host_indices = alloc_pages(pool, staging_pages)
                wipe_pages(pool, page_starts(pool, transfer.host_indices))
                staged.append(transfer)
            completed_tokens, pool_hits = self._run_page_transfer(operation)
            pages = self._read_restored(
                operation, completed_tokens // self.page_tokens, staged, pool_hits
            )
        finally:
            self._free(PoolName.KV, kv_slots)
            for transfer in staged:
                self._free(transfer.name, transfer.host_indices)
        return PrefetchResult(
            completed_tokens=completed_tokens,
            pool_hits=pool_hits,
            pages=pages,
            sidecar_keys={t.name: tuple(t.keys or ()) for t in staged},
        )

    def _run_page_transfer(self, operation: PrefetchOperation) -> tuple[int, dict[str, int]]:
        self.controller._page_transfer(operation)
        # _page_transfer emits one ack per STORAGE_BATCH_SIZE keys and, with
        # pool transfers, one sidecar ack; the controller's sync thread
        # reduces them (a no-op on one rank) into ack_prefetch_queue.
        expected = math.ceil(len(operation.hash_value) / STORAGE_BATCH_SIZE)
        expected += operation.pool_transfers is not None
        completed_tokens, pool_hits = 0, {}
        for _ in range(expected):
            ack = _get_ack(self.controller.ack_prefetch_queue, "prefetch")
            if ack.completed_tokens is not None:
                completed_tokens = int(ack.completed_tokens)
            if ack.pool_hits is not None:
                pool_hits = {str(k): int(v) for k, v in ack.pool_hits.items() if v}
        return completed_tokens, pool_hits

    def _read_restored(
        self,
        operation: PrefetchOperation,
        completed_keys: int,
        staged: list[PoolTransfer],
        pool_hits: Mapping[str, int],
    ) -> dict[PoolName, dict[str, bytes]]:
        keys = operation.hash_value[:completed_keys]
        kv_slots = operation.host_indices[: completed_keys * self.page_tokens]
        pages = {name: self._key_bytes(name, kv_slots, keys) for name in self.kv_derived_pools}
        for transfer in staged:
            # Only the leading keys the backend reported restored; the rest
            # (all of them when KV fell short and the sidecar read was skipped)
            # still hold zeros or placeholder keys.
            restored = pool_hits.get(str(transfer.name), 0)
            per_key = transfer.host_indices.numel() // max(1, len(transfer.keys or ()))
            pages[transfer.name] = self._key_bytes(
                transfer.name,
                transfer.host_indices[: restored * per_key],
                (transfer.keys or [])[:restored],
            )
        return pages

    # -- verification ---------------------------------------------------------

    @staticmethod
    def mismatches(restored: PrefetchResult, *backups: BackupResult) -> list[str]:
        """Descriptions of every restored key whose bytes differ from the
        backed-up bytes of the same pool and key (empty: byte-exact)."""
        expected: dict[PoolName, dict[str, bytes]] = {}
        for backup in backups:
            for name, by_key in backup.pages.items():
                expected.setdefault(name, {}).update(by_key)
        problems = []
        for name, by_key in restored.pages.items():
            for key, data in by_key.items():
                want = expected.get(name, {}).get(key)
                if want is None:
                    problems.append(f"{name}:{key[:12]} was never backed up")
                elif data != want:
                    problems.append(f"{name}:{key[:12]} differs ({len(data)} vs {len(want)} bytes)")
        return problems


def _get_ack(ack_queue: queue.Queue, what: str) -> Any:
    try:
        return ack_queue.get(timeout=_ACK_TIMEOUT_S)
    except queue.Empty as exc:
        raise TimeoutError(f"the controller did not acknowledge the {what} in time") from exc


# ---------------------------------------------------------------------------
# builders
# ---------------------------------------------------------------------------


def _indexer_backup(keys: list[str]) -> PoolTransfer:
    # UnifiedRadixCache._build_sidecar_transfers(BACKUP_STORAGE): the indexer
    # borrows the KV transfer's keys and (resolved by the controller) slots.
    return PoolTransfer(
        name=PoolName.INDEXER,
        keys=list(keys),
        hit_policy=PoolHitPolicy.ALL_PAGES,
        indices_from_pool=PoolName.KV,
    )


def _indexer_query() -> PoolTransfer:
    # The PREFETCH phase builds it from PoolTransfer(KV, host_indices=None),
    # whose keys are None: the backend uses the query's own keys.
    return PoolTransfer(
        name=PoolName.INDEXER,
        keys=None,
        hit_policy=PoolHitPolicy.ALL_PAGES,
        indices_from_pool=PoolName.KV,
    )


def _mamba_backup(mamba_host: Any, keys: list[str]) -> PoolTransfer:
    # MambaComponent.build_hicache_transfers(BACKUP_STORAGE): the node's one
    # checkpoint slot under its last key.
    return PoolTransfer(
        name=PoolName.MAMBA,
        host_indices=alloc_pages(mamba_host, 1),
        keys=[keys[-1]],
        hit_policy=PoolHitPolicy.TRAILING_PAGES,
    )


def _mamba_query() -> PoolTransfer:
    # MambaComponent.build_hicache_transfers(PREFETCH): staging comes at hit time.
    return PoolTransfer(
        name=PoolName.MAMBA,
        keys=[PLACEHOLDER_KEY],
        hit_policy=PoolHitPolicy.TRAILING_PAGES,
    )


def _dsa_group(
    device_pool: Any, *, layers: int
) -> tuple[HostPoolGroup, PagedTokenToKVPoolAllocator]:
    """KV + INDEXER host pools through sglang's own declaration/assembler path
    (what ``_DsaStrategy`` and ``build_hybrid_mamba_stack`` do)."""
    config = prepare_host_pool_config(
        decls=device_pool.host_pool_decls(),
        full_layer_mapping={i: i for i in range(layers)},
        transfer_layer_id_max=layers,
        transfer_page_size=DSA_PAGE_TOKENS,
    )
    group = build_host_pool_group(config=config)
    allocator = PagedTokenToKVPoolAllocator(
        device_pool.size,
        device_pool.page_size,
        device_pool.dtype,
        "cpu",
        device_pool,
        need_sort=False,
    )
    return group, allocator


def _controller(
    controller_cls: type[HybridCacheController],
    *,
    allocator: Any,
    group: HostPoolGroup,
    page_tokens: int,
    tp_group: Any,
    extra_config: Mapping[str, Any],
    model_name: str,
    transfer_layer_id_max: int,
    storage_backend: str | None = "dynamic",
    **kwargs: Any,
) -> HybridCacheController:
    return controller_cls(
        allocator,
        group,
        page_tokens,
        tp_group,
        load_cache_event=threading.Event(),
        write_policy="write_through",
        io_backend="direct",
        storage_backend=storage_backend,
        model_name=model_name,
        storage_backend_extra_config=dict(extra_config),
        transfer_layer_id_max=transfer_layer_id_max,
        **kwargs,
    )


def build_dsa_harness(
    extra_config: Mapping[str, Any],
    *,
    layout: str = "page_first",
    layers: int = 2,
    kv_lora_rank: int = 32,
    rope_dim: int = 16,
    device_pages: int = 4,
    host_pages: int = 16,
    model_name: str = "harness-dsa",
) -> ControllerHarness:
    """MLA KV + DSA INDEXER through sglang's own assembler (the ``_DsaStrategy`` path)."""
    with ExitStack() as stack:
        tp_group = stack.enter_context(_single_rank_process_group())
        stack.enter_context(
            sglang_cpu_runtime(layout=layout, host_to_device_ratio=host_pages / device_pages)
        )
        device_pool = make_dsa_device_pool(
            layers=layers, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, device_pages=device_pages
        )
        group, allocator = _dsa_group(device_pool, layers=layers)
        controller = _controller(
            HybridCacheController,
            allocator=allocator,
            group=group,
            page_tokens=DSA_PAGE_TOKENS,
            tp_group=tp_group,
            extra_config=extra_config,
            model_name=model_name,
            transfer_layer_id_max=layers,
        )
        return ControllerHarness(
            stack=stack.pop_all(),
            controller=controller,
            group=group,
            page_tokens=DSA_PAGE_TOKENS,
            kv_derived_pools=frozenset({PoolName.KV, PoolName.INDEXER}),
            backup_sidecars=lambda harness, keys: [_indexer_backup(keys)],
            query_sidecars=lambda harness, keys: [_indexer_query()],
        )


SPAN_ORDERS = ("construction", "fork_startup", "runtime_attach")


def build_compressed_dsa_harness(
    extra_config: Mapping[str, Any],
    *,
    span: bool = True,
    order: str = "construction",
    transfer_page_hashing: bool = False,
    storage_backend: str = "dynamic",
    tp_rank: int = 0,
    tp_size: int = 1,
    indexer_first_page_only: bool = False,
    layout: str = "page_first",
    layers: int = 2,
    index_kpool: int = 4,
    mamba_layers: int = 2,
    kv_lora_rank: int = 32,
    rope_dim: int = 16,
    device_pages: int = 2,
    host_pages: int = 32,
    mamba_slots: int = 8,
    model_name: str = "harness-compressed-dsa",
) -> ControllerHarness:
    """MLA KV + compressed DSA INDEXER + MAMBA, 64-token host pages.

    With ``span`` (the default) one storage key covers the ``64 * index_kpool``
    token tree page, i.e. ``index_kpool`` host pages of KV and INDEXER and one
    Mamba checkpoint slot; this needs ``interface_v1`` in ``extra_config``
    (see ``_SpanHybridCacheController``). ``order`` is how the backend learns
    that page (span-aware-builds facts):

    * ``construction``: on ``storage_config.storage_page_size`` when built;
    * ``fork_startup``: the span fork's startup: built and registered at the
      host page, then assigned on the live backend (``_ForkStartupController``);
    * ``runtime_attach``: no startup backend; the controller's page is set,
      then ``attach_storage_backend`` builds it with the page on its config.

    Without ``span`` it is plain 0.5.23 (one key per 64-token host page, no
    field); with ``transfer_page_hashing`` too, the fork's production patch:
    keys hashed at the 64-token host page (the config's field says 64, K=1)
    under a ``64 * index_kpool``-token tree, hits trimmed to whole tree pages.

    ``storage_backend``: the name the controller asks the factory for (the
    fork's gate opens only for a registered name, e.g. ``mooncake`` through
    the plugin). ``tp_rank`` / ``tp_size``: the rank the storage config names.
    """
    if span and not extra_config.get("interface_v1"):
        raise ValueError(
            "span mode needs interface_v1: 0.5.23's generic KV path moves one page per key"
        )
    if order not in SPAN_ORDERS or (order != "construction" and not span):
        raise ValueError(f"order must be one of {SPAN_ORDERS} (span mode only), got {order!r}")
    if span and transfer_page_hashing:
        raise ValueError("transfer-page hashing keys one host page (K=1): pass span=False")
    tree_page_tokens = DSA_PAGE_TOKENS * index_kpool
    storage_page_tokens = tree_page_tokens if span else DSA_PAGE_TOKENS
    with ExitStack() as stack:
        tp_group = stack.enter_context(_single_rank_process_group())
        device_pool = make_dsa_device_pool(
            layers=layers,
            kv_lora_rank=kv_lora_rank,
            rope_dim=rope_dim,
            index_kpool=index_kpool,
            device_pages=device_pages,
        )
        stack.enter_context(
            sglang_cpu_runtime(
                layout=layout,
                host_to_device_ratio=host_pages * DSA_PAGE_TOKENS / device_pool.size,
            )
        )
        group, allocator = _dsa_group(device_pool, layers=layers)
        mamba_device = make_mamba_device_pool(layers=mamba_layers, device_slots=mamba_slots)
        mamba_host = mamba_host_from_device(
            mamba_device,
            slots=mamba_slots,
            layout=layout if layout in MAMBA_LAYOUTS else "page_first",
        )
        transfer_layer_id_max = layers + mamba_layers
        group.add_entry(
            build_pool_entry(
                name=PoolName.MAMBA,
                host_pool=mamba_host,
                device_pool=mamba_device,
                layer_mapping={layers + i: i for i in range(mamba_layers)},
                transfer_layer_id_max=transfer_layer_id_max,
            )
        )
        base, page_kwargs = HybridCacheController, {}
        if span and order == "fork_startup":
            base = _ForkStartupController
            page_kwargs = {
                "host_page_size": DSA_PAGE_TOKENS,
                "storage_page_size": storage_page_tokens,
            }
        elif span or transfer_page_hashing:
            base = _SpanHybridCacheController
            page_kwargs = {"storage_page_size": storage_page_tokens}
        controller_cls = type(
            f"Rank{tp_rank}{base.__name__}",
            (_RankedController, base),
            {"tp_rank_override": tp_rank, "tp_size_override": tp_size},
        )
        attach_later = span and order == "runtime_attach"
        controller = _controller(
            controller_cls,
            allocator=allocator,
            group=group,
            page_tokens=storage_page_tokens,
            tp_group=tp_group,
            extra_config=extra_config,
            model_name=model_name,
            transfer_layer_id_max=transfer_layer_id_max,
            storage_backend=None if attach_later else storage_backend,
            **page_kwargs,
        )
        if attach_later:
            # attach_storage_backend: the gate, then the page on the controller
            # before the backend is built (so its config carries it).
            if not fork_backend_supports_page_spans(storage_backend):
                raise ValueError(
                    f"Compressed DSA currently supports L2 HiCache only ({storage_backend!r})"
                )
            controller.storage_page_size = storage_page_tokens
            controller.attach_storage_backend(
                storage_backend=storage_backend,
                model_name=model_name,
                storage_backend_extra_config=dict(extra_config),
                host_pools=group.entries,
            )
        # write_backup_storage / prefetch_from_storage list component
        # transfers (MAMBA) before the KV-derived sidecars (INDEXER).
        return ControllerHarness(
            stack=stack.pop_all(),
            controller=controller,
            group=group,
            page_tokens=storage_page_tokens,
            kv_derived_pools=frozenset({PoolName.KV, PoolName.INDEXER}),
            backup_sidecars=lambda harness, keys: [
                _mamba_backup(mamba_host, keys),
                _indexer_backup(keys),
            ],
            query_sidecars=lambda harness, keys: [_mamba_query(), _indexer_query()],
            tree_page_tokens=tree_page_tokens if transfer_page_hashing else None,
            indexer_first_page_only=indexer_first_page_only,
        )


def _stock_glm_stack(
    device: StockGlmDevice,
    *,
    layout: str,
    tp_group: Any,
    extra_config: Mapping[str, Any],
    model_name: str,
) -> tuple[HostPoolGroup, HybridCacheController]:
    """sglang's ``build_hybrid_mamba_stack`` builds pools and controller, as
    ``_MambaStrategy`` does; it refuses layer_first (the Mamba host pool
    asserts), so that layout composes the same builders with the KDA state
    page_first and constructs the controller the same way."""
    if mamba_layout_for(layout) == layout:
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=device.req_to_token,
            token_to_kv_pool_allocator=device.allocator,
            page_size=device.page_tokens,
            tp_cache_group=tp_group,
            mtp_draft_device_pools=device.drafts,
        )
        group, controller, _ = build_hybrid_mamba_stack(
            params=params,
            decls=device.kv.host_pool_decls(),
            mamba_pool=device.mamba,
            full_layer_mapping=device.full_layer_mapping,
            start_layer=0,
            load_cache_event=threading.Event(),
            storage_backend="dynamic",
            use_mla=True,
            model_name=model_name,
            storage_backend_extra_config=dict(extra_config),
        )
        return group, controller
    group = build_stock_glm_group(device, layout)
    controller = _controller(
        HybridCacheController,
        allocator=device.allocator,
        group=group,
        page_tokens=device.page_tokens,
        tp_group=tp_group,
        extra_config=extra_config,
        model_name=model_name,
        transfer_layer_id_max=device.transfer_layer_id_max,
    )
    return group, controller


def build_stock_glm_harness(
    extra_config: Mapping[str, Any],
    *,
    layout: str = "page_first",
    layers: int = 2,
    mamba_layers: int = 2,
    draft_layers: int = 1,
    index_kpool: int = STOCK_INDEX_KPOOL,
    device_pages: int = 2,
    host_to_device_ratio: float = 4.0,
    mamba_slots: int = 8,
    model_name: str = "harness-stock-glm",
) -> ControllerHarness:
    """GLM-5.3-Flash on stock 0.5.23: MLA KV + compressed DSA INDEXER (both
    with ``draft_layers`` packed MTP layers) + KDA state, one key per
    ``64 * index_kpool``-token host page (K=1)."""
    with ExitStack() as stack:
        tp_group = stack.enter_context(_single_rank_process_group())
        stack.enter_context(
            sglang_cpu_runtime(layout=layout, host_to_device_ratio=host_to_device_ratio)
        )
        device = make_stock_glm_device(
            layers=layers,
            mamba_layers=mamba_layers,
            draft_layers=draft_layers,
            index_kpool=index_kpool,
            device_pages=device_pages,
            mamba_slots=mamba_slots,
        )
        group, controller = _stock_glm_stack(
            device,
            layout=layout,
            tp_group=tp_group,
            extra_config=extra_config,
            model_name=model_name,
        )
        mamba_host = group.get_pool(PoolName.MAMBA)
        return ControllerHarness(
            stack=stack.pop_all(),
            controller=controller,
            group=group,
            page_tokens=device.page_tokens,
            kv_derived_pools=frozenset({PoolName.KV, PoolName.INDEXER}),
            backup_sidecars=lambda harness, keys: [
                _mamba_backup(mamba_host, keys),
                _indexer_backup(keys),
            ],
            query_sidecars=lambda harness, keys: [_mamba_query(), _indexer_query()],
        )


def build_mamba_swa_harness(
    extra_config: Mapping[str, Any],
    *,
    layout: str = "page_first",
    page_tokens: int = 64,
    full_layers: int = 2,
    swa_layers: int = 2,
    mamba_layers: int = 2,
    heads: int = 2,
    head_dim: int = 16,
    swa_window_pages: int = 2,
    device_pages: int = 4,
    host_pages: int = 16,
    mamba_slots: int = 8,
    model_name: str = "harness-mamba-swa",
) -> ControllerHarness:
    """MHA KV + SWA + MAMBA (the ``_MambaSwaStrategy`` pool set), hand-built.

    Backups write the SWA window (``swa_window_pages`` trailing pages) and one
    Mamba state for the last page, both TRAILING_PAGES; hit queries send the
    placeholder keys the radix cache sends. Mamba has no layer_first host
    layout in sglang, so with ``layout="layer_first"`` it stays page_first.
    """
    with ExitStack() as stack:
        tp_group = stack.enter_context(_single_rank_process_group())
        stack.enter_context(sglang_cpu_runtime(layout=layout))
        kv_device, swa_device = (
            make_mha_device_pool(
                layers=n,
                page_tokens=page_tokens,
                heads=heads,
                head_dim=head_dim,
                device_pages=device_pages,
            )
            for n in (full_layers, swa_layers)
        )
        mamba_device = make_mamba_device_pool(layers=mamba_layers, device_slots=mamba_slots)
        kv_host = mha_host_from_device(kv_device, layout, host_pages=host_pages)
        swa_host = mha_host_from_device(swa_device, layout, host_pages=host_pages, pool_label="swa")
        mamba_host = mamba_host_from_device(
            mamba_device,
            slots=mamba_slots,
            layout=layout if layout in MAMBA_LAYOUTS else "page_first",
        )
        # Disjoint transfer-layer ids per component, as in a hybrid model.
        swa_first = full_layers
        mamba_first = full_layers + swa_layers
        transfer_layer_id_max = mamba_first + mamba_layers
        group = HostPoolGroup(
            [
                build_pool_entry(
                    name=PoolName.KV,
                    host_pool=kv_host,
                    device_pool=kv_device,
                    layer_mapping={i: i for i in range(full_layers)},
                    transfer_layer_id_max=transfer_layer_id_max,
                    is_anchor=True,
                ),
                build_pool_entry(
                    name=PoolName.SWA,
                    host_pool=swa_host,
                    device_pool=swa_device,
                    layer_mapping={swa_first + i: i for i in range(swa_layers)},
                    transfer_layer_id_max=transfer_layer_id_max,
                ),
                build_pool_entry(
                    name=PoolName.MAMBA,
                    host_pool=mamba_host,
                    device_pool=mamba_device,
                    layer_mapping={mamba_first + i: i for i in range(mamba_layers)},
                    transfer_layer_id_max=transfer_layer_id_max,
                ),
            ]
        )
        allocator = PagedTokenToKVPoolAllocator(
            kv_device.size, page_tokens, kv_device.dtype, "cpu", kv_device, need_sort=False
        )
        controller = _controller(
            HybridCacheController,
            allocator=allocator,
            group=group,
            page_tokens=page_tokens,
            tp_group=tp_group,
            extra_config=extra_config,
            model_name=model_name,
            transfer_layer_id_max=transfer_layer_id_max,
        )

        def backup_sidecars(harness: ControllerHarness, keys: list[str]) -> list[PoolTransfer]:
            # SwaComponent.build_hicache_transfers(BACKUP_STORAGE): the node's
            # SWA window, then its Mamba checkpoint.
            window = min(swa_window_pages, len(keys))
            swa = PoolTransfer(
                name=PoolName.SWA,
                host_indices=alloc_pages(swa_host, window),
                keys=list(keys[-window:]),
                hit_policy=PoolHitPolicy.TRAILING_PAGES,
            )
            try:
                return [swa, _mamba_backup(mamba_host, keys)]
            except Exception:
                swa_host.free(swa.host_indices)
                raise

        def query_sidecars(harness: ControllerHarness, keys: int) -> list[PoolTransfer]:
            # SwaComponent.build_hicache_transfers(PREFETCH): placeholders
            # sized by the staging plan.
            window = min(swa_window_pages, keys)
            swa = [
                PoolTransfer(
                    name=PoolName.SWA,
                    keys=[PLACEHOLDER_KEY] * window,
                    hit_policy=PoolHitPolicy.TRAILING_PAGES,
                )
            ]
            return (swa if window else []) + [_mamba_query()]

        return ControllerHarness(
            stack=stack.pop_all(),
            controller=controller,
            group=group,
            page_tokens=page_tokens,
            kv_derived_pools=frozenset({PoolName.KV}),
            backup_sidecars=backup_sidecars,
            query_sidecars=query_sidecars,
        )
