"""The store's one entry: ``MooncakeClient``, over one ``MooncakeDistributedStore``.

It sets the native store up (the only module that loads Mooncake), hands each
put and get down to ``DomainCalls`` and closes it. Calls go one way: nothing
below calls the client back. Native codes are read once, in ``errors.py``.
Its layers: docs/architecture.md, step 4 of a get and of a put.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from mooncake_span.config import SpanOptions
from mooncake_span.errors import SetupError, code_name, found
from mooncake_span.mooncake_settings import MooncakeSettings
from mooncake_span.span.plan import ObjectPlan, PlanBatch
from mooncake_span.store import ssd_marker
from mooncake_span.store.domain_calls import DomainCalls
from mooncake_span.store.gate import EXISTS_KEYS_PER_CALL, NativeCalls, NativeGate, Puts, uncounted
from mooncake_span.store.integrity import IntegrityFailures
from mooncake_span.store.native import (
    NativeBinding,
    SharedEngine,
    mooncake_import_failure,
    native_env_defaults,
    reach_cluster,
    setup_arguments,
    setup_store,
)
from mooncake_span.store.router import DomainRouter, FailureLedger, PutPressure
from mooncake_span.store.seal import TrailerArena
from mooncake_span.store.segments import SegmentDirectory, start_directory
from mooncake_span.store.serving_ssd import ServingSsd

logger = logging.getLogger(__name__)
_ask_marker = operator.methodcaller("batch_is_exist", [ssd_marker.MARKER_KEY])

# NativeBinding and native_env_defaults are imported from here by callers.
__all__ = ["MooncakeClient", "NativeBinding", "load_native_binding", "native_env_defaults"]


def load_native_binding() -> NativeBinding:
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except ImportError as exc:
        raise SetupError(mooncake_import_failure(exc)) from exc
    return NativeBinding(MooncakeDistributedStore, ReplicateConfig, shares_process_env=True)


_CLOSE_DRAIN_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class Existence:
    found: list[bool]  # per key asked
    # Per touched object asked: a head of them, as many as fit in the query's last
    # RPC, and none while the router is troubled (touching never adds an RPC).
    touched_head: list[bool]


class MooncakeClient:
    def __init__(
        self,
        settings: MooncakeSettings,
        options: SpanOptions,
        binding: NativeBinding | None = None,
        shared_engine: SharedEngine | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.options = options
        self._binding = binding
        # A transfer engine this process already runs, reused when it serves the settings.
        self._shared_engine = shared_engine
        self._gate = NativeGate(options)
        self.pressure = PutPressure(options.full_cooldown_s, now_s=clock)
        self._directory: SegmentDirectory | None = None
        self.ledger = FailureLedger(options, clock)
        self.router = DomainRouter(options, self.ledger)
        self._ssd = ServingSsd(self._gate, self.ledger)
        self._seal: TrailerArena | None = None  # span_object_checksums, set by connect()
        self._native = NativeCalls(self._gate, self._ssd)
        self._integrity = IntegrityFailures(self._native.remove_one, clock)
        self._domains = DomainCalls(
            self._native, self.router, self.ledger, self._integrity, self._ssd, self.pressure
        )

    # ---- lifecycle -------------------------------------------------------

    def connect(self) -> None:
        """Set up the native client; SetupError says why it cannot."""
        s = self.settings
        binding = self._binding or load_native_binding()
        self._binding = binding
        admin_url = reach_cluster(s, self.options, binding)
        self._domains.dial = functools.partial(
            binding.segment_answers, s.metadata_server, admin_url
        )
        self._native.connected(binding.replicate_config_factory, self.router.mooncake_replicas)
        store = binding.store_factory()
        started = time.monotonic()
        with self._ssd.opened(s, admin_url, binding.list_segments, binding.list_disk_owners):
            setup_store(store, s, **setup_arguments(s, self._shared_engine))
        if self._ssd.owns_directory:
            self._ssd.running(segment=store.get_hostname())
        self._gate.store = store
        try:
            self._choose_seals(store)
        except BaseException:
            self.close()
            raise
        if self.options.object_checksums:
            self._seal = TrailerArena(self.register_buffer, float(self.options.transfer_timeout_s))
            self._native.seal = self._seal
        if self.options.placement:
            self._directory = start_directory(admin_url, self.options, binding.list_segments)
            if self._directory is not None:
                self._domains.wake = self._directory.wake
                self.router.directory = self._directory
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

    def _choose_seals(self, store: Any) -> None:
        """Whether this client seals its objects (``store/ssd_marker.py``): as given, or on
        where the cluster has an SSD tier (a rank with its own stores the marker first);
        ``options`` carry the answer on, and the layout guard publishes it."""
        if self._ssd.owns_directory:
            segment = store.get_hostname()
            ssd_marker.publish(functools.partial(self._native.put_one, segment=segment), segment)
        sealed, why = ssd_marker.resolve_object_checksums(
            self.options.object_checksums,
            self._ssd.owns_directory,
            lambda: self._gate.invoke("batch_is_exist", _ask_marker, 1)[0] > 0,
            self.options.layout_guard,
        )
        sources = {**self.options.sources, "object_checksums": why}
        self.options = dataclasses.replace(self.options, object_checksums=sealed, sources=sources)
        logger.info("mooncake-span: object seals %s (%s)", "on" if sealed else "off", why)

    def segments(self) -> tuple[str, ...]:
        """The live segments placement chooses from (empty: Mooncake places objects)."""
        return self.router.segments()

    def close(self) -> None:
        """Idempotent. Waits (bounded) for calls in flight, then closes the native client."""
        if self._directory is not None:
            self._directory.stop()
        store = self._gate.shut(_CLOSE_DRAIN_TIMEOUT_S)
        self._domains.close()
        if store is None:
            return
        state = self._ssd.unmount(store)
        store.close()
        self._ssd.release(state)

    @property
    def closed(self) -> bool:
        return self._gate.closed

    def place_by(self, domain_of: Callable[[str], str] | None) -> None:
        """Objects whose ``domain_of(object key)`` is equal share a segment, unless
        a call names its domains (None: each key is its own domain)."""
        self.router.place_by(domain_of)

    # ---- the write path ----------------------------------------------------------

    def put(
        self,
        keys: Sequence[str],
        plans: Sequence[ObjectPlan] | PlanBatch,
        group_ids: Sequence[str] | None = None,
        hard_pin: bool = False,
        domains: Sequence[str] | None = None,
        steps: Sequence[int] | None = None,
        sealed: bool = True,
    ) -> list[bool]:
        """Write objects that do not exist yet (Mooncake keeps an existing key's value
        and answers success); True only if every copy was written. Objects of one
        domain (``domains``, else ``place_by``'s) and chain step share a segment;
        ``hard_pin``: never evicted; ``sealed=False``: no seal even with
        ``span_object_checksums`` (small records other tools read as they are)."""
        puts = Puts(list(keys), PlanBatch.of(plans), group_ids, hard_pin, domains, steps)
        return self.put_objects(puts, sealed)

    def put_objects(self, puts: Puts, sealed: bool = True) -> list[bool]:
        """``put`` of objects gathered in one ``Puts`` (the write path's own call)."""
        if not sealed or self._seal is None:
            return self._domains.put(puts)
        with self._seal.writing(puts.keys, puts.batch) as sealed_batch:
            return self._domains.put(dataclasses.replace(puts, batch=sealed_batch))

    # ---- the read path -----------------------------------------------------------

    def get(
        self,
        keys: Sequence[str],
        plans: Sequence[ObjectPlan] | PlanBatch,
        domains: Sequence[str] | None = None,
        steps: Sequence[int] | None = None,
        sealed: bool = True,
    ) -> list[bool]:
        """Read objects into the planned buffers; True only for a complete read (with
        ``span_object_checksums``, of bytes that match their seal, unless
        ``sealed=False``). ``domains``/``steps``: the placement its put used, if known."""
        batch = PlanBatch.of(plans)
        if sealed and self._seal is not None:
            with self._seal.reading(keys, batch) as sealed_batch:
                return self._domains.get(keys, sealed_batch, domains, steps)
        return self._domains.get(keys, batch, domains, steps)

    # ---- replica descriptions ----------------------------------------------------

    def locate(
        self,
        object_keys: Sequence[str],
        sizes: dict[str, int] | None = None,
        on_rpc: Callable[[], None] = uncounted,
    ) -> dict[str, set[str]]:
        return self._native.locate(object_keys, sizes, on_rpc)

    # ---- existence ---------------------------------------------------------------

    @property
    def untroubled(self) -> bool:
        """Existence queries carry touched objects (``DomainRouter.untroubled``)."""
        return self.router.untroubled

    def exists(
        self,
        keys: Sequence[str],
        domains: Sequence[str] | None = None,
        steps: Sequence[int] | None = None,
        on_rpc: Callable[[], None] = uncounted,
    ) -> list[bool]:
        """Per key, whether a readable copy is stored (lost keys and keys with every
        copy in a bad failure domain are absent without asking). ``on_rpc`` is
        called once per native RPC sent."""
        return self.exists_and_touch(keys, (), domains, steps, on_rpc).found

    def exists_and_touch(
        self,
        keys: Sequence[str],
        touch: Sequence[str],
        domains: Sequence[str] | None = None,
        steps: Sequence[int] | None = None,
        on_rpc: Callable[[], None] = uncounted,
    ) -> Existence:
        """``exists``, renewing the leases of the head of ``touch`` that fits in its last RPC
        (``Existence.touched_head``); none while troubled (``DomainCalls.exists``)."""
        if not self.router.untroubled:
            return Existence(self._domains.exists(keys, domains, steps, on_rpc), [])
        head = list(touch[: -len(keys) % EXISTS_KEYS_PER_CALL])
        flags = found(self._native.exists_codes([*keys, *head], on_rpc))
        return Existence(flags[: len(keys)], flags[len(keys) :])

    # ---- other operations ----------------------------------------------------------

    def register_buffer(self, ptr: int, size_bytes: int) -> None:
        if size_bytes <= 0:
            return
        rc = self._gate.invoke_one("register_buffer", lambda s: s.register_buffer(ptr, size_bytes))
        if rc != 0:
            raise SetupError(
                f"register_buffer(ptr={ptr:#x}, {size_bytes} bytes) failed with {rc} "
                f"({code_name(rc)})"
            )

    def remove(self, keys: Sequence[str]) -> int:
        """Force-remove objects (and their copies); returns how many keys were removed."""
        removed = 0
        for key in keys:
            codes = [self._native.remove_one(k) for k in self.router.copy_keys(key)]
            if 0 in codes:  # a key is removed when one of its copies was
                removed += 1
        return removed

    def remove_all(self) -> int:
        with self._gate.native("remove_all") as store:
            return int(store.remove_all(True))

    def remove_prefix(self, prefix: str) -> int:
        pattern = "^" + re.escape(prefix)
        with self._gate.native("remove_by_regex") as store:
            return int(store.remove_by_regex(pattern, True))

    def size_of(self, key: str) -> int:
        """The stored size of ``key`` in bytes, or a negative native code."""
        return self._gate.invoke_one("get_size", lambda s: s.get_size(key))

    # ---- statistics: read from the owner of each count ---------------------------------

    def stats_revision(self) -> tuple[int, bool, int, int, int]:
        """Cheap to read; changes whenever ``stats()`` has news for the metrics (every
        failure is counted, and the breaker and segment marks follow them)."""
        return (
            *self._gate.revision(),
            self.ledger.times_marked,
            self.pressure.skipped_total,
            self._ssd.read_rpcs,
        )

    def stats(self) -> dict[str, Any]:
        return {
            "error_counts": self._gate.counts(),
            **self._gate.breaker_stats(),
            "segments": list(self.router.segments()),
            "bad_segments": sorted(self.ledger.bad_segments()),
            "full_segments": sorted(self.ledger.full_segments()),
            "domains_marked_bad": self.ledger.times_marked,
            "lost_keys": self.ledger.lost_count,
            "skipped_backups": self.pressure.skipped(),
            "ssd_read_rpcs": self._ssd.read_rpcs,
            **self._integrity.snapshot(),
        }
