"""One process of the checksum corruption test (tests/faults/test_checksums.py).

Mooncake reads MOONCAKE_STORE_CHECKSUM once per process, at its first client
setup, so each setting under test needs a process of its own. Roles:

* ``corrupt``: a MooncakeSpanStore (K=4, MLA KV + DSA indexer, real sglang
  host pools) that also holds the cluster's only storage segment, so the
  stored objects live in this process' memory. It backs up six keys, flips
  one byte in the middle of every object of the third key in place, restores
  the six keys and asks the hit queries again. With ``plain_writer`` it then
  starts a ``plain`` child (checksums off, no segment) that backs up keys of
  its own into this segment, restores them, and flips one of them too: what
  the option cannot protect.
* ``plain``: that child: writes keys, prints their expected digests, exits.

Prints one JSON object on its last stdout line.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from typing import Any

from tests.faults.conftest import CallLog, SpanOracle, build_dsa_pools, open_span_store

PAGES_PER_KEY = 4
SEGMENT_BYTES = 64 << 20
KEYS = [f"chunk-{i}" for i in range(6)]
CORRUPT_INDEX = 2
PLAIN_KEYS = [f"plain-{i}" for i in range(3)]


def _oracle(config: dict[str, Any], model: str, **extra: Any) -> SpanOracle:
    pools = build_dsa_pools(host_keys=16, pages_per_key=PAGES_PER_KEY)
    store = open_span_store(config, pools, pages_per_key=PAGES_PER_KEY, model_name=model, **extra)
    return SpanOracle(store, pools, PAGES_PER_KEY, CallLog())


def _object_keys(oracle: SpanOracle, key: str) -> list[str]:
    store = oracle.store
    return [
        obj
        for name in ("kv", "indexer")
        for obj in store.key_schema.object_keys([key], store.pools[name].components)
    ]


def _flip_middle_byte(oracle: SpanOracle, object_key: str) -> dict[str, Any]:
    """Invert one byte in the middle of the stored object, in this process' segment."""
    replicas = oracle.store.client._gate.store.get_replica_desc(object_key)
    desc = replicas[0].get_memory_descriptor().buffer_descriptor
    byte = ctypes.c_ubyte.from_address(desc.buffer_address + desc.size // 2)
    byte.value ^= 0xFF
    return {"object": object_key, "size": desc.size, "endpoint": desc.transport_endpoint}


def _hits(oracle: SpanOracle, keys: list[str]) -> dict[str, Any]:
    v2 = oracle.hit_v2(keys)
    return {
        "batch_exists": oracle.hit(keys),
        "batch_exists_v2_kv_hit_pages": v2.kv_hit_pages,
        "presence": oracle.object_presence(keys),
    }


def _plain_child(config: dict[str, Any], model: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "MOONCAKE_STORE_CHECKSUM"}
    argv = [
        sys.executable,
        "-m",
        "tests.faults.checksum_worker",
        "plain",
        json.dumps(config),
        model,
    ]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"plain writer failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def corrupt(config: dict[str, Any], model: str, verify: bool, plain_writer: bool) -> dict:
    oracle = _oracle(
        dict(config, global_segment_size=SEGMENT_BYTES), model, span_verify_checksums=verify
    )
    try:
        out: dict[str, Any] = {"written": oracle.write(KEYS, seed=7)}
        out["hits_before"] = _hits(oracle, KEYS)
        out["flipped"] = [_flip_middle_byte(oracle, o) for o in _object_keys(oracle, KEYS[2])]
        out["restored"] = oracle.read(KEYS)
        out["corrupt_restores"] = list(oracle.corrupt)
        out["hits_after"] = _hits(oracle, KEYS)
        out["stats"] = oracle.store.client.stats()
        out["layout_integrity"] = oracle.store.describe_l3_object_layout()["integrity"]
        from prometheus_client import REGISTRY

        out["metric"] = REGISTRY.get_sample_value(
            "mooncake_span_integrity_failures_total", {"code": "CHECKSUM_MISMATCH"}
        )
        if plain_writer:
            child = _plain_child(config, model)
            oracle.expected.update({tuple(k): v for k, v in child["expected"]})
            oracle.corrupt.clear()
            out["plain_written"] = child["written"]
            out["plain_restored"] = oracle.read(PLAIN_KEYS)
            _flip_middle_byte(oracle, _object_keys(oracle, PLAIN_KEYS[0])[0])
            out["plain_flipped_restored"] = oracle.read(PLAIN_KEYS[:1])
            out["plain_corrupt_restores"] = list(oracle.corrupt)
        return out
    finally:
        oracle.store.close()


def plain(config: dict[str, Any], model: str) -> dict[str, Any]:
    oracle = _oracle(config, model)
    try:
        written = oracle.write(PLAIN_KEYS, seed=11)
        return {"written": written, "expected": [[list(k), v] for k, v in oracle.expected.items()]}
    finally:
        oracle.store.close()


def main(argv: list[str]) -> None:
    role, config, model = argv[0], json.loads(argv[1]), argv[2]
    if role == "plain":
        result = plain(config, model)
    else:
        result = corrupt(config, model, verify=argv[3] == "1", plain_writer=argv[4] == "1")
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main(sys.argv[1:])
