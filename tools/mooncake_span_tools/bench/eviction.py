"""``mooncake-span bench --eviction``: what a full L3 keeps, and whether it stays useful.

The workload of issue #33, seeded: ``conversations`` conversations of
``keys_per_conversation`` storage keys (sglang-shaped page hashes, each
chained on the one before) on DSA host pools (MLA KV + indexer, 64-token
pages, K=1, so sglang's ``MooncakeStore`` stores exactly the same objects),
backed up in ``turns`` turns as sglang's controller backs them up
(``batch_set_v2`` for the indexer, then ``batch_set_v1``, with the turn's
prefix keys in ``extra_info``). Round r backs up turn r of every conversation,
always in the same (seeded) order and spread over ``round_s``, so the
conversation backed up last is the newest. After every round but the last, a
quarter of the conversations (seeded) come back: a hit query over everything
written so far and a restore of what it found. In all, ``load_ratio`` times
the storage node's segment is offered. Each contender runs on a fresh cluster
of its own (one master, one storage node) with the same keys and bytes.

At the end, per contender:

* **reachable share**: of the keys still stored whole (every object), the
  share that a hit query from the conversation's first key reaches (the
  leading run of each conversation); the rest are dead keys, and the bytes of
  every stored object outside a reachable key are **dead bytes**;
* **returning users**: the hit tokens restored byte-exact for the newest
  ``returning`` conversations and for the oldest (the first backed up in each
  round): a hit query from the first key, then a restore of what it found,
  compared byte for byte (a restored key with other bytes counts as wrong);
* **backups**: objects offered, refused by the master (a no-space answer) and
  skipped by the backend without asking (its put cool-down);
* **master RPCs** of the workload (backups and returning reads, not this
  final accounting), from the master's own request counters (every data
  request: existence, put start/end/revoke, replica lists, removes), per 1,000
  tokens backed up (keys whose objects were all accepted x 64 tokens).

``storm`` is the other side of the cool-down: a segment full of hard-pinned,
leased objects (nothing can be evicted) and backups at a steady rate: native
put calls and refused objects with the cool-down and without it.

The module imports only what the package had before it (``testing.backends``,
``bench.pressure``, ``bench.shared_native``, ``testing``, ``ops.cluster``), so the
same driver can measure an older tree of the package (``run_eviction`` with
its default contender ``span`` names that tree's backend).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import random
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

PAGE_TOKENS = 64
OBJECTS_PER_KEY = 2  # KV + indexer, for both backends
_HEX_KEY = re.compile(r"[0-9a-f]{64}")
_EXISTS_CHUNK = 4096
# The master's request counters that are data requests (not heartbeats, mounts, tasks).
DATA_REQUESTS = (
    "exist_key",
    "batch_exist_key",
    "put_start",
    "put_end",
    "put_revoke",
    "batch_put_start",
    "batch_put_end",
    "batch_put_revoke",
    "get_replica_list",
    "batch_get_replica_list",
    "get_replica_list_by_regex",
    "remove",
    "remove_by_regex",
    "remove_all",
    "batch_query_ip",
    "batch_replica_clear",
)
# name -> (backend, extra-config); "span" alone is the tree's defaults.
CONTENDERS: dict[str, tuple[str, dict[str, Any]]] = {
    "span": ("span", {}),
    "span-noskip": ("span", {"span_skip_unreachable": False}),
    "span-norefresh": ("span", {"span_refresh_prefix": False}),
    "span-nopause": ("span", {"span_full_cooldown_s": 0}),
    "upstream": ("upstream", {}),
}
DEFAULT_CONTENDERS = ("span", "span-noskip", "span-norefresh", "upstream")


@dataclass(frozen=True)
class EvictionConfig:
    conversations: int = 48
    keys_per_conversation: int = 24
    turns: int = 4
    load_ratio: float = 3.0
    reread_share: float = 0.25
    returning: int = 12
    # One round (a turn of every conversation) is spread over this long; with
    # the master's lease it sets how much of the cache a lease covers.
    round_s: float = 4.0
    # The master's --default_kv_lease_ttl (None: Mooncake's 10 s). 500 ms against
    # 4 s rounds keeps a lease short beside the time the cache takes to turn
    # over (~5 s here), as 10 s is beside minutes in a deployment.
    lease_ms: int | None = 500
    layers: int = 2
    seed: int = 0
    reps: int = 3
    contenders: tuple[str, ...] = DEFAULT_CONTENDERS

    def __post_init__(self) -> None:
        if self.keys_per_conversation % self.turns:
            raise ValueError("keys_per_conversation must be a multiple of turns")
        if not 0 < self.reread_share <= 1 or not 0 < self.load_ratio:
            raise ValueError("reread_share must be in (0, 1] and load_ratio > 0")
        if not 0 < self.returning <= self.conversations // 2:
            raise ValueError("returning must be in 1..conversations/2")
        unknown = set(self.contenders) - set(CONTENDERS)
        if unknown:
            raise ValueError(f"unknown contender(s) {sorted(unknown)}; known: {list(CONTENDERS)}")

    @property
    def keys_per_turn(self) -> int:
        return self.keys_per_conversation // self.turns


def conversation_keys(seed: int, conversation: int, count: int) -> list[str]:
    """A conversation's storage keys, each hashed from the one before (as sglang's)."""
    from mooncake_span_tools.testing.controller import chained_keys

    return chained_keys(f"evict:{seed}:{conversation}", count)


# ---- one contender on one cluster ---------------------------------------------------


@dataclass
class Rig:
    """A contender's backend on DSA host pools (a whole conversation's pages to back
    up from, as many to restore into), its recording native store, the keys."""

    name: str
    store: Any
    native: Any
    pools: Any
    config: EvictionConfig
    keys: list[list[str]]
    key_bytes: int
    counts: collections.Counter = field(default_factory=collections.Counter)

    def _page_bytes(self, conversation: int, key: int, nbytes: int) -> np.ndarray:
        rng = np.random.default_rng([self.config.seed, conversation, key, nbytes])
        return rng.integers(0, 256, nbytes, dtype=np.uint8)

    def _each_page(self):
        import torch

        for pool in (self.pools.kv, self.pools.indexer):
            sample = pool.get_dummy_flat_data_page()
            dtype = None if sample.dtype == torch.uint8 else sample.dtype
            yield pool, sample.nbytes, dtype

    def fill(self, conversation: int, keys: range) -> None:
        import torch

        for pool, nbytes, dtype in self._each_page():
            for k in keys:
                page = torch.from_numpy(self._page_bytes(conversation, k, nbytes))
                pool.set_from_flat_data_page(
                    k * PAGE_TOKENS, page if dtype is None else page.view(dtype)
                )

    def exact(self, conversation: int, count: int) -> list[bool]:
        """Per key of the first ``count``: does the restore area hold its bytes?"""
        import torch

        ok = [True] * count
        first = self.config.keys_per_conversation
        for pool, nbytes, _ in self._each_page():
            for k in range(count):
                got = pool.get_data_page((first + k) * PAGE_TOKENS, flat=True)
                got = got.contiguous().view(torch.uint8).numpy()
                ok[k] = ok[k] and np.array_equal(got, self._page_bytes(conversation, k, nbytes))
        return ok


def _extra(prefix: list[str]) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    return HiCacheStorageExtraInfo(prefix_keys=list(prefix))


def backup_turn(rig: Rig, conversation: int, turn: int) -> int:
    """One turn as the controller backs it up; how many of its keys were accepted whole."""
    from mooncake_span_tools.testing import controller as sg

    per = rig.config.keys_per_turn
    rows = range(turn * per, (turn + 1) * per)
    chain = rig.keys[conversation]
    keys = chain[rows.start : rows.stop]
    rig.fill(conversation, rows)
    slots = sg.slots_of_pages(list(rows), PAGE_TOKENS)
    extra = _extra(chain[: rows.start])
    side = rig.store.batch_set_v2([sg.indexer(keys, slots)], extra)
    kv = rig.store.batch_set_v1(keys, slots, extra)
    flags = next(iter(side.values()), [False] * len(keys))
    return sum(a and b for a, b in zip(kv, flags, strict=True))


def read_back(rig: Rig, conversation: int, count: int) -> tuple[int, int]:
    """A returning user: a hit query over the conversation's first ``count`` keys and a
    restore of what it found. (keys restored byte-exact from the first, wrong keys)."""
    from mooncake_span_tools.testing import controller as sg

    keys = rig.keys[conversation][:count]
    extra = _extra([])
    found = rig.store.batch_exists_v2(keys, [sg.indexer(None)], extra)
    pages = found.restorable_prefix_pages
    hit = max(pages) if pages else 0 if pages is not None else found.kv_hit_pages
    if not hit:
        return 0, 0
    first = rig.config.keys_per_conversation
    slots = sg.slots_of_pages(list(range(first, first + hit)), PAGE_TOKENS)
    got_kv = rig.store.batch_get_v1(keys[:hit], slots, extra)
    got_idx = next(iter(rig.store.batch_get_v2([sg.indexer(keys[:hit], slots)], extra).values()))
    exact = rig.exact(conversation, hit)
    restored = [a and b for a, b in zip(got_kv, got_idx, strict=True)]
    wrong = sum(r and not e for r, e in zip(restored, exact, strict=True))
    good = [r and e for r, e in zip(restored, exact, strict=True)]
    return (good.index(False) if False in good else hit), wrong


def drive(rig: Rig, sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """Every round, paced; the returning quarter after each round but the last."""
    config = rig.config
    order = list(range(config.conversations))
    random.Random(config.seed).shuffle(order)
    rereads = max(1, round(config.reread_share * config.conversations))
    picker = random.Random(config.seed + 1)
    accepted = reread_tokens = wrong = 0
    interval_s = config.round_s / config.conversations
    started = time.perf_counter()
    for turn in range(config.turns):
        next_s = time.perf_counter()
        for conversation in order:
            wait_s = next_s - time.perf_counter()
            if wait_s > 0:
                sleep(wait_s)
            next_s += interval_s
            accepted += backup_turn(rig, conversation, turn)
        if turn == config.turns - 1:
            break
        for conversation in picker.sample(order, rereads):
            good, bad = read_back(rig, conversation, (turn + 1) * config.keys_per_turn)
            reread_tokens += good * PAGE_TOKENS
            wrong += bad
    return {
        "order": order,
        "accepted_keys": accepted,
        "reread_hit_tokens": reread_tokens,
        "reread_wrong_keys": wrong,
        "drive_s": round(time.perf_counter() - started, 2),
    }


def returning_users(rig: Rig, order: list[int]) -> dict[str, Any]:
    """Hit tokens restored byte-exact for the newest and the oldest conversations."""
    n, count = rig.config.returning, rig.config.keys_per_conversation
    out: dict[str, Any] = {"wrong_keys": 0}
    for label, group in (("recent", order[-n:]), ("old", order[:n])):
        tokens = []
        for conversation in group:
            good, bad = read_back(rig, conversation, count)
            tokens.append(good * PAGE_TOKENS)
            out["wrong_keys"] += bad
        out[f"{label}_hit_tokens"] = sum(tokens)
        out[f"{label}_hit_tokens_per_user"] = round(sum(tokens) / len(tokens), 1)
    return out


def what_stays(rig: Rig) -> dict[str, Any]:
    """Stored, reachable and dead keys and bytes, from the objects the contender
    stored (recorded at put time) that still exist now."""
    position = {k: (c, i) for c, keys in enumerate(rig.keys) for i, k in enumerate(keys)}
    objects = [o for o in rig.native.stored if _page_of(o, position) is not None]
    exists: list[int] = []
    for start in range(0, len(objects), _EXISTS_CHUNK):
        exists += rig.native.batch_is_exist(objects[start : start + _EXISTS_CHUNK])
    per_key: collections.Counter = collections.Counter()
    alive = [o for o, code in zip(objects, exists, strict=True) if code == 1]
    for o in alive:
        per_key[_page_of(o, position)] += 1
    whole = {k for k, n in per_key.items() if n >= OBJECTS_PER_KEY}
    reachable: set[tuple[int, int]] = set()
    for c in range(len(rig.keys)):
        i = 0
        while (c, i) in whole:
            reachable.add((c, i))
            i += 1
    dead_bytes = sum(rig.native.stored[o] for o in alive if _page_of(o, position) not in reachable)
    stored = len(whole)
    return {
        "stored_keys": stored,
        "reachable_keys": len(reachable),
        "reachable_share": round(len(reachable) / stored, 4) if stored else None,
        "dead_keys": stored - len(reachable),
        "dead_bytes": dead_bytes,
        "stored_bytes": sum(rig.native.stored[o] for o in alive),
        "first_turn_survival": _survival(whole, rig.config, 0),
        "later_turn_survival": _survival(whole, rig.config, 1),
    }


def _page_of(object_key: str, position: dict[str, tuple[int, int]]) -> tuple[int, int] | None:
    match = _HEX_KEY.search(object_key)
    return position.get(match.group(0)) if match else None


def _survival(whole: set[tuple[int, int]], config: EvictionConfig, first_turn: int) -> float:
    """Share of keys of the first turn (``first_turn`` 0) or of later turns still stored."""
    per = config.keys_per_turn
    rows = range(0, per) if first_turn == 0 else range(per, config.keys_per_conversation)
    total = config.conversations * len(rows)
    return round(sum((c, i) in whole for c in range(config.conversations) for i in rows) / total, 4)


def master_requests(metrics_url: str) -> dict[str, int]:
    from mooncake_span.ops import master_http

    wanted = {f"master_{name}_requests_total": name for name in DATA_REQUESTS}
    out = dict.fromkeys(DATA_REQUESTS, 0)
    for name, _, value in master_http.master_metrics(metrics_url, 5.0):
        if name in wanted:
            out[wanted[name]] = int(value)
    return out


def backup_answers(rig: Rig) -> dict[str, Any]:
    """Objects offered, refused by the master and skipped without asking."""
    from mooncake_span.errors import is_no_space

    native = rig.native
    refused = sum(n for code, n in native.put_codes.items() if is_no_space(code))
    skipped = 0
    client = getattr(rig.store, "client", None)
    if client is not None:
        skipped = client.stats()["error_counts"].get("FULL_COOLDOWN_SKIPPED", 0)
    return {
        "native_put_calls": native.put_calls,
        "native_put_objects": native.put_objects,
        "refused_by_master_objects": refused,
        "skipped_without_asking_objects": skipped,
        "skipped_share_of_refusals": round(skipped / (skipped + refused), 4)
        if skipped + refused
        else 0.0,
    }


# ---- building a contender -----------------------------------------------------------


def _pools(config: EvictionConfig) -> Any:
    from mooncake_span_tools.testing import pools as P

    return P.build_dsa_pools(
        "page_first",
        layers=config.layers,
        host_pages=2 * config.keys_per_conversation,
        kv_lora_rank=128,
        rope_dim=64,
    )


def key_bytes(config: EvictionConfig) -> int:
    pools = _pools(config)
    return sum(p.get_dummy_flat_data_page().nbytes for p in (pools.kv, pools.indexer))


def segment_bytes(config: EvictionConfig) -> int:
    """The storage node's segment: the offered bytes over ``load_ratio``, whole MiB,
    at least Mooncake's 16 MiB."""
    offered = config.conversations * config.keys_per_conversation * key_bytes(config)
    return max(16 << 20, -(-int(offered / config.load_ratio) // (1 << 20)) << 20)


def build_rig(name: str, config: EvictionConfig, cluster: Any) -> Rig:
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from mooncake_span.store.client import load_native_binding
    from mooncake_span_tools.bench.pressure import counting_binding
    from mooncake_span_tools.bench.shared_native import RecordingNative
    from mooncake_span_tools.testing.backends import span_backend, storage_config, upstream_backend

    kind, options = CONTENDERS[name]
    pools = _pools(config)
    host = {PoolName.KV: pools.kv, PoolName.INDEXER: pools.indexer}
    extra = {**cluster.client_config(), "span_layout_guard": "off", **options}
    model = f"bench-evict-{name}"
    if kind == "span":
        binding, made = counting_binding(load_native_binding())
        store = span_backend(storage_config(extra, model), host, binding=binding)
        native = made[-1]
    else:
        native = RecordingNative(_native_client(extra), shared=False)
        store = upstream_backend(storage_config(extra, model), host, native)
    keys = [
        conversation_keys(config.seed, c, config.keys_per_conversation)
        for c in range(config.conversations)
    ]
    return Rig(name, store, native, pools, config, keys, key_bytes(config))


def _native_client(client_config: dict[str, Any]) -> Any:
    from mooncake.store import MooncakeDistributedStore

    native = MooncakeDistributedStore()
    rc = native.setup(
        client_config["local_hostname"],
        client_config["metadata_server"],
        0,
        16 << 20,
        "tcp",
        "",
        client_config["master_server_address"],
    )
    if rc != 0:
        raise RuntimeError(f"Mooncake setup failed with {rc}")
    return native


def run_contender(name: str, config: EvictionConfig) -> dict[str, Any]:
    from mooncake_span.ops.cluster import ClusterSpec, LocalCluster

    spec = ClusterSpec(
        storage_nodes=1,
        storage_node_segment_bytes=segment_bytes(config),
        lease_ttl_ms=config.lease_ms,
    )
    with LocalCluster(spec) as cluster:
        rig = build_rig(name, config, cluster)
        try:
            before = master_requests(cluster.metrics_url)
            row: dict[str, Any] = {"contender": name, **drive(rig)}
            after = master_requests(cluster.metrics_url)
            row["master_requests"] = {k: after[k] - before[k] for k in DATA_REQUESTS}
            row.update(backup_answers(rig))
            row.update(returning_users(rig, row.pop("order")))
            row.update(what_stays(rig))
        finally:
            rig.store.close()
    return finish_row(row, config)


def finish_row(row: dict[str, Any], config: EvictionConfig) -> dict[str, Any]:
    """Totals and ratios of one run."""
    offered_keys = config.conversations * config.keys_per_conversation
    rpcs = sum(row["master_requests"].values())
    backed_up_tokens = row["accepted_keys"] * PAGE_TOKENS
    row.update(
        offered_keys=offered_keys,
        offered_objects=offered_keys * OBJECTS_PER_KEY,
        master_rpcs=rpcs,
        rpcs_per_1k_backed_up_tokens=round(1000 * rpcs / backed_up_tokens, 2)
        if backed_up_tokens
        else None,
        rpcs_per_1k_offered_tokens=round(1000 * rpcs / (offered_keys * PAGE_TOKENS), 2),
        wrong_keys=row["wrong_keys"] + row["reread_wrong_keys"],
    )
    return row


# ---- the storm: a cluster that stays full ----------------------------------------------


def storm_one(name: str, seconds: float, rate_hz: float, config: EvictionConfig) -> dict[str, Any]:
    """Backups at ``rate_hz`` for ``seconds`` into a 16 MiB segment full of hard-pinned
    objects leased for 10 minutes: nothing can be evicted, every put is refused."""
    from mooncake_span.ops.cluster import ClusterSpec, LocalCluster

    spec = ClusterSpec(storage_nodes=1, storage_node_segment_bytes=16 << 20, lease_ttl_ms=600_000)
    with LocalCluster(spec) as cluster:
        _pin_full(cluster.client_config())
        rig = build_rig(name, config, cluster)
        try:
            sent = 0
            deadline = time.monotonic() + seconds
            conversation = 0
            while time.monotonic() < deadline:
                backup_turn(rig, conversation % config.conversations, 0)
                conversation += 1
                sent += 1
                time.sleep(1 / rate_hz)
            answers = backup_answers(rig)
        finally:
            rig.store.close()
    return {"contender": name, "backups": sent, "seconds": seconds, **answers}


def _pin_full(client_config: dict[str, Any], object_bytes: int = 1 << 20) -> int:
    """Fill the segment with hard-pinned objects, then lease them all; how many."""
    import ctypes

    from mooncake.store import ReplicateConfig

    native = _native_client(client_config)
    buffer = ctypes.create_string_buffer(object_bytes)
    native.register_buffer(ctypes.addressof(buffer), object_bytes)
    config = ReplicateConfig()
    config.with_hard_pin = True
    stored = []
    for i in range(64):
        key = f"pinned-{i}"
        code = native.batch_put_from([key], [ctypes.addressof(buffer)], [object_bytes], config)[0]
        if code != 0:
            break
        stored.append(key)
    native.batch_is_exist(stored)
    native.close()
    return len(stored)


# ---- the section ---------------------------------------------------------------------


_SUMMARY = (
    "reachable_share",
    "dead_keys",
    "dead_bytes",
    "stored_keys",
    "accepted_keys",
    "recent_hit_tokens_per_user",
    "old_hit_tokens_per_user",
    "reread_hit_tokens",
    "refused_by_master_objects",
    "skipped_without_asking_objects",
    "skipped_share_of_refusals",
    "master_rpcs",
    "rpcs_per_1k_backed_up_tokens",
    "rpcs_per_1k_offered_tokens",
    "first_turn_survival",
    "later_turn_survival",
    "wrong_keys",
)


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per contender: the mean of every summary figure over its runs, with min and max."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["contender"] for r in rows):
        mine = [r for r in rows if r["contender"] == name]
        entry: dict[str, Any] = {"runs": len(mine)}
        for key in _SUMMARY:
            values = [r[key] for r in mine if r.get(key) is not None]
            if values:
                entry[key] = round(sum(values) / len(values), 4)
                entry[f"{key}_range"] = [min(values), max(values)]
        out[name] = entry
    return out


def _provenance() -> dict[str, Any]:
    """Which tree ran (the driver may run an older tree of the package) and where."""
    import platform
    import subprocess

    import mooncake_span

    tree = os.path.dirname(os.path.dirname(os.path.abspath(mooncake_span.__file__)))
    commit = subprocess.run(
        ["git", "-C", tree, "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        timeout=5,
        check=False,
    ).stdout.strip()
    return {
        "tree": tree,
        "git_commit": commit or None,
        "python": platform.python_version(),
        "nproc": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def run_eviction(
    config: EvictionConfig, say: Callable[[str], None] = print, storm_s: float = 5.0
) -> dict[str, Any]:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    provenance = _provenance()
    started = time.perf_counter()
    rows = []
    for rep in range(config.reps):
        shift = rep % len(config.contenders)
        for name in config.contenders[shift:] + config.contenders[:shift]:
            row = {"rep": rep, **run_contender(name, config)}
            say(format_row(row))
            rows.append(row)
    storms = []
    if storm_s > 0:
        for name in ("span", "span-nopause"):
            storms.append(storm_one(name, storm_s, 50.0, config))
            say(f"storm {name}: {storms[-1]}")
    return {
        "provenance": provenance,
        "config": asdict(config),
        "segment_bytes": segment_bytes(config),
        "key_bytes": key_bytes(config),
        "runs": rows,
        "summary": summarize(rows),
        "storm": storms,
        "seconds": round(time.perf_counter() - started, 1),
    }


def format_row(row: dict[str, Any]) -> str:
    return (
        f"{row['contender']:<15} reachable {row['reachable_share']} of {row['stored_keys']} "
        f"stored (dead {row['dead_keys']} keys, {row['dead_bytes']} B), accepted "
        f"{row['accepted_keys']}/{row['offered_keys']}, recent/old users "
        f"{row['recent_hit_tokens_per_user']}/{row['old_hit_tokens_per_user']} tokens, "
        f"refused {row['refused_by_master_objects']} skipped "
        f"{row['skipped_without_asking_objects']} objects, {row['master_rpcs']} RPCs "
        f"({row['rpcs_per_1k_backed_up_tokens']}/1k tokens), wrong {row['wrong_keys']}"
    )


def run_eviction_command(
    quick: bool, json_path: str | None, lease_ms: int | None = None, round_s: float | None = None
) -> int:
    """``lease_ms`` 0: Mooncake's default lease; None: the config's."""
    config = (
        EvictionConfig(conversations=16, round_s=1.0, reps=1, returning=4)
        if quick
        else EvictionConfig()
    )
    if lease_ms is not None:
        config = replace(config, lease_ms=lease_ms or None)
    if round_s is not None:
        config = replace(config, round_s=round_s)
    result = run_eviction(config, storm_s=2.0 if quick else 5.0)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
            fh.write("\n")
    return 1 if any(r["wrong_keys"] for r in result["runs"]) else 0
