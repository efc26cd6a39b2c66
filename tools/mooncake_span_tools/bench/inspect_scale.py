"""How fast ``mooncake-span inspect`` is on a store with many keys.

Starts a local cluster (master + one storage node), writes ``--keys`` small
objects spread over a few span namespaces (real object-key grammar), runs the
inspect collection once with sampled bytes, and writes a JSON document with
the key count, the scan time and the total time. Usage::

    python -m mooncake_span_tools.bench.inspect_scale --keys 100000 --json out.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time

from mooncake_span.ops.cluster import ClusterSpec, LocalCluster
from mooncake_span.ops.inspect_cmd import collect
from mooncake_span.ops.master_http import iter_lines
from mooncake_span.span.keys import ComponentSpec, KeySchema, RankScope, RankTags

_BATCH = 500
_OBJECT_BYTES = 64


def _fill(cluster: LocalCluster, total_keys: int, namespaces: int) -> float:
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    cfg = cluster.client_config(0)
    store = MooncakeDistributedStore()
    # By name, as the backend calls it: later wheels add parameters.
    rc = store.setup(
        local_hostname=cfg["local_hostname"],
        metadata_server=cfg["metadata_server"],
        global_segment_size=0,
        local_buffer_size=64 << 20,
        protocol="tcp",
        rdma_devices="",
        master_server_addr=cfg["master_server_address"],
    )
    if rc != 0:
        raise RuntimeError(f"setup returned {rc}")
    payload = ctypes.create_string_buffer(b"x" * _OBJECT_BYTES, _OBJECT_BYTES)
    config = ReplicateConfig()
    schemas = [
        KeySchema(f"scale-{i}", 64, 4, "page_first", "bfloat16", RankTags.from_ranks(tp_rank=0))
        for i in range(namespaces)
    ]
    comps = (ComponentSpec("k", RankScope.REPLICATED),)
    started = time.perf_counter()
    written = 0
    while written < total_keys:
        n = min(_BATCH, total_keys - written)
        schema = schemas[(written // _BATCH) % namespaces]
        keys = schema.object_keys([f"{written + i:064x}" for i in range(n)], comps)
        codes = store.batch_put_from_multi_buffers(
            keys, [[ctypes.addressof(payload)]] * n, [[_OBJECT_BYTES]] * n, config
        )
        if any(code != 0 for code in codes):
            raise RuntimeError(f"put failed: {sorted(set(codes))[:5]}")
        written += n
    store.close()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--namespaces", type=int, default=4)
    parser.add_argument("--sample", type=int, default=32)
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    spec = ClusterSpec(storage_nodes=1, storage_node_segment_bytes=1 << 30)
    with LocalCluster(spec) as cluster:
        fill_s = _fill(cluster, args.keys, args.namespaces)
        started = time.perf_counter()
        fetched = sum(1 for _ in iter_lines(cluster.metrics_url + "/get_all_keys", 60.0))
        fetch_s = time.perf_counter() - started
        started = time.perf_counter()
        doc = collect(cluster.metrics_url, sample_per_namespace=args.sample)
        total_s = time.perf_counter() - started
    result = {
        "keys": doc["keys"]["total"],
        "namespaces": len(doc["namespaces"]),
        "objects_counted": sum(ns["objects"] for ns in doc["namespaces"]),
        "fetch_only_s": round(fetch_s, 3),
        "fetched_keys": fetched,
        "scan_s": doc["keys"]["scan_s"],
        "inspect_total_s": round(total_s, 3),
        "sample_per_namespace": args.sample,
        "fill_s": round(fill_s, 3),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
