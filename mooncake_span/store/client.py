"""The only module that talks to Mooncake.

``MooncakeClient`` wraps one ``MooncakeDistributedStore`` and turns its native
conventions into plain Python ones, once:

* per-object results become ``bool`` (put: rc 0; get: exactly the planned
  bytes read; exists: 1); every other code is counted by name for ``stats()``;
* cluster-level failures (an exception, a wrong-length result, every entry an
  RPC-level code) raise ``TransportError`` and feed the circuit breaker; a
  TRANSFER_FAIL instead marks the failing segment's failure domain bad;
* ``router.py`` decides where objects go and which copies to read; a call of
  a healthy cluster goes out as the caller built it, in one native call, and
  otherwise calls carry at most ``max_buffers_per_call`` buffers and a get
  never names one key twice (Mooncake would leave a buffer unwritten);
* a no-space answer to a put pauses puts (``pressure.py``): they read False;
* after ``close()`` every method raises ``StoreClosedError`` (the native
  client segfaults if called after close).

Before ``setup`` the endpoints are probed with a short TCP connect (a dead etcd
blocks setup for minutes) and ``MC_TCP_STATUS_TIMEOUT_SEC`` /
``MC_STORE_CLIENT_SETUP_RETRIES`` get bounded defaults unless already set.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import operator
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from mooncake_span.config import MooncakeSettings, SpanOptions
from mooncake_span.errors import (
    ErrorCode,
    SetupError,
    StoreClosedError,
    TransportError,
    code_name,
    is_transport_failure,
)
from mooncake_span.span.plan import ObjectPlan, PlanBatch, dedup_rounds
from mooncake_span.store.breaker import BreakerSnapshot, CircuitBreaker
from mooncake_span.store.domains import copy_key, is_cluster_failure
from mooncake_span.store.integrity import IntegrityFailures
from mooncake_span.store.native import (
    REACHABILITY_TIMEOUT_S,
    NativeBinding,
    SharedEngine,
    _probe_tcp,
    native_env_defaults,
    prepare_native_env,
    replicate_config,
    setup_arguments,
    setup_store,
    wait_for_segments,
)
from mooncake_span.store.pressure import FULL_SKIPPED_LABEL, SKIPPED_CODE, PutPressure
from mooncake_span.store.probe import RecoveryProbe
from mooncake_span.store.router import DomainRouter
from mooncake_span.store.segments import SegmentDirectory, replica_segments, start_directory

logger = logging.getLogger(__name__)

# NativeBinding and native_env_defaults are imported from here by callers.
__all__ = ["MooncakeClient", "NativeBinding", "load_native_binding", "native_env_defaults"]

# Error counters live as long as the client and are keyed by code name, and an
# unknown native code gets a label of its own (CODE_<n>): past this many
# labels, new codes are counted together under _OTHER_CODES_LABEL. Bound: at
# most _MAX_ERROR_LABELS + 1 code labels plus the five fixed ones.
_MAX_ERROR_LABELS = 64
_OTHER_CODES_LABEL = "CODE_OTHER"


def load_native_binding() -> NativeBinding:
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except ImportError as exc:
        raise SetupError(
            "the Mooncake store client is not installed: pip install "
            "mooncake-transfer-engine-non-cuda (CPU/TCP) or mooncake-transfer-engine (GPU hosts), "
            "or install mooncake-span with the [cpu] or [cuda] extra"
        ) from exc
    return NativeBinding(MooncakeDistributedStore, ReplicateConfig, shares_process_env=True)


_CLOSE_DRAIN_TIMEOUT_S = 60.0
_EXISTS_KEYS_PER_CALL = 4096
_TRANSFER_FAIL = int(ErrorCode.TRANSFER_FAIL)
# Mooncake 0.3.13's put with group ids costs more per object the more objects
# one call carries: a 1024-object MHA put took 148 ms in one call and 46 ms in
# calls of 64 (32 ms without group ids); a 256-object one 23 vs 19 ms.
_GROUPED_PUT_OBJECTS = 64


class MooncakeClient:
    def __init__(
        self,
        settings: MooncakeSettings,
        options: SpanOptions,
        binding: NativeBinding | None = None,
        shared_engine: SharedEngine | None = None,
    ) -> None:
        self.settings = settings
        self.options = options
        self._binding = binding
        # A transfer engine this process already runs, reused when it serves the settings.
        self._shared_engine = shared_engine
        self._store: Any = None
        self._cond = threading.Condition()
        self._closed = False
        self._inflight = 0
        self._breaker = CircuitBreaker(options.breaker_failures)
        self._prober = RecoveryProbe(
            self._breaker, options.breaker_probe_interval_s, self._probe_once
        )
        self._counters: collections.Counter[str] = collections.Counter()
        self.pressure = PutPressure(options.full_cooldown_s)
        self._probe_key = f"mooncake-span-probe-{uuid.uuid4().hex}"
        self._directory: SegmentDirectory | None = None
        # Placement and failure domains; the backend sets router.domain_of.
        self.router = DomainRouter(options, self.segments)
        self._health, self._lost = self.router.health, self.router.lost
        self._copies = self.router.copies
        self._integrity = IntegrityFailures(
            lambda k: self._invoke_one("remove", lambda s: s.remove(k, True))
        )

    # ---- lifecycle -------------------------------------------------------

    def connect(self) -> None:
        """Set up the native client; SetupError says why it cannot."""
        s = self.settings
        binding = self._binding or load_native_binding()
        self._binding = binding
        prepare_native_env(s, self.options, binding.shares_process_env)
        endpoints = s.etcd_endpoints()
        if not s.master_server_address.startswith("etcd://"):
            endpoints.append(s.master_server_address)
        for endpoint in endpoints:
            _probe_tcp(endpoint, REACHABILITY_TIMEOUT_S)
        # span_master_admin_url overrides the master host on master_metrics_port.
        admin_url = self.options.master_admin_url or s.admin_url()
        if s.check_server:
            if admin_url is None:
                raise SetupError("check_server with an etcd master needs span_master_admin_url")
            wait_for_segments(admin_url, binding.list_segments)
        store = binding.store_factory()
        started = time.monotonic()
        setup_store(store, s, **setup_arguments(s, self._shared_engine))
        self._store = store
        if self.options.placement:
            self._directory = start_directory(admin_url, self.options, binding.list_segments)
        logger.info(
            "mooncake-span connected to master %s (metadata %s, protocol %s, device %r, "
            "tenant %r, segment %d bytes) in %.2fs",
            s.master_server_address,
            s.metadata_server,
            s.protocol,
            s.device_name,
            s.tenant_id,
            s.global_segment_size_bytes,
            time.monotonic() - started,
        )

    def segments(self) -> tuple[str, ...]:
        """The live segments placement chooses from (empty: Mooncake places objects)."""
        return self._directory.segments if self._directory is not None else ()

    def close(self) -> None:
        """Idempotent. Waits (bounded) for calls in flight, then closes the native client."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            if self._directory is not None:
                self._directory.stop()
            deadline = time.monotonic() + _CLOSE_DRAIN_TIMEOUT_S
            while self._inflight and time.monotonic() < deadline:
                self._cond.wait(timeout=0.5)
            leaked = self._inflight
        if leaked:
            # Closing under a running native call would crash the process;
            # leaking the client is the lesser evil.
            logger.error(
                "mooncake-span: %d calls still running at close; not closing the native client",
                leaked,
            )
            return
        if self._store is not None:
            self._store.close()

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- guarded native access ---------------------------------------------

    def _enter(self, op: str) -> Any:
        """Count a call in flight and hand out the native store, or raise why not."""
        with self._cond:
            if self._closed:
                raise StoreClosedError(f"{op} called after close()")
            if self._store is None:
                raise StoreClosedError(f"{op} called before connect()")
            if self._breaker.is_open:
                self._counters["BREAKER_REJECTED"] += 1
                raise TransportError(f"{op} refused: circuit breaker open (cluster unreachable)")
            self._inflight += 1
            return self._store

    def _leave(self) -> None:
        with self._cond:
            self._inflight -= 1
            if self._closed:  # only close() waits for calls in flight
                self._cond.notify_all()

    @contextmanager
    def _native(self, op: str) -> Iterator[Any]:
        store = self._enter(op)
        try:
            yield store
        finally:
            self._leave()

    def _record(self, op: str, codes: Sequence[int]) -> None:
        """Count non-success codes; a call where every entry is a cluster-level
        failure counts against the breaker, any other answer proves the master
        is alive (a dead storage node is a failure domain, not the cluster)."""
        if not codes or min(codes) >= 0:
            self._breaker.record_success()
            return
        for code in codes:
            if code < 0:
                label = code_name(code)
                if label not in self._counters and len(self._counters) >= _MAX_ERROR_LABELS:
                    label = _OTHER_CODES_LABEL
                self._counters[label] += 1
        if all(is_cluster_failure(c) for c in codes):
            self._fail(op, f"all {len(codes)} entries failed ({code_name(codes[0])})")
        else:
            self._breaker.record_success()

    def _fail(self, op: str, why: str) -> None:
        if self._breaker.record_failure(time.monotonic()):
            logger.warning(
                "mooncake-span: circuit breaker OPEN after %s failed: %s; answering misses until "
                "the cluster responds",
                op,
                why,
            )
            self._prober.start()

    def _invoke(self, op: str, fn: Callable[[Any], list[int]], expected_len: int) -> list[int]:
        store = self._enter(op)  # not _native(): a generator costs more on the hot path
        try:
            result = fn(store)
        except Exception as exc:  # the binding's own errors are whole-call failures
            self._counters["EXCEPTION"] += 1
            self._fail(op, repr(exc))
            raise TransportError(f"{op} raised {exc!r}") from exc
        finally:
            self._leave()
        if not isinstance(result, list) or len(result) != expected_len:
            # e.g. the empty list an uninitialised client returns
            self._counters["BAD_RESULT_LENGTH"] += 1
            self._fail(
                op,
                f"returned {type(result).__name__} of length "
                f"{len(result) if isinstance(result, list) else '?'}",
            )
            raise TransportError(
                f"{op} returned {len(result) if isinstance(result, list) else result!r} results "
                f"for {expected_len} keys"
            )
        self._record(op, result)
        return result

    def _invoke_one(self, op: str, fn: Callable[[Any], int]) -> int:
        """A native call answering one int code, with the error accounting of ``_invoke``."""
        return self._invoke(op, lambda s: [int(fn(s))], 1)[0]

    # ---- prober --------------------------------------------------------------

    def _probe_once(self) -> bool | None:
        """One existence query past the breaker: did the cluster answer? None once closed."""
        with self._cond:
            if self._closed:
                return None
            self._inflight += 1
        try:
            codes = self._store.batch_is_exist([self._probe_key])
            return isinstance(codes, list) and len(codes) == 1 and codes[0] in (0, 1)
        except Exception:  # the cluster is still down
            return False
        finally:
            self._leave()

    # ---- failure domains -------------------------------------------------------

    def _locate(
        self, object_keys: Sequence[str], sizes: dict[str, int] | None = None
    ) -> dict[str, set[str]]:
        """Where the master says objects are (one RPC); {} if it does not answer."""
        if not object_keys:
            return {}
        suppress = contextlib.suppress(TransportError, StoreClosedError)
        with suppress, self._native("batch_get_replica_desc") as store:
            try:
                return replica_segments(store.batch_get_replica_desc(list(object_keys)), sizes)
            except Exception:  # observation only: unknown means "treat as lost"
                logger.debug("batch_get_replica_desc failed", exc_info=True)
        return {}

    def _mark_failed_domains(self, op: str, planned_bytes: dict[str, int]) -> None:
        """Mark bad the segments holding objects a transfer just failed on, as the
        master locates them (placement may not have been followed). Only objects
        of exactly the planned size count: a read into larger buffers also gets
        -800, a wrong request and not a dead node."""
        located = self._locate(list(planned_bytes), planned_bytes)
        segments = set().union(*located.values())
        if not segments:
            return
        fresh = self._health.mark_bad(segments, time.monotonic())
        if fresh:
            logger.warning(
                "mooncake-span: %s failed on segment(s) %s; their keys read as misses for %.0fs",
                op,
                fresh,
                self.options.domain_bad_ttl_s,
            )
        if self._directory is not None:
            self._directory.wake()

    # ---- operations ------------------------------------------------------------

    def register_buffer(self, ptr: int, size_bytes: int) -> None:
        if size_bytes <= 0:
            return
        rc = self._invoke_one("register_buffer", lambda s: s.register_buffer(ptr, size_bytes))
        if rc != 0:
            raise SetupError(
                f"register_buffer(ptr={ptr:#x}, {size_bytes} bytes) failed with {rc} "
                f"({code_name(rc)})"
            )

    def _exists_codes(self, keys: list[str]) -> list[int]:
        out: list[int] = []
        for start in range(0, len(keys), _EXISTS_KEYS_PER_CALL):
            chunk = keys[start : start + _EXISTS_KEYS_PER_CALL]
            codes = self._invoke(
                "batch_is_exist", lambda s, keys=chunk: s.batch_is_exist(keys), len(chunk)
            )
            if all(is_transport_failure(code) for code in codes):
                # Nothing answered: a caller must not read this as "absent" and
                # follow up with a put that would wait just as long.
                raise TransportError(f"batch_is_exist: every key failed ({code_name(codes[0])})")
            out += codes
        return out

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Per key, whether a readable copy is stored. Keys whose restore failed
        recently, and keys whose every copy sits in a bad failure domain, are
        absent without asking the master."""
        if self._copies == 1 and not self._lost and not self._health.any_bad:
            return [code == 1 for code in self._exists_codes(list(keys))]  # the common case
        lost = self._lost.lost_mask(keys, time.monotonic())
        rows = self.router.read_rows(keys, self._locate)
        asked = [obj for i, row in enumerate(rows) if not lost[i] for obj in row]
        skipped = sum(1 for i, row in enumerate(rows) if not row and not lost[i])
        if skipped:
            self._counters["DOMAIN_BAD_SKIPPED"] += skipped
        if any(lost):
            self._counters["LOST_KEY_SKIPPED"] += sum(lost)
        found = dict(zip(asked, self._exists_codes(asked), strict=True)) if asked else {}
        return [
            not lost[i] and any(found.get(obj) == 1 for obj in row) for i, row in enumerate(rows)
        ]

    def put(
        self,
        keys: Sequence[str],
        plans: Sequence[ObjectPlan] | PlanBatch,
        group_ids: Sequence[str] | None = None,
        hard_pin: bool = False,
        domains: Sequence[str] | None = None,
    ) -> list[bool]:
        """Write objects that do not exist yet. Mooncake keeps the old value of an
        existing key and reports success, so callers check existence first.
        Objects with the same domain (``domains``, else ``router.domain_of``) land
        on the same segment. ``hard_pin`` exempts them from eviction (small
        metadata only). True only if every copy was written."""
        batch = PlanBatch.of(plans)
        if self.router.direct(keys):
            keys, codes = list(keys), [0] * len(keys)
            for segment, rows in self.router.direct_groups(keys, domains):
                if rows is None:
                    codes = self._put_part(keys, batch, group_ids, hard_pin, segment)
                    break
                groups = [group_ids[i] for i in rows] if group_ids else None
                part = self._put_part(
                    [keys[i] for i in rows], batch.take(rows), groups, hard_pin, segment
                )
                for i, code in zip(rows, part, strict=True):
                    codes[i] = code
            ok = [code == 0 for code in codes]
            self._lost.discard(k for k, good in zip(keys, ok, strict=True) if good)
            return ok
        first: dict[str, int] = {}
        unique = [i for i, k in enumerate(keys) if first.setdefault(k, i) == i]
        written = collections.Counter()
        mine = [domains[i] for i in unique] if domains is not None else None
        for segment, entries in self.router.put_groups([keys[i] for i in unique], mine).items():
            rows = [unique[j] for j, _ in entries]
            groups = [group_ids[i] for i in rows] if group_ids else None
            part = [k for _, k in entries]
            codes = self._put_part(part, batch.take(rows), groups, hard_pin, segment)
            for i, code in zip(rows, codes, strict=True):
                written[i] += code == 0
        ok = {i: written[i] == self._copies for i in unique}
        self._lost.discard(keys[i] for i in unique if ok[i])
        return [ok[first[k]] for k in keys]

    def _put_part(
        self,
        keys: list[str],
        batch: PlanBatch,
        group_ids: Sequence[str] | None,
        hard_pin: bool,
        segment: str,
    ) -> list[int]:
        """Objects onto one segment, in calls within the buffer budget. Every
        object failing to transfer there marks the segment bad."""
        codes: list[int] = []
        grouped = bool(group_ids) and self.options.group_ids
        for span in self.router.calls(batch, _GROUPED_PUT_OBJECTS if grouped else 0):
            if not hard_pin and self.pressure.cooling:  # the cluster is full: not sent
                self._counters[FULL_SKIPPED_LABEL] += len(span)
                codes += [SKIPPED_CODE] * len(span)
                continue
            part = batch.part(span)
            config = replicate_config(
                self._binding.replicate_config_factory,
                self.options.replica_num if self._copies == 1 else 1,
                group_ids[span.start : span.stop] if grouped else None,
                hard_pin,
                segment,
            )
            codes += self.pressure.record(
                self._invoke(
                    "batch_put_from_multi_buffers",
                    lambda s, k=keys[span.start : span.stop], p=part, c=config: (
                        s.batch_put_from_multi_buffers(k, p.ptrs, p.sizes, c)
                    ),
                    len(span),
                )
            )
        if segment and codes and all(c == _TRANSFER_FAIL for c in codes):
            if self._health.mark_bad([segment], time.monotonic()):
                logger.warning("mooncake-span: put failed on segment %s; avoiding it", segment)
        return codes

    def _get_codes(self, keys: Sequence[str], batch: PlanBatch) -> list[int]:
        """One read attempt per key: the native code (bytes read, or an error)."""
        out = [int(ErrorCode.INTERNAL_ERROR)] * len(keys)
        for round_positions in dedup_rounds(keys):
            rows = batch.take(round_positions)
            for span in self.router.calls(rows):  # the one place the buffer budget is cut
                idx = round_positions[span.start : span.stop]
                codes = self._get_call([keys[i] for i in idx], rows.part(span))
                for i, code in zip(idx, codes, strict=True):
                    out[i] = code
        return out

    def _get_call(self, keys: list[str], batch: PlanBatch) -> list[int]:
        codes = self._invoke(
            "batch_get_into_multi_buffers",
            lambda s: s.batch_get_into_multi_buffers(keys, batch.ptrs, batch.sizes),
            len(keys),
        )
        if codes != batch.nbytes:
            short = sum(1 for code, n in zip(codes, batch.nbytes, strict=True) if 0 <= code != n)
            if short:
                self._counters["SHORT_READ"] += short
        return codes

    def get(self, keys: Sequence[str], plans: Sequence[ObjectPlan] | PlanBatch) -> list[bool]:
        """Read objects into the planned buffers; True only for a complete read.

        Copies in a bad failure domain are skipped without a transfer; a copy
        that fails is retried on the next one (at most ``span_replica_num``
        attempts per key). A key that cannot be read is remembered as lost."""
        batch = PlanBatch.of(plans)
        if self.router.direct(keys):
            keys, codes = list(keys), []
            for span in self.router.calls(batch):
                codes += self._get_call(keys[span.start : span.stop], batch.part(span))
            ok = list(map(operator.eq, codes, batch.nbytes))
            if not all(ok):
                unreadable = self._on_failed_reads(keys, batch.nbytes, codes)
                self._lost.add(unreadable, time.monotonic())
            return ok
        candidates = self.router.read_rows(keys, self._locate)
        ok = [False] * len(keys)
        unreadable = [False] * len(keys)
        pending = [i for i in range(len(keys)) if candidates[i]]
        if len(pending) < len(keys):
            self._counters["DOMAIN_BAD_SKIPPED"] += len(keys) - len(pending)
        for attempt in range(self._copies):
            pending = [i for i in pending if attempt < len(candidates[i])]
            if not pending:
                break
            object_keys = [candidates[i][attempt] for i in pending]
            codes = self._get_codes(object_keys, batch.take(pending))
            bad = set(self._on_failed_reads(object_keys, [batch.nbytes[i] for i in pending], codes))
            for i, object_key, code in zip(pending, object_keys, codes, strict=True):
                ok[i] = code == batch.nbytes[i]
                unreadable[i] = unreadable[i] or object_key in bad
            pending = [i for i in pending if not ok[i]]
        lost = [k for i, k in enumerate(keys) if not ok[i] and (unreadable[i] or not candidates[i])]
        if lost:
            self._lost.add(lost, time.monotonic())
        return ok

    def _on_failed_reads(
        self, object_keys: Sequence[str], planned: Sequence[int], codes: Sequence[int]
    ) -> list[str]:
        """Marks the domains of transfer failures and removes corrupt objects;
        returns the keys of both kinds (the reads that cannot succeed again)."""
        failed = [f for f in zip(object_keys, planned, codes, strict=True) if f[1] != f[2]]
        dead = {k: n for k, n, code in failed if code == _TRANSFER_FAIL}
        if dead:
            self._mark_failed_domains("batch_get_into_multi_buffers", dead)
        return [*dead, *self._integrity.record(failed)]

    def remove(self, keys: Sequence[str]) -> int:
        """Force-remove objects (and their copies); returns how many keys were removed."""
        removed = 0
        for key in keys:
            copies = [copy_key(key, r) for r in range(self._copies)]
            removed += 0 in [
                self._invoke_one("remove", lambda s, k=k: s.remove(k, True)) for k in copies
            ]
        return removed

    def remove_all(self) -> int:
        with self._native("remove_all") as store:
            return int(store.remove_all(True))

    def remove_prefix(self, prefix: str) -> int:
        """Force-remove every object whose key starts with ``prefix``."""
        pattern = "^" + re.escape(prefix)
        with self._native("remove_by_regex") as store:
            return int(store.remove_by_regex(pattern, True))

    def size_of(self, key: str) -> int:
        """The stored size of ``key`` in bytes, or a negative native code."""
        return self._invoke_one("get_size", lambda s: s.get_size(key))

    def stats_revision(self) -> tuple[int, bool, int]:
        """Cheap to read; changes whenever ``stats()`` has news for the metrics
        (every failure is counted, and the breaker and segment marks follow them)."""
        return sum(self._counters.values()), self._breaker.is_open, self._health.times_marked

    def stats(self) -> dict[str, Any]:
        snapshot: BreakerSnapshot = self._breaker.snapshot()
        return {
            "error_counts": dict(self._counters),
            "breaker_state": snapshot.state.value,
            "breaker_consecutive_failures": snapshot.consecutive_failures,
            "breaker_times_opened": snapshot.times_opened,
            "segments": list(self.segments()),
            "bad_segments": sorted(self._health.bad(time.monotonic())),
            "domains_marked_bad": self._health.times_marked,
            "lost_keys": len(self._lost),
            "integrity_failures": dict(self._integrity.counts),
            "integrity_removed": self._integrity.removed,
        }
