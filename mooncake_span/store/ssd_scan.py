"""The check of an SSD directory before Mooncake registers what it holds.

Mooncake keeps no checksum on disk and ``remove`` leaves the file, so this deletes
the objects that could only ever be misses. The modes and their cost: docs/reliability.md,
"Integrity across restarts", and docs/operating.md, "Start-up time and files"; the
files read: docs/span-format.md, "The SSD tier's files".
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from mooncake_span.errors import ConfigError
from mooncake_span.store import seal
from mooncake_span.store.domains import COPY_SEPARATOR
from mooncake_span.store.ssd_tier import CHECK_MODES

logger = logging.getLogger(__name__)

DEFAULT_CHECK = "size"
# A serving rank's check (and a storage node's without --ssd-check).
CHECK_ENV = "MOONCAKE_SPAN_SSD_CHECK"
# Threads reading the directory's files at once: on a cold page cache each small file
# costs a disk round trip, and a device answers many at once.
READERS = 16
_CHUNK_METAS = 4096  # metas handed to the readers at a time, bounding what is queued


@dataclass
class ScanReport:
    buckets: int = 0
    checked_objects: int = 0  # sealed objects whose bytes were read and matched
    unsealed_objects: int = 0
    torn: list[str] = field(default_factory=list)  # object keys
    corrupt: list[str] = field(default_factory=list)
    unreadable_meta: int = 0
    orphan_buckets: int = 0  # bucket files without a .meta, deleted
    # Bytes of the object files kept (what the tier holds, without a walk of its own).
    kept_bytes: int = 0
    seconds: float = 0.0

    @property
    def removed(self) -> int:
        return len(self.torn) + len(self.corrupt)


def resolve_check(flag: str | None, environ: Mapping[str, str]) -> tuple[str, str]:
    """(the check mode, where it came from): the flag, else ``MOONCAKE_SPAN_SSD_CHECK``,
    else ``size``; ConfigError names a bad value and its source."""
    if flag is not None:
        mode, source = flag, "--ssd-check"
    elif environ.get(CHECK_ENV):
        mode, source = environ[CHECK_ENV], CHECK_ENV
    else:
        mode, source = DEFAULT_CHECK, "the default"
    if mode not in CHECK_MODES:
        raise ConfigError(f"{source}: the SSD check must be one of {CHECK_MODES}, got {mode!r}")
    return mode, source


@dataclass(frozen=True)
class _Entry:
    key: bytes  # as stored: tenant NUL key
    offset: int
    key_bytes: int
    data_bytes: int


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7


def _fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of a protobuf message: varints and length-delimited only."""
    at = 0
    while at < len(data):
        tag, at = _varint(data, at)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, at = _varint(data, at)
            yield number, value
        elif wire == 2:
            length, at = _varint(data, at)
            if at + length > len(data):
                raise ValueError("truncated field")
            yield number, data[at : at + length]
            at += length
        else:
            raise ValueError(f"wire type {wire}")


def parse_meta(data: bytes) -> tuple[int, list[_Entry]]:
    """(the bucket's data bytes, its objects) from a ``.meta`` file; ValueError if unreadable."""
    total = None
    keys: list[bytes] = []
    shapes: list[dict[int, int]] = []
    for number, value in _fields(data):
        if number == 1 and isinstance(value, int):
            total = value
        elif number == 2 and isinstance(value, bytes):
            keys.append(value)
        elif number == 3 and isinstance(value, bytes):
            shapes.append({n: v for n, v in _fields(value) if isinstance(v, int)})
    if total is None or not keys or len(keys) != len(shapes):
        raise ValueError("not a bucket meta")
    return total, [
        _Entry(key, shape.get(1, 0), shape.get(2, 0), shape.get(3, 0))
        for key, shape in zip(keys, shapes, strict=True)
    ]


def _object_key(stored_key: bytes) -> str:
    return stored_key.split(b"\0", 1)[-1].decode("utf-8", "surrogateescape")


def _sealed_ok(key: str, stored: memoryview) -> bool | None:
    """A copy's seal is its logical key's (store/domains.copy_key)."""
    verdict = seal.check_stored(key, stored)
    if verdict is False and COPY_SEPARATOR in key:
        head, _, copy = key.rpartition(COPY_SEPARATOR)
        if copy.isdigit():
            verdict = seal.check_stored(head, stored)
    return verdict


def _check_bucket(path: str, entries: list[_Entry]) -> ScanReport:
    found = ScanReport(buckets=1)
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        try:
            for entry in entries:
                start = entry.offset + entry.key_bytes
                key = _object_key(entry.key)
                verdict = _sealed_ok(key, view[start : start + entry.data_bytes])
                if verdict is None:
                    found.unsealed_objects += 1
                elif verdict:
                    found.checked_objects += 1
                else:
                    found.corrupt.append(key)
        finally:
            view.release()
    return found


def _read(path: str) -> bytes:
    # os.read, not open(): a file object costs 2.7 us more per .meta (6.8 vs 4.1 us,
    # warm cache), which a million-object start-up pays a million times.
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = [os.read(fd, 1 << 16)]
        while len(chunks[-1]) == 1 << 16:
            chunks.append(os.read(fd, 1 << 16))
        return b"".join(chunks)
    finally:
        os.close(fd)


def _bucket_bytes(bucket_path: str) -> int:
    try:
        return os.stat(bucket_path).st_size
    except FileNotFoundError:
        return -1  # its bucket is gone: nothing behind the key


def _inspect(meta_path: str, mode: str) -> ScanReport:
    """What one ``.meta`` and its bucket hold, read by a worker (deleted by the caller).
    The size check's common case costs one short read and one ``stat``: a start-up
    pays this per object."""
    bucket_path = meta_path[: -len(".meta")] + ".bucket"
    try:
        data = _read(meta_path)
    except OSError:
        return ScanReport(unreadable_meta=1)
    # Field 1, a varint (tag 0x08): the bucket's data bytes, first in every .meta.
    if mode != "full" and data[:1] == b"\x08":
        try:
            size = _bucket_bytes(bucket_path)
            if size >= _varint(data, 1)[0]:
                return ScanReport(buckets=1, kept_bytes=size + len(data))
        except ValueError:
            pass  # the full parse below says what it is
    try:
        total, entries = parse_meta(data)
    except ValueError:
        return ScanReport(unreadable_meta=1)
    size = _bucket_bytes(bucket_path)
    ends = max(e.offset + e.key_bytes + e.data_bytes for e in entries)
    if size < total or size < ends:
        return ScanReport(buckets=1, torn=[_object_key(e.key) for e in entries])
    if mode != "full":
        return ScanReport(buckets=1, kept_bytes=size + len(data))
    found = _check_bucket(bucket_path, entries)
    found.kept_bytes = 0 if found.corrupt else size + len(data)
    return found


def check_directory(directory: str, mode: str = DEFAULT_CHECK) -> ScanReport:
    """Delete the torn and orphaned (and, with ``full``, corrupt) objects of an SSD
    directory before Mooncake scans it; returns what was found."""
    if mode not in CHECK_MODES:
        raise ConfigError(f"the SSD check must be one of {CHECK_MODES}, got {mode!r}")
    report = ScanReport()
    if mode == "off":
        return report
    if mode == "full" and seal.xxhash is None:
        raise ConfigError(
            "the full SSD check reads object seals and needs the xxhash package: pip install "
            "xxhash, or check sizes only (--ssd-check size, MOONCAKE_SPAN_SSD_CHECK=size)"
        )
    started = time.monotonic()
    names = set(os.listdir(directory))
    metas = []
    for name in sorted(names):
        if name.endswith(".bucket") and name[: -len(".bucket")] + ".meta" not in names:
            report.orphan_buckets += 1
            _delete(os.path.join(directory, name))
        elif name.endswith(".meta"):
            metas.append(os.path.join(directory, name))
    with ThreadPoolExecutor(READERS, thread_name_prefix="ssd-check") as pool:
        for at in range(0, len(metas), _CHUNK_METAS):
            chunk = metas[at : at + _CHUNK_METAS]
            for meta_path, found in zip(
                chunk, pool.map(_inspect, chunk, itertools.repeat(mode)), strict=True
            ):
                _apply(meta_path, found, report)
    report.seconds = time.monotonic() - started
    _log(directory, mode, report)
    return report


def _apply(meta_path: str, found: ScanReport, report: ScanReport) -> None:
    # Field by field: a loop over fields() costs 2 us more per .meta, serially.
    report.buckets += found.buckets
    report.unreadable_meta += found.unreadable_meta
    report.checked_objects += found.checked_objects
    report.unsealed_objects += found.unsealed_objects
    report.torn += found.torn
    report.corrupt += found.corrupt
    report.kept_bytes += found.kept_bytes
    if found.removed:
        # One key per bucket (SsdTier): the whole pair goes.
        _delete(meta_path[: -len(".meta")] + ".bucket", meta_path)


def _delete(*paths: str) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _log(directory: str, mode: str, report: ScanReport) -> None:
    if report.removed or report.orphan_buckets:
        logger.warning(
            "SSD check (%s) of %s: deleted %d torn and %d corrupt object(s) and %d bucket(s) "
            "without a .meta before registering it (e.g. %s); they would only ever read as "
            "misses",
            mode,
            directory,
            len(report.torn),
            len(report.corrupt),
            report.orphan_buckets,
            (report.torn + report.corrupt)[:3],
        )
    logger.info(
        "SSD check (%s) of %s: %d buckets, %d sealed objects verified, %d without a seal, "
        "%d removed, %d metas left to Mooncake, %.2fs",
        mode,
        directory,
        report.buckets,
        report.checked_objects,
        report.unsealed_objects,
        report.removed,
        report.unreadable_meta,
        report.seconds,
    )
