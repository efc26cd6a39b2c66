"""Objects per stored token: what a backup of N tokens leaves in the master.

For GLM-5.3-Flash's three pools (MLA KV, DSA indexer, Mamba/KDA state: one
state per backup call, for its last key) and for an MHA model, each contender
backs up the same ``tokens`` of 64-token host pages, the way sglang's
controller does (one backup call per ``BACKUP_CALL_TOKENS``: the sidecar pools
first, then the KV pool per 128 keys with the keys before as prefix keys). The
objects it stored are the master's ``master_key_count`` after the backup minus
before: exact. Contenders: this backend at K=4 and K=1, and sglang's
``MooncakeStore`` (one key per 64-token page). GLM's K=4 runs on the compressed
indexer (index_kpool 4, its 256-token storage page); K=1 and sglang's store on
index_kpool 1, as stock sglang runs a 64-token page. The same tokens are then
asked and read back as the controller does, and the master's data requests
(its own counters) are counted for the backup and for the read.

Master bytes per stored token = objects per token x the master's RSS per
object measured by the fill (``scale.run_fill``), with the fill's key length
(each contender's own mean key length is reported beside it).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

HOST_PAGE_TOKENS = 64
BACKUP_CALL_TOKENS = 8_192
CONTROLLER_BATCH_KEYS = 128
TOKENS = 65_536
QUICK_TOKENS = 8_192
MODELS = ("glm-5.3-flash", "mha")
CONTENDERS = {"span-K4": ("span", 4), "span-K1": ("span", 1), "upstream": ("upstream", 1)}


def _pools(model: str, pages_per_key: int, host_pages: int, calls: int) -> dict[Any, Any]:
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from mooncake_span_tools.testing import pools as P

    if model == "mha":
        kv = P.build_mha_host("page_first", layers=1, host_pages=host_pages, heads=1, head_dim=64)
        return {PoolName.KV: kv}
    return dict(
        P.build_compressed_hybrid_dsa(
            "page_first",
            layers=1,
            host_pages=host_pages,
            mamba_layers=1,
            mamba_slots=calls,
            kv_lora_rank=112,
            rope_dim=16,
            index_kpool=pages_per_key,
        ).pools
    )


def _backend(kind: str, model: str, k: int, pools: Any, client_config: dict[str, Any]) -> Any:
    from mooncake.store import MooncakeDistributedStore

    from mooncake_span_tools.testing.backends import span_backend, storage_config, upstream_backend

    extra = {**client_config, "span_layout_guard": "off"}
    name = f"bench-objects-{model}-{kind}-K{k}"
    config = storage_config(extra, name, is_mla=model != "mha")
    if kind == "span":
        if k > 1:
            config.storage_page_size = HOST_PAGE_TOKENS * k
        return span_backend(config, pools)
    native = MooncakeDistributedStore()
    return upstream_backend(config, pools, native)


def backup(store: Any, model: str, k: int, tokens: int, root: str) -> int:
    """Back up ``tokens`` as the controller does; keys stored whole."""
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    from mooncake_span_tools.testing import controller as sg

    storage_tokens = HOST_PAGE_TOKENS * k
    keys = sg.chained_keys(root, tokens // storage_tokens)
    per_call = BACKUP_CALL_TOKENS // storage_tokens
    stored = 0
    for call, first in enumerate(range(0, len(keys), per_call)):
        call_keys = keys[first : first + per_call]
        slots = torch.arange(first * storage_tokens, (first + len(call_keys)) * storage_tokens)
        prefix = keys[:first]
        if model != "mha":
            sidecars = [
                sg.indexer(call_keys, slots),
                sg.state([call_keys[-1]], torch.tensor([call])),
            ]
            store.batch_set_v2(sidecars, HiCacheStorageExtraInfo(prefix_keys=list(prefix)))
        for start in range(0, len(call_keys), CONTROLLER_BATCH_KEYS):
            batch = call_keys[start : start + CONTROLLER_BATCH_KEYS]
            batch_slots = slots[start * storage_tokens : (start + len(batch)) * storage_tokens]
            extra = HiCacheStorageExtraInfo(prefix_keys=[*prefix, *call_keys[:start]])
            stored += sum(map(bool, store.batch_set_v1(batch, batch_slots, extra)))
    return stored


def read_back(store: Any, model: str, k: int, tokens: int, root: str) -> tuple[int, int]:
    """The controller's hit query (per 128 keys, prefix keys growing) and restore of the
    KV pool (and the indexer's pages, for GLM) into the same slots: (hit keys, restored keys)."""
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    from mooncake_span_tools.testing import controller as sg

    storage_tokens = HOST_PAGE_TOKENS * k
    keys = sg.chained_keys(root, tokens // storage_tokens)
    hit = restored = 0
    for start in range(0, len(keys), CONTROLLER_BATCH_KEYS):
        batch = keys[start : start + CONTROLLER_BATCH_KEYS]
        extra = HiCacheStorageExtraInfo(prefix_keys=keys[:start])
        if model == "mha":
            found = store.batch_exists(batch, extra)
        else:
            found = store.batch_exists_v2(batch, sg.hit_query(), extra).kv_hit_pages
        hit += found
        if found < len(batch):
            break
    for start in range(0, hit, CONTROLLER_BATCH_KEYS):
        batch = keys[start : min(hit, start + CONTROLLER_BATCH_KEYS)]
        slots = torch.arange(start * storage_tokens, (start + len(batch)) * storage_tokens)
        extra = HiCacheStorageExtraInfo(prefix_keys=keys[:start])
        flags = store.batch_get_v1(batch, slots, extra)
        if model != "mha":
            side = store.batch_get_v2([sg.indexer(batch, slots, follows_kv=False)], extra)
            flags = [a and b for a, b in zip(flags, next(iter(side.values())), strict=True)]
        restored += sum(map(bool, flags))
    return hit, restored


def master_requests(metrics_url: str) -> int:
    """The master's data requests so far (existence, puts, replica lists, removes)."""
    from mooncake_span.ops import master_http
    from mooncake_span_tools.bench.eviction import DATA_REQUESTS

    wanted = {f"master_{name}_requests_total" for name in DATA_REQUESTS}
    return sum(
        int(value)
        for name, _, value in master_http.master_metrics(metrics_url, 10.0)
        if name in wanted
    )


def _all_keys(metrics_url: str) -> set[str]:
    from mooncake_span.ops.master_http import iter_lines

    return {
        line.strip() for line in iter_lines(metrics_url + "/get_all_keys", 60.0) if line.strip()
    }


def count_objects(model: str, tokens: int) -> dict[str, Any]:
    """Per contender, on one cluster: objects and keys stored by a backup of ``tokens``."""
    from mooncake_span.ops.cluster import ClusterSpec, LocalCluster
    from mooncake_span_tools.bench.scale import master_key_count

    out: dict[str, Any] = {}
    calls = -(-tokens // BACKUP_CALL_TOKENS)
    with LocalCluster(ClusterSpec(storage_nodes=1, storage_node_segment_bytes=512 << 20)) as c:
        client_config = dict(c.client_config(0))
        for label, (kind, k) in CONTENDERS.items():
            pools = _pools(model, k, tokens // HOST_PAGE_TOKENS, calls)
            store = _backend(kind, model, k, pools, client_config)
            before_keys = _all_keys(c.metrics_url)
            before = master_key_count(c.metrics_url)
            root = f"objects:{model}:{label}"
            rpcs = [master_requests(c.metrics_url)]
            stored = backup(store, model, k, tokens, root)
            rpcs.append(master_requests(c.metrics_url))
            after = master_key_count(c.metrics_url)
            hit, restored = read_back(store, model, k, tokens, root)
            rpcs.append(master_requests(c.metrics_url))
            new = _all_keys(c.metrics_url) - before_keys
            store.close()
            keys = tokens // (HOST_PAGE_TOKENS * k)
            if not stored == hit == restored == keys:
                raise RuntimeError(
                    f"{model}/{label}: of {keys} keys {stored} stored, {hit} hit, {restored} read"
                )
            objects = after - before
            out[label] = {
                "pages_per_key": k,
                "storage_keys": keys,
                "objects": objects,
                "objects_listed": len(new),
                "objects_per_1000_tokens": round(1000 * objects / tokens, 3),
                "objects_per_storage_key": round(objects / keys, 3),
                "mean_object_key_bytes": round(sum(map(len, new)) / len(new), 1) if new else None,
                # The master's data requests per 1,000 tokens: the backup, then the
                # hit query and restore of the same tokens (KV, and GLM's indexer).
                "backup_master_rpcs_per_1000_tokens": round(1000 * (rpcs[1] - rpcs[0]) / tokens, 3),
                "read_master_rpcs_per_1000_tokens": round(1000 * (rpcs[2] - rpcs[1]) / tokens, 3),
            }
    return {"tokens": tokens, "backup_calls": calls, "contenders": out}


def run_objects(quick: bool) -> dict[str, Any]:
    tokens = QUICK_TOKENS if quick else TOKENS
    return {model: count_objects(model, tokens) for model in MODELS}


def bytes_per_token(objects: dict[str, Any], rss_per_object_bytes: float | None) -> dict[str, Any]:
    """Master bytes per stored token: objects per token x RSS per object."""
    if rss_per_object_bytes is None:
        return {}
    return {
        model: {
            label: round(row["objects_per_1000_tokens"] / 1000 * rss_per_object_bytes, 3)
            for label, row in figures["contenders"].items()
        }
        for model, figures in objects.items()
    }


def format_objects(result: dict[str, Any]) -> str:
    lines = ["objects per 1,000 stored tokens (master bytes per token)"]
    per_token = result.get("master_bytes_per_token", {})
    for model, figures in result["objects"].items():
        cells = [
            f"{label} {row['objects_per_1000_tokens']:.2f} "
            f"({per_token.get(model, {}).get(label, float('nan')):.2f} B, "
            f"keys {row['mean_object_key_bytes']} B)"
            for label, row in figures["contenders"].items()
        ]
        lines.append(f"  {model:14s} " + "  ".join(cells))
    return "\n".join(lines)
