"""``mooncake-span bench --pressure``: backups into a full cluster.

One master and one small storage segment (``LocalCluster``) receive
sglang-shaped backups through the real ``MooncakeSpanStore``: a DSA model's
host pools (MLA KV + compressed indexer, K=4 host pages per key), each call
``batch_set_v2`` (indexer) then ``batch_set_v1`` (KV) for ``keys_per_call``
prefix-chained keys, offered at a steady rate until ``load_ratio`` times the
segment was written. Each scenario (a put cool-down, a pair of master
eviction flags) runs on a fresh cluster with the same keys and bytes.

Per scenario: native put calls and objects (a counting wrapper around the
native store), what they answered, the share of offered keys stored at the
end, backup latency (p50/p99 of one v2+v1 pair), the hit share of the newest
requests (``batch_exists_v2``), and a byte-exact check of every key restored
(``batch_get_v1`` + ``batch_get_v2``): a restore that reads True with other
bytes counts as corrupt, and the command exits 1 if any does.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from mooncake_span_tools.bench.shared_native import RecordingNative
from mooncake_span_tools.testing.controller import chained_keys

logger = logging.getLogger(__name__)

_HOST_PAGE_TOKENS = 64
_INDEX_KPOOL = 4  # host pages per storage key (K)
_MODEL = "bench-pressure"


@dataclass(frozen=True)
class MasterFlags:
    """The master flags that decide how much space comes back; None keeps
    Mooncake's default (high watermark 0.9, ratio 0.05, lease 10 s)."""

    high_watermark: float | None = None
    ratio: float | None = None
    lease_ms: int | None = None

    @property
    def label(self) -> str:
        parts = [
            f"{name} {'default' if value is None else value}"
            for name, value in (
                ("hw", self.high_watermark),
                ("ratio", self.ratio),
                ("lease_ms", self.lease_ms),
            )
        ]
        return ", ".join(parts)


DEFAULT_FLAGS = (MasterFlags(), MasterFlags(lease_ms=2000), MasterFlags(0.9, 0.1, 2000))


@dataclass(frozen=True)
class PressureConfig:
    segment_bytes: int = 32 << 20
    load_ratio: float = 5.0
    keys_per_call: int = 32
    layers: int = 1
    kv_lora_rank: int = 128
    rope_dim: int = 64
    # The offered load is spread over this long (a steady backup stream).
    duration_s: float = 6.0
    cooldowns_s: tuple[float, ...] = (0.0, 0.25, 1.0)
    flags: tuple[MasterFlags, ...] = DEFAULT_FLAGS
    newest_share: float = 0.2
    # Hit queries (batch_exists_v2) after each backup, on the newest requests
    # (this one included): the scheduler's lookups of follow-up turns sharing
    # their prefixes. Mooncake leases what they find (--default_kv_lease_ttl)
    # and eviction spares leased objects.
    lookups_per_backup: int = 2
    seed: int = 0
    # Each scenario runs this many times (fresh cluster each): single runs are noisy.
    reps: int = 2

    def __post_init__(self) -> None:
        if self.load_ratio <= 0 or self.duration_s <= 0 or self.keys_per_call < 1:
            raise ValueError("load_ratio, duration_s and keys_per_call must be positive")
        if self.reps < 1:
            raise ValueError(f"reps must be >= 1, got {self.reps}")
        if not 0 < self.newest_share <= 1:
            raise ValueError(f"newest_share must be in (0, 1], got {self.newest_share}")


def counting_binding(binding: Any) -> tuple[Any, list[RecordingNative]]:
    """``binding`` whose stores are wrapped in ``RecordingNative`` (listed as made);
    the backend still owns each client it makes."""
    from mooncake_span.store.native import NativeBinding

    made: list[RecordingNative] = []

    def factory() -> RecordingNative:
        made.append(RecordingNative(binding.store_factory(), shared=False))
        return made[-1]

    return (
        NativeBinding(
            factory,
            binding.replicate_config_factory,
            binding.list_segments,
            probe_endpoint=binding.probe_endpoint,
        ),
        made,
    )


def request_keys(seed: int, request: int, count: int) -> list[str]:
    """A request's keys, prefix-chained like sglang's page hashes."""
    return chained_keys(f"{seed}:{request}", count)


def percentile_ms(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    return round(float(np.percentile(np.asarray(values), q)) * 1e3, 2)


@dataclass
class Rig:
    """A backend on DSA host pools, its counted native store, and the offered keys."""

    store: Any
    counted: RecordingNative
    pools: Any
    requests: list[list[str]]
    bytes_per_key: int
    pages_per_call: int = field(init=False)

    def __post_init__(self) -> None:
        self.pages_per_call = len(self.requests[0]) * _INDEX_KPOOL

    def _page_bytes(self, seed: int, request: int, pool: Any, flat_bytes: int) -> np.ndarray:
        rng = np.random.default_rng([seed, request, flat_bytes])
        return rng.integers(0, 256, (self.pages_per_call, flat_bytes), dtype=np.uint8)

    def _pools(self) -> list[tuple[Any, int, Any]]:
        import torch

        out = []
        for pool in (self.pools.kv, self.pools.indexer):
            sample = pool.get_dummy_flat_data_page()
            out.append((pool, sample.nbytes, sample.dtype if sample.dtype != torch.uint8 else None))
        return out

    def fill(self, seed: int, request: int, first_page: int) -> None:
        """Write request ``request``'s bytes into the host pages from ``first_page``."""
        import torch

        for pool, nbytes, dtype in self._pools():
            data = torch.from_numpy(self._page_bytes(seed, request, pool, nbytes))
            for i in range(self.pages_per_call):
                page = data[i] if dtype is None else data[i].view(dtype)
                pool.set_from_flat_data_page((first_page + i) * _HOST_PAGE_TOKENS, page)

    def matches(self, seed: int, request: int, first_page: int, keys: int) -> list[bool]:
        """Per key of the first ``keys``: do its host pages hold the request's bytes?"""
        import torch

        ok = [True] * keys
        for pool, nbytes, _ in self._pools():
            want = self._page_bytes(seed, request, pool, nbytes)
            for i in range(keys * _INDEX_KPOOL):
                page = pool.get_data_page((first_page + i) * _HOST_PAGE_TOKENS, flat=True)
                got = page.contiguous().view(torch.uint8).numpy()
                if not np.array_equal(got, want[i]):
                    ok[i // _INDEX_KPOOL] = False
        return ok

    def slots(self, first_page: int, keys: int) -> Any:
        import torch

        start = first_page * _HOST_PAGE_TOKENS
        return torch.arange(start, start + keys * _INDEX_KPOOL * _HOST_PAGE_TOKENS)

    def close(self) -> None:
        self.store.close()


def build_rig(
    config: PressureConfig, extra_config: dict[str, Any], cooldown_s: float, binding: Any
) -> Rig:
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from mooncake_span_tools.testing import pools as P
    from mooncake_span_tools.testing.backends import span_backend, storage_config

    pools = P.build_dsa_pools(
        "page_first",
        layers=config.layers,
        host_pages=2 * config.keys_per_call * _INDEX_KPOOL,
        kv_lora_rank=config.kv_lora_rank,
        rope_dim=config.rope_dim,
        index_kpool=_INDEX_KPOOL,
    )
    extra = {
        **extra_config,
        "storage_page_size": _HOST_PAGE_TOKENS * _INDEX_KPOOL,
        "span_full_cooldown_s": cooldown_s,
    }
    counted_binding, made = counting_binding(binding)
    store = span_backend(
        storage_config(extra, _MODEL, metrics=True),
        {PoolName.KV: pools.kv, PoolName.INDEXER: pools.indexer},
        binding=counted_binding,
    )
    bytes_per_key = _INDEX_KPOOL * sum(
        p.get_dummy_flat_data_page().nbytes for p in (pools.kv, pools.indexer)
    )
    calls = math.ceil(
        config.load_ratio * config.segment_bytes / (bytes_per_key * config.keys_per_call)
    )
    requests = [request_keys(config.seed, r, config.keys_per_call) for r in range(calls)]
    return Rig(store, made[-1], pools, requests, bytes_per_key)


def _indexer(keys: list[str], slots: Any) -> Any:
    from mooncake_span_tools.testing import controller as sg

    return sg.indexer(keys, slots)


def _lookup() -> Any:
    from mooncake_span_tools.testing import controller as sg

    return sg.indexer(None)


def drive(rig: Rig, config: PressureConfig, sleep: Callable[[float], None] = time.sleep) -> dict:
    """Offer every request's backup at a steady rate; what the backend answered."""
    store, slots = rig.store, rig.slots(0, config.keys_per_call)
    interval_s = config.duration_s / len(rig.requests)
    latencies: list[float] = []
    accepted = 0
    started = next_s = time.perf_counter()
    for r, keys in enumerate(rig.requests):
        rig.fill(config.seed, r, 0)
        wait_s = next_s - time.perf_counter()
        if wait_s > 0:
            sleep(wait_s)
        next_s += interval_s
        t0 = time.perf_counter()
        side = store.batch_set_v2([_indexer(keys, slots)])
        kv = store.batch_set_v1(keys, slots)
        latencies.append(time.perf_counter() - t0)
        flags = next(iter(side.values()), [False] * len(keys))
        accepted += sum(a and b for a, b in zip(kv, flags, strict=True))
        for recent in range(max(0, r + 1 - config.lookups_per_backup), r + 1):
            store.batch_exists_v2(rig.requests[recent], [_lookup()])
    return {
        "offered_keys": sum(len(k) for k in rig.requests),
        "accepted_keys": accepted,
        "accepted_share": round(accepted / sum(len(k) for k in rig.requests), 4),
        "drive_s": round(time.perf_counter() - started, 2),
        "backup_p50_ms": percentile_ms(latencies, 50),
        "backup_p99_ms": percentile_ms(latencies, 99),
        "backup_max_ms": percentile_ms(latencies, 100),
    }


def verify(rig: Rig, config: PressureConfig) -> dict:
    """What is stored at the end, the newest requests' hits, and byte-exact restores."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from mooncake_span.sglang_backend.pool_layout import pool_name_str

    store = rig.store
    kv, idx = store.pools["kv"], store.pools[pool_name_str(PoolName.INDEXER)]
    stored = 0
    hits: list[int] = []
    query = [_lookup()]
    for keys in rig.requests:
        objects = kv.object_keys(store.key_schema, keys) + idx.object_keys(store.key_schema, keys)
        flags = store.client.exists(objects)
        stored += sum(a and b for a, b in zip(flags[: len(keys)], flags[len(keys) :], strict=True))
        hits.append(store.batch_exists_v2(keys, query).kv_hit_pages)
    newest = max(1, round(config.newest_share * len(rig.requests)))
    restored = corrupt = 0
    first = config.keys_per_call * _INDEX_KPOOL  # restore into the second half of the pool
    for r, (keys, hit) in enumerate(zip(rig.requests, hits, strict=True)):
        if not hit:
            continue
        slots = rig.slots(first, hit)
        got_kv = store.batch_get_v1(keys[:hit], slots)
        got_idx = next(iter(store.batch_get_v2([_indexer(keys[:hit], slots)]).values()))
        same = rig.matches(config.seed, r, first, hit)
        for a, b, exact in zip(got_kv, got_idx, same, strict=True):
            restored += a and b
            corrupt += (a and b) and not exact
    offered = sum(len(k) for k in rig.requests)
    newest_keys = sum(len(k) for k in rig.requests[-newest:])
    return {
        "stored_keys": stored,
        "stored_share": round(stored / offered, 4),
        "newest_requests": newest,
        "newest_hit_share": round(sum(hits[-newest:]) / newest_keys, 4),
        "restored_keys": restored,
        "corrupt_restores": corrupt,
    }


def native_counts(rig: Rig) -> dict:
    from mooncake_span.errors import code_name

    counted = rig.counted
    return {
        "native_put_calls": counted.put_calls,
        "native_put_objects": counted.put_objects,
        "native_put_answers": {code_name(c): n for c, n in sorted(counted.put_codes.items())},
        "client_error_counts": dict(rig.store.client.stats()["error_counts"]),
        "cooldowns_started": rig.store.client.pressure.cooldowns_started,
    }


def run_scenario(config: PressureConfig, cooldown_s: float, flags: MasterFlags) -> dict:
    from mooncake_span.ops.cluster import ClusterSpec, LocalCluster
    from mooncake_span.store.client import load_native_binding

    spec = ClusterSpec(
        storage_nodes=1,
        storage_node_segment_bytes=config.segment_bytes,
        eviction_high_watermark_ratio=flags.high_watermark,
        eviction_ratio=flags.ratio,
        lease_ttl_ms=flags.lease_ms,
    )
    with LocalCluster(spec) as cluster:
        rig = build_rig(config, cluster.client_config(), cooldown_s, load_native_binding())
        try:
            row = {"cooldown_s": cooldown_s, "master_flags": flags.label, **asdict(flags)}
            row.update(drive(rig, config))
            row.update(native_counts(rig))
            row.update(verify(rig, config))
        finally:
            rig.close()
    return row


def run_pressure(config: PressureConfig, say: Callable[[str], None] = print) -> dict:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    rows = []
    for rep in range(config.reps):
        for flags in config.flags:
            for cooldown_s in config.cooldowns_s:
                row = {"rep": rep, **run_scenario(config, cooldown_s, flags)}
                say(format_row(row))
                rows.append(row)
    return {"config": asdict(config), "scenarios": rows, "summary": summarize(rows)}


_SUMMARY_FIELDS = (
    "native_put_calls",
    "native_put_objects",
    "refused_objects",
    "accepted_share",
    "stored_share",
    "newest_hit_share",
    "backup_p50_ms",
    "backup_p99_ms",
    "corrupt_restores",
)


def summarize(rows: list[dict]) -> list[dict]:
    """Per (master flags, cool-down): the mean over repetitions, plus min and max."""
    groups: dict[tuple[str, float], list[dict]] = {}
    for row in rows:
        refused = row["native_put_answers"].get("NO_AVAILABLE_HANDLE", 0)
        groups.setdefault((row["master_flags"], row["cooldown_s"]), []).append(
            {**row, "refused_objects": refused}
        )
    out = []
    for (flags, cooldown_s), group in groups.items():
        entry: dict[str, Any] = {"master_flags": flags, "cooldown_s": cooldown_s}
        entry["runs"] = len(group)
        for name in _SUMMARY_FIELDS:
            values = [r[name] for r in group if r[name] is not None]
            if values:
                entry[name] = round(sum(values) / len(values), 4)
                entry[f"{name}_range"] = [min(values), max(values)]
        out.append(entry)
    return out


def format_row(row: dict) -> str:
    return (
        f"{row['master_flags']:<42} cooldown {row['cooldown_s']:>5.2f}s: "
        f"native puts {row['native_put_calls']:>4} calls / {row['native_put_objects']:>5} objects, "
        f"stored {row['stored_share']:.1%}, newest hit {row['newest_hit_share']:.1%}, "
        f"backup p99 {row['backup_p99_ms']} ms, corrupt {row['corrupt_restores']}"
    )


def run_pressure_command(quick: bool, json_path: str | None) -> int:
    config = (
        PressureConfig(cooldowns_s=(0.0, 0.25), flags=DEFAULT_FLAGS[:1], duration_s=3.0, reps=1)
        if quick
        else PressureConfig()
    )
    report = run_pressure(config)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)
            fh.write("\n")
    return 1 if any(r["corrupt_restores"] for r in report["scenarios"]) else 0
