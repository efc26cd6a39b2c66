"""``mooncake-span bench --scale``: what one master costs as it fills.

One real master and one storage node (``LocalCluster``). The master is filled
in steps (10k to 10M objects by default) with small objects (64 B values, keys
in this backend's object-key grammar), put with Mooncake's ``batch_put_from``
by one client. Before the fill, one 300,032-token conversation (one small MLA
layer, K=4: 1,172 storage keys, each chained on the one before as sglang's
page hashes are) is backed up as sglang's controller backs it up. At every
step, in one run:

* the master's RSS (``/proc/PID/status``) and key count, so RSS per object;
* this backend's hit query over the whole conversation as the controller asks
  it (``batch_exists`` per 128 keys, with the keys before as prefix keys), and
  its restore (``batch_get_v1`` per 128 keys), each ``reps`` times: p50/p99 of
  the whole conversation and of one 128-key call, and the ratio to the first
  step's p50 (the target: within 2x at 10M objects against 10k).

The conversation is restored whole and byte-exact at the first and last step.
The fill stops early, and says so, if the box's available memory falls below
``min_available_bytes``: the box is shared.

Objects per stored token (``scale_objects``) is the other half of the section.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_STEPS = (10_000, 100_000, 1_000_000, 3_000_000, 10_000_000)
QUICK_STEPS = (2_000, 6_000)
HOST_PAGE_TOKENS = 64
PAGES_PER_KEY = 4
STORAGE_PAGE_TOKENS = HOST_PAGE_TOKENS * PAGES_PER_KEY
# 4,688 host pages: the ~300k-token conversation of docs/../scale-and-gpu.md.
CONVERSATION_TOKENS = 300_032
# sglang 0.5.23's STORAGE_BATCH_SIZE: the controller asks and reads per 128 keys.
CONTROLLER_BATCH_KEYS = 128
# One MLA layer of small dims: 256 B a token, so a conversation is 77 MB and
# the run measures the master, not bandwidth.
MLA_LAYERS, KV_LORA_RANK, ROPE_DIM = 1, 112, 16
FILL_VALUE_BYTES = 64
# 5,000 objects a call overflowed Mooncake's TCP lane queue ("queue-full
# rejection", then -800 after 60 s); 2,000 did once on a loaded box.
FILL_BATCH_OBJECTS = 1_000
FILL_PUT_TRIES = 5
FILL_LANES = 3
MEMORY_WAIT_S, MEMORY_POLL_S = 900.0, 2.0
# Mooncake's allocator holds at most max(segment / 1 KiB, 2**20) objects in a segment.
ALLOCATOR_BYTES_PER_OBJECT = 1024
_KiB, _MiB, _GiB = 1 << 10, 1 << 20, 1 << 30


@dataclass(frozen=True)
class ScaleConfig:
    steps: tuple[int, ...] = DEFAULT_STEPS
    conversation_tokens: int = CONVERSATION_TOKENS
    hit_reps: int = 21
    get_reps: int = 9
    fill_batch_objects: int = FILL_BATCH_OBJECTS
    fill_lanes: int = FILL_LANES
    # Stop filling below this much MemAvailable (the box is shared).
    min_available_bytes: int = 3 * _GiB
    # Kept after the run when set (the cluster's logs); else a temporary directory.
    log_dir: str | None = None

    def __post_init__(self) -> None:
        steps = self.steps
        if not steps or any(s <= 0 for s in steps) or list(steps) != sorted(set(steps)):
            raise ValueError(f"ScaleConfig.steps must be increasing object counts > 0, got {steps}")
        if self.conversation_tokens <= 0 or self.conversation_tokens % STORAGE_PAGE_TOKENS:
            raise ValueError(
                f"ScaleConfig.conversation_tokens={self.conversation_tokens}: must be a positive "
                f"multiple of the {STORAGE_PAGE_TOKENS}-token storage page"
            )
        for name in ("hit_reps", "get_reps", "fill_batch_objects", "fill_lanes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ScaleConfig.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def conversation_keys(self) -> int:
        return self.conversation_tokens // STORAGE_PAGE_TOKENS

    def segment_bytes(self) -> int:
        """The storage node's segment: room for every object by the allocator's count
        limit (the fill's bytes are far less), whole GiB plus slack."""
        objects = self.steps[-1] + 2 * self.conversation_keys
        return -(-int(objects * 1.1) * ALLOCATOR_BYTES_PER_OBJECT // _GiB) * _GiB


def status_bytes(pid: int, field_name: str = "VmRSS") -> int:
    """A ``/proc/PID/status`` size field (kB there) in bytes."""
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * _KiB
    raise RuntimeError(f"/proc/{pid}/status has no {field_name}")


def available_bytes() -> int:
    with open("/proc/meminfo", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * _KiB
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def quantiles_ms(seconds: list[float]) -> dict[str, float]:
    """p50 and p99 (nearest rank) in ms."""
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, max(0, -(-99 * len(ordered) // 100) - 1))]
    return {
        "p50_ms": round(1e3 * statistics.median(ordered), 3),
        "p99_ms": round(1e3 * p99, 3),
        "samples": len(ordered),
    }


def master_key_count(metrics_url: str) -> int:
    from mooncake_span.ops import master_http

    for name, _, value in master_http.master_metrics(metrics_url, 10.0):
        if name == "master_key_count":
            return int(value)
    raise RuntimeError(f"{metrics_url}: the master reports no master_key_count")


# ---- the fill -----------------------------------------------------------------------


class Filler:
    """Bare clients putting small objects with the backend's object-key grammar, each
    in a thread of its own on its share of a step (``lanes``: on a loaded 2-core box
    one client's thread is starved between its calls)."""

    def __init__(self, client_config: dict[str, Any], batch_objects: int, lanes: int) -> None:
        from mooncake.store import ReplicateConfig

        from mooncake_span.span.keys import ComponentSpec, KeySchema, RankScope, RankTags
        from mooncake_span_tools.bench.shared_native import raw_client

        self._value = ctypes.create_string_buffer(FILL_VALUE_BYTES)
        self._address = ctypes.addressof(self._value)
        self.natives: list[Any] = []
        for _ in range(lanes):
            native = raw_client(client_config)
            self.natives.append(native)
            if native.register_buffer(self._address, FILL_VALUE_BYTES) != 0:
                raise RuntimeError("the filler's value buffer did not register")
        self._config = ReplicateConfig()
        self._schema = KeySchema(
            "scale-fill", HOST_PAGE_TOKENS, PAGES_PER_KEY, "page_first", "bfloat16",
            RankTags.from_ranks(tp_rank=0),
        )  # fmt: skip
        self._components = (ComponentSpec("kv", RankScope.REPLICATED),)
        self.batch_objects = batch_objects
        self.filled = 0
        self.retried_objects = 0
        self.memory_wait_s = 0.0

    def key_bytes(self) -> int:
        return len(self._keys(0, 1)[0])

    def _keys(self, start: int, count: int) -> list[str]:
        # 64 hex digits, as a sha256 page hash; the index keeps them unique.
        hashes = [f"{i:064x}" for i in range(start, start + count)]
        return self._schema.object_keys(hashes, self._components)

    def fill_to(self, target: int, memory_floor_bytes: int) -> bool:
        """Put objects until ``target`` are in; False if the box's available memory
        stayed below ``memory_floor_bytes`` for ``MEMORY_WAIT_S`` first."""
        from concurrent.futures import ThreadPoolExecutor

        total = target - self.filled
        if total <= 0:
            return True
        lanes = len(self.natives)
        bounds = [self.filled + total * i // lanes for i in range(lanes + 1)]
        with ThreadPoolExecutor(lanes) as pool:
            done = list(
                pool.map(
                    lambda i: self._fill_range(i, bounds[i], bounds[i + 1], memory_floor_bytes),
                    range(lanes),
                )
            )
        self.filled += sum(n for n, _ in done)
        return all(whole for _, whole in done)

    def _fill_range(self, lane: int, start: int, stop: int, floor_bytes: int) -> tuple[int, bool]:
        """(objects put, whether all of them) for objects ``start``..``stop`` on one client."""
        native, at = self.natives[lane], start
        while at < stop:
            if not self._memory_back(floor_bytes):
                return at - start, False
            n = min(self.batch_objects, stop - at)
            keys = self._keys(at, n)
            for _ in range(FILL_PUT_TRIES):
                codes = native.batch_put_from(
                    keys, [self._address] * len(keys), [FILL_VALUE_BYTES] * len(keys), self._config
                )
                failed = [(k, int(c)) for k, c in zip(keys, codes, strict=True) if c != 0]
                if not failed:
                    break
                # A loaded shared box has failed a TCP transfer to the node
                # mid-fill (-800); the fill is not what is measured, so the
                # objects that failed are put again and the retries counted.
                self.retried_objects += len(failed)
                keys = [k for k, _ in failed]
            else:
                codes = sorted({c for _, c in failed})
                raise RuntimeError(
                    f"the fill's put near object {at} answered {codes} {FILL_PUT_TRIES} times"
                )
            at += n
        return at - start, True

    def _memory_back(self, floor_bytes: int) -> bool:
        """Wait up to ``MEMORY_WAIT_S`` for the box's available memory to be above
        ``floor_bytes`` (other jobs on a shared box come and go); False if it never was."""
        deadline = time.monotonic() + MEMORY_WAIT_S
        started = time.monotonic()
        while available_bytes() < floor_bytes:
            if time.monotonic() > deadline:
                return False
            time.sleep(MEMORY_POLL_S)
        self.memory_wait_s += time.monotonic() - started
        return True

    def close(self) -> None:
        for native in self.natives:
            native.unregister_buffer(self._address)
            native.close()


# ---- the conversation -----------------------------------------------------------------


@dataclass
class Conversation:
    """This backend at K=4 on one MLA layer's host pool: the conversation's pages in
    the first half (random bytes), restored into the second half."""

    store: Any
    pool: Any
    keys: list[str]
    host_pages: int

    @classmethod
    def build(cls, client_config: dict[str, Any], config: ScaleConfig, nonce: str) -> Conversation:
        from sglang.srt.mem_cache.hicache_storage import PoolName

        from mooncake_span_tools.testing import controller as sg
        from mooncake_span_tools.testing import pools as P
        from mooncake_span_tools.testing.backends import span_backend, storage_config

        host_pages = config.conversation_keys * PAGES_PER_KEY
        pool = P.build_mla_host(
            "page_first",
            layers=MLA_LAYERS,
            host_pages=2 * host_pages,
            kv_lora_rank=KV_LORA_RANK,
            rope_dim=ROPE_DIM,
        )
        extra = {**client_config, "span_layout_guard": "off"}
        backend_config = storage_config(extra, f"bench-scale-{nonce}")
        backend_config.storage_page_size = STORAGE_PAGE_TOKENS
        store = span_backend(backend_config, {PoolName.KV: pool})
        keys = sg.chained_keys(f"scale:{nonce}", config.conversation_keys)
        buffer = pool.kv_buffer.view(-1).view(dtype=_uint8())
        half = buffer.numel() // 2
        import torch

        generator = torch.Generator().manual_seed(0)
        buffer[:half] = torch.randint(0, 256, (half,), generator=generator, dtype=_uint8())
        return cls(store, pool, keys, host_pages)

    def _batches(self) -> list[tuple[int, list[str], list[str]]]:
        """(first key, the batch's keys, the prefix keys before it), as the controller."""
        out = []
        for start in range(0, len(self.keys), CONTROLLER_BATCH_KEYS):
            out.append((start, self.keys[start : start + CONTROLLER_BATCH_KEYS], self.keys[:start]))
        return out

    def _slots(self, first_key: int, count: int, restore: bool) -> Any:
        import torch

        base = (self.host_pages if restore else 0) * HOST_PAGE_TOKENS
        start = base + first_key * STORAGE_PAGE_TOKENS
        return torch.arange(start, start + count * STORAGE_PAGE_TOKENS)

    def backup(self) -> int:
        """Keys stored, as the controller's backup: per 128 keys, with prefix keys."""
        stored = 0
        for start, keys, prefix in self._batches():
            flags = self.store.batch_set_v1(
                keys, self._slots(start, len(keys), False), _extra(prefix)
            )
            stored += sum(map(bool, flags))
        return stored

    def hit_query(self) -> tuple[int, list[float]]:
        """(hit keys, seconds per call); stops at the first short answer, as sglang."""
        hit, seconds = 0, []
        for _, keys, prefix in self._batches():
            started = time.perf_counter()
            found = self.store.batch_exists(keys, _extra(prefix))
            seconds.append(time.perf_counter() - started)
            hit += found
            if found < len(keys):
                break
        return hit, seconds

    def restore(self) -> tuple[int, list[float]]:
        """(keys restored, seconds per call) into the second half of the pool."""
        restored, seconds = 0, []
        for start, keys, prefix in self._batches():
            slots = self._slots(start, len(keys), True)
            started = time.perf_counter()
            flags = self.store.batch_get_v1(keys, slots, _extra(prefix))
            seconds.append(time.perf_counter() - started)
            restored += sum(map(bool, flags))
        return restored, seconds

    def byte_exact(self) -> bool:
        import torch

        buffer = self.pool.kv_buffer.view(-1).view(dtype=_uint8())
        half = buffer.numel() // 2
        exact = bool(torch.equal(buffer[:half], buffer[half:]))
        buffer[half:] = 0
        return exact

    def close(self) -> None:
        self.store.close()


def _uint8() -> Any:
    import torch

    return torch.uint8


def _extra(prefix: list[str]) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    return HiCacheStorageExtraInfo(prefix_keys=list(prefix))


# ---- one step ---------------------------------------------------------------------------


@dataclass
class StepFigures:
    target_objects: int
    filled_objects: int
    master_keys: int
    master_rss_bytes: int
    node_rss_bytes: int
    master_rss_per_object_bytes: float
    fill_objects_per_s: float
    hit_keys: int
    restored_keys: int
    hit_query: dict[str, float]
    hit_call: dict[str, float]
    get: dict[str, float]
    get_call: dict[str, float]
    byte_exact: bool | None = None
    hit_ratio_to_first: float | None = None
    get_ratio_to_first: float | None = None
    available_bytes: int = 0


def measure_step(conversation: Conversation, config: ScaleConfig) -> dict[str, Any]:
    """The conversation's hit query and restore, interleaved rep by rep."""
    hit_totals, hit_calls, get_totals, get_calls = [], [], [], []
    hit = restored = 0
    for rep in range(max(config.hit_reps, config.get_reps)):
        if rep < config.hit_reps:
            hit, seconds = conversation.hit_query()
            hit_totals.append(sum(seconds))
            hit_calls += seconds
        if rep < config.get_reps:
            restored, seconds = conversation.restore()
            get_totals.append(sum(seconds))
            get_calls += seconds
    return {
        "hit_keys": hit,
        "restored_keys": restored,
        "hit_query": quantiles_ms(hit_totals),
        "hit_call": quantiles_ms(hit_calls),
        "get": quantiles_ms(get_totals),
        "get_call": quantiles_ms(get_calls),
    }


def run_fill(config: ScaleConfig, progress: bool = True, on_step: Any = None) -> dict[str, Any]:
    """The fill, step by step; ``on_step(record)`` after each step with the record so
    far (the same shape as the result). A fill that fails after a step (the master
    killed, a put refused) ends the run there, saying why in ``stopped_early``."""
    from mooncake_span.ops.cluster import ClusterSpec, LocalCluster

    nonce = str(time.time_ns())
    segment = config.segment_bytes()
    spec = ClusterSpec(storage_nodes=1, storage_node_segment_bytes=segment, log_dir=config.log_dir)
    steps: list[dict[str, Any]] = []
    stopped_early = None
    started = time.perf_counter()
    with LocalCluster(spec) as cluster:
        pids = cluster.pids()
        master_pid, node_pid = pids["master0"], pids["node0"]
        client_config = dict(cluster.client_config(0))
        empty_rss = status_bytes(master_pid)
        conversation = Conversation.build(client_config, config, nonce)
        filler = Filler(client_config, config.fill_batch_objects, config.fill_lanes)
        try:
            stored = conversation.backup()
            if stored != len(conversation.keys):
                raise RuntimeError(
                    f"the conversation stored {stored}/{len(conversation.keys)} keys"
                )
            header = {
                "config": asdict(config),
                "segment_bytes": segment,
                "fill_value_bytes": FILL_VALUE_BYTES,
                "fill_key_bytes": filler.key_bytes(),
                "conversation_keys": config.conversation_keys,
                "conversation_tokens": config.conversation_tokens,
                "master_rss_empty_bytes": empty_rss,
                "master_rss_after_conversation_bytes": status_bytes(master_pid),
                "master_keys_after_conversation": master_key_count(cluster.metrics_url),
            }
            for i, target in enumerate(config.steps):
                fill_started = time.perf_counter()
                before = filler.filled
                try:
                    whole = filler.fill_to(target, config.min_available_bytes)
                except RuntimeError as exc:
                    if not steps:
                        raise
                    stopped_early = (
                        f"the fill failed after {steps[-1]['master_keys']} objects: {exc}"
                    )
                    break
                fill_s = time.perf_counter() - fill_started
                figures = measure_step(conversation, config)
                rss = status_bytes(master_pid)
                keys = master_key_count(cluster.metrics_url)
                last = i == len(config.steps) - 1 or not whole
                row = StepFigures(
                    target_objects=target,
                    filled_objects=filler.filled,
                    master_keys=keys,
                    master_rss_bytes=rss,
                    node_rss_bytes=status_bytes(node_pid),
                    master_rss_per_object_bytes=round((rss - empty_rss) / max(1, keys), 1),
                    fill_objects_per_s=round((filler.filled - before) / max(fill_s, 1e-9)),
                    available_bytes=available_bytes(),
                    byte_exact=conversation.byte_exact() if i == 0 or last else None,
                    **figures,
                )
                steps.append(
                    {
                        **asdict(row),
                        "fill_retried_objects": filler.retried_objects,
                        "fill_memory_wait_s": round(filler.memory_wait_s, 1),
                        # The box is shared: its load beside each step's timings.
                        "load_average_1m": round(os.getloadavg()[0], 2),
                    }
                )
                if on_step is not None:
                    on_step(summarize(header, steps, None, time.perf_counter() - started))
                if progress:
                    print(_step_line(steps[-1]), flush=True)
                if not whole:
                    stopped_early = (
                        f"MemAvailable stayed below {config.min_available_bytes} bytes for "
                        f"{MEMORY_WAIT_S:.0f} s at {filler.filled} objects"
                    )
                    break
        finally:
            filler.close()
            conversation.close()
    return summarize(header, steps, stopped_early, time.perf_counter() - started)


def summarize(
    header: dict[str, Any], steps: list[dict[str, Any]], stopped_early: str | None, seconds: float
) -> dict[str, Any]:
    """The fill's record: each step's p50 against the first step's, and the RSS the
    master grew by per object from the first step to the last (the figure a
    deployment multiplies by its object count)."""
    first, last = steps[0], steps[-1]
    for row in steps:
        row["hit_ratio_to_first"] = round(
            row["hit_query"]["p50_ms"] / first["hit_query"]["p50_ms"], 3
        )
        row["get_ratio_to_first"] = round(row["get"]["p50_ms"] / first["get"]["p50_ms"], 3)
    grown = last["master_keys"] - first["master_keys"]
    marginal = (last["master_rss_bytes"] - first["master_rss_bytes"]) / grown if grown else None
    return {
        **header,
        "master_rss_per_object_marginal_bytes": None if marginal is None else round(marginal, 1),
        "stopped_early": stopped_early,
        "steps": steps,
        "seconds": round(seconds, 1),
    }


def _step_line(row: dict[str, Any]) -> str:
    return (
        f"{row['master_keys']:>10} objects  master RSS {row['master_rss_bytes'] / _MiB:8.1f} MiB "
        f"({row['master_rss_per_object_bytes']:.0f} B/object)  fill {row['fill_objects_per_s']}/s  "
        f"hit {row['hit_query']['p50_ms']:.1f}/{row['hit_query']['p99_ms']:.1f} ms  "
        f"get {row['get']['p50_ms']:.1f}/{row['get']['p99_ms']:.1f} ms  "
        f"({row['hit_keys']} hit, {row['restored_keys']} restored)"
    )


# ---- the command ------------------------------------------------------------------------


def format_fill(result: dict[str, Any]) -> str:
    lines = [
        f"master fill: {result['conversation_tokens']}-token conversation "
        f"({result['conversation_keys']} keys, K={PAGES_PER_KEY}); hit query and get p50/p99 ms "
        "(ratio of p50 to the first step)"
    ]
    for row in result["steps"]:
        ratios = f"x{row['hit_ratio_to_first']:.2f} / x{row['get_ratio_to_first']:.2f}"
        lines.append(f"  {_step_line(row)}  {ratios}")
    lines.append(
        f"  marginal master RSS per object: {result['master_rss_per_object_marginal_bytes']} B"
    )
    if result["stopped_early"]:
        lines.append(f"  STOPPED EARLY: {result['stopped_early']}")
    return "\n".join(lines)


def run_scale(
    quick: bool,
    steps: tuple[int, ...] | None = None,
    log_dir: str | None = None,
    partial_path: str | None = None,
) -> dict[str, Any]:
    from mooncake_span_tools.bench import scale_objects

    if steps is None:
        steps = QUICK_STEPS if quick else DEFAULT_STEPS
    config = ScaleConfig(
        steps=steps,
        conversation_tokens=16_384 if quick else CONVERSATION_TOKENS,
        hit_reps=3 if quick else 21,
        get_reps=2 if quick else 9,
        log_dir=log_dir,
    )

    def save(record: dict[str, Any]) -> None:
        if partial_path:
            with open(partial_path, "w", encoding="utf-8") as fh:
                json.dump(record, fh, indent=1)

    result: dict[str, Any] = {"fill": run_fill(config, on_step=save)}
    result["objects"] = scale_objects.run_objects(quick)
    result["master_bytes_per_token"] = scale_objects.bytes_per_token(
        result["objects"], result["fill"]["master_rss_per_object_marginal_bytes"]
    )
    return result


def run_scale_command(quick: bool, json_path: str | None, plot_path: str | None) -> int:
    """``MOONCAKE_SPAN_SCALE_STEPS`` (a comma list of object counts) replaces the
    steps; ``MOONCAKE_SPAN_SCALE_LOG_DIR`` keeps the cluster's logs there."""
    from mooncake_span_tools.bench import scale_objects

    steps = os.environ.get("MOONCAKE_SPAN_SCALE_STEPS")
    result = run_scale(
        quick,
        tuple(int(s) for s in steps.split(",")) if steps else None,
        log_dir=os.environ.get("MOONCAKE_SPAN_SCALE_LOG_DIR"),
        partial_path=f"{json_path}.partial" if json_path else None,
    )
    print(format_fill(result["fill"]), flush=True)
    print(scale_objects.format_objects(result), flush=True)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {json_path}", flush=True)
    if plot_path:
        write_scale_plot(result["fill"], plot_path)
        print(f"wrote {plot_path}", flush=True)
    return 0 if all(r["hit_keys"] == r["restored_keys"] for r in result["fill"]["steps"]) else 1


def write_scale_plot(fill: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = fill["steps"]
    objects = [r["master_keys"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for name, label in (("hit_query", "hit query"), ("get", "get")):
        left.plot(objects, [r[name]["p50_ms"] for r in rows], marker="o", label=f"{label} p50")
        left.plot(
            objects, [r[name]["p99_ms"] for r in rows], marker=".", ls="--", label=f"{label} p99"
        )
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("objects in the master")
    left.set_ylabel(f"ms per {fill['conversation_tokens']:,}-token conversation")
    left.legend(fontsize=7)
    right.plot(objects, [r["master_rss_bytes"] / _GiB for r in rows], marker="o")
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("objects in the master")
    right.set_ylabel("master RSS (GiB)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
