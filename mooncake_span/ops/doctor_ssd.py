"""``doctor``'s SSD-tier checks, ``ssd tier`` and ``ssd master``: is an SSD tier asked for
(a rank's ``enable_ssd_offload`` or ``doctor --ssd-dir``), and would it persist anything?
What each FAILs on: docs/operating.md, "doctor and metrics"."""

from __future__ import annotations

import os
from typing import Any

from mooncake_span.errors import ConfigError, ErrorCode
from mooncake_span.ops.doctor_host import FAIL, PASS, SKIP, Check, Context
from mooncake_span.store import ssd_tier

_NAME = "ssd tier"
MASTER_CHECK = "ssd master"
# Mooncake refuses a segment below this: a storage node's segment, and so the
# largest object it may be sent, is at least this.
SMALLEST_SEGMENT_BYTES = 16 << 20


def ssd_requested(ctx: Context) -> bool:
    return bool(ctx.ssd_dir) or ctx.settings.enable_ssd_offload


def check_ssd(ctx: Context) -> list[Check]:
    if not ssd_requested(ctx):
        return [Check(_NAME, SKIP, "no SSD tier asked for (enable_ssd_offload, --ssd-dir)")]
    if ctx.ssd_dir:
        segment_bytes = ctx.ssd_segment_bytes or ctx.settings.global_segment_size_bytes
        return [_check_node_dir(ctx.ssd_dir, segment_bytes)]
    return _check_rank(ctx)


def _check_node_dir(root: str, segment_bytes: int) -> Check:
    """A storage node's directory, and whether its usable capacity holds one object of up
    to the node's segment (Mooncake's smallest when unknown), as the node itself demands."""
    try:
        path = ssd_tier.check_root(root)
    except ConfigError as exc:
        return Check(_NAME, FAIL, str(exc), "fix the directory as the message says")
    cap = ssd_tier.default_cap_bytes(path)
    usable = ssd_tier.usable_bytes(path, ssd_tier.held_bytes(path))
    if segment_bytes > 0:
        object_bytes, which = segment_bytes, f"the node's {segment_bytes}-byte segment"
    else:
        object_bytes = SMALLEST_SEGMENT_BYTES
        which = (
            f"the node's segment is not known, so Mooncake's smallest, {object_bytes} bytes "
            "(pass --segment-bytes as the node gets it)"
        )
    data = {
        "ssd_dir": path,
        "default_cap_bytes": cap,
        "usable_bytes": usable,
        "object_bytes": object_bytes,
    }
    reserve = f"Mooncake's {ssd_tier.DISK_RESERVE_BYTES >> 20} MiB reserve"
    if usable < object_bytes:
        detail = (
            f"{path}: {usable} bytes usable (free space plus what it holds, less {reserve}), "
            f"less than one object of up to {object_bytes} bytes ({which}): the tier would "
            "keep nothing that size, and a storage node with this segment refuses to start"
        )
        return Check(_NAME, FAIL, detail, "free space on that disk or pick a larger one", data)
    detail = (
        f"{path}: a writable directory; a storage node with --ssd-dir {root} uses "
        f"{path}/<node name>; {usable} bytes usable (free space plus what it holds, less "
        f"{reserve}; a --ssd-size above that holds no more), at least one object of up to "
        f"{object_bytes} bytes ({which}); default cap {cap} bytes (90% of the disk)"
    )
    return Check(_NAME, PASS, detail, None, data)


def _check_rank(ctx: Context) -> list[Check]:
    s = ctx.settings
    directory = s.ssd_offload_path or os.environ.get("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", "")
    if s.global_segment_size_bytes == 0:
        detail = (
            "enable_ssd_offload on a rank with global_segment_size 0 persists nothing: a "
            "rank offloads only the objects its own segment holds, and the storage nodes "
            "hold them"
        )
        fix = (
            "start the storage nodes with --ssd-dir DIR (and drop enable_ssd_offload here), "
            "or give this rank a segment"
        )
        return [Check(_NAME, FAIL, detail, fix)]
    if not directory:
        return [
            Check(_NAME, FAIL, "enable_ssd_offload without a directory", "set ssd_offload_path")
        ]
    tier = ssd_tier.SsdTier(
        directory=os.path.abspath(directory),
        cap_bytes=s.global_segment_size_bytes,
        largest_object_bytes=s.global_segment_size_bytes,
    )
    effective = {**tier.native_env(), **os.environ}
    problems = ssd_tier.layout_problems(effective, s.global_segment_size_bytes)
    if problems:
        return [
            Check(_NAME, FAIL, f"the layout would persist nothing: {p}", p.rpartition("; ")[2])
            for p in problems
        ]
    parent, name = os.path.split(os.path.abspath(directory))
    # The directory need not exist yet: check the nearest part of its path that does.
    existing = parent
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    try:
        ssd_tier.check_root(existing, "ssd_offload_path")
        if os.path.islink(os.path.join(parent, name)):
            raise ConfigError(f"{directory} is a symbolic link, which Mooncake refuses")
        if os.path.isdir(parent):
            ssd_tier.DirLock(parent, name).check_free(directory)
    except ConfigError as exc:
        return [Check(_NAME, FAIL, str(exc), "fix ssd_offload_path as the message says")]
    detail = (
        f"{directory}: writable, not in use; every object this rank's segment holds is "
        "written there one heartbeat after its put"
    )
    return [Check(_NAME, PASS, detail, data={"ssd_dir": directory})]


def master_check(reply: dict[str, Any]) -> Check:
    """What the probe's offload setup says about the master's --enable_offload."""
    if reply.get("setup_rc") == int(ErrorCode.UNABLE_OFFLOAD):
        return Check(
            MASTER_CHECK,
            FAIL,
            "the master refused an SSD-tier client (UNABLE_OFFLOAD, -1300): it runs without "
            "--enable_offload=true, and every SSD setup fails the same way",
            "restart mooncake_master with --enable_offload=true (mooncake-span cluster up "
            "--ssd-dir and the scripts' --ssd do), with --default_kv_lease_ttl=500",
        )
    if "error" in reply:
        return Check(MASTER_CHECK, SKIP, f"not known: the probe failed ({reply['error']})")
    return Check(MASTER_CHECK, PASS, "the master accepts SSD-tier clients (--enable_offload)")
