"""``mooncake-span demo-span``: a compressed hybrid DSA model's KV cache through Mooncake L3,
at the level of host pools (no sglang server; ``mooncake-span demo`` runs two).

The pool set is what sglang builds for the GLM-5.3-Flash family: an MLA KV
anchor, a DSA indexer sidecar with compressed keys (``index_kpool=4``) and
Mamba recurrent state, with 64-token host pages and a 256-token radix-tree
(storage) page, so every storage key spans K=4 host pages.

The backend learns the storage page in the order a span-aware build hands it
(``--order``): ``fork-startup`` (the default, the span fork's startup: built and
registered at the 64-token host page, then ``storage_page_size = 256``
assigned on the live backend), ``runtime-attach`` (the page on the config when
the backend is built) or ``derived`` (no page named: the first transfer's
host slots per key tell it).

The demo backs up requests the way sglang's HybridCacheController does
(``batch_set_v2`` for the sidecars, then ``batch_set_v1`` for KV, in batches of
128 keys, one Mamba checkpoint at each request's end), wipes the host pools,
queries hits with ``batch_exists_v2``, restores with ``batch_get_v1`` +
``batch_get_v2`` into *different* host pages, and compares every byte.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mooncake_span.ops.cluster import ClusterSpec, LocalCluster

logger = logging.getLogger(__name__)

HOST_PAGE_TOKENS = 64
DEMO_MODEL = "demo/glm-5.3-flash-like"
INDEX_KPOOL = 4
# How the backend is handed the storage page, and what the demo prints for it.
ORDERS = {
    "fork-startup": "the span fork's startup: registered at the host page, then "
    "storage_page_size assigned on the live backend",
    "runtime-attach": "runtime attach: storage_page_size on the config when built",
    "derived": "no page named: the first transfer's host slots per key",
}


@dataclass(frozen=True)
class DemoConfig:
    requests: int = 8
    keys_per_request: int = 8
    layout: str = "page_first"
    layers: int = 4
    kv_lora_rank: int = 512
    rope_dim: int = 64
    seed: int = 0
    master_server_address: str | None = None
    metadata_server: str | None = None
    storage_node_bytes: int = 1 << 30
    order: str = "fork-startup"

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {sorted(ORDERS)}, got {self.order!r}")
        for name in ("requests", "keys_per_request", "layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if (self.master_server_address is None) != (self.metadata_server is None):
            raise ValueError("an existing cluster needs both --master and --metadata")


@dataclass
class DemoReport:
    keys: int
    hit_keys: int
    hit_tokens: int
    bytes_written: int
    bytes_read: int
    backup_s: float
    restore_s: float
    mismatched_pages: int

    @property
    def ok(self) -> bool:
        return self.hit_keys == self.keys and self.mismatched_pages == 0


def run_demo(config: DemoConfig, say: Callable[[str], None] = print) -> DemoReport:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    if config.master_server_address is None:
        spec = ClusterSpec(storage_nodes=1, storage_node_segment_bytes=config.storage_node_bytes)
        say("starting an embedded Mooncake cluster (master + 1 storage node) ...")
        with LocalCluster(spec) as cluster:
            say(f"  master {cluster.master_address}, metadata {cluster.metadata_server}")
            return _run(config, cluster.client_config(), say)
    return _run(
        config,
        {
            "master_server_address": config.master_server_address,
            "metadata_server": config.metadata_server,
            "protocol": "tcp",
            "global_segment_size": 0,
        },
        say,
    )


def _run(
    config: DemoConfig, client_config: dict[str, Any], say: Callable[[str], None]
) -> DemoReport:
    # sglang, torch and the host pools load here: the CLI imports this module
    # on machines that have none of them.
    import torch

    from mooncake_span_tools.testing import controller as sg
    from mooncake_span_tools.testing import pools as P
    from mooncake_span_tools.testing.backends import span_backend, storage_config

    def slots_of(pages: list[int]) -> torch.Tensor:
        return sg.slots_of_pages(pages, HOST_PAGE_TOKENS)

    rng = random.Random(config.seed)
    keys_total = config.requests * config.keys_per_request
    host_pages = keys_total * INDEX_KPOOL
    pools = P.build_compressed_hybrid_dsa(
        config.layout,
        layers=config.layers,
        host_pages=2 * host_pages,
        mamba_slots=2 * config.requests,
        kv_lora_rank=config.kv_lora_rank,
        rope_dim=config.rope_dim,
        index_kpool=INDEX_KPOOL,
    )
    kv, indexer, mamba = pools[sg.KV], pools[sg.INDEXER], pools[sg.MAMBA]
    storage_page = pools.storage_page_tokens
    config_of_store = storage_config(dict(client_config), DEMO_MODEL, metrics=True)
    if config.order == "fork-startup":
        config_of_store.storage_page_size = HOST_PAGE_TOKENS
    elif config.order == "runtime-attach":
        config_of_store.storage_page_size = storage_page
    store = span_backend(config_of_store, pools.pools)
    try:
        if config.order == "fork-startup":
            store.storage_page_size = storage_page  # init_hicache, after registration
        say(f"order: {ORDERS[config.order]}")
        say(
            f"shape: MLA KV ({config.layout}) + DSA indexer + Mamba; host page "
            f"{HOST_PAGE_TOKENS} tokens, tree page {storage_page} tokens, one key per tree page"
        )
        all_pages = list(range(2 * host_pages))
        rng.shuffle(all_pages)
        src_pages, dst_pages = all_pages[:host_pages], all_pages[host_pages:]
        requests = []
        for r in range(config.requests):
            tokens = [rng.randrange(1 << 20) for _ in range(config.keys_per_request * storage_page)]
            keys = sg.page_hashes(tokens, storage_page)
            pages = src_pages[
                r * config.keys_per_request * INDEX_KPOOL : (r + 1)
                * config.keys_per_request
                * INDEX_KPOOL
            ]
            requests.append((keys, pages, r))
        starts = [p * HOST_PAGE_TOKENS for p in src_pages]
        P.fill_random_pages(kv, starts, seed=config.seed + 1)
        P.fill_random_pages(indexer, starts, seed=config.seed + 2)
        P.fill_random_pages(mamba, list(range(config.requests)), seed=config.seed + 3)
        ref = {
            "kv": {s: P.page_bytes(kv, s) for s in starts},
            "indexer": {s: P.page_bytes(indexer, s) for s in starts},
            "mamba": {r: P.page_bytes(mamba, r) for r in range(config.requests)},
        }

        started = time.perf_counter()
        for keys, pages, r in requests:
            for b in range(0, len(keys), sg.STORAGE_BATCH_SIZE):
                batch = keys[b : b + sg.STORAGE_BATCH_SIZE]
                slots = slots_of(pages[b * INDEX_KPOOL : (b + len(batch)) * INDEX_KPOOL])
                sidecars = [sg.indexer(batch, slots)]
                if b + len(batch) == len(keys):
                    sidecars.append(sg.state([keys[-1]], torch.tensor([r])))
                side = store.batch_set_v2(sidecars)
                ok = store.batch_set_v1(batch, slots)
                if not (all(ok) and all(all(v) for v in side.values())):
                    raise RuntimeError(f"backup of request {r} failed: kv={ok} sidecars={side}")
        backup_s = time.perf_counter() - started
        say(
            f"storage page {store.storage_page_size} tokens = K={store.geometry.pages_per_span} "
            f"host pages per key (prefix {store.key_schema.prefix})"
        )
        bytes_per_key = sum(
            len(ref["kv"][s]) + len(ref["indexer"][s]) for s in starts[:INDEX_KPOOL]
        )
        say(f"backed up {keys_total} keys ({keys_total * storage_page} tokens) in {backup_s:.2f}s")

        P.wipe_pages(kv, starts)
        P.wipe_pages(indexer, starts)
        P.wipe_pages(mamba, list(range(2 * config.requests)))

        started = time.perf_counter()
        hit_keys = 0
        mismatched = 0
        for keys, pages, r in requests:
            hit = store.batch_exists_v2(keys, sg.hit_query())
            got = 0
            dst = dst_pages[r * config.keys_per_request * INDEX_KPOOL :]
            for b in range(0, hit.kv_hit_pages, sg.STORAGE_BATCH_SIZE):
                batch = keys[b : min(b + sg.STORAGE_BATCH_SIZE, hit.kv_hit_pages)]
                slots = slots_of(dst[b * INDEX_KPOOL : (b + len(batch)) * INDEX_KPOOL])
                kv_ok = store.batch_get_v1(batch, slots)
                side = store.batch_get_v2([sg.indexer(batch, slots, follows_kv=False)])
                got += min(
                    kv_ok.index(False) if False in kv_ok else len(kv_ok),
                    side[sg.INDEXER].count(True),
                )
            state_slot = config.requests + r
            if got == len(keys):
                st = store.batch_get_v2([sg.state([keys[-1]], torch.tensor([state_slot]))])
                if not st[sg.MAMBA][0]:
                    got = 0
            hit_keys += got
            for i, (src, new) in enumerate(zip(pages, dst, strict=False)):
                if i // INDEX_KPOOL >= got:
                    break
                mismatched += (
                    P.page_bytes(kv, new * HOST_PAGE_TOKENS) != ref["kv"][src * HOST_PAGE_TOKENS]
                )
                mismatched += (
                    P.page_bytes(indexer, new * HOST_PAGE_TOKENS)
                    != ref["indexer"][src * HOST_PAGE_TOKENS]
                )
            if got == len(keys):
                mismatched += P.page_bytes(mamba, state_slot) != ref["mamba"][r]
        restore_s = time.perf_counter() - started
        moved = keys_total * bytes_per_key
        say(f"restored {hit_keys}/{keys_total} keys in {restore_s:.2f}s into different host pages")
        say(
            f"bytes: {moved / 2**20:.1f} MiB each way; "
            f"backup {moved / 2**30 / backup_s:.2f} GiB/s, "
            f"restore {moved / 2**30 / restore_s:.2f} GiB/s"
        )
        say(f"verification: {mismatched} mismatched pages")
        return DemoReport(
            keys=keys_total,
            hit_keys=hit_keys,
            hit_tokens=hit_keys * storage_page,
            bytes_written=moved,
            bytes_read=moved,
            backup_s=backup_s,
            restore_s=restore_s,
            mismatched_pages=mismatched,
        )
    finally:
        store.clear()
        store.close()
