"""One process of ``bench --long``: a rank that backs up long conversations, or a second
server's rank that restores them.

``long_conversation`` starts these processes (``python -m mooncake_span_tools.bench.long_worker
SPEC``) and drives them with one JSON command per line on stdin; each answer is one line
on stdout that starts with ``REPLY_PREFIX`` (the native library may print other lines).
A process holds one arm per cluster (``open`` into a ``slot``): real sglang host pools,
sized for the longest conversation, and a backend built the way that arm's sglang build
builds it:

* ``span-K4``: ``MooncakeSpanStore`` on the span fork's pool set (64-token host pages,
  256-token storage pages), in the fork's startup order: built and registered with
  ``storage_page_size = 64`` on the config, then 256 assigned on the live backend;
* ``span-K1-stock``: ``MooncakeSpanStore`` on stock 0.5.23's pool set (256-token host
  pages, one per key, packed MTP draft layer), nothing named;
* ``upstream``: sglang 0.5.23's ``MooncakeStore`` on the stock pool set.

Backups follow sglang's ``HybridCacheController`` with ``hicache_storage_pass_prefix_keys``:
one write operation per chunked-prefill chunk, its sidecars first (``batch_set_v2``: the
indexer over the chunk's keys, the KDA state at its last key), then the KV in batches of
``STORAGE_BATCH_SIZE`` keys, each call carrying the keys before it as ``prefix_keys``.
A restore is one ``batch_exists_v2`` over the whole conversation (a fresh server has no
prefix, so sglang passes ``prefix_keys=None``), then ``batch_get_v1`` and the indexer's
``batch_get_v2`` per batch, then the state of the last key. Each answer carries a digest
of every restored host page, so the driver checks the bytes against the writer's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

REPLY_PREFIX = "LONGCONV "
CHUNK_TOKENS = 8192  # sglang's default chunked-prefill size
ARMS = ("span-K4", "span-K1-stock", "upstream")
# The longest wait for a synchronised start (the driver sends it a second ahead).
START_WAIT_LIMIT_S = 30.0


def _shapes() -> tuple[Any, Any]:
    from mooncake_span_tools.bench.workloads import STOCK_PAGE_TOKENS, ModelShape

    # GLM-5.3-Flash's pools at two MLA layers (bf16 latent 112 + rope 16), so that a
    # 300k-token conversation is a few hundred MiB and eight readers fit a small box:
    # span shape 578 bytes a token (KV 512, index rows 66), stock 867 (a packed MTP
    # draft layer: KV 768, index rows 99), plus a KDA state per 8,192-token chunk.
    span = ModelShape("dsa", "long", layers=2, kv_lora_rank=112, rope_dim=16)
    stock = ModelShape(
        "dsa-stock",
        "long",
        layers=2,
        kv_lora_rank=112,
        rope_dim=16,
        page_tokens=STOCK_PAGE_TOKENS,
        draft_layers=1,
    )
    return span, stock


@dataclass(frozen=True)
class Conversation:
    """A conversation's tokens follow from its seed; ``tokens`` is a multiple of 256."""

    tokens: int
    seed: int

    @classmethod
    def of(cls, spec: dict[str, Any]) -> Conversation:
        return cls(int(spec["tokens"]), int(spec["seed"]))

    def token_ids(self) -> list[int]:
        rng = np.random.default_rng([self.seed, 7])
        return rng.integers(0, 1 << 20, self.tokens).tolist()


def _digest(views: list[np.ndarray], row: int) -> str:
    h = hashlib.blake2b(digest_size=8)
    for view in views:
        h.update(view[row].data)
    return h.hexdigest()


class ArmRig:
    """One arm in this process: host pools, the backend and its recording native client."""

    def __init__(self, arm: str, client_config: dict[str, Any], max_tokens: int, nonce: str):
        from mooncake_span.store.client import load_native_binding
        from mooncake_span_tools.bench.pages import build_parts, host_pools
        from mooncake_span_tools.bench.pressure import counting_binding
        from mooncake_span_tools.bench.shared_native import RecordingNative, raw_client
        from mooncake_span_tools.testing.backends import (
            span_backend,
            storage_config,
            upstream_backend,
        )

        if arm not in ARMS:
            raise ValueError(f"unknown arm {arm!r}; known: {ARMS}")
        self.arm = arm
        span_shape, stock_shape = _shapes()
        self.model = stock_shape if arm != "span-K4" else span_shape
        self.host_page_tokens = self.model.page_tokens
        self.key_tokens = 256
        self.k = self.key_tokens // self.host_page_tokens
        self.host_pages = max_tokens // self.host_page_tokens
        self.state_slots = max_tokens // CHUNK_TOKENS + 2
        self.parts = build_parts(self.model, "page_first", self.host_pages, self.state_slots)
        self.kv_parts = [p for p in self.parts if p.per_key]
        self.state_part = next(p for p in self.parts if not p.per_key)
        self.last_written: tuple[list[str], dict[str, int]] | None = None
        extra = {
            **client_config,
            "span_layout_guard": "off",
            "span_master_admin_url": client_config["span_master_admin_url"],
        }
        config = storage_config(extra, f"long-{arm}-{nonce}")
        pools = host_pools(self.parts)
        if arm == "upstream":
            self.native = RecordingNative(raw_client(client_config), shared=False)
            self.store = upstream_backend(config, pools, self.native)
        else:
            binding, made = counting_binding(load_native_binding())
            if arm == "span-K4":
                config.storage_page_size = self.host_page_tokens  # the fork's construction
            self.store = span_backend(config, pools, binding=binding)
            if arm == "span-K4":
                self.store.storage_page_size = self.key_tokens  # init_hicache, after registration
            self.native = made[-1]

    # ---- pages ------------------------------------------------------------------

    def pages_for(self, conv: Conversation, salt: int) -> np.ndarray:
        """This process's host pages for ``conv``: scattered over the pool, as in a busy server."""
        rng = np.random.default_rng([conv.seed, salt])
        return rng.permutation(self.host_pages)[: conv.tokens // self.host_page_tokens]

    def slots(self, pages: np.ndarray) -> Any:
        import torch

        offsets = np.arange(self.host_page_tokens)
        return torch.from_numpy((pages[:, None] * self.host_page_tokens + offsets).reshape(-1))

    def fill(self, conv: Conversation, pages: np.ndarray, chunks: int, seed: int) -> None:
        from mooncake_span_tools.testing import page_io

        rng = np.random.default_rng([seed, 11])
        for part in self.kv_parts:
            page_io.fill_random_rows(part.views, pages, rng)
        page_io.fill_random_rows(self.state_part.views, np.arange(chunks), rng)

    def digests(self, pages: np.ndarray, state_row: int) -> dict[str, list[str]]:
        out = {str(p.name.value): [_digest(p.views, int(r)) for r in pages] for p in self.kv_parts}
        out["state"] = [_digest(self.state_part.views, state_row)]
        return out

    def bytes_of(self, pages: int, states: int) -> int:
        return pages * sum(p.page_bytes for p in self.kv_parts) + states * (
            self.state_part.page_bytes
        )

    def keys(self, conv: Conversation) -> list[str]:
        from mooncake_span_tools.testing import controller as sg

        return sg.page_hashes(conv.token_ids(), self.key_tokens)

    def locate(self) -> dict[str, Any]:
        """Where the master put the objects of the last conversation written."""
        if self.last_written is None:
            raise ValueError("locate: nothing written yet")
        return placement_of(self, *self.last_written)

    def close(self) -> None:
        import ctypes
        import gc

        with contextlib.suppress(Exception):
            self.store.close()
        self.parts.clear()
        self.kv_parts.clear()
        self.store = self.native = self.state_part = None
        gc.collect()
        # Hand the pools' pages back, so the next arm's readers fit beside them.
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def _extra(prefix: list[str] | None) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    return HiCacheStorageExtraInfo(prefix_keys=None if prefix is None else list(prefix))


def _counters(rig: ArmRig) -> dict[str, int]:
    native = rig.native
    c = native.counters
    return {
        "exist_calls": c.exist_calls + len(native.exist_calls),
        "io_calls": c.io_calls,
        "io_objects": c.io_objects,
        "put_calls": native.put_calls,
        "put_objects": native.put_objects,
    }


def _minus(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


def write(rig: ArmRig, conv: Conversation, decoy_seed: int) -> dict[str, Any]:
    """Back the conversation up as sglang does, chunk by chunk; its digests, and those of
    a decoy conversation (the negative control's expected bytes)."""
    import torch
    from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE

    from mooncake_span_tools.testing import controller as sg

    keys = rig.keys(conv)
    pages = rig.pages_for(conv, salt=1)
    chunk_keys = CHUNK_TOKENS // rig.key_tokens
    chunks = -(-len(keys) // chunk_keys)
    rig.fill(conv, pages, chunks, conv.seed)
    digests = rig.digests(pages, chunks - 1)
    rig.native.stored.clear()
    before = _counters(rig)
    failed = 0
    started = time.perf_counter()
    for c in range(chunks):
        lo, hi = c * chunk_keys, min((c + 1) * chunk_keys, len(keys))
        op_keys = keys[lo:hi]
        slots = rig.slots(pages[lo * rig.k : hi * rig.k])
        side = rig.store.batch_set_v2([sg.indexer(op_keys, slots)], extra_info=_extra(keys[:lo]))
        state = sg.state([op_keys[-1]], torch.tensor([c]))
        side.update(rig.store.batch_set_v2([state], extra_info=_extra(keys[: hi - 1])))
        failed += sum(not ok for flags in side.values() for ok in flags)
        for b in range(lo, hi, STORAGE_BATCH_SIZE):
            e = min(b + STORAGE_BATCH_SIZE, hi)
            flags = rig.store.batch_set_v1(
                keys[b:e], rig.slots(pages[b * rig.k : e * rig.k]), _extra(keys[:b])
            )
            failed += sum(not ok for ok in flags)
    put_s = time.perf_counter() - started
    stored = dict(rig.native.stored)
    out = {
        "keys": len(keys),
        "chunks": chunks,
        "put_s": put_s,
        "failed_objects": failed,
        "bytes": rig.bytes_of(len(pages), chunks),
        "state_bytes": rig.bytes_of(0, 1),
        "objects": len(stored),
        "stored_bytes": sum(stored.values()),
        "native": _minus(_counters(rig), before),
        "digests": digests,
    }
    rig.last_written = (keys, stored)
    rig.fill(conv, pages, chunks, decoy_seed)
    out["decoy_digests"] = rig.digests(pages, chunks - 1)
    return out


def placement_of(rig: ArmRig, keys: list[str], stored: dict[str, int]) -> dict[str, Any]:
    """Where the master says the objects are: bytes per segment, and per segment the
    share of the conversation's tokens still restorable (its leading keys) if it died."""
    from mooncake_span.store.segments import replica_segments

    position = {key: i for i, key in enumerate(keys)}
    located = replica_segments(rig.native.batch_get_replica_desc(list(stored)))
    per_segment: dict[str, int] = {}
    first: dict[str, int] = {}
    for obj, nbytes in stored.items():
        index = next((position[k] for k in _page_keys(obj) if k in position), None)
        for segment in located.get(obj, ()):
            per_segment[segment] = per_segment.get(segment, 0) + nbytes
            if index is not None:
                first[segment] = min(first.get(segment, len(keys)), index)
    return {
        "bytes_per_segment": per_segment,
        "share_if_lost": {s: round(first.get(s, len(keys)) / len(keys), 4) for s in per_segment},
    }


def _page_keys(object_key: str) -> list[str]:
    import re

    return re.findall(r"[0-9a-f]{64}", object_key)


def query(rig: ArmRig, conv: Conversation) -> dict[str, Any]:
    from mooncake_span_tools.testing import controller as sg

    keys = rig.keys(conv)
    if rig.arm != "upstream":
        rig.store.get_stats()  # drain, so the next read holds this query's RPCs only
    before = _counters(rig)
    started = time.perf_counter()
    result = rig.store.batch_exists_v2(keys, sg.hit_query(), _extra(None))
    query_s = time.perf_counter() - started
    out: dict[str, Any] = {
        "keys": len(keys),
        "hit_keys": int(result.kv_hit_pages),
        "query_s": query_s,
        "native": _minus(_counters(rig), before),
    }
    if rig.arm != "upstream":
        metrics = rig.store.get_stats()
        out["backend_hit_query_rpcs"] = metrics.hit_query_rpcs
        out["backend_probed_objects"] = metrics.hit_query_probed_objects
    return out


def fetch(rig: ArmRig, conv: Conversation, hit_keys: int, start_at: float) -> dict[str, Any]:
    """Restore the first ``hit_keys`` keys into wiped host pages, from ``start_at``
    (wall clock, so several readers start together)."""
    import torch
    from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE, PoolTransfer

    from mooncake_span_tools.testing import controller as sg
    from mooncake_span_tools.testing import page_io

    keys = rig.keys(conv)[:hit_keys]
    pages = rig.pages_for(conv, salt=2 + os.getpid())[: hit_keys * rig.k]
    state_row = rig.state_slots - 1
    for part in rig.kv_parts:
        page_io.wipe_rows(part.layout, pages)
    page_io.wipe_rows(rig.state_part.layout, np.array([state_row]))
    before = _counters(rig)
    wait_s = start_at - time.time()
    if wait_s > START_WAIT_LIMIT_S:
        raise ValueError(f"start_at is {wait_s:.0f}s away, more than {START_WAIT_LIMIT_S}s")
    if wait_s > 0:
        time.sleep(wait_s)
    wall_start = time.time()
    started = time.perf_counter()
    done = 0
    for b in range(0, len(keys), STORAGE_BATCH_SIZE):
        batch = keys[b : b + STORAGE_BATCH_SIZE]
        slots = rig.slots(pages[b * rig.k : (b + len(batch)) * rig.k])
        info = _extra(keys[:b])
        kv = rig.store.batch_get_v1(batch, slots, info)
        side = rig.store.batch_get_v2(
            [PoolTransfer(sg.INDEXER, host_indices=slots, keys=batch)], extra_info=info
        )
        got = min(_leading(kv), _leading(side[sg.INDEXER]))
        done += got
        if got < len(batch):
            break
    state_ok = False
    if keys and done == len(keys):
        side = rig.store.batch_get_v2(
            [sg.state([keys[-1]], torch.tensor([state_row]))], extra_info=_extra(keys[:-1])
        )
        state_ok = bool(side[sg.MAMBA][0])
    fetch_s = time.perf_counter() - started
    wall_end = time.time()
    restored = pages[: done * rig.k]
    return {
        "restored_keys": done,
        "state_restored": state_ok,
        "fetch_s": fetch_s,
        "wall_start": wall_start,
        "wall_end": wall_end,
        "bytes": rig.bytes_of(len(restored), int(state_ok)),
        "native": _minus(_counters(rig), before),
        "digests": rig.digests(restored, state_row),
    }


def _leading(flags: Any) -> int:
    n = 0
    for ok in flags:
        if not ok:
            break
        n += 1
    return n


def _reply(payload: dict[str, Any]) -> None:
    sys.stdout.write(REPLY_PREFIX + json.dumps(payload) + "\n")
    sys.stdout.flush()


def serve(spec: dict[str, Any]) -> None:
    """Answer commands until ``exit`` or the end of stdin. A process holds one rig per
    ``slot`` (one per cluster), so the driver can alternate clusters cell by cell."""
    rigs: dict[str, ArmRig] = {}
    _reply({"ok": True, "ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        command = json.loads(line)
        op, slot = command["op"], str(command.get("slot", ""))
        try:
            if op == "exit":
                break
            if op in ("open", "close") and slot in rigs:
                rigs.pop(slot).close()
            if op == "open":
                started = time.perf_counter()
                rigs[slot] = ArmRig(
                    command["arm"], command["client_config"], spec["max_tokens"], spec["nonce"]
                )
                _reply({"ok": True, "setup_s": time.perf_counter() - started})
                continue
            if op == "close":
                _reply({"ok": True})
                continue
            rig = rigs.get(slot)
            if rig is None:
                raise ValueError(f"{op}: no arm is open in slot {slot!r}")
            conv = Conversation.of(command["conv"]) if "conv" in command else None
            if op == "write":
                _reply({"ok": True, **write(rig, conv, command["decoy_seed"])})
            elif op == "query":
                _reply({"ok": True, **query(rig, conv)})
            elif op == "fetch":
                _reply({"ok": True, **fetch(rig, conv, command["hit_keys"], command["start_at"])})
            elif op == "locate":
                _reply({"ok": True, **rig.locate()})
            elif op == "clear":
                rig.native.remove_all(True)
                _reply({"ok": True})
            else:
                raise ValueError(f"unknown command {op!r}")
        except Exception as exc:  # the driver reports it and stops the run
            logger.exception("long_worker: %s failed", op)
            _reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    for rig in rigs.values():
        rig.close()


def main() -> None:
    import warnings

    warnings.filterwarnings("ignore", message="Only CUDA", category=UserWarning)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    serve(json.loads(sys.argv[1]))


if __name__ == "__main__":
    main()
