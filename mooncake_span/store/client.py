"""The only module that talks to Mooncake.

``MooncakeClient`` wraps one ``MooncakeDistributedStore`` and turns its native
conventions into plain Python ones, once:

* per-object results become ``bool`` (put: rc 0; get: exactly the planned
  number of bytes read; exists: 1) and every other return code is counted by
  name for ``stats()``;
* whole-call failures (a result list of the wrong length, an exception from the
  binding, every entry a transport code) raise ``TransportError`` and feed the
  circuit breaker; an open breaker refuses calls at once;
* calls are split so that none carries more than ``max_buffers_per_call``
  buffers (the TCP transport fails a batch partly past 2048 buffers per peer),
  and a get never names one key twice (Mooncake would leave a buffer unwritten
  while reporting success);
* after ``close()`` every method raises ``StoreClosedError`` -- the native
  client segfaults if it is called after close, so it is never reached again.

Before ``setup`` the client also guards against the native library's blocking
and aborting paths: metadata URLs are validated by ``config``; etcd and master
endpoints are probed with a short TCP connect, because a dead etcd makes setup
block for minutes; ``MC_TCP_STATUS_TIMEOUT_SEC`` (how long one stalled transfer
may block, 30 s by default) and ``MC_STORE_CLIENT_SETUP_RETRIES`` get bounded
defaults unless the operator already set them.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from mooncake_span.config import MooncakeSettings, SpanOptions
from mooncake_span.errors import (
    SetupError,
    StoreClosedError,
    TransportError,
    code_name,
    is_transport_failure,
)
from mooncake_span.span.plan import ObjectPlan, dedup_rounds, split_calls
from mooncake_span.store.breaker import BreakerSnapshot, CircuitBreaker
from mooncake_span.store.protocol import NativeStore

logger = logging.getLogger(__name__)

_REACHABILITY_TIMEOUT_S = 2.0
_CLOSE_DRAIN_TIMEOUT_S = 60.0
_EXISTS_KEYS_PER_CALL = 4096
# Mooncake's TCP transport queues 1024 transfers per peer plus 1024 pending admissions.
_TCP_QUEUE_BUFFERS = 2048
# Error counters live as long as the client and are keyed by code name, and an
# unknown native code gets a label of its own (CODE_<n>): past this many
# labels, new codes are counted together under _OTHER_CODES_LABEL. Bound: at
# most _MAX_ERROR_LABELS + 1 code labels plus the five fixed ones.
_MAX_ERROR_LABELS = 64
_OTHER_CODES_LABEL = "CODE_OTHER"


@dataclass(frozen=True)
class NativeBinding:
    """Where the store class comes from: the real wheel, or a fake in tests."""

    store_factory: Callable[[], NativeStore]
    replicate_config_factory: Callable[[], Any]


def load_native_binding() -> NativeBinding:
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except ImportError as exc:
        raise SetupError(
            "the Mooncake store client is not installed: pip install "
            "mooncake-transfer-engine-non-cuda (CPU/TCP) or mooncake-transfer-engine (GPU hosts), "
            "or install mooncake-span with the [cpu] or [cuda] extra"
        ) from exc
    return NativeBinding(MooncakeDistributedStore, ReplicateConfig)


def native_env_defaults(options: SpanOptions) -> dict[str, str]:
    return {
        # One stalled transfer (a partitioned peer) blocks this long, then -800.
        "MC_TCP_STATUS_TIMEOUT_SEC": str(options.transfer_timeout_s),
        # With etcd metadata, each setup retry can take ~12 s.
        "MC_STORE_CLIENT_SETUP_RETRIES": "2",
    }


def _probe_tcp(endpoint: str, timeout_s: float) -> None:
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise SetupError(f"cannot reach {endpoint}: {exc}") from exc


class MooncakeClient:
    def __init__(
        self,
        settings: MooncakeSettings,
        options: SpanOptions,
        binding: NativeBinding | None = None,
    ) -> None:
        self.settings = settings
        self.options = options
        self._binding = binding
        self._store: Any = None
        self._cond = threading.Condition()
        self._closed = False
        self._inflight = 0
        self._breaker = CircuitBreaker(options.breaker_failures)
        self._prober: threading.Thread | None = None
        self._counters: collections.Counter[str] = collections.Counter()
        self._probe_key = f"mooncake-span-probe-{uuid.uuid4().hex}"
        self._supports_group_ids: bool | None = None

    # ---- lifecycle -------------------------------------------------------

    def connect(self) -> None:
        """Set up the native client; SetupError says why it cannot."""
        for name, value in native_env_defaults(self.options).items():
            if name not in os.environ:
                os.environ[name] = value
                logger.info("mooncake-span: %s=%s (set it yourself to override)", name, value)
        if (
            self.settings.protocol == "tcp"
            and self.options.max_buffers_per_call > _TCP_QUEUE_BUFFERS
            and "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER" not in os.environ
        ):
            # Past the queue a TCP call does not just slow down: it stalls for
            # Mooncake's 60 s transfer wait and every key in it fails.
            logger.warning(
                "mooncake-span: span_max_buffers_per_call=%d exceeds the TCP transport's %d "
                "queued transfers per peer; raise MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER or lower "
                "the option",
                self.options.max_buffers_per_call,
                _TCP_QUEUE_BUFFERS,
            )
        endpoints = self.settings.etcd_endpoints()
        if not self.settings.master_server_address.startswith("etcd://"):
            endpoints.append(self.settings.master_server_address)
        for endpoint in endpoints:
            _probe_tcp(endpoint, _REACHABILITY_TIMEOUT_S)
        binding = self._binding or load_native_binding()
        self._binding = binding
        store = binding.store_factory()
        s = self.settings
        started = time.monotonic()
        try:
            rc = store.setup(
                s.local_hostname,
                s.metadata_server,
                s.global_segment_size_bytes,
                s.local_buffer_size_bytes,
                s.protocol,
                s.device_name,
                s.master_server_address,
            )
        except (TypeError, RuntimeError) as exc:
            raise SetupError(f"Mooncake setup raised {exc!r}") from exc
        if rc != 0:
            raise SetupError(
                f"Mooncake setup failed with code {rc} ({code_name(rc)}) for master "
                f"{s.master_server_address}, metadata {s.metadata_server}, protocol {s.protocol}"
            )
        self._store = store
        logger.info(
            "mooncake-span connected to master %s (metadata %s, protocol %s, segment %d bytes) "
            "in %.2fs",
            s.master_server_address,
            s.metadata_server,
            s.protocol,
            s.global_segment_size_bytes,
            time.monotonic() - started,
        )

    def close(self) -> None:
        """Idempotent. Waits (bounded) for calls in flight, then closes the native client."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
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

    @contextmanager
    def _native(self, op: str) -> Iterator[Any]:
        with self._cond:
            if self._closed:
                raise StoreClosedError(f"{op} called after close()")
            if self._store is None:
                raise StoreClosedError(f"{op} called before connect()")
            if self._breaker.is_open:
                self._counters["BREAKER_REJECTED"] += 1
                raise TransportError(f"{op} refused: circuit breaker open (cluster unreachable)")
            self._inflight += 1
        try:
            yield self._store
        finally:
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

    def _record(self, op: str, codes: Sequence[int]) -> None:
        """Count non-success codes; a call where every entry is a transport failure
        counts against the breaker, any other answer proves the cluster is alive."""
        for code in codes:
            if code < 0:
                label = code_name(code)
                if label not in self._counters and len(self._counters) >= _MAX_ERROR_LABELS:
                    label = _OTHER_CODES_LABEL
                self._counters[label] += 1
        if codes and all(is_transport_failure(c) for c in codes):
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
            self._start_prober()

    def _invoke(self, op: str, fn: Callable[[Any], list[int]], expected_len: int) -> list[int]:
        with self._native(op) as store:
            try:
                result = fn(store)
            except Exception as exc:  # the binding's own errors are whole-call failures
                self._counters["EXCEPTION"] += 1
                self._fail(op, repr(exc))
                raise TransportError(f"{op} raised {exc!r}") from exc
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

    # ---- prober --------------------------------------------------------------

    def _start_prober(self) -> None:
        with self._cond:
            if self._prober is not None and self._prober.is_alive():
                return
            self._prober = threading.Thread(
                target=self._probe_loop, name="mooncake-span-probe", daemon=True
            )
            self._prober.start()

    def _probe_loop(self) -> None:
        while True:
            time.sleep(self.options.breaker_probe_interval_s)
            with self._cond:
                if self._closed:
                    return
                self._inflight += 1
            try:
                codes = self._store.batch_is_exist([self._probe_key])
                alive = isinstance(codes, list) and len(codes) == 1 and codes[0] in (0, 1)
            except Exception:  # keep probing; the cluster is still down
                alive = False
            finally:
                with self._cond:
                    self._inflight -= 1
                    self._cond.notify_all()
            if alive:
                if self._breaker.record_success():
                    logger.warning(
                        "mooncake-span: circuit breaker CLOSED, the cluster answers again"
                    )
                return

    # ---- operations ------------------------------------------------------------

    def register_buffer(self, ptr: int, size_bytes: int) -> None:
        if size_bytes <= 0:
            return
        with self._native("register_buffer") as store:
            rc = store.register_buffer(ptr, size_bytes)
        if rc != 0:
            raise SetupError(
                f"register_buffer(ptr={ptr:#x}, {size_bytes} bytes) failed with {rc} "
                f"({code_name(rc)})"
            )

    def exists(self, keys: Sequence[str]) -> list[bool]:
        out: list[bool] = []
        for start in range(0, len(keys), _EXISTS_KEYS_PER_CALL):
            chunk = list(keys[start : start + _EXISTS_KEYS_PER_CALL])
            codes = self._invoke(
                "batch_is_exist", lambda s, keys=chunk: s.batch_is_exist(keys), len(chunk)
            )
            if all(is_transport_failure(code) for code in codes):
                # Nothing answered: a caller must not read this as "absent" and
                # follow up with a put that would wait just as long.
                raise TransportError(f"batch_is_exist: every key failed ({code_name(codes[0])})")
            out += [code == 1 for code in codes]
        return out

    def _replicate_config(self, group_ids: Sequence[str] | None, hard_pin: bool = False) -> Any:
        config = self._binding.replicate_config_factory()
        config.replica_num = self.options.replica_num
        if hard_pin and hasattr(config, "with_hard_pin"):
            config.with_hard_pin = True
        if group_ids is not None and self.options.group_ids:
            if self._supports_group_ids is None:
                self._supports_group_ids = hasattr(config, "group_ids")
            if self._supports_group_ids:
                config.group_ids = list(group_ids)
        return config

    def put(
        self,
        keys: Sequence[str],
        plans: Sequence[ObjectPlan],
        group_ids: Sequence[str] | None = None,
        hard_pin: bool = False,
    ) -> list[bool]:
        """Write objects that do not exist yet. Mooncake keeps the old value of an
        existing key and reports success, so callers check existence first.
        ``hard_pin`` exempts the objects from eviction (small metadata only)."""
        ok = [False] * len(keys)
        first: dict[str, int] = {}
        unique = [i for i, k in enumerate(keys) if first.setdefault(k, i) == i]
        for call in split_calls(
            [len(plans[i].ptrs) for i in unique], self.options.max_buffers_per_call
        ):
            idx = [unique[j] for j in call]
            call_keys = [keys[i] for i in idx]
            config = self._replicate_config(
                [group_ids[i] for i in idx] if group_ids else None, hard_pin
            )
            codes = self._invoke(
                "batch_put_from_multi_buffers",
                lambda s, keys=call_keys, idx=idx, config=config: s.batch_put_from_multi_buffers(
                    keys, [plans[i].ptrs for i in idx], [plans[i].sizes for i in idx], config
                ),
                len(idx),
            )
            for i, code in zip(idx, codes, strict=False):
                ok[i] = code == 0
        return [ok[first[k]] for k in keys]

    def get(self, keys: Sequence[str], plans: Sequence[ObjectPlan]) -> list[bool]:
        """Read objects into the planned buffers; True only for a complete read."""
        ok = [False] * len(keys)
        for round_positions in dedup_rounds(keys):
            counts = [len(plans[i].ptrs) for i in round_positions]
            for call in split_calls(counts, self.options.max_buffers_per_call):
                idx = [round_positions[j] for j in call]
                call_keys = [keys[i] for i in idx]
                codes = self._invoke(
                    "batch_get_into_multi_buffers",
                    lambda s, keys=call_keys, idx=idx: s.batch_get_into_multi_buffers(
                        keys, [plans[i].ptrs for i in idx], [plans[i].sizes for i in idx]
                    ),
                    len(idx),
                )
                for i, code in zip(idx, codes, strict=False):
                    if code == plans[i].nbytes:
                        ok[i] = True
                    elif code >= 0:
                        self._counters["SHORT_READ"] += 1
        return ok

    def remove(self, keys: Sequence[str]) -> int:
        """Force-remove objects; returns how many were removed."""
        removed = 0
        for key in keys:
            with self._native("remove") as store:
                rc = store.remove(key, True)
            removed += rc == 0
        return removed

    def remove_all(self) -> int:
        with self._native("remove_all") as store:
            return int(store.remove_all(True))

    def remove_prefix(self, prefix: str) -> int:
        """Force-remove every object whose key starts with ``prefix``."""
        pattern = "^" + re.escape(prefix)
        with self._native("remove_by_regex") as store:
            return int(store.remove_by_regex(pattern, True))

    def create_blob(self, key: str, data: bytes) -> bool:
        """Store ``data`` under ``key`` unless the key exists; True if this call wrote it."""
        if self.exists([key])[0]:
            return False
        buffer = ctypes.create_string_buffer(data, len(data))
        return self.put(
            [key], [ObjectPlan([ctypes.addressof(buffer)], [len(data)])], hard_pin=True
        )[0]

    def read_blob(self, key: str) -> bytes | None:
        with self._native("get_size") as store:
            size = int(store.get_size(key))
        if size <= 0:
            return None
        buffer = ctypes.create_string_buffer(size)
        if not self.get([key], [ObjectPlan([ctypes.addressof(buffer)], [size])])[0]:
            return None
        return buffer.raw

    def stats(self) -> dict[str, Any]:
        snapshot: BreakerSnapshot = self._breaker.snapshot()
        return {
            "error_counts": dict(self._counters),
            "breaker_state": snapshot.state.value,
            "breaker_consecutive_failures": snapshot.consecutive_failures,
            "breaker_times_opened": snapshot.times_opened,
        }
