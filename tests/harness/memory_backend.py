"""A tiny in-memory HiCache L3 backend that records every call.

It exists only to validate the controller harness: the real backend is
plugged into the same harness through ``extra_config`` (module_path /
class_name). Objects are bytes keyed by strings: ``"{key}"`` for the KV
anchor (generic and v1 paths alike, both store the flat page bytes), and
``"{key}@{pool}"`` for every v2 pool.

Like HiCacheFile, the number of host slots per key is derived from the
transfer (``host_indices.numel() // len(keys)``), so one key may cover
several consecutive host pages (span mode); their flat pages are
concatenated in slot order.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from mooncake_span_tools.testing.pools import page_bytes

logger = logging.getLogger(__name__)

__all__ = ["CallRecord", "MemoryBackend", "TransferRecord", "memory_backend_config"]

PLACEHOLDER_KEY = "__placeholder__"


def memory_backend_config(**extra: Any) -> dict[str, Any]:
    """``storage_backend_extra_config`` that makes sglang's "dynamic" factory load
    this class; ``extra`` adds keys such as ``interface_v1``."""
    # __name__ is the name this module was imported under, so the factory's
    # importlib.import_module finds it however pytest put tests/ on sys.path.
    return {
        "backend_name": "memory",
        "module_path": __name__,
        "class_name": MemoryBackend.__name__,
        **extra,
    }


@dataclass(frozen=True)
class TransferRecord:
    """What one PoolTransfer looked like when the backend received it."""

    name: str
    keys: int | None
    host_indices: int | None
    hit_policy: str
    indices_from_pool: str | None
    placeholder_keys: bool

    @classmethod
    def of(cls, transfer: PoolTransfer) -> TransferRecord:
        keys = transfer.keys
        return cls(
            name=str(transfer.name),
            keys=None if keys is None else len(keys),
            host_indices=None
            if transfer.host_indices is None
            else int(transfer.host_indices.numel()),
            hit_policy=PoolHitPolicy(transfer.hit_policy).value,
            indices_from_pool=None
            if transfer.indices_from_pool is None
            else str(transfer.indices_from_pool),
            placeholder_keys=bool(keys) and all(k == PLACEHOLDER_KEY for k in keys),
        )


@dataclass(frozen=True)
class CallRecord:
    """One call into the backend, in arrival order."""

    method: str
    keys: int | None = None
    host_indices: int | None = None
    transfers: tuple[TransferRecord, ...] = ()
    prefix_keys: int | None = None
    detail: str = ""


def _prefix_len(extra_info: HiCacheStorageExtraInfo | None) -> int | None:
    if extra_info is None or extra_info.prefix_keys is None:
        return None
    return len(extra_info.prefix_keys)


def _as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()


class MemoryBackend(HiCacheStorage):
    """Dict-backed ``HiCacheStorage`` built by sglang's "dynamic" factory."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any]):
        self.storage_config = storage_config
        self.factory_kwargs = dict(kwargs)
        self.registered_pools: dict[Any, Any] = {}
        self.mem_pool_host = None
        self.calls: list[CallRecord] = []
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._record(CallRecord("__init__", detail=type(storage_config).__name__))

    # -- bookkeeping -------------------------------------------------------

    def _record(self, call: CallRecord) -> None:
        with self._lock:
            self.calls.append(call)

    def calls_named(self, *methods: str) -> list[CallRecord]:
        with self._lock:
            return [c for c in self.calls if c.method in methods]

    def object_names(self) -> list[str]:
        with self._lock:
            return sorted(self._objects)

    def _get_object(self, name: str) -> bytes | None:
        with self._lock:
            return self._objects.get(name)

    def _put_object(self, name: str, data: bytes) -> None:
        with self._lock:
            self._objects[name] = data

    def _has_object(self, name: str) -> bool:
        with self._lock:
            return name in self._objects

    @staticmethod
    def _object_name(key: str, pool: PoolName | str) -> str:
        pool = PoolName(pool)
        return key if pool == PoolName.KV else f"{key}@{pool.value}"

    def _pool(self, name: PoolName | str) -> Any:
        pool = self.registered_pools.get(name)
        if pool is None:
            pool = self.registered_pools.get(PoolName(name))
        if pool is None and PoolName(name) == PoolName.KV:
            pool = self.mem_pool_host
        if pool is None:
            raise KeyError(f"host pool {name!r} was never registered")
        return pool

    # -- registration ------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._record(CallRecord("register_mem_pool_host", detail=type(mem_pool_host).__name__))

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._record(
            CallRecord(
                "register_mem_host_pool_v2",
                detail=f"{PoolName(host_pool_name).value}:{type(host_pool).__name__}",
            )
        )

    def on_host_pools_registered(self) -> None:
        names = ",".join(sorted(PoolName(n).value for n in self.registered_pools))
        self._record(CallRecord("on_host_pools_registered", detail=names))

    # -- page <-> object ---------------------------------------------------

    def _slot_groups(
        self, pool: Any, keys: Sequence[str], host_indices: torch.Tensor | None
    ) -> list[list[int]] | None:
        """Per key, the first slot of each host page it covers; None on a
        length mismatch (the caller answers False for every key)."""
        if not keys:
            return []
        page_size = getattr(pool, "page_size", 1) or 1
        numel = 0 if host_indices is None else int(host_indices.numel())
        per_key = numel // len(keys)
        if numel == 0 or numel % len(keys) or per_key % page_size:
            logger.error(
                "memory backend: %d host slots do not split into %d keys of whole %d-slot pages",
                numel,
                len(keys),
                page_size,
            )
            return None
        slots = host_indices.tolist()
        return [slots[i * per_key : (i + 1) * per_key : page_size] for i in range(len(keys))]

    def _write(self, pool: Any, name: PoolName | str, keys, host_indices) -> list[bool]:
        groups = self._slot_groups(pool, keys, host_indices)
        if groups is None:
            return [False] * len(keys)
        for key, starts in zip(keys, groups, strict=True):
            data = b"".join(page_bytes(pool, slot) for slot in starts)
            self._put_object(self._object_name(key, name), data)
        return [True] * len(keys)

    def _read(self, pool: Any, name: PoolName | str, keys, host_indices) -> list[bool]:
        groups = self._slot_groups(pool, keys, host_indices)
        if groups is None:
            return [False] * len(keys)
        template = pool.get_dummy_flat_data_page()
        page_nbytes = template.nbytes
        results = []
        for key, starts in zip(keys, groups, strict=True):
            data = self._get_object(self._object_name(key, name))
            if data is None or len(data) != page_nbytes * len(starts):
                results.append(False)
                continue
            for i, slot in enumerate(starts):
                chunk = bytearray(data[i * page_nbytes : (i + 1) * page_nbytes])
                page = torch.frombuffer(chunk, dtype=torch.uint8).view(template.dtype)
                pool.set_from_flat_data_page(slot, page)
            results.append(True)
        return results

    # -- v2 (hybrid pools) -------------------------------------------------

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        self._record(
            CallRecord(
                "batch_exists_v2",
                keys=len(keys),
                transfers=tuple(TransferRecord.of(t) for t in pool_transfers or ()),
                prefix_keys=_prefix_len(extra_info),
            )
        )
        kv_pages = self._leading_kv_hits(keys)
        hits: dict[str, int] = {PoolName.KV: kv_pages}
        restorable = set(range(1, kv_pages + 1))
        for transfer in pool_transfers or ():
            present = [
                self._has_object(self._object_name(k, transfer.name)) for k in keys[:kv_pages]
            ]
            if transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(transfer.keys or ()))
                pool_ok = {
                    n for n in range(1, kv_pages + 1) if all(present[max(0, n - window) : n])
                }
                hits[transfer.name] = max(pool_ok, default=0)
            else:
                boundary = present.index(False) if False in present else kv_pages
                pool_ok = set(range(1, boundary + 1))
                hits[transfer.name] = boundary
            restorable &= pool_ok
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hits, ordered)

    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        self._record(
            CallRecord(
                "batch_set_v2",
                transfers=tuple(TransferRecord.of(t) for t in transfers),
                prefix_keys=_prefix_len(extra_info),
            )
        )
        return {
            t.name: self._write(self._pool(t.name), t.name, t.keys or [], t.host_indices)
            for t in transfers
        }

    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        self._record(
            CallRecord(
                "batch_get_v2",
                transfers=tuple(TransferRecord.of(t) for t in transfers),
                prefix_keys=_prefix_len(extra_info),
            )
        )
        return {
            t.name: self._read(self._pool(t.name), t.name, t.keys or [], t.host_indices)
            for t in transfers
        }

    # -- v1 (zero-copy KV anchor path) -------------------------------------

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        self._record(
            CallRecord(
                "batch_set_v1",
                keys=len(keys),
                host_indices=int(host_indices.numel()),
                prefix_keys=_prefix_len(extra_info),
            )
        )
        return self._write(self.mem_pool_host, PoolName.KV, keys, host_indices)

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        self._record(
            CallRecord(
                "batch_get_v1",
                keys=len(keys),
                host_indices=int(host_indices.numel()),
                prefix_keys=_prefix_len(extra_info),
            )
        )
        return self._read(self.mem_pool_host, PoolName.KV, keys, host_indices)

    # -- generic KV path ---------------------------------------------------

    def _leading_kv_hits(self, keys: Sequence[str]) -> int:
        for i, key in enumerate(keys):
            if not self._has_object(key):
                return i
        return len(keys)

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        self._record(
            CallRecord("batch_exists", keys=len(keys), prefix_keys=_prefix_len(extra_info))
        )
        return self._leading_kv_hits(keys)

    def exists(self, key: str) -> bool:
        return self._has_object(key)

    def get(
        self,
        key: str,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> torch.Tensor | None:
        data = self._get_object(key)
        if data is None:
            return None
        value = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if target_location is None:
            return value
        if target_location.nbytes != len(data):
            logger.error(
                "memory backend: object %s has %d bytes, target holds %d",
                key,
                len(data),
                target_location.nbytes,
            )
            return None
        target_location.view(torch.uint8).reshape(-1).copy_(value)
        return target_location

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None]:
        shape = None
        if target_locations:
            first = target_locations[0]
            shape = f"{tuple(first.shape)}:{first.dtype}"
        self._record(CallRecord("batch_get", keys=len(keys), detail=shape or ""))
        return [
            self.get(key, None if target_locations is None else target_locations[i])
            for i, key in enumerate(keys)
        ]

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        if not isinstance(value, torch.Tensor):
            return False
        self._put_object(key, _as_bytes(value))
        return True

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        shape = None
        if values:
            shape = f"{tuple(values[0].shape)}:{values[0].dtype}"
        self._record(CallRecord("batch_set", keys=len(keys), detail=shape or ""))
        return all([self.set(key, value) for key, value in zip(keys, values or [], strict=True)])

    # -- admin -------------------------------------------------------------

    def clear(self) -> None:
        with self._lock:
            self._objects.clear()

    def close(self) -> None:
        self._record(CallRecord("close"))
