"""doctor's view of this host for one sglang rank: the check records, and the checks
of the deployment (this rank's NIC from the device_name map, memory over the local
ranks, memlock over what one rank registers)."""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass, field
from typing import Any

from mooncake_span.mooncake_settings import MooncakeSettings, RankInfo

_IB_PATH = "/sys/class/infiniband"
PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str | None = None
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Context:
    settings: MooncakeSettings | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    admin_url: str | None = None
    native_log: str | None = None
    deadline: float = 0.0
    # The layout-guard key of doctor --model (and --tag); None without --model.
    guard_key: str | None = None
    failed: set[str] = field(default_factory=set)
    # The rank whose settings were resolved, and how many ranks of the server share this host.
    ranks: RankInfo = field(default_factory=RankInfo)
    local_ranks: int = 1
    # Host KV pool bytes per rank (sglang's --hicache-size), registered too; 0 = unknown.
    host_pool_bytes: int = 0
    # The backend's staging arena (span_staging_buffer_size), registered once per rank.
    staging_bytes: int = 0
    # tp_rank -> the NIC the device_name map gives it, for the other local ranks.
    rank_devices: dict[int, str] = field(default_factory=dict)
    ib_path: str = _IB_PATH
    # doctor --ssd-dir: a storage node's SSD directory to check (ops/doctor_ssd.py),
    # and --segment-bytes: that node's segment (0: the config's).
    ssd_dir: str | None = None
    ssd_segment_bytes: int = 0

    def remaining_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


def _meminfo() -> dict[str, int]:
    info = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    info[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return info


def _nics(device_name: str) -> list[str]:
    return [d.strip() for d in device_name.replace(";", ",").split(",") if d.strip()]


def check_device(ctx: Context) -> list[Check]:
    """This rank's NIC (from a device_name map: the entry for its tp_rank) exists here."""
    s = ctx.settings
    if s.protocol != "rdma":
        return [Check("device", PASS, f"protocol {s.protocol}: no RDMA device needed")]
    root = ctx.ib_path
    devices = sorted(os.listdir(root)) if os.path.isdir(root) else []
    rank = ctx.ranks.tp_rank
    wanted = _nics(s.device_name)
    missing = [d for d in wanted if d not in devices]
    data = {"tp_rank": rank, "device_name": s.device_name, "present": devices}
    if not devices or missing:
        check = Check(
            "rdma device",
            FAIL,
            f"tp_rank {rank}: device_name gives {wanted or 'none (auto)'}, missing "
            f"{missing or wanted or 'any'}; {root} holds {devices or 'no device'}",
            "install the RDMA driver / correct this rank's entry of the device_name map "
            "(a listed device), or use protocol tcp",
            data,
        )
    elif not wanted:
        check = Check(
            "rdma device",
            WARN,
            f"tp_rank {rank}: device_name names no NIC (empty, or the map leaves this rank "
            f"out): Mooncake picks one of {devices} itself",
            'map every rank to its own NIC: device_name = {"0": "mlx5_0", "1": "mlx5_1", ...}',
            data,
        )
    else:
        check = Check(
            "rdma device", PASS, f"tp_rank {rank}: {wanted} present in {root}", None, data
        )
    checks = [check]
    others = {r: d for r, d in ctx.rank_devices.items() if r != rank}
    absent = {r: d for r, d in others.items() if not d or any(n not in devices for n in _nics(d))}
    if absent:
        checks.append(
            Check(
                "rdma device (other ranks)",
                WARN,
                f"local ranks whose NIC is missing here or unnamed: {absent}",
                "fix those entries of the device_name map",
                {"absent": absent},
            )
        )
    pages = _meminfo().get("HugePages_Total", 0)
    checks.append(Check("hugepages", PASS, f"{pages} huge pages configured (optional)"))
    return checks


def _registered(ctx: Context) -> tuple[int, str]:
    """The bytes one rank registers, and their terms as both checks word them."""
    s = ctx.settings
    terms = {
        "segment": s.global_segment_size_bytes,
        "buffer": s.local_buffer_size_bytes,
        "staging": ctx.staging_bytes,
    }
    if ctx.host_pool_bytes:
        terms["host pools"] = ctx.host_pool_bytes
    return sum(terms.values()), " + ".join(f"{name} {size}" for name, size in terms.items())


def check_memlock(ctx: Context) -> list[Check]:
    """RLIMIT_MEMLOCK is per process, and each rank is a process registering its own memory."""
    if ctx.settings.protocol != "rdma":
        return [Check("memlock", PASS, f"protocol {ctx.settings.protocol}: nothing is pinned")]
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    need, terms = _registered(ctx)
    unknown = "" if ctx.host_pool_bytes else " (host pools unknown)"
    what = f"{terms}{unknown} = {need} bytes per rank"
    limited = soft != resource.RLIM_INFINITY
    data = {"limit_bytes": soft if limited else None, "need_bytes": need}
    if limited and soft < need:
        fix = "ulimit -l unlimited (or LimitMEMLOCK=infinity / --ulimit memlock=-1 in containers)"
        return [Check("memlock", FAIL, f"memlock limit {soft} bytes < {what}", fix, data)]
    limit = f"{soft} bytes" if limited else "unlimited"
    return [Check("memlock", PASS, f"memlock limit {limit} covers {what}", None, data)]


def check_memory(ctx: Context) -> list[Check]:
    """Every local rank's segment share, buffer and host pools against free host memory."""
    per_rank, terms = _registered(ctx)
    need = per_rank * ctx.local_ranks
    available = _meminfo().get("MemAvailable")
    if available is None:
        return [Check("memory", SKIP, "MemAvailable unknown")]
    detail = (
        f"{terms} bytes per rank x {ctx.local_ranks} local ranks = {need} bytes vs {available} "
        "bytes available"
    )
    data = {"need_bytes": need, "per_rank_bytes": per_rank, "available_bytes": available}
    fix = "lower global_segment_size (per server, split over tp x pp) or free memory"
    if need > available:
        return [Check("memory", FAIL, detail, fix, data)]
    if need > 0.8 * available:
        return [Check("memory", WARN, detail, "leave headroom: " + fix, data)]
    return [Check("memory", PASS, detail, None, data)]
