"""A deliberately wrong restore, for the negative controls of the serving oracles.

:class:`FaultyRestoreStore` wraps a HiCache backend (by default this project's,
``MooncakeSpanStore``, loaded by name as sglang loads a dynamic backend) and
forwards every call to it, with one addition: before answering a restore
(``batch_get_v1`` / ``batch_get_v2``), it reads a fault from the JSON file
named by :data:`FAULT_FILE_ENV` (re-read at every call, so a test can change
it between requests) and applies it to the restore it just made, in the host
pools that were registered through it. A server loads it with
``--hicache-storage-backend dynamic`` and ``module_path`` :data:`MODULE_PATH`.
It knows the backend only through sglang's ``HiCacheStorage`` interface, so
the runtime's classes stay out of its inheritance. Test support only: no
runtime path imports this module.

Faults (``{"kind": ..., "pool": ...}``; an empty file or ``{}`` is none):

- ``swap``: the pages of two keys of ``pool`` (``first``, ``second``: their
  positions in the call's keys) trade places after a good read, as if each
  had been read from the other's key; the call still answers success;
- ``zero``: ``pool`` is not read at all, its host pages are left as a fresh
  pool holds them (zeros), and the call answers success: a silently dropped
  restore;
- ``miss``: ``pool`` is not read and the call says so (every key False).

A fault with ``"call": n`` applies only to the n-th call (from 0) that reads
its pool after the file was written, so a test can spoil one request of
several (one call per request of up to 128 pages); without it, every call.

Each call that applied a fault appends a line to ``<fault file>.log``, so a
test can tell a fault that fired from one that never met a matching call.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

logger = logging.getLogger(__name__)

FAULT_FILE_ENV = "MOONCAKE_SPAN_TEST_RESTORE_FAULTS"
MODULE_PATH = "mooncake_span_tools.testing.restore_faults"
CLASS_NAME = "FaultyRestoreStore"
# The backend it wraps unless it is given one: this project's.
WRAPPED = ("mooncake_span.sglang_backend.backend", "MooncakeSpanStore")
KINDS = ("swap", "zero", "miss")


def read_fault(path: str | None) -> dict[str, Any]:
    """The fault the file names now, ``{}`` for none; a malformed one raises ValueError."""
    if not path or not Path(path).exists():
        return {}
    text = Path(path).read_text().strip()
    fault = json.loads(text) if text else {}
    if fault and (fault.get("kind") not in KINDS or not fault.get("pool")):
        raise ValueError(f"{path}: a fault needs kind in {KINDS} and a pool, got {fault}")
    return fault


def write_fault(path: Path, fault: dict[str, Any] | None) -> None:
    path.write_text(json.dumps(fault or {}))


def applied(path: Path) -> list[dict[str, Any]]:
    """The faults applied so far, one entry per call."""
    log = Path(f"{path}.log")
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line]


def _pool_name_of(name: Any) -> str:
    return str(getattr(name, "value", name))


def _pool_name(transfer: Any) -> str:
    return _pool_name_of(transfer.name)


def _key_index(host_indices: Any, keys: int, position: int) -> int:
    """The host index of key ``position``'s first slot."""
    per_key = host_indices.numel() // keys
    return int(host_indices.reshape(-1)[position * per_key])


def _swap_pages(host_pool: Any, first: int, second: int) -> None:
    a = host_pool.get_data_page(first, flat=True).clone()
    b = host_pool.get_data_page(second, flat=True).clone()
    host_pool.set_from_flat_data_page(first, b)
    host_pool.set_from_flat_data_page(second, a)


def _zero_pages(host_pool: Any, host_indices: Any, keys: int) -> None:
    for position in range(keys):
        index = _key_index(host_indices, keys, position)
        page = host_pool.get_data_page(index, flat=True)
        host_pool.set_from_flat_data_page(index, page.new_zeros(page.shape))


class FaultyRestoreStore(HiCacheStorage):
    """A backend, with the restore fault of :data:`FAULT_FILE_ENV` applied to its reads.

    sglang reads the KV pool with ``batch_get_v1`` and the other pools of a
    hybrid stack with ``batch_get_v2``; a fault applies to whichever call
    carries its pool. Every other method and attribute is the wrapped backend's.
    """

    def __init__(
        self,
        storage_config: Any = None,
        kwargs_or_host_pool: Any = None,
        *,
        backend: HiCacheStorage | None = None,
    ) -> None:
        if backend is None:
            module, name = WRAPPED
            wrapped = getattr(importlib.import_module(module), name)
            backend = wrapped(storage_config, kwargs_or_host_pool)
        self._backend = backend
        self._host_pools: dict[str, Any] = {}  # by pool name, as registered through here
        self._fault_calls: dict[tuple, int] = {}  # reads per writing of the fault file

    def __getattr__(self, name: str) -> Any:
        # Only reached for what this class lacks (sglang's optional hooks, span fields).
        return getattr(self.__dict__["_backend"], name)

    @property
    def storage_page_size(self) -> int:
        return self._backend.storage_page_size

    @storage_page_size.setter
    def storage_page_size(self, value: int) -> None:
        # The span fork assigns it on the live backend: it must reach the wrapped one.
        self._backend.storage_page_size = value

    # ---- registration: forwarded, the host pools remembered for the faults --------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self._host_pools["kv"] = mem_pool_host
        self._backend.register_mem_pool_host(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        self._host_pools.setdefault(_pool_name_of(host_pool_name), host_pool)
        self._backend.register_mem_host_pool_v2(host_pool, host_pool_name)

    def on_host_pools_registered(self) -> None:
        self._backend.on_host_pools_registered()

    # ---- restores: the fault applied ------------------------------------------------------

    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        fault = read_fault(os.environ.get(FAULT_FILE_ENV))
        if fault.get("pool") != "kv" or not self._due(fault):
            return self._backend.batch_get_v1(keys, host_indices, extra_info)
        if fault["kind"] == "swap":
            results = self._backend.batch_get_v1(keys, host_indices, extra_info)
        else:
            results = [False] * len(keys)
        return self._spoil(fault, keys, host_indices, results)

    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
        fault = read_fault(os.environ.get(FAULT_FILE_ENV))
        target = [t for t in transfers if fault and _pool_name(t) == fault["pool"]]
        if target and not self._due(fault):
            target = []
        if not target or fault["kind"] == "swap":
            results = self._backend.batch_get_v2(transfers, extra_info)
            return self._spoil_transfers(fault, target, results)
        rest = [t for t in transfers if t not in target]
        results = self._backend.batch_get_v2(rest, extra_info) if rest else {}
        for transfer in target:
            results[transfer.name] = [False] * len(transfer.keys)
        return self._spoil_transfers(fault, target, results)

    def _due(self, fault: dict) -> bool:
        """Whether this call of the fault's pool is the one its ``call`` names (a fault
        without one: every call). Calls are counted per writing of the fault file."""
        if "call" not in fault:
            return True
        stat = os.stat(os.environ[FAULT_FILE_ENV])
        written = (json.dumps(fault, sort_keys=True), stat.st_mtime_ns, stat.st_ino)
        counts = self._fault_calls
        seen = counts.get(written, 0)
        counts[written] = seen + 1
        return seen == int(fault["call"])

    # ---- everything else: forwarded as it is ----------------------------------------------

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None):
        return self._backend.batch_exists_v2(keys, pool_transfers, extra_info)

    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None):
        return self._backend.batch_set_v2(transfers, extra_info)

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None):
        return self._backend.batch_set_v1(keys, host_indices, extra_info)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None):
        return self._backend.get(key, target_location, target_sizes)

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None):
        return self._backend.batch_get(keys, target_locations, target_sizes)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes=None):
        return self._backend.set(key, value, target_location, target_sizes)

    def batch_set(self, keys: list[str], values=None, target_locations=None, target_sizes=None):
        return self._backend.batch_set(keys, values, target_locations, target_sizes)

    def exists(self, key: str) -> bool:
        return self._backend.exists(key)

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        return self._backend.batch_exists(keys, extra_info)

    def clear(self) -> None:
        return self._backend.clear()

    def get_stats(self):
        return self._backend.get_stats()

    def close(self) -> None:
        self._backend.close()

    def _spoil_transfers(self, fault: dict, target: list[Any], results: dict) -> dict:
        for transfer in target:
            results[transfer.name] = self._spoil(
                fault, transfer.keys, transfer.host_indices, results[transfer.name]
            )
        return results

    def _spoil(
        self, fault: dict, keys: list[str], host_indices: Any, results: list[bool]
    ) -> list[bool]:
        """Apply ``fault`` to a read of ``keys`` into ``host_indices`` that answered ``results``."""
        host_pool = self._host_pools[fault["pool"]]
        if fault["kind"] == "swap":
            first, second = int(fault.get("first", 0)), int(fault.get("second", 1))
            if max(first, second) >= len(keys) or not all(results):
                return results
            _swap_pages(
                host_pool,
                _key_index(host_indices, len(keys), first),
                _key_index(host_indices, len(keys), second),
            )
        elif fault["kind"] == "zero":
            _zero_pages(host_pool, host_indices, len(keys))
            results = [True] * len(keys)
        with open(f"{os.environ[FAULT_FILE_ENV]}.log", "a") as log:
            log.write(json.dumps({**fault, "keys": len(keys)}) + "\n")
        logger.warning("restore fault applied to %d keys: %s", len(keys), fault)
        return results
