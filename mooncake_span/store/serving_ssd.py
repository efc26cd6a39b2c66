"""A serving client's view of Mooncake's SSD tier: its one owner, ``ServingSsd``.

This rank's own tier (sglang's ``enable_ssd_offload``), an owner's read buffer that
takes all of a call's objects or none, an owner down but not yet expired, and disk
owners that only the master's admin server names: docs/operating.md, "Reads" and
"Known upstream issues". The native calls are made in ``gate.py``, which hands the answers in.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any

from mooncake_span.errors import ConfigError, ErrorCode, SetupError
from mooncake_span.mooncake_settings import MooncakeSettings
from mooncake_span.span.plan import PlanBatch
from mooncake_span.store import ssd_tier
from mooncake_span.store.gate import NativeGate
from mooncake_span.store.router import FailureLedger
from mooncake_span.store.ssd_scan import check_directory, resolve_check

logger = logging.getLogger(__name__)

# Plain ints: a get's codes are scanned per object, and an enum member costs 3x there.
OVERFLOW = int(ErrorCode.BUFFER_OVERFLOW)
OWNER_RPC_FAILED = int(ErrorCode.RPC_FAIL)
# The client's counter (failed_objects_total{code=...}) of reads from an SSD owner that was down.
OWNER_DOWN_LABEL = "SSD_OWNER_DOWN"

# Per object key, the segments whose SSD holds it, given the admin URL (None: no answer).
ListDiskOwners = Callable[[str, Sequence[str]], dict[str, set[str]] | None]
# A call's native codes, given its object keys and their buffers.
GetCall = Callable[[list[str], PlanBatch], list[int]]


def disk_only(found: Mapping[str, Sequence[Any]] | None) -> set[str]:
    """Object keys whose replicas (``batch_get_replica_desc``) are all on an owner's disk."""
    return {
        key
        for key, replicas in (found or {}).items()
        if replicas and all(replica.is_local_disk_replica() for replica in replicas)
    }


def open_serving_tier(
    directory: str,
    largest_object_bytes: int,
    environ: MutableMapping[str, str],
    list_segments: Callable[[], list[str] | None] | None,
    client_ttl_s: float = 10.0,
) -> ssd_tier.DirLock:
    """A serving rank's own tier: a storage node's checks, lock, wait after a crash and
    settings (those the operator exported win unless they would keep objects off the
    disk). Returns the held lock; ConfigError for a bad or busy directory, or settings
    that persist nothing.
    """
    parent, name = os.path.split(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)  # as sglang's MooncakeStore does
    ssd_tier.check_root(parent, "ssd_offload_path")
    ssd_tier.process_dir(parent, name, "ssd_offload_path")
    largest = largest_object_bytes or 256 << 20  # a pure reader offloads nothing of its own
    tier = ssd_tier.SsdTier(
        directory=os.path.join(parent, name),
        cap_bytes=ssd_tier.int_setting(environ.get(ssd_tier.CAP_ENV), 0)
        or ssd_tier.default_cap_bytes(parent),
        largest_object_bytes=largest,
    )
    for env_name, value in tier.native_env().items():
        environ.setdefault(env_name, value)
    problems = ssd_tier.layout_problems(environ, largest)
    if problems:
        raise ConfigError("enable_ssd_offload would persist nothing: " + "; ".join(problems))
    lock = ssd_tier.DirLock(parent, name)
    previous = lock.acquire(tier.directory)
    try:
        check_directory(tier.directory, resolve_check(None, environ)[0])
    except BaseException:
        lock.release()
        raise
    if ssd_tier.crashed(previous):
        logger.warning(
            "mooncake-span: the previous owner of %s (pid %s) did not stop cleanly; waiting for "
            "the master to drop it (at most %.0f s)",
            tier.directory,
            previous.get("pid"),
            client_ttl_s + ssd_tier.EXPIRY_MARGIN_S,
        )
        ssd_tier.wait_for_owner_expiry(previous, client_ttl_s, list_segments)
    return lock


class ServingSsd:
    """The SSD tier as one client meets it: its own directory, owners' read buffers,
    owners that are down, where disk replicas are, and the owner reads it made."""

    def __init__(self, gate: NativeGate, ledger: FailureLedger) -> None:
        self._gate = gate  # its counters and its "the cluster answered"
        self._ledger = ledger
        self._lock: ssd_tier.DirLock | None = None  # this rank's SSD directory, if it has one
        self._stop_wait_s = 0.0
        self._admin_url: str | None = None
        self._list_disk_owners: ListDiskOwners | None = None
        self.read_rpcs = 0  # Mooncake's count of reads it asked an SSD owner for

    # ---- this rank's own tier ----------------------------------------------------------

    @contextlib.contextmanager
    def opened(
        self,
        settings: MooncakeSettings,
        admin_url: str | None,
        list_segments: Callable[[str], list[str] | None],
        list_disk_owners: ListDiskOwners,
    ) -> Iterator[None]:
        """Around ``setup``: with ``enable_ssd_offload``, check and lock this rank's directory
        first (``open_serving_tier``) and learn where to ask for disk owners; release the
        directory if ``setup`` fails (a later start must find it free)."""
        self._admin_url = admin_url
        self._list_disk_owners = list_disk_owners
        if settings.enable_ssd_offload:
            # Without ssd_offload_path Mooncake reads this variable itself, as under
            # sglang's MooncakeStore.
            directory = settings.ssd_offload_path or os.environ.get(
                "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", ""
            )
            if not directory:
                raise SetupError(
                    "enable_ssd_offload needs a directory: set ssd_offload_path (each rank then "
                    "uses its own rank_<dp>_<tp>_<pp>_<cp> sub-directory, as in sglang)"
                )
            lister = (lambda: list_segments(admin_url)) if admin_url else None
            try:
                self._lock = open_serving_tier(
                    directory, settings.global_segment_size_bytes, os.environ, lister
                )
            except (ConfigError, OSError) as exc:
                raise SetupError(f"SSD tier ({directory}): {exc}") from exc
        try:
            # A rank without a segment of its own (a pure reader) offloads nothing.
            if self._lock is not None and settings.global_segment_size_bytes > 0:
                try:
                    self._stop_wait_s = ssd_tier.resolve_stop_wait_s(None, os.environ)
                except ConfigError as exc:
                    raise SetupError(f"SSD tier: {exc}") from exc
            yield
        except BaseException:
            self.release()
            raise

    @property
    def owns_directory(self) -> bool:
        return self._lock is not None

    def running(self, segment: str) -> None:
        """``setup`` succeeded: the directory's record names this process's segment."""
        if self._lock is not None:
            self._lock.update(state="running", segment=segment)

    def unmount(self, store: Any) -> str:
        """At close, before the native client closes: once what this rank accepted is
        written (bounded), the disk segment goes, so readers miss cleanly at once and a
        restart right after registers every key again. Returns the state ``release`` records."""
        if self._lock is None:
            return "stopped"
        quiet_s = ssd_tier.offload_quiet_s(os.environ)
        if self._stop_wait_s and not ssd_tier.wait_offloads_written(
            self._lock.directory, self._stop_wait_s, quiet_s
        ):
            logger.warning(
                "mooncake-span: %s still took offloads after %.0f s (%s); closing anyway: "
                "objects put in the last heartbeat may be lost",
                self._lock.directory,
                self._stop_wait_s,
                ssd_tier.STOP_WAIT_ENV,
            )
        return "stopped" if store.unmount_local_disk_segment(0) == 0 else "unmount-failed"

    def release(self, state: str = "stopped") -> None:
        if self._lock is not None:
            self._lock.release(state)

    # ---- reads -------------------------------------------------------------------------

    def read(self, get_call: GetCall, keys: list[str], batch: PlanBatch) -> list[int]:
        """``get_call``'s codes; objects an owner's read buffer could not take are asked
        again in halves."""
        codes = get_call(keys, batch)
        if OVERFLOW not in codes or len(keys) < 2:  # every get: one C-level scan
            return codes
        overflow = [i for i, code in enumerate(codes) if code == OVERFLOW]
        middle = len(overflow) // 2
        for half in filter(None, (overflow[:middle], overflow[middle:])):
            again = self.read(get_call, [keys[i] for i in half], batch.take(half))
            for i, code in zip(half, again, strict=True):
                codes[i] = code
        return codes

    def saw_owner_reads(self, cumulative: int) -> None:
        """Mooncake's cumulative count of reads it asked SSD owners for, per native client."""
        self.read_rpcs = max(self.read_rpcs, cumulative)

    def owners_down(
        self, object_keys: Sequence[str], codes: Sequence[int], replica_desc: Callable[..., Any]
    ) -> list[str]:
        """Reads that failed at the RPC layer (a dead master, or a dead owner): if the
        master answers and the objects had only disk replicas, their owner is down; the
        admin server names it and the ledger marks its segment. Without an owner to name,
        returns the keys to remember lost. The master is asked past the breaker: the
        failed read may just have opened it, and this RPC tells the two apart."""
        positions = [i for i, code in enumerate(codes) if code == OWNER_RPC_FAILED]
        if not positions:
            return []
        keys = [object_keys[i] for i in positions]
        found = replica_desc(keys, past_breaker=True)
        if not isinstance(found, dict):
            return []  # the master is down too: the breaker's business
        down = sorted(disk_only(found) & set(keys))
        if not down:
            return []
        self._gate.answered()  # a storage node is down, not the cluster
        self._gate.count(OWNER_DOWN_LABEL, len(down))
        segments = set().union(*self.owners(down).values())
        if not segments:
            return down
        self._ledger.owners_down(segments)
        return []

    # ---- where disk replicas are ---------------------------------------------------------

    def owners(self, object_keys: Sequence[str]) -> dict[str, set[str]]:
        """Per object, the segments whose SSD holds it ({} without an admin server)."""
        if self._admin_url is None or self._list_disk_owners is None or not object_keys:
            return {}
        return self._list_disk_owners(self._admin_url, list(object_keys)) or {}

    def add_disk_owners(self, found: Any, located: dict[str, set[str]]) -> dict[str, set[str]]:
        """``located`` (object -> segments) with the owners of objects found only on disk."""
        on_disk = [k for k in disk_only(found) if k not in located]
        for key, owners in self.owners(on_disk).items():
            located.setdefault(key, set()).update(owners)
        return located
