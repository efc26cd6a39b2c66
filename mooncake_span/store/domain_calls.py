"""Calls while failure domains matter, and what a failed read teaches.

``MooncakeClient`` sends a call as its caller built it whenever the router
says it can (``DomainRouter.direct``): nearly every call of a healthy
cluster. Otherwise the call comes here, to ``DomainCalls``, which decides
copy by copy and sends each part through the client's native calls
(``NativeParts``: it makes none of its own):

* a put writes every copy of every unique key onto the segment the router
  places it on; a key is written when all its copies are;
* a get reads each key's live copies in turn, until one reads completely (a
  round never names one key twice: Mooncake would leave a buffer unwritten);
  a key that cannot be read is remembered lost;
* an existence query asks about the live copies only; keys known lost, or
  with every copy in a bad failure domain, are absent without asking;
* a failed put (``failed_put``, on both paths) has its preferred segment
  dialled, and the ledger judges it bad or full;
* a failed read (``failed_reads``, on both paths) marks the segments its
  transfer failures sit on (as the master locates them), removes corrupt
  objects (``IntegrityFailures``) and hears about SSD owners that are down
  (``ServingSsd``); what can never be read again is returned to be
  remembered lost in the ``FailureLedger``.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from mooncake_span.errors import ErrorCode, is_transfer_failure
from mooncake_span.span.plan import PlanBatch, dedup_rounds
from mooncake_span.store.failure_ledger import FailureLedger, PutTarget
from mooncake_span.store.gate import NativeGate
from mooncake_span.store.integrity import IntegrityFailures
from mooncake_span.store.router import DomainRouter
from mooncake_span.store.serving_ssd import ServingSsd

# A call's placement as its caller knows it: (domains, chain steps), either None.
Placed = tuple[Sequence[str] | None, Sequence[int] | None]


# Per object: the native code of a put onto one segment (keys, plans, group ids, hard pin, segment).
PutPart = Callable[[list[str], PlanBatch, Sequence[str] | None, bool, str], list[int]]
# Object key -> the segments the master says hold it (keys, expected sizes, on_rpc=...).
Locate = Callable[..., dict[str, set[str]]]


class NativeParts(Protocol):
    """The client's native calls that the paths here are made of (``store/client.py``)."""

    put_part: PutPart
    get_call: Callable[[list[str], PlanBatch], list[int]]
    exists_codes: Callable[[list[str], Callable[[], None]], list[int]]
    locate: Locate
    replica_desc_past_breaker: Callable[[list[str]], Any]
    wake_directory: Callable[[], None]


@dataclass(eq=False)
class DomainCalls:
    """Puts, gets and existence queries copy by copy, on the client's native parts."""

    native: NativeParts
    router: DomainRouter
    ledger: FailureLedger
    gate: NativeGate  # its error counters
    integrity: IntegrityFailures
    ssd: ServingSsd
    # Whether a segment's transfer endpoint answers (None: unknown); set at connect.
    dial: Callable[[str], bool | None] = lambda segment: None

    def put(
        self,
        keys: Sequence[str],
        batch: PlanBatch,
        group_ids: Sequence[str] | None,
        hard_pin: bool,
        placed: Placed,
    ) -> list[bool]:
        """Every copy of every unique key onto the segment the router places it on;
        a key is written when all its copies are."""
        first: dict[str, int] = {}
        unique = [i for i, k in enumerate(keys) if first.setdefault(k, i) == i]
        written = collections.Counter()
        mine = [None if p is None else [p[i] for i in unique] for p in placed]
        for segment, entries in self.router.put_groups([keys[i] for i in unique], *mine).items():
            rows = [unique[j] for j, _ in entries]
            groups = [group_ids[i] for i in rows] if group_ids else None
            part = [k for _, k in entries]
            codes = self.native.put_part(part, batch.take(rows), groups, hard_pin, segment)
            for i, code in zip(rows, codes, strict=True):
                if code == 0:
                    written[i] += 1
        ok = {i: written[i] == self.router.copies for i in unique}
        self.ledger.forget_lost(keys[i] for i in unique if ok[i])
        return [ok[first[k]] for k in keys]

    def get(self, keys: Sequence[str], batch: PlanBatch, placed: Placed) -> list[bool]:
        """Each key's live copies in turn, until one reads completely."""
        candidates = self.router.read_rows(keys, self.native.locate, *placed)
        ok = [False] * len(keys)
        unreadable = [False] * len(keys)
        pending = [i for i in range(len(keys)) if candidates[i]]
        if len(pending) < len(keys):
            self.gate.count("DOMAIN_BAD_SKIPPED", len(keys) - len(pending))
        for attempt in range(self.router.copies):
            pending = [i for i in pending if attempt < len(candidates[i])]
            if not pending:
                break
            object_keys = [candidates[i][attempt] for i in pending]
            codes = self._get_codes(object_keys, batch.take(pending))
            bad = set(self.failed_reads(object_keys, [batch.nbytes[i] for i in pending], codes))
            for i, object_key, code in zip(pending, object_keys, codes, strict=True):
                ok[i] = code == batch.nbytes[i]
                unreadable[i] = unreadable[i] or object_key in bad
            pending = [i for i in pending if not ok[i]]
        lost = [k for i, k in enumerate(keys) if not ok[i] and (unreadable[i] or not candidates[i])]
        if lost:
            self.ledger.remember_lost(lost)
        return ok

    def _get_codes(self, keys: Sequence[str], batch: PlanBatch) -> list[int]:
        """One read attempt per key: the native code (bytes read, or an error).
        A round never names one key twice."""
        out = [int(ErrorCode.INTERNAL_ERROR)] * len(keys)
        for round_positions in dedup_rounds(keys):
            rows = batch.take(round_positions)
            for call in self.router.calls(rows):  # the one place the buffer budget is cut
                idx = round_positions[call.start : call.stop]
                codes = self.native.get_call([keys[i] for i in idx], rows.part(call))
                for i, code in zip(idx, codes, strict=True):
                    out[i] = code
        return out

    def exists(
        self,
        keys: Sequence[str],
        domains: Sequence[str] | None,
        steps: Sequence[int] | None,
        on_rpc: Callable[[], None],
    ) -> list[bool]:
        """Per key, whether a live copy is stored; lost keys and keys with every copy
        in a bad failure domain are absent without asking."""
        lost = self.ledger.lost_mask(keys)
        locate = functools.partial(self.native.locate, on_rpc=on_rpc)
        rows = self.router.read_rows(keys, locate, domains, steps)
        asked = [obj for i, row in enumerate(rows) if not lost[i] for obj in row]
        skipped = sum(1 for i, row in enumerate(rows) if not row and not lost[i])
        if skipped:
            self.gate.count("DOMAIN_BAD_SKIPPED", skipped)
        if any(lost):
            self.gate.count("LOST_KEY_SKIPPED", sum(lost))
        codes = self.native.exists_codes(asked, on_rpc) if asked else []
        found = dict(zip(asked, codes, strict=True))
        return [not lost[i] and any(found.get(o) == 1 for o in row) for i, row in enumerate(rows)]

    # ---- what a failed call teaches ----------------------------------------------------

    def failed_put(self, segment: str, codes: Sequence[int]) -> None:
        """Transfers of a put that preferred ``segment`` failed. Mooncake moves a put off
        a full preferred segment onto any listed one, so the failure does not name
        its segment: the segment is dialled (a blocking TCP connect, or None where
        metadata cannot say where it listens) and the ledger judges (``PutTarget``)."""
        whole_call = all(map(is_transfer_failure, codes))
        verdict = self.ledger.put_target_failed(segment, self.dial(segment), whole_call)
        if verdict is PutTarget.BAD:
            self.native.wake_directory()

    def failed_reads(
        self,
        object_keys: Sequence[str],
        planned: Sequence[int],
        codes: Sequence[int],
    ) -> list[str]:
        """Marks the domains of transfer failures and of SSD owners that are down,
        and removes corrupt objects; returns the keys to remember lost (the reads
        that cannot succeed again)."""
        failed = [f for f in zip(object_keys, planned, codes, strict=True) if f[1] != f[2]]
        dead = {k: n for k, n, code in failed if is_transfer_failure(code)}
        if dead:
            self._mark_failed_domains("batch_get_into_multi_buffers", dead)
        lost = [*dead, *self.integrity.record(failed)]
        return lost + self.ssd.owners_down(
            object_keys, codes, self.native.replica_desc_past_breaker
        )

    def _mark_failed_domains(self, op: str, planned_bytes: dict[str, int]) -> None:
        """Mark bad the segments holding objects a transfer just failed on, as the
        master locates them (placement may not have been followed). Only objects
        of exactly the planned size count: a read into larger buffers also gets
        -800, a wrong request and not a dead node."""
        located = self.native.locate(list(planned_bytes), planned_bytes)
        segments = set().union(*located.values())
        if segments:
            self.ledger.transfer_failed(segments, op)
            self.native.wake_directory()
