"""``mooncake-span bench --leases``: what hit queries lease, ours vs sglang's MooncakeStore.

Mooncake 0.3.13 grants a read lease to every existing object ``batch_is_exist``
finds; a leased object cannot be removed (``remove`` answers -706
OBJECT_HAS_LEASE) or evicted until the lease ends. Two measurements, each on a
real master, the contenders paired in one run:

* **shapes**: per query of ``QUERY_KEYS`` keys (DSA pools: MLA KV, indexer
  ALL_PAGES, Mamba TRAILING, one state per key) whose first key misses, whose
  middle key misses, or which fully hits: existence RPCs (``batch_is_exist``
  calls, counted by a wrapper of the native client), objects probed, and
  objects leased, counted by a non-forced ``remove`` of every stored object
  right after the query (-706: leased). Each query gets freshly written keys.
* **storm**: a small segment filled with backups, then a read-heavy storm of
  hit queries (the three shapes in turn), then new backups right away, while
  the storm's leases still hold: the share of new keys stored, per contender,
  each on its own master of the same size.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any
from unittest import mock

import torch

from mooncake_span.span.hit_rounds import KV_ROUNDS_ALONE, KV_ROUNDS_WITH_SIDECARS, ProbePolicy
from mooncake_span_tools.bench.shared_native import RecordingNative, Topology
from mooncake_span_tools.bench.workloads import BenchConfig
from mooncake_span_tools.testing import pools as P
from mooncake_span_tools.testing.backends import span_backend, storage_config, upstream_backend

logger = logging.getLogger(__name__)

QUERY_KEYS = 24
MIDDLE_MISS_KEY = 12
CONTENDERS = ("span", "upstream")
# middle_miss is the shape (key 12 of 24); early_miss (key 6) falls
# inside a probe chunk rather than at its end, so it shows the chunk's cost.
SHAPES = ("first_miss", "early_miss", "middle_miss", "full_hit")
EARLY_MISS_KEY = 6
OBJECT_HAS_LEASE = -706
# A short lease keeps the run short; what is leased does not depend on how long.
LEASE_TTL_MS = 5000
QUERY_TIMING_REPS = 21
PAGE_TOKENS = 64
# Alternatives to the default (1 key, then equal chunks), measured side by side.
POLICIES = (ProbePolicy(4), ProbePolicy(16), ProbePolicy(4, growth=4))
MODEL_QUERY_KEYS = (24, 64, 128)
# Storm timing: the new backups start right after the storm and get
# BACKUP_WINDOW_S in all, well inside LEASE_TTL_MS, retrying refused batches.
SETTLE_S = 1.0
BACKUP_WINDOW_S = 2.0
RETRY_S = 0.05


def leased(native: RecordingNative) -> list[str]:
    """Stored objects a non-forced remove refuses with -706 (every other one is
    removed); the record of stored objects starts afresh."""
    out = [k for k in sorted(native.stored) if native.remove(k) == OBJECT_HAS_LEASE]
    native.stored.clear()
    return out


@dataclass
class Contender:
    name: str
    native: RecordingNative | None
    store: Any
    pool_set: Any
    kv_objects: set[str] = field(default_factory=set)


def _config(client_config: dict[str, Any], name: str, page_tokens: int, **more: Any) -> Any:
    extra = {
        **client_config,
        "span_layout_guard": "off",
        "storage_page_size": page_tokens,
        **more,
    }
    return storage_config(extra, name)


@dataclass
class Rig:
    """One topology's recording client and the DSA host pools every contender shares
    (one set of registered buffers: Mooncake refuses overlapping registrations)."""

    topology: Topology
    native: RecordingNative
    pool_set: Any

    @classmethod
    def of(cls, topology: Topology) -> Rig:
        pool_set = P.build_compressed_hybrid_dsa(
            "page_first", host_pages=QUERY_KEYS, mamba_slots=QUERY_KEYS, index_kpool=1
        )
        return cls(topology, RecordingNative(topology.native), pool_set)


def make_contender(
    kind: str, rig: Rig, nonce: str, policy: ProbePolicy | None = None, group_ids: bool = True
) -> Contender:
    """Our backend or sglang's MooncakeStore on DSA pools, K=1, on the rig's client."""
    native, pool_set, topology = rig.native, rig.pool_set, rig.topology
    config = _config(
        topology.client_config, f"lease-{kind}-{nonce}", PAGE_TOKENS, span_group_ids=group_ids
    )
    if kind == "span":
        store = span_backend(config, pool_set.pools, native)
        if policy is not None:
            store.prober.policy = policy
    else:
        store = upstream_backend(config, pool_set.pools, native)
    return Contender(kind, native, store, pool_set)


def _keys(tag: str, count: int) -> list[str]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(count)]


def _transfers(keys: list[str], with_slots: bool) -> list[Any]:
    from mooncake_span_tools.testing import controller as sg

    slots = torch.arange(len(keys) * PAGE_TOKENS) if with_slots else None
    states = torch.arange(len(keys)) if with_slots else None
    return [sg.indexer(keys, slots), sg.state(keys if with_slots else [keys[-1]], states)]


def backup(contender: Contender, keys: list[str]) -> int:
    """sglang's backup order (sidecars, then KV); how many keys were stored whole."""
    store, native = contender.store, contender.native
    side = store.batch_set_v2(_transfers(keys, with_slots=True))
    before = set(native.stored) if native is not None else set()
    kv = store.batch_set_v1(keys, torch.arange(len(keys) * PAGE_TOKENS))
    if native is not None:  # None: a caller that does not count objects
        contender.kv_objects |= native.stored.keys() - before
    flags = [all(f) for f in zip(kv, *side.values(), strict=True)]
    return sum(flags)


def query_keys(shape: str, keys: list[str], tag: str) -> list[str]:
    absent = hashlib.sha256(f"absent/{tag}".encode()).hexdigest()
    if shape == "first_miss":
        return [absent, *keys[1:]]
    if shape in ("early_miss", "middle_miss"):
        at = EARLY_MISS_KEY if shape == "early_miss" else MIDDLE_MISS_KEY
        return [*keys[:at], absent, *keys[at + 1 :]]
    return list(keys)


@dataclass
class ShapeFigures:
    hit_keys: int
    rpcs: int
    probed_objects: int
    leased_objects: int
    leased_kv_objects: int
    leased_sidecar_objects: int
    stored_objects: int
    leased_not_probed: int
    query_ms: float


def measure_shape(contender: Contender, shape: str, tag: str) -> ShapeFigures:
    keys = _keys(f"{tag}/{contender.name}/{shape}", QUERY_KEYS)
    stored = backup(contender, keys)
    if stored != QUERY_KEYS:
        raise RuntimeError(f"{contender.name}: only {stored}/{QUERY_KEYS} keys stored")
    native = contender.native
    stored_objects = len(native.stored)
    asked = query_keys(shape, keys, tag)
    native.exist_calls.clear()
    hit = contender.store.batch_exists_v2(asked, _transfers(asked, with_slots=False))
    probed = {k for call in native.exist_calls for k in call}
    rpcs, probed_objects = len(native.exist_calls), sum(map(len, native.exist_calls))
    held = leased(native)
    kv_leased = [k for k in held if k in contender.kv_objects]
    # Latency of the same query again (the unleased objects are gone now, so
    # the answer is the same or shorter); median of QUERY_TIMING_REPS.
    seconds = []
    for _ in range(QUERY_TIMING_REPS):
        started = time.perf_counter()
        contender.store.batch_exists_v2(asked, _transfers(asked, with_slots=False))
        seconds.append(time.perf_counter() - started)
    return ShapeFigures(
        hit_keys=int(hit.kv_hit_pages),
        rpcs=rpcs,
        probed_objects=probed_objects,
        leased_objects=len(held),
        leased_kv_objects=len(kv_leased),
        leased_sidecar_objects=len(held) - len(kv_leased),
        stored_objects=stored_objects,
        leased_not_probed=len(set(held) - probed),
        query_ms=1e3 * statistics.median(seconds),
    )


@contextlib.contextmanager
def _topology(segment_bytes: int) -> Iterator[Topology]:
    with mock.patch("mooncake_span_tools.bench.shared_native.ClusterSpec", _short_lease_spec):
        topology = Topology("same", BenchConfig(segment_bytes=segment_bytes, progress=False))
        with topology:
            yield topology


def _short_lease_spec(**kwargs: Any) -> Any:
    from mooncake_span.ops.cluster import ClusterSpec

    return ClusterSpec(lease_ttl_ms=LEASE_TTL_MS, **kwargs)


def shapes_section(nonce: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with _topology(256 << 20) as topology:
        rig = Rig.of(topology)
        for kind in CONTENDERS:
            contender = make_contender(kind, rig, nonce)
            out[kind] = {s: asdict(measure_shape(contender, s, nonce)) for s in SHAPES}
        variants = [(policy_label(p), p, True) for p in POLICIES]
        # Group ids tie a key's objects together: a lease on its KV pins its sidecars.
        variants.append(("span-nogroup", None, False))
        for label, policy, groups in variants:
            contender = make_contender("span", rig, f"{nonce}-{label}", policy, groups)
            out[label] = {
                s: asdict(measure_shape(contender, s, f"{nonce}-{label}")) for s in SHAPES
            }
    return out


def policy_label(policy: ProbePolicy) -> str:
    rest = f"x{policy.growth}" if policy.growth else "even"
    return f"span-first{policy.first_chunk_keys}-{rest}"


def policy_model(policy: ProbePolicy, total_keys: int, rounds: int) -> dict[str, Any]:
    """KV keys probed past the first miss, over every miss position (pure arithmetic)."""
    chunks = policy.chunks(total_keys, rounds)
    past = [next(e for s, e in chunks if s <= miss < e) - miss - 1 for miss in range(total_keys)]
    return {
        "chunks": chunks,
        "mean_keys_past_miss": sum(past) / total_keys,
        "max_keys_past_miss": max(past),
        "full_hit_kv_rounds": len(chunks),
    }


def model_section() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for policy in (ProbePolicy(), *POLICIES):
        out[policy_label(policy)] = {
            f"{n}_keys_{rounds}_rounds": policy_model(policy, n, rounds)
            for n in MODEL_QUERY_KEYS
            for rounds in (KV_ROUNDS_ALONE, KV_ROUNDS_WITH_SIDECARS)
        }
    return out


@dataclass
class StormFigures:
    filled_keys: int
    storm_queries: int
    storm_probed_objects: int
    new_keys: int
    new_keys_stored_first_try: int
    new_keys_stored: int
    share_stored: float
    seconds: float = 0.0


def key_bytes(pool_set: Any) -> int:
    """Bytes one storage key stores over every pool (the same for both contenders)."""
    from mooncake_span.sglang_backend.pool_layout import describe_pool

    return sum(
        describe_pool(str(name.value), pool, is_mla=True).layout.flat_page_bytes
        for name, pool in pool_set.pools.items()
    )


def fill(contender: Contender, segment_bytes: int, nonce: str) -> list[list[str]]:
    """Back up batches until the cluster refuses part of one twice in a row (eviction
    runs behind the writes, so one refusal may be its lag); the batches stored whole."""
    limit = 3 * segment_bytes // (key_bytes(contender.pool_set) * QUERY_KEYS) + 1
    batches: list[list[str]] = []
    refusals = attempt = 0
    while refusals < 2 and attempt < limit:
        keys = _keys(f"{nonce}/fill/{attempt}", QUERY_KEYS)
        attempt += 1
        if backup(contender, keys) == QUERY_KEYS:
            batches.append(keys)
            refusals = 0
        else:
            refusals += 1
    return batches


def backup_within(
    contender: Contender, batches: list[list[str]], deadline: float
) -> tuple[int, int]:
    """(keys stored on the first try, keys stored whole in the end); a refused
    batch is tried again (eviction may free room) until ``deadline``, which
    falls inside the storm's leases."""
    first = stored = 0
    for keys in batches:
        done = backup(contender, keys)
        first += done
        while done < len(keys) and time.monotonic() < deadline:
            time.sleep(RETRY_S)
            done = backup(contender, keys)
        stored += done
    return first, stored


def storm_one(kind: str, segment_bytes: int, nonce: str, passes: int) -> StormFigures:
    started = time.perf_counter()
    with _topology(segment_bytes) as topology:
        rig = Rig.of(topology)
        contender = make_contender(kind, rig, nonce)
        batches = fill(contender, segment_bytes, nonce)
        filled = QUERY_KEYS * len(batches)
        fill_batches = len(batches)
        time.sleep(SETTLE_S)  # let eviction catch up with the fill
        probed = queries = 0
        for _ in range(passes):  # read-heavy: every batch asked again, within the lease
            for i, keys in enumerate(batches):
                asked = query_keys(SHAPES[i % len(SHAPES)], keys, f"{nonce}/storm/{i}")
                contender.native.exist_calls.clear()
                contender.store.batch_exists_v2(asked, _transfers(asked, with_slots=False))
                probed += sum(map(len, contender.native.exist_calls))
                queries += 1
        new = [_keys(f"{nonce}/new/{j}", QUERY_KEYS) for j in range(max(2, fill_batches // 4))]
        first, stored = backup_within(contender, new, time.monotonic() + BACKUP_WINDOW_S)
    total_new = sum(map(len, new))
    return StormFigures(
        filled_keys=filled,
        storm_queries=queries,
        storm_probed_objects=probed,
        new_keys=total_new,
        new_keys_stored_first_try=first,
        new_keys_stored=stored,
        share_stored=stored / total_new if total_new else 0.0,
        seconds=time.perf_counter() - started,
    )


def storm_section(
    nonce: str, segment_bytes: int = 16 << 20, passes: int = 2, rounds: int = 3
) -> dict[str, Any]:
    """Per contender, ``rounds`` times in turn: the storm, and a control run
    without it (a fill of the same kind, no queries); each on its own master."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in range(rounds):
        for kind in CONTENDERS:
            for label, storm_passes in ((kind, passes), (f"{kind}-no-storm", 0)):
                figures = storm_one(kind, segment_bytes, f"{nonce}-{r}-{label}", storm_passes)
                out.setdefault(label, []).append(asdict(figures))
    return out


def leased_eviction(probe: bool, segment_bytes: int = 16 << 20, object_bytes: int = 256 << 10):
    """Raw client: fill the segment, lease every stored object with one
    ``batch_is_exist`` (or not), then put new objects. Does eviction wait for
    the leases? Returns the stored, new-ok and surviving-old counts."""
    import ctypes

    with _topology(segment_bytes) as topology:
        native = topology.native
        buffer = ctypes.create_string_buffer(object_bytes)
        address = ctypes.addressof(buffer)
        native.register_buffer(address, object_bytes)
        stored: list[str] = []
        attempts = 0
        while attempts < 4 * segment_bytes // object_bytes and len(stored) < attempts + 3:
            key = f"old-{attempts}"
            attempts += 1
            if native.put_from(key, address, object_bytes) == 0:
                stored.append(key)
            elif attempts - len(stored) >= 3:
                break
        time.sleep(SETTLE_S)
        alive = sum(code == 1 for code in native.batch_is_exist(stored)) if probe else None
        new_ok = sum(
            native.put_from(f"new-{j}", address, object_bytes) == 0
            for j in range(segment_bytes // object_bytes // 2)
        )
        survivors = sum(code == 1 for code in native.batch_is_exist(stored))
        native.unregister_buffer(address)
    return {
        "probed": probe,
        "old_stored": len(stored),
        "old_leased": alive,
        "new_objects": segment_bytes // object_bytes // 2,
        "new_ok": new_ok,
        "old_surviving": survivors,
    }


def run_leases() -> dict[str, Any]:
    nonce = str(time.time_ns())
    started = time.perf_counter()
    result: dict[str, Any] = {
        "query_keys": QUERY_KEYS,
        "middle_miss_key": MIDDLE_MISS_KEY,
        "lease_ttl_ms": LEASE_TTL_MS,
        "default_policy": policy_label(ProbePolicy()),
        "model": model_section(),
        "shapes": shapes_section(nonce),
        "storm": storm_section(nonce),
        "leased_eviction": [leased_eviction(True), leased_eviction(False)],
    }
    result["seconds"] = time.perf_counter() - started
    return result


def format_leases(result: dict[str, Any]) -> str:
    lines = [
        f"hit queries of {result['query_keys']} keys (DSA pools, K=1); "
        "rpcs / probed / leased (kv + sidecar) objects"
    ]
    for name, shapes in result["shapes"].items():
        cells = [
            f"{shape} {f['rpcs']}/{f['probed_objects']}/{f['leased_objects']}"
            f" ({f['leased_kv_objects']}+{f['leased_sidecar_objects']}) {f['query_ms']:.2f}ms"
            for shape, f in shapes.items()
        ]
        lines.append(f"  {name:18s} " + "  ".join(cells))
    lines.append("probe storm on a full segment: new keys stored (first try / in the window)")
    for name, runs in result["storm"].items():
        cells = [
            f"filled {f['filled_keys']} q {f['storm_queries']} new "
            f"{f['new_keys_stored_first_try']}/{f['new_keys_stored']} of {f['new_keys']}"
            for f in runs
        ]
        lines.append(f"  {name:18s} " + " | ".join(cells))
    for f in result["leased_eviction"]:
        lines.append(f"raw eviction check: {f}")
    return "\n".join(lines)


def run_leases_command(json_path: str | None) -> int:
    import json

    result = run_leases()
    print(format_leases(result), flush=True)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {json_path}", flush=True)
    return 0
