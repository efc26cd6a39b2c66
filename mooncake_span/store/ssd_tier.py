"""Mooncake's SSD tier (0.3.13.post1) set up so that every object reaches disk and is found again.

``SsdTier`` holds the native settings that persist every object; they and the directory
checks: docs/operating.md, "What the launcher sets, and why"; ``DirLock`` and the waits
around a crash and a stop: docs/operating.md, "Restart procedure".
Nothing here deletes or rewrites what is in an offload directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mooncake_span.errors import ConfigError

logger = logging.getLogger(__name__)

# The start-up checks (store/ssd_scan.py), here so the operator's commands need not import it.
CHECK_MODES = ("size", "full", "off")

# Mooncake's defaults where ours differ: heartbeat 10 s, read buffer 1.25 GiB.
HEARTBEAT_S = 1
DEFAULT_READ_BUFFER_BYTES = 256 << 20
# Mooncake keeps this much of the disk free, evicting its own objects first: a
# directory's usable capacity is its free space (plus what it holds) less this.
DISK_RESERVE_BYTES = 256 << 20
# A restart waits this much past the master's client_ttl for the old owner to expire.
EXPIRY_MARGIN_S = 2.0
_EXPIRY_POLL_S = 0.5
# How long a graceful stop waits for its offloads (wait_offloads_written).
DEFAULT_STOP_WAIT_S = 20.0
STOP_WAIT_ENV = "MOONCAKE_SPAN_SSD_STOP_WAIT_S"
_QUIET_POLL_S = 0.05

LAYOUT_ENV = "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR"
BUCKET_LAYOUT = "bucket_storage_backend"
KEYS_PER_BUCKET_ENV = "MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT"
BUCKET_BYTES_ENV = "MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES"
CAP_ENV = "MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE"
EVICTION_ENV = "MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY"
HEARTBEAT_ENV = "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS"
READ_BUFFER_ENV = "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES"


@dataclass(frozen=True)
class SsdTier:
    """One process's SSD tier: its own directory and the native settings that persist it."""

    directory: str
    cap_bytes: int
    # Bucket size limit: objects larger than this are never written.
    largest_object_bytes: int
    read_buffer_bytes: int = DEFAULT_READ_BUFFER_BYTES

    def __post_init__(self) -> None:
        if not os.path.isabs(self.directory):
            raise ConfigError(f"the SSD directory must be absolute, got {self.directory!r}")
        if self.largest_object_bytes <= 0:
            raise ConfigError(
                f"the largest object must be > 0 bytes, got {self.largest_object_bytes}"
            )
        if self.cap_bytes < self.largest_object_bytes:
            raise ConfigError(
                f"the SSD cap ({self.cap_bytes} bytes) is smaller than one object this process "
                f"may hold (up to {self.largest_object_bytes} bytes, its DRAM segment): such an "
                f"object could never be written; give --ssd-size at least "
                f"{self.largest_object_bytes} bytes (several times the segment, or the tier "
                "holds less than DRAM)"
            )
        if self.read_buffer_bytes < 1 << 20:
            raise ConfigError(
                f"the SSD read buffer must be at least 1mb, got {self.read_buffer_bytes} bytes; "
                "an object read from disk is staged in it whole"
            )

    def native_env(self) -> dict[str, str]:
        """The ``MOONCAKE_OFFLOAD_*`` variables Mooncake reads at ``setup``."""
        return {
            LAYOUT_ENV: BUCKET_LAYOUT,
            KEYS_PER_BUCKET_ENV: "1",
            BUCKET_BYTES_ENV: str(self.largest_object_bytes),
            CAP_ENV: str(self.cap_bytes),
            EVICTION_ENV: "fifo",
            HEARTBEAT_ENV: str(HEARTBEAT_S),
            READ_BUFFER_ENV: str(self.read_buffer_bytes),
        }


def default_cap_bytes(directory: str) -> int:
    """Mooncake's own default for the bucket layout: 90% of the disk holding ``directory``."""
    stats = os.statvfs(directory)
    return int(stats.f_blocks * stats.f_frsize * 0.9)


def free_bytes(directory: str) -> int:
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def held_bytes(directory: str) -> int:
    """Bytes of the files under ``directory`` (0 if it does not exist)."""
    total = 0
    for parent, _, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(parent, name))
    return total


def usable_bytes(directory: str, held: int = 0) -> int:
    """What Mooncake can keep in ``directory``: free space plus ``held`` (what the
    tier already holds there) less Mooncake's reserve; 0 when nothing."""
    return max(0, free_bytes(directory) + held - DISK_RESERVE_BYTES)


def check_room(
    usable: int, cap_bytes: int, largest_object_bytes: int, shown: str, flag: str = "--ssd-size"
) -> str | None:
    """ConfigError when ``usable`` bytes cannot hold one object of the process; the
    warning to give when the cap exceeds them (None when it does not)."""
    if usable < largest_object_bytes:
        raise ConfigError(
            f"{shown} has {usable} bytes usable (free space less Mooncake's "
            f"{DISK_RESERVE_BYTES >> 20} MiB reserve), less than one object this process may "
            f"hold ({largest_object_bytes} bytes): the SSD tier would keep nothing; free space "
            "or pick a larger disk"
        )
    if cap_bytes > usable:
        return (
            f"the SSD cap {flag} ({cap_bytes} bytes) exceeds what {shown} can hold: "
            f"{usable} bytes usable (free space plus what it holds, less Mooncake's "
            f"{DISK_RESERVE_BYTES >> 20} MiB reserve); the tier holds at most that"
        )
    return None


def check_root(path: str, flag: str = "--ssd-dir") -> str:
    """The absolute path of an existing, writable, real directory; ConfigError otherwise
    (never created, as its message says)."""
    root = os.path.abspath(path)
    if os.path.islink(root):
        raise ConfigError(
            f"{flag} {path!r} is a symbolic link, which Mooncake refuses; pass the directory it "
            f"points to ({os.path.realpath(root)!r})"
        )
    if not os.path.exists(root):
        raise ConfigError(
            f"{flag} {path!r} does not exist; create it on the SSD first (mkdir -p {root}); it "
            "is never created for you, so a typo cannot put the cache on the wrong disk"
        )
    if not os.path.isdir(root):
        raise ConfigError(f"{flag} {path!r} is not a directory; pass a directory on the SSD")
    _check_writable(root, flag, path)
    return root


def _check_writable(directory: str, flag: str, shown: str) -> None:
    # A probe file rather than os.access: root passes access() on read-only mounts.
    try:
        fd, probe = tempfile.mkstemp(prefix=".mooncake-span-probe-", dir=directory)
    except OSError as exc:
        raise ConfigError(
            f"{flag} {shown!r} is not writable by this process ({exc.strerror}); fix its owner "
            f"or mode (e.g. chown $(id -u) {directory}), or pick a writable directory"
        ) from None
    os.close(fd)
    os.unlink(probe)


def process_dir(root: str, name: str, flag: str = "--ssd-dir") -> str:
    """``root/name``, created if missing; refused when it is a symlink or not a directory."""
    if not name or name in (".", "..") or "/" in name or name.startswith("."):
        raise ConfigError(
            f"{name!r} cannot name a sub-directory of {flag}: use letters, digits, '-' or '_'"
        )
    directory = os.path.join(root, name)
    if os.path.islink(directory):
        raise ConfigError(
            f"{directory!r} is a symbolic link, which Mooncake refuses; replace it with the "
            "directory it points to"
        )
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ConfigError(f"{directory!r} exists and is not a directory; move it away")
    try:
        os.makedirs(directory, mode=0o750, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create {directory!r}: {exc.strerror}") from None
    _check_writable(directory, flag, directory)
    return directory


def layout_problems(environ: Mapping[str, str], largest_object_bytes: int | None) -> list[str]:
    """What in these ``MOONCAKE_OFFLOAD_*`` settings keeps objects off the disk, or the cap
    unenforced, each with its fix (an empty list: every object is persisted)."""
    layout = environ.get(LAYOUT_ENV, BUCKET_LAYOUT)
    if layout == "file_per_key_storage_backend":
        return [
            f"{LAYOUT_ENV}={layout} does not enforce its disk cap (Mooncake 0.3.13.post1 wrote "
            f"393 MB under a 128 MB cap); unset it: the bucket layout with one key per bucket "
            "enforces the cap"
        ]
    if layout != BUCKET_LAYOUT:
        return [f"{LAYOUT_ENV}={layout} is not a layout mooncake-span has measured; unset it"]
    problems = []
    # Mooncake's own defaults where the environment leaves a setting unset.
    keys = int_setting(environ.get(KEYS_PER_BUCKET_ENV), 500)
    if keys != 1:
        problems.append(
            f"{KEYS_PER_BUCKET_ENV}={keys}: a bucket that is not full at a heartbeat is reported "
            "failed and never written (Mooncake #3006; with the defaults nothing reached disk); "
            f"set {KEYS_PER_BUCKET_ENV}=1"
        )
    bucket_bytes = int_setting(environ.get(BUCKET_BYTES_ENV), 256 << 20)
    if largest_object_bytes and bucket_bytes < largest_object_bytes:
        problems.append(
            f"{BUCKET_BYTES_ENV}={bucket_bytes} is below the largest object this process may "
            f"hold ({largest_object_bytes} bytes), and larger objects are never written; set it "
            f"to at least {largest_object_bytes}"
        )
    return problems


def int_setting(text: str | None, default: int) -> int:
    try:
        return int(text) if text else default
    except ValueError:
        return default


class DirLock:
    """An exclusive ``flock`` on ``<root>/.<name>.lock`` (beside the directory, which
    Mooncake scans), held while a process uses ``root/name``. Its JSON record says who
    holds it, the segment, and whether the last owner stopped cleanly."""

    def __init__(self, root: str, name: str) -> None:
        self.directory = os.path.join(root, name)
        self.path = os.path.join(root, f".{name}.lock")
        self._fd: int | None = None
        self._record: dict[str, Any] = {}

    def acquire(self, what: str) -> dict[str, Any]:
        """Lock; the previous owner's record ({} if none). ConfigError when another
        running process holds it."""
        self._fd = self._lock(what)
        previous = _read_record(self._fd)
        self.update(pid=os.getpid(), state="starting", segment=None, started=time.time())
        return previous

    def check_free(self, what: str) -> None:
        """ConfigError if a running process holds the lock; changes nothing."""
        fd = self._lock(what)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def _lock(self, what: str) -> int:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_record(fd)
            os.close(fd)
            raise ConfigError(
                f"{what} is in use by another running process (pid {holder.get('pid', '?')}, "
                f"segment {holder.get('segment') or '?'}); give this one another directory or "
                f"--node-name, or stop that process first"
            ) from None
        return fd

    def update(self, **fields: Any) -> None:
        """Rewrite the record with these fields changed (only while locked)."""
        if self._fd is None:
            return
        self._record.update(fields)
        data = json.dumps(self._record, sort_keys=True).encode()
        os.lseek(self._fd, 0, os.SEEK_SET)
        os.ftruncate(self._fd, 0)
        os.write(self._fd, data)
        os.fsync(self._fd)

    def release(self, state: str = "stopped") -> None:
        if self._fd is None:
            return
        self.update(state=state)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def resolve_stop_wait_s(flag: float | None, environ: Mapping[str, str]) -> float:
    """How long a graceful stop waits for its offloads: ``--ssd-stop-wait-s``, then
    ``MOONCAKE_SPAN_SSD_STOP_WAIT_S``, then 20 s. ConfigError names a bad value."""
    if flag is not None:
        text, source = str(flag), "--ssd-stop-wait-s"
    elif environ.get(STOP_WAIT_ENV):
        text, source = environ[STOP_WAIT_ENV], STOP_WAIT_ENV
    else:
        return DEFAULT_STOP_WAIT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ConfigError(
            f"{source} must be a number of seconds >= 0 (0 stops at once, losing what is not "
            f"on disk yet), got {text!r}"
        )
    return value


def offload_quiet_s(environ: Mapping[str, str]) -> float:
    """Two offload heartbeats, as this process runs them: how long a directory stays
    unchanged before a stop takes its offloads as finished."""
    return 2.0 * int_setting(environ.get(HEARTBEAT_ENV), HEARTBEAT_S)


def wait_offloads_written(
    directory: str,
    limit_s: float,
    quiet_s: float,
    *,
    stamp: Callable[[], int] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Before a graceful stop unmounts the disk segment (the master refuses a disk replica
    registered after it): wait until what this process holds unwritten is on disk and
    registered; False if ``limit_s`` ran out.

    Writing an object renames its ``.meta`` into ``directory``, changing its mtime (one
    ``stat``, whatever the file count), and registration follows within milliseconds; so
    a directory unchanged for ``quiet_s`` (two heartbeats) means a heartbeat found nothing
    left. Why: docs/reliability.md, "What a graceful restart keeps".
    """
    stamp = stamp or (lambda: os.stat(directory).st_mtime_ns)
    started_s = quiet_since_s = clock()
    try:
        last = stamp()
        while clock() - quiet_since_s < quiet_s:
            if clock() - started_s >= limit_s:
                return False
            sleep(_QUIET_POLL_S)
            current = stamp()
            if current != last:
                last, quiet_since_s = current, clock()
    except OSError as exc:  # the directory is gone: nothing tells when offloads end
        logger.warning("cannot watch %s for offloads (%s)", directory, exc)
        return False
    return True


def _read_record(fd: int) -> dict[str, Any]:
    os.lseek(fd, 0, os.SEEK_SET)
    try:
        record = json.loads(os.read(fd, 1 << 16) or b"{}")
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def crashed(previous: Mapping[str, Any]) -> bool:
    """Whether the previous owner of a directory stopped without releasing its disk
    segment (a crash, or an unmount the master did not confirm)."""
    return bool(previous) and previous.get("state") != "stopped"


def wait_for_owner_expiry(
    previous: Mapping[str, Any],
    client_ttl_s: float,
    list_segments: Callable[[], list[str] | None] | None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> float:
    """After a crash, wait until the master no longer lists the dead owner's segment
    (at most ``client_ttl_s`` plus a margin); without a segment list, wait the whole
    bound. Returns the seconds waited."""
    started = clock()
    bound_s = client_ttl_s + EXPIRY_MARGIN_S
    segment = previous.get("segment")
    if list_segments is None or not segment:
        sleep(bound_s)
        return clock() - started
    while clock() - started < bound_s:
        listed = list_segments()
        if listed is not None and segment not in listed:
            break
        sleep(_EXPIRY_POLL_S)
    return clock() - started
