"""``mooncake-span bench --ssd-scale``: an SSD tier of tens of GB and a million objects.

One master and one storage node with an SSD tier (the layout ``SsdTier``
sets: one directory, a ``.bucket`` and a ``.meta`` per object). Every object
is sealed as the backend seals it (``store/seal.py``, so the ``full`` check
really reads and hashes every byte). The tier is filled in two steps:

1. ``large_objects`` of ``large_object_bytes`` (1 MiB: a K=4 MLA span key),
   put by a bare Mooncake client and written by the node's offload heartbeat;
2. ``small_objects`` of ``small_object_bytes`` (10 KiB: small pools' keys),
   which brings the object count past a million: the first
   ``offloaded_objects`` through the heartbeat, then, the node stopped, the
   rest written straight into the directory in the wheel's own format
   (``store/ssd_scan.py`` reads it; the node registers them at its next start,
   and the sample reads below read them back), then the last
   ``offloaded_objects`` through the heartbeat again, now into a directory of
   two million files. On a 2-core box the heartbeat offloads 100-1,500 small
   objects a second depending on the load, so a million through it would take
   hours; the two offload runs give its rate in a small and a full directory.

Per step: the offload rates (objects and MB per second from the first put to
the last ``.meta`` on disk), files per object and bytes on disk. After each
step the node stops gracefully and starts again once per check mode (size,
the default; full; off), the page cache dropped before each start (needs
root): seconds to its ``READY`` line, the check's own seconds from its log,
Mooncake's setup seconds, then a sample of keys read back and compared byte
for byte. And the directory listed cold (``os.scandir`` with a ``stat`` per
entry). Two data sizes give restart seconds per GB and per object.

``MOONCAKE_SPAN_SSD_SCALE_LARGE_GB`` sizes step 1 (default 10 GB) and
``MOONCAKE_SPAN_SSD_SCALE_SMALL_OBJECTS=0`` leaves step 2 out, for a tier of
production-sized objects alone.

Load: the box's other work is not stopped; the load average at each
measurement is recorded beside it.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from mooncake_span.ops import launcher as L
from mooncake_span.ops.cluster import LocalCluster
from mooncake_span.ops.cluster_spec import ClusterSpec
from mooncake_span.store import seal
from mooncake_span.store.ssd_scan import CHECK_MODES
from mooncake_span_tools.bench.shared_native import raw_client

logger = logging.getLogger(__name__)

BATCH_OBJECTS = 256
PUT_RETRY_SLEEP_S = 0.2
OFFLOAD_TIMEOUT_S = 3600.0
READY_TIMEOUT_S = 1800.0
SAMPLE_KEYS = 256
_CHECK_LINE = re.compile(r"SSD check \(\w+\) of .*, ([0-9.]+)s$", re.MULTILINE)
_NOT_ROOT = "dropping the page cache needs root"


@dataclass(frozen=True)
class SsdScaleConfig:
    large_objects: int = 9_540  # 10.0 GB
    large_object_bytes: int = 1 << 20
    small_objects: int = 1_000_000  # 10.2 GB
    small_object_bytes: int = 10 << 10
    # Small objects offloaded through the heartbeat before and after the rest are written.
    offloaded_objects: int = 10_000
    segment_bytes: int = 512 << 20
    modes: tuple[str, ...] = CHECK_MODES
    work_dir: Path = field(default_factory=lambda: Path("/tmp/mooncake-span-bench-ssd-scale"))
    keep: bool = False  # leave the directory (tens of GB) after the run

    def __post_init__(self) -> None:
        if min(self.large_objects, self.large_object_bytes) < 1 or self.small_objects < 0:
            raise ValueError("object counts and sizes must be >= 1 (small_objects: 0 skips step 2)")
        if self.small_objects and not 1 <= 2 * self.offloaded_objects <= self.small_objects:
            raise ValueError("need 1 <= 2 * offloaded_objects <= small_objects")
        if self.small_object_bytes <= seal.TRAILER_BYTES:
            raise ValueError(f"objects must be larger than the {seal.TRAILER_BYTES}-byte seal")
        if not set(self.modes) <= set(CHECK_MODES):
            raise ValueError(f"modes must be among {CHECK_MODES}")


def config_from_env(quick: bool, env: Mapping[str, str]) -> SsdScaleConfig:
    """The run's configuration: ``--quick``'s or the default, with
    ``MOONCAKE_SPAN_SSD_SCALE_LARGE_GB`` (step 1's tier size in GB, as whole
    large objects) and ``MOONCAKE_SPAN_SSD_SCALE_SMALL_OBJECTS`` (0: no step 2)
    replacing their fields where set."""
    config = (
        SsdScaleConfig(large_objects=64, small_objects=4_000, offloaded_objects=500)
        if quick
        else SsdScaleConfig()
    )
    changes: dict[str, int] = {}
    large_gb = env.get("MOONCAKE_SPAN_SSD_SCALE_LARGE_GB")
    if large_gb:
        try:
            gb = float(large_gb)
        except ValueError:
            gb = 0.0
        if not gb > 0 or gb != gb or gb == float("inf"):
            raise ValueError(
                f"MOONCAKE_SPAN_SSD_SCALE_LARGE_GB={large_gb!r}: must be a size in GB > 0"
            )
        changes["large_objects"] = max(1, round(gb * 1e9 / config.large_object_bytes))
    small = env.get("MOONCAKE_SPAN_SSD_SCALE_SMALL_OBJECTS")
    if small:
        if not small.isdigit():
            raise ValueError(
                f"MOONCAKE_SPAN_SSD_SCALE_SMALL_OBJECTS={small!r}: must be an object count >= 0"
            )
        changes["small_objects"] = int(small)
    return replace(config, **changes)


def _load() -> float:
    return os.getloadavg()[0]


def drop_page_cache() -> None:
    """Write back and drop the page cache, dentries and inodes (root only)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as fh:
            fh.write("3\n")
    except PermissionError:
        raise RuntimeError(_NOT_ROOT) from None


class Objects:
    """One step's keys and their sealed bytes: a random payload per step, each
    object sealed with its own key (so every seal differs)."""

    def __init__(self, step: str, count: int, object_bytes: int, seed: int) -> None:
        self.names = [f"ssdscale-{step}-{i:07d}" for i in range(count)]
        self.payload = random.Random(seed).randbytes(object_bytes - seal.TRAILER_BYTES)
        self.object_bytes = object_bytes

    def sealed(self, name: str) -> bytes:
        return self.payload + seal.trailer_bytes(name, self.payload)

    def part(self, start: int, stop: int) -> Objects:
        """The same objects' keys ``start:stop``, with the same bytes."""
        part = Objects.__new__(Objects)
        part.names = self.names[start:stop]
        part.payload, part.object_bytes = self.payload, self.object_bytes
        return part


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def _field(number: int, value: int | bytes) -> bytes:
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def write_directly(directory: Path, objects: Objects, tenant: bytes = b"default") -> float:
    """Write ``objects`` into a stopped node's directory as the 0.3.13.post1 wheel
    lays them out (one key per bucket, ids after the largest there); seconds taken."""
    started = time.monotonic()
    ids = [int(n.split(".")[0]) for n in os.listdir(directory) if n.endswith(".meta")]
    next_id = max(ids, default=1 << 40) + 1
    for offset, name in enumerate(objects.names):
        stored_key = tenant + b"\0" + name.encode()
        data = objects.sealed(name)
        shape = _field(2, len(stored_key)) + _field(3, len(data))
        meta = _field(1, len(stored_key) + len(data)) + _field(2, stored_key) + _field(3, shape)
        stem = directory / str(next_id + offset)
        with open(f"{stem}.bucket", "wb") as fh:
            fh.write(stored_key + data)
        with open(f"{stem}.meta", "wb") as fh:
            fh.write(meta)
    return time.monotonic() - started


class Writer:
    """A bare client putting sealed objects from one registered buffer."""

    def __init__(self, cluster: LocalCluster, largest_bytes: int) -> None:
        self.store = raw_client(cluster.client_config())
        self.slot_bytes = largest_bytes
        self._buffer = ctypes.create_string_buffer(BATCH_OBJECTS * largest_bytes)
        self.ptr = ctypes.addressof(self._buffer)
        rc = self.store.register_buffer(self.ptr, BATCH_OBJECTS * largest_bytes)
        if rc != 0:
            raise RuntimeError(f"register_buffer returned {rc}")

    def put_all(self, objects: Objects) -> int:
        """Every object, batches again while the node refuses them (each copy stays
        pinned until the heartbeat has written it); returns the refused puts."""
        refused = 0
        for start in range(0, len(objects.names), BATCH_OBJECTS):
            names = objects.names[start : start + BATCH_OBJECTS]
            for i, name in enumerate(names):
                data = objects.sealed(name)
                ctypes.memmove(self.ptr + i * self.slot_bytes, data, len(data))
            ptrs = [self.ptr + i * self.slot_bytes for i in range(len(names))]
            sizes = [objects.object_bytes] * len(names)
            deadline = time.monotonic() + OFFLOAD_TIMEOUT_S
            while True:
                # Mooncake keeps an existing key and answers success: the whole batch again.
                codes = self.store.batch_put_from(names, ptrs, sizes)
                bad = sum(code != 0 for code in codes)
                if not bad:
                    break
                refused += bad
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{bad} puts refused for {OFFLOAD_TIMEOUT_S:.0f} s")
                time.sleep(PUT_RETRY_SLEEP_S)
        return refused

    def close(self) -> None:
        self.store.close()


def _metas(directory: Path) -> int:
    return sum(1 for e in os.scandir(directory) if e.name.endswith(".meta"))


def _wait_on_disk(directory: Path, count: int) -> None:
    deadline = time.monotonic() + OFFLOAD_TIMEOUT_S
    while _metas(directory) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {count} objects on disk after {OFFLOAD_TIMEOUT_S} s")
        time.sleep(1.0)


def _fill(cluster: LocalCluster, writer: Writer, objects: Objects, held: int) -> dict[str, Any]:
    directory = cluster.node_ssd_dir(0)
    load = _load()
    started = time.monotonic()
    refused = writer.put_all(objects)
    put_s = time.monotonic() - started
    _wait_on_disk(directory, held + len(objects.names))
    offload_s = time.monotonic() - started
    count = len(objects.names)
    return {
        "objects": count,
        "object_bytes": objects.object_bytes,
        "bytes": count * objects.object_bytes,
        "put_s": put_s,
        "refused_puts": refused,
        "offload_s": offload_s,
        "offload_objects_per_s": count / offload_s,
        "offload_mb_per_s": count * objects.object_bytes / offload_s / 1e6,
        "load_1min": [load, _load()],
    }


def _disk(directory: Path) -> dict[str, Any]:
    names = os.listdir(directory)
    objects = sum(n.endswith(".meta") for n in names)
    used = subprocess.run(
        ["du", "-sb", "--apparent-size", str(directory)], capture_output=True, text=True, check=True
    )
    blocks = subprocess.run(["du", "-sB1", str(directory)], capture_output=True, text=True)
    return {
        "files": len(names),
        "objects": objects,
        "files_per_object": len(names) / max(1, objects),
        "apparent_bytes": int(used.stdout.split()[0]),
        "disk_bytes": int(blocks.stdout.split()[0]),
    }


def _listing(directory: Path) -> dict[str, Any]:
    """Cold listing of the directory: names alone, then names with a stat each."""
    drop_page_cache()
    started = time.monotonic()
    names = os.listdir(directory)
    listdir_s = time.monotonic() - started
    drop_page_cache()
    started = time.monotonic()
    total = 0
    for entry in os.scandir(directory):
        total += entry.stat().st_size
    stat_s = time.monotonic() - started
    return {"entries": len(names), "listdir_s": listdir_s, "scandir_stat_s": stat_s}


class Node:
    """The storage node on the tier's directory, started by hand per check mode."""

    def __init__(self, cluster: LocalCluster, config: SsdScaleConfig) -> None:
        self.cluster = cluster
        self.config = config
        self.root = Path(cluster.spec.ssd_dir).absolute()

    def start(self, mode: str) -> tuple[L.LocalProcess, float]:
        spec = self.cluster.spec
        ssd = L.NodeSsdArgs(
            root=self.root,
            node_name="node0",
            cap_bytes=spec.ssd_size_bytes,
            admin_url=self.cluster.metrics_url,
            check=mode,
        )
        argv = L.storage_node_argv(
            master=self.cluster.master_address,
            metadata=self.cluster.metadata_server,
            segment_bytes=spec.storage_node_segment_bytes,
            local_buffer_bytes=spec.storage_node_local_buffer_bytes,
            host=spec.host,
            ssd=ssd,
        )
        env = {**os.environ, **self.cluster.client_env(), "PYTHONUNBUFFERED": "1"}
        log = self.cluster.log_dir / f"restart-{mode}.log"
        log.unlink(missing_ok=True)
        process = L.LocalProcess(f"restart-{mode}", argv, log, env)
        started = time.monotonic()
        process.start()
        L.wait_ready_line(process, started + READY_TIMEOUT_S)
        return process, time.monotonic() - started


def _ready_fields(process: L.LocalProcess) -> dict[str, str]:
    line = next(ln for ln in process.output_text().splitlines() if ln.startswith("READY "))
    return dict(part.split("=", 1) for part in line.split()[1:] if "=" in part)


def _check_seconds(process: L.LocalProcess) -> float | None:
    """The check's own seconds, from its summary line (``..., 1.23s``); None with ``off``."""
    found = _CHECK_LINE.search(process.output_text())
    return float(found.group(1)) if found else None


def _sample_reads(store: Any, steps: list[Objects]) -> dict[str, int]:
    """A sample of every step's keys, read back and compared with their sealed bytes."""
    rng = random.Random(7)
    exact = wrong = missing = 0
    for objects in steps:
        for name in rng.sample(objects.names, min(SAMPLE_KEYS // len(steps), len(objects.names))):
            data = store.get(name)
            if not data:
                missing += 1
            elif bytes(data) == objects.sealed(name):
                exact += 1
            else:
                wrong += 1
    return {"exact": exact, "wrong": wrong, "missing": missing}


def _restarts(
    node: Node, reader: Any, steps: list[Objects], modes: tuple[str, ...]
) -> dict[str, Any]:
    out = {}
    for mode in modes:
        drop_page_cache()
        load = _load()
        process, ready_s = node.start(mode)
        try:
            fields = _ready_fields(process)
            out[mode] = {
                "ready_s": ready_s,
                "check_s": _check_seconds(process),
                "mooncake_setup_s": float(fields.get("setup_s", "nan")),
                "reads": _sample_reads(reader, steps),
                "load_1min": [load, _load()],
            }
            logger.info("restart with the %s check: %s", mode, out[mode])
        finally:
            L.terminate([process], signal.SIGTERM, 120.0)
    return out


def _fill_small(
    cluster: LocalCluster, writer: Writer, small: Objects, held: int, config: SsdScaleConfig
) -> dict[str, Any]:
    """Offload the first ``offloaded_objects``, write all but the last as many
    straight to the stopped node's directory, offload the last ones."""
    count, n = len(small.names), config.offloaded_objects
    cluster.restart_storage_node(0)
    first = _fill(cluster, writer, small.part(0, n), held)
    cluster.kill_storage_node(0, signal.SIGTERM)
    written_s = write_directly(cluster.node_ssd_dir(0), small.part(n, count - n))
    started = time.monotonic()
    cluster.restart_storage_node(0)  # registers the directory: the default check
    registered_s = time.monotonic() - started
    last = _fill(cluster, writer, small.part(count - n, count), held + count - n)
    return {
        "fill": first,
        "written_directly": {"objects": count - 2 * n, "s": written_s},
        "node_start_warm_s": registered_s,
        "fill_at_full_directory": last,
    }


def _cluster_spec(config: SsdScaleConfig) -> ClusterSpec:
    return ClusterSpec(
        storage_nodes=1,
        storage_node_segment_bytes=config.segment_bytes,
        ssd_dir=config.work_dir / "ssd",
        log_dir=config.work_dir / "logs",
        start_timeout_s=READY_TIMEOUT_S,
        stop_timeout_s=120.0,
    )


def run_ssd_scale_bench(config: SsdScaleConfig) -> dict[str, Any]:
    drop_page_cache()  # fails early without root
    started = time.monotonic()
    shutil.rmtree(config.work_dir, ignore_errors=True)
    (config.work_dir / "ssd").mkdir(parents=True)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    result: dict[str, Any] = {
        "bench": "ssd_scale",
        "config": {**asdict(config), "work_dir": str(config.work_dir)},
        "cpus": os.cpu_count(),
        "steps": [],
    }
    large = Objects("large", config.large_objects, config.large_object_bytes, seed=1)
    small = Objects("small", config.small_objects, config.small_object_bytes, seed=2)
    steps = (large, small) if config.small_objects else (large,)
    try:
        with LocalCluster(_cluster_spec(config)) as cluster:
            directory = cluster.node_ssd_dir(0)
            node = Node(cluster, config)
            writer = Writer(cluster, config.large_object_bytes)
            try:
                held: list[Objects] = []
                for objects in steps:
                    if objects is large:
                        step = {"fill": _fill(cluster, writer, objects, 0)}
                    else:
                        step = _fill_small(cluster, writer, objects, len(large.names), config)
                    held.append(objects)
                    cluster.kill_storage_node(0, signal.SIGTERM)  # graceful: unmount, close
                    step["disk"] = _disk(directory)
                    step["listing"] = _listing(directory)
                    step["restart"] = _restarts(node, writer.store, held, config.modes)
                    result["steps"].append(step)
                    logger.info("step done: %s", json.dumps(step))
            finally:
                writer.close()
    finally:
        if not config.keep:
            shutil.rmtree(config.work_dir / "ssd", ignore_errors=True)
    result["per_gb_and_object"] = _rates(result["steps"])
    result["date_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    result["wall_s"] = time.monotonic() - started
    return result


def _rates(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Restart seconds per GB on the tier and per million objects, per mode and step."""
    out: dict[str, Any] = {}
    for step in steps:
        gb = step["disk"]["apparent_bytes"] / 1e9
        objects = step["disk"]["objects"]
        for mode, row in step["restart"].items():
            out.setdefault(mode, []).append(
                {
                    "tier_gb": gb,
                    "objects": objects,
                    "ready_s": row["ready_s"],
                    "ready_s_per_gb": row["ready_s"] / gb,
                    "ready_s_per_million_objects": row["ready_s"] / objects * 1e6,
                }
            )
    return out


def format_ssd_scale(result: dict[str, Any]) -> str:
    lines = []
    for step in result["steps"]:
        fill, disk, listing = step["fill"], step["disk"], step["listing"]
        lines.append(
            f"tier {disk['apparent_bytes'] / 1e9:.1f} GB, {disk['objects']} objects, "
            f"{disk['files_per_object']:.2f} files/object; this step offloaded "
            f"{fill['objects']} x {fill['object_bytes']} B at {fill['offload_objects_per_s']:.0f} "
            f"objects/s ({fill['offload_mb_per_s']:.1f} MB/s); cold listing "
            f"{listing['listdir_s']:.2f} s, with stat {listing['scandir_stat_s']:.2f} s"
        )
        if "fill_at_full_directory" in step:
            last = step["fill_at_full_directory"]
            lines.append(
                f"  {last['objects']} more offloaded into the full directory at "
                f"{last['offload_objects_per_s']:.0f} objects/s; "
                f"{step['written_directly']['objects']} written straight to disk"
            )
        for mode, row in step["restart"].items():
            check_s = row["check_s"]
            lines.append(
                f"  restart, {mode} check: ready in {row['ready_s']:.1f} s "
                f"({row['ready_s'] / (disk['apparent_bytes'] / 1e9):.3f} s/GB; check "
                f"{'-' if check_s is None else f'{check_s:.1f}'} s, Mooncake setup "
                f"{row['mooncake_setup_s']:.1f} s); sample reads {row['reads']}"
            )
    return "\n".join(lines)


def run_ssd_scale_command(quick: bool, json_path: str | None) -> int:
    result = run_ssd_scale_bench(config_from_env(quick, os.environ))
    print(format_ssd_scale(result), flush=True)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {json_path}", flush=True)
    bad = sum(
        row["reads"]["wrong"] + row["reads"]["missing"]
        for step in result["steps"]
        for row in step["restart"].values()
    )
    return 1 if bad else 0
