"""Every native call of one client: ``NativeGate``, the gate each passes, and
``NativeCalls``, the data calls the store's paths are made of.

The gate refuses calls before setup, after ``close`` (the native client crashes
when called after close) and while its circuit breaker is open; it checks each
answer's shape, feeds the breaker and owns the error counters. Nothing here
calls back up: a put runs ``MooncakeClient`` -> ``DomainCalls`` -> ``NativeCalls``
-> the gate. Why the breaker and its probe: docs/reliability.md, "What bounds a call".
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import operator
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mooncake_span.config import SpanOptions
from mooncake_span.errors import (
    StoreClosedError,
    TransportError,
    code_name,
    is_cluster_failure,
    is_transport_failure,
    short_reads,
)
from mooncake_span.span.plan import PlanBatch
from mooncake_span.store.segments import replica_segments

if TYPE_CHECKING:
    from mooncake_span.store.seal import TrailerArena
    from mooncake_span.store.serving_ssd import ServingSsd

logger = logging.getLogger(__name__)

# Error counters live as long as the client, keyed by code name (an unknown code:
# CODE_<n>); past this many labels new codes share _OTHER_CODES_LABEL.
_MAX_ERROR_LABELS = 64
_OTHER_CODES_LABEL = "CODE_OTHER"


class CircuitBreaker:
    """Opens after ``failure_threshold`` whole-call failures in a row. Pure."""

    def __init__(self, failure_threshold: int) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        self._threshold = failure_threshold
        self._lock = threading.Lock()
        self._open = False
        self._failures = 0
        self._times_opened = 0

    @property
    def is_open(self) -> bool:
        return self._open

    def record_success(self) -> bool:
        """Returns True when this success closed an open breaker."""
        with self._lock:
            was_open = self._open
            self._open = False
            self._failures = 0
            return was_open

    def record_failure(self) -> bool:
        """Returns True when this failure opened the breaker."""
        with self._lock:
            self._failures += 1
            if not self._open and self._failures >= self._threshold:
                self._open = True
                self._times_opened += 1
                return True
            return False

    def stats(self) -> dict[str, Any]:
        """Its entries of the client's ``stats()``."""
        with self._lock:
            return {
                "breaker_state": "open" if self._open else "closed",
                "breaker_consecutive_failures": self._failures,
                "breaker_times_opened": self._times_opened,
            }


class RecoveryProbe:
    """While the breaker is open nothing on the request path sees the cluster recover:
    a thread asks ``probe()`` every ``interval_s``: True (it answered: close the
    breaker), False (not yet) or None (the client closed: stop)."""

    def __init__(
        self, breaker: CircuitBreaker, interval_s: float, probe: Callable[[], bool | None]
    ) -> None:
        self._breaker = breaker
        self._interval_s = interval_s
        self._probe = probe
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._thread = threading.Thread(
                target=self._loop, name="mooncake-span-probe", daemon=True
            )
            self._thread.start()

    def _loop(self) -> None:
        while True:
            time.sleep(self._interval_s)
            alive = self._probe()
            if alive is None:
                return
            if alive:
                if self._breaker.record_success():
                    logger.warning(
                        "mooncake-span: circuit breaker CLOSED, the cluster answers again"
                    )
                return


class NativeGate:
    def __init__(self, options: SpanOptions) -> None:
        self.store: Any = None  # set by the client once setup succeeded
        self._cond = threading.Condition()
        self._closed = False
        self._inflight = 0
        self._breaker = CircuitBreaker(options.breaker_failures)
        self._prober = RecoveryProbe(
            self._breaker, options.breaker_probe_interval_s, self._probe_once
        )
        self._counts_lock = threading.Lock()
        self._counters: collections.Counter[str] = collections.Counter()
        self._probe_key = f"mooncake-span-probe-{uuid.uuid4().hex}"

    # ---- lifecycle -------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def shut(self, drain_timeout_s: float) -> Any:
        """Refuse new calls and wait (bounded) for those in flight. Returns the
        native store for the caller to close, or None: already shut, never set
        up, or calls still running (closing under one would crash the process;
        leaking the client is the lesser evil)."""
        with self._cond:
            if self._closed:
                return None
            self._closed = True
            deadline = time.monotonic() + drain_timeout_s
            while self._inflight and time.monotonic() < deadline:
                self._cond.wait(timeout=0.5)
            leaked = self._inflight
        if leaked:
            logger.error(
                "mooncake-span: %d calls still running at close; not closing the native client",
                leaked,
            )
            return None
        return self.store

    # ---- guarded native access ---------------------------------------------

    def _enter(self, op: str, past_breaker: bool = False) -> Any:
        """Count a call in flight and hand out the native store, or raise why not."""
        with self._cond:
            if self._closed:
                raise StoreClosedError(f"{op} called after close()")
            if self.store is None:
                raise StoreClosedError(f"{op} called before connect()")
            if self._breaker.is_open and not past_breaker:
                self.count("BREAKER_REJECTED")
                raise TransportError(f"{op} refused: circuit breaker open (cluster unreachable)")
            self._inflight += 1
            return self.store

    def _leave(self) -> None:
        with self._cond:
            self._inflight -= 1
            if self._closed:  # only shut() waits for calls in flight
                self._cond.notify_all()

    @contextmanager
    def native(self, op: str, past_breaker: bool = False) -> Iterator[Any]:
        """The native store for one call whose answer is not a list of codes;
        ``past_breaker``: even while the breaker is open (one call that tells
        whether the master answers, as the recovery probe's)."""
        store = self._enter(op, past_breaker)
        try:
            yield store
        finally:
            self._leave()

    def invoke(self, op: str, fn: Callable[[Any], list[int]], expected_len: int) -> list[int]:
        """``fn(store)``: one native call answering ``expected_len`` codes, accounted."""
        store = self._enter(op)  # not native(): a generator costs more on the hot path
        try:
            result = fn(store)
        except Exception as exc:  # the binding's own errors are whole-call failures
            self.count("EXCEPTION")
            self._fail(op, repr(exc))
            raise TransportError(f"{op} raised {exc!r}") from exc
        finally:
            self._leave()
        if not isinstance(result, list) or len(result) != expected_len:
            # e.g. the empty list an uninitialised client returns
            length = str(len(result)) if isinstance(result, list) else None  # "0" is true
            self.count("BAD_RESULT_LENGTH")
            self._fail(op, f"returned {type(result).__name__} of length {length or '?'}")
            got = length or repr(result)
            raise TransportError(f"{op} returned {got} results for {expected_len} keys")
        self._record(op, result)
        return result

    def invoke_one(self, op: str, fn: Callable[[Any], int]) -> int:
        """A native call answering one int code, with the accounting of ``invoke``."""
        return self.invoke(op, lambda s: [int(fn(s))], 1)[0]

    def _record(self, op: str, codes: Sequence[int]) -> None:
        """Count non-success codes; a call where every entry is a cluster-level
        failure counts against the breaker, any other answer proves the master
        is alive (a dead storage node is a failure domain, not the cluster)."""
        if not codes or min(codes) >= 0:
            self._breaker.record_success()
            return
        self._count_codes(codes)
        if all(is_cluster_failure(c) for c in codes):
            self._fail(op, f"all {len(codes)} entries failed ({code_name(codes[0])})")
        else:
            self._breaker.record_success()

    def answered(self) -> None:
        """A call past the gate got the master's answer: whatever failed before it
        was not the cluster (e.g. a read from a storage node that is down)."""
        self._breaker.record_success()

    def _fail(self, op: str, why: str) -> None:
        if self._breaker.record_failure():
            logger.warning(
                "mooncake-span: circuit breaker OPEN after %s failed: %s; answering misses until "
                "the cluster responds",
                op,
                why,
            )
            self._prober.start()

    def _probe_once(self) -> bool | None:
        """One existence query past the breaker: did the cluster answer? None once closed."""
        with self._cond:
            if self._closed:
                return None
            self._inflight += 1
        try:
            codes = self.store.batch_is_exist([self._probe_key])
            return isinstance(codes, list) and len(codes) == 1 and codes[0] in (0, 1)
        except Exception:  # the cluster is still down
            return False
        finally:
            self._leave()

    # ---- the error counters -------------------------------------------------------

    def count(self, label: str, n: int = 1) -> None:
        """Count ``n`` objects or calls under a fixed ``label`` (a skip or a wrong answer)."""
        with self._counts_lock:
            self._counters[label] += n

    def _count_codes(self, codes: Sequence[int]) -> None:
        with self._counts_lock:
            for code in codes:
                if code < 0:
                    label = code_name(code)
                    if label not in self._counters and len(self._counters) >= _MAX_ERROR_LABELS:
                        label = _OTHER_CODES_LABEL
                    self._counters[label] += 1

    def counts(self) -> dict[str, int]:
        with self._counts_lock:
            return dict(self._counters)

    # ---- observation -----------------------------------------------------------

    def revision(self) -> tuple[int, bool]:
        """Changes whenever a failure is counted or the breaker flips."""
        with self._counts_lock:
            total = sum(self._counters.values())
        return total, self._breaker.is_open

    def breaker_stats(self) -> dict[str, Any]:
        return self._breaker.stats()


# ---- the data calls ----------------------------------------------------------------

EXISTS_KEYS_PER_CALL = 4096


def uncounted() -> None:
    """The ``on_rpc`` of a caller that does not count RPCs."""


def replicate_config(
    factory: Callable[[], Any],
    replica_num: int,
    group_ids: Sequence[str] | None,
    hard_pin: bool,
    segment: str,
) -> Any:
    """The ``ReplicateConfig`` of one put call. Fields an older wheel lacks
    (``with_hard_pin``, ``group_ids``) are left out rather than failing the put."""
    config = factory()
    config.replica_num = replica_num
    if segment:
        config.preferred_segment = segment
    if hard_pin and hasattr(config, "with_hard_pin"):
        config.with_hard_pin = True
    if group_ids is not None and hasattr(config, "group_ids"):
        config.group_ids = list(group_ids)
    return config


@dataclass(frozen=True)
class Puts:
    """Objects to put: their keys, plans and eviction group ids (None: none sent),
    whether they are pinned, and where the caller placed them (``domains``,
    ``steps``: None when it does not say)."""

    keys: list[str]
    batch: PlanBatch
    group_ids: Sequence[str] | None = None
    hard_pin: bool = False
    domains: Sequence[str] | None = None
    steps: Sequence[int] | None = None

    def part(self, call: range) -> Puts:
        """Consecutive objects, one native call's (the placement is spent by then)."""
        groups = self.group_ids[call.start : call.stop] if self.group_ids else None
        return Puts(self.keys[call.start : call.stop], self.batch.part(call), groups, self.hard_pin)

    def take(self, rows: Sequence[int], keys: list[str] | None = None) -> Puts:
        """The objects at ``rows``, under ``keys`` when given (their copies' keys)."""
        groups = [self.group_ids[i] for i in rows] if self.group_ids else None
        keys = [self.keys[i] for i in rows] if keys is None else keys
        return Puts(keys, self.batch.take(rows), groups, self.hard_pin)


def _before_connect(*_: Any) -> Any:
    """A put's ``ReplicateConfig`` before ``connect``: refused, as the gate refuses
    every native call then."""
    raise StoreClosedError("batch_put_from_multi_buffers called before connect()")


class NativeCalls:
    """The data calls, each one native call through the gate (an SSD owner's read
    buffer may split a get: ``ServingSsd.read``). What only ``connect`` knows is
    set by the client: the put's config factory (``connected``) and, with
    ``span_object_checksums``, the seal arena each get is verified against."""

    def __init__(self, gate: NativeGate, ssd: ServingSsd) -> None:
        self.gate = gate
        self._ssd = ssd
        self.seal: TrailerArena | None = None
        # Every put's ReplicateConfig but for its group ids, pin and segment.
        self._config: Callable[..., Any] = _before_connect

    def connected(self, config_factory: Callable[[], Any], replica_num: int) -> None:
        self._config = functools.partial(replicate_config, config_factory, replica_num)

    def put_call(self, puts: Puts, segment: str) -> list[int]:
        """One native put (objects within the buffer budget), preferring ``segment``."""
        config = self._config(puts.group_ids, puts.hard_pin, segment)
        args = (puts.keys, puts.batch.ptrs, puts.batch.sizes, config)
        put = operator.methodcaller("batch_put_from_multi_buffers", *args)
        return self.gate.invoke("batch_put_from_multi_buffers", put, len(puts.keys))

    def put_one(self, key: str, data: bytes, segment: str) -> int:
        """One pinned small object from Python bytes (``put``, not zero-copy)."""
        config = self._config(None, True, segment)
        return self.gate.invoke_one("put", lambda s: s.put(key, data, config))

    def remove_one(self, key: str) -> int:
        """Force-remove one object: its native code (0: removed)."""
        return self.gate.invoke_one("remove", lambda s: s.remove(key, True))

    def get_call(self, keys: list[str], batch: PlanBatch) -> list[int]:
        # What an SSD owner's read buffer could not take is asked again in halves.
        codes = self._ssd.read(self._native_get_call, keys, batch)
        if codes != batch.nbytes and (short := short_reads(codes, batch.nbytes)):
            self.gate.count("SHORT_READ", short)
        return codes

    def _native_get_call(self, keys: list[str], batch: PlanBatch) -> list[int]:
        return self.gate.invoke(
            "batch_get_into_multi_buffers",
            functools.partial(self._native_get, keys, batch),
            len(keys),
        )

    def _native_get(self, keys: list[str], batch: PlanBatch, store: Any) -> list[int]:
        codes = store.batch_get_into_multi_buffers(keys, batch.ptrs, batch.sizes)
        if self.seal is not None:
            codes = self.seal.verify(batch, codes)
        self._ssd.saw_owner_reads(store.get_offload_rpc_read_count())
        return codes

    def exists_codes(self, keys: list[str], on_rpc: Callable[[], None]) -> list[int]:
        out: list[int] = []
        for start in range(0, len(keys), EXISTS_KEYS_PER_CALL):
            chunk = keys[start : start + EXISTS_KEYS_PER_CALL]

            def ask(store: Any, keys: list[str] = chunk) -> list[int]:
                on_rpc()  # called once the gate let the call through
                return store.batch_is_exist(keys)

            codes = self.gate.invoke("batch_is_exist", ask, len(chunk))
            if all(is_transport_failure(code) for code in codes):
                # Not "absent": a put that followed would wait just as long.
                raise TransportError(f"batch_is_exist: every key failed ({code_name(codes[0])})")
            out += codes
        return out

    def locate(
        self,
        object_keys: Sequence[str],
        sizes: dict[str, int] | None = None,
        on_rpc: Callable[[], None] = uncounted,
    ) -> dict[str, set[str]]:
        """Where the master says objects are (one RPC), with the owners of those
        found only on an SSD (``ServingSsd.add_disk_owners``); {} if it does not answer."""
        if not object_keys:
            return {}
        replicas = self.replica_desc(list(object_keys), on_rpc=on_rpc)
        return self._ssd.add_disk_owners(replicas, replica_segments(replicas, sizes))

    def replica_desc(
        self,
        object_keys: list[str],
        past_breaker: bool = False,
        on_rpc: Callable[[], None] = uncounted,
    ) -> Any:
        """The master's replica descriptions (``batch_get_replica_desc``), None if it
        does not answer; ``past_breaker``: also while the breaker is open."""
        suppress = contextlib.suppress(TransportError, StoreClosedError)
        with suppress, self.gate.native("batch_get_replica_desc", past_breaker) as store:
            on_rpc()  # past the gate: the RPC goes out
            try:
                return store.batch_get_replica_desc(object_keys)
            except Exception:  # observation only: unknown means "treat as lost"
                logger.debug("batch_get_replica_desc failed", exc_info=True)
        return None
