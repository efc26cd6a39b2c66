"""Which native calls a put or a get becomes, by the router's word: direct, as its
caller built it (nearly every call of a healthy cluster), or copy by copy while
failure domains matter; and what a failed call teaches. Calls go down to
``NativeCalls`` only, never back to the client. Walk-through: docs/architecture.md,
step 4 of a get and of a put; the rules: docs/reliability.md, "What the backend does".
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from mooncake_span.errors import ErrorCode, found, is_transfer_failure, read_whole, written
from mooncake_span.span.plan import PlanBatch, dedup_rounds
from mooncake_span.store.gate import NativeCalls, Puts
from mooncake_span.store.integrity import IntegrityFailures
from mooncake_span.store.router import (
    FULL_SKIPPED_LABEL,
    DomainRouter,
    FailureLedger,
    PutPressure,
    PutTarget,
)
from mooncake_span.store.serving_ssd import ServingSsd

# Where a caller placed its keys, if it knows: their domains, their chain steps.
Domains = Sequence[str] | None
Steps = Sequence[int] | None

# Mooncake 0.3.13's put with group ids costs more per object the more objects
# one call carries: a 1024-object MHA put took 148 ms in one call and 46 ms in
# calls of 64 (32 ms without group ids); a 256-object one 23 vs 19 ms.
GROUPED_PUT_OBJECTS = 64
# Segments one put writes to at once; more shares wait for a free thread.
MAX_SEGMENTS_AT_ONCE = 8


@dataclass(eq=False)
class DomainCalls:
    """Puts and gets, direct or copy by copy, and existence queries copy by copy."""

    native: NativeCalls
    router: DomainRouter
    ledger: FailureLedger
    integrity: IntegrityFailures
    ssd: ServingSsd
    pressure: PutPressure
    # Whether a segment's transfer endpoint answers (None: unknown); set at connect.
    dial: Callable[[str], bool | None] = lambda segment: None
    # Refreshes the live segment list now; set at connect when there is one.
    wake: Callable[[], None] = lambda: None
    _pool: ThreadPoolExecutor | None = None
    _pool_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    # ---- puts ----------------------------------------------------------------------

    def put(self, puts: Puts) -> list[bool]:
        """Per key, True when every copy was written."""
        if not self.router.direct_put(puts.keys):
            return self._put_copies(puts)
        ok = self._put_direct(puts)
        self.ledger.forget_lost(k for k, good in zip(puts.keys, ok, strict=True) if good)
        return ok

    def _put_direct(self, puts: Puts) -> list[bool]:
        """One copy per key, in the caller's order."""
        groups = self.router.direct_groups(puts.keys, puts.domains, puts.steps)
        if len(groups) == 1:  # every object goes to one segment, in the caller's order
            return written(self._put_segment(puts, groups[0][0]))
        codes = np.zeros(len(puts.keys), dtype=np.int64)
        answers = self.each_segment([(segment, puts.take(rows)) for segment, rows in groups])
        for (_, rows), answer in zip(groups, answers, strict=True):
            codes[rows] = answer
        return written(codes.tolist())

    def _put_copies(self, puts: Puts) -> list[bool]:
        """Every copy of every unique key onto the segment the router places it on;
        a key is written when all its copies are."""
        keys = puts.keys
        first: dict[str, int] = {}
        unique = [i for i, k in enumerate(keys) if first.setdefault(k, i) == i]
        copies_written = collections.Counter()
        mine = [None if p is None else [p[i] for i in unique] for p in (puts.domains, puts.steps)]
        groups = self.router.put_groups([keys[i] for i in unique], *mine).items()
        rows_of = [[unique[j] for j, _ in entries] for _, entries in groups]
        shares = [
            (segment, puts.take(rows, [k for _, k in entries]))
            for (segment, entries), rows in zip(groups, rows_of, strict=True)
        ]
        for rows, codes in zip(rows_of, self.each_segment(shares), strict=True):
            copies_written.update(i for i, ok in zip(rows, written(codes), strict=True) if ok)
        ok = {i: copies_written[i] == self.router.copies for i in unique}
        self.ledger.forget_lost(keys[i] for i in unique if ok[i])
        return [ok[first[k]] for k in keys]

    def each_segment(self, shares: Sequence[tuple[str, Puts]]) -> list[list[int]]:
        """Each segment's share of a put at once, not one after another (their times add up)."""
        futures = [self._threads().submit(self._put_segment, p, s) for s, p in shares]
        return [future.result() for future in futures]

    def _put_segment(self, puts: Puts, segment: str) -> list[int]:
        """Objects onto one segment in calls within the buffer budget, none in a put pause."""
        codes: list[int] = []
        for call in self.router.calls(puts.batch, GROUPED_PUT_OBJECTS if puts.group_ids else 0):
            if not puts.hard_pin and self.pressure.cooling:
                self.native.gate.count(FULL_SKIPPED_LABEL, len(call))
                codes += self.pressure.skip(len(call))
            else:
                codes += self.pressure.record(self.native.put_call(puts.part(call), segment))
        if segment and any(map(is_transfer_failure, codes)):
            self.failed_put(segment, codes)
        return codes

    def _threads(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(MAX_SEGMENTS_AT_ONCE, "mooncake-span-put")
            return self._pool

    def close(self) -> None:
        """Ends the put threads (the client closes the native store after this)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    # ---- gets ----------------------------------------------------------------------

    def get(
        self, keys: Sequence[str], batch: PlanBatch, domains: Domains, steps: Steps
    ) -> list[bool]:
        """Per key, True when exactly its planned bytes arrived."""
        if self.router.direct(keys):
            return self._get_direct(list(keys), batch)
        return self._get_copies(keys, batch, domains, steps)

    def _get_direct(self, keys: list[str], batch: PlanBatch) -> list[bool]:
        """One copy per unique key, in the caller's order, cut by the buffer budget."""
        codes: list[int] = []
        for call in self.router.calls(batch):
            codes += self.native.get_call(keys[call.start : call.stop], batch.part(call))
        ok = read_whole(codes, batch.nbytes)
        if not all(ok):
            self.ledger.remember_lost(self.failed_reads(keys, batch.nbytes, codes))
        return ok

    def _get_copies(
        self, keys: Sequence[str], batch: PlanBatch, domains: Domains, steps: Steps
    ) -> list[bool]:
        """Each key's live copies in turn, until one reads completely."""
        candidates = self.router.read_rows(keys, self.native.locate, domains, steps)
        ok = [False] * len(keys)
        unreadable = [False] * len(keys)
        pending = [i for i in range(len(keys)) if candidates[i]]
        if len(pending) < len(keys):
            self.native.gate.count("DOMAIN_BAD_SKIPPED", len(keys) - len(pending))
        for attempt in range(self.router.copies):
            pending = [i for i in pending if attempt < len(candidates[i])]
            if not pending:
                break
            object_keys = [candidates[i][attempt] for i in pending]
            planned = [batch.nbytes[i] for i in pending]
            codes = self._get_codes(object_keys, batch.take(pending))
            bad = set(self.failed_reads(object_keys, planned, codes))
            whole = read_whole(codes, planned)
            for i, object_key, read in zip(pending, object_keys, whole, strict=True):
                ok[i] = read
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

    # ---- existence queries -----------------------------------------------------------

    def exists(
        self, keys: Sequence[str], domains: Domains, steps: Steps, on_rpc: Callable[[], None]
    ) -> list[bool]:
        lost = self.ledger.lost_mask(keys)
        locate = functools.partial(self.native.locate, on_rpc=on_rpc)
        rows = self.router.read_rows(keys, locate, domains, steps)
        asked = [obj for i, row in enumerate(rows) if not lost[i] for obj in row]
        skipped = sum(1 for i, row in enumerate(rows) if not row and not lost[i])
        if skipped:
            self.native.gate.count("DOMAIN_BAD_SKIPPED", skipped)
        if any(lost):
            self.native.gate.count("LOST_KEY_SKIPPED", sum(lost))
        codes = self.native.exists_codes(asked, on_rpc) if asked else []
        stored = dict(zip(asked, found(codes), strict=True))
        return [not lost[i] and any(stored.get(o) for o in row) for i, row in enumerate(rows)]

    # ---- what a failed call teaches ----------------------------------------------------

    def failed_put(self, segment: str, codes: Sequence[int]) -> None:
        """Transfers of a put that preferred ``segment`` failed. Mooncake moves a put off
        a full preferred segment onto any listed one, so the failure does not name
        its segment: the segment is dialled (a blocking TCP connect, or None where
        metadata cannot say where it listens) and the ledger judges (``PutTarget``)."""
        whole_call = all(map(is_transfer_failure, codes))
        verdict = self.ledger.put_target_failed(segment, self.dial(segment), whole_call)
        if verdict is PutTarget.BAD:
            self.wake()

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
            # Where the master locates them (placement may not have been followed), and
            # only replicas of exactly the planned size: a read into larger buffers also
            # gets -800, a wrong request and not a dead node.
            located = self.native.locate(list(dead), dead)
            if segments := set().union(*located.values()):
                self.ledger.transfer_failed(segments, "batch_get_into_multi_buffers")
                self.wake()
        lost = [*dead, *self.integrity.record(failed)]
        return lost + self.ssd.owners_down(object_keys, codes, self.native.replica_desc)
