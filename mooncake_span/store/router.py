"""What failed calls taught one client, and the routing decided from it. Pure:
state and rules on the caller's clock, no I/O.

``FailureLedger`` owns the failure marks (bad, full and owner-down segments,
lost keys), ``PutPressure`` the put pause and the counts of backups not written,
``DomainRouter`` decides per call: direct or copy by copy, how it is cut, where
its objects go. Why: docs/reliability.md, "What the backend does" and "A full
cluster: the put cool-down"; the layers: docs/architecture.md, step 4 of a put.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from mooncake_span.config import SpanOptions
from mooncake_span.errors import ErrorCode, is_no_space
from mooncake_span.span.plan import PlanBatch, split_calls
from mooncake_span.store.domains import (
    copy_candidates,
    copy_key,
    live_copies,
    put_targets,
    rankings,
    segment_weights,
    suspect_copies,
)
from mooncake_span.store.segments import SegmentDirectory

logger = logging.getLogger(__name__)


class PutTarget(enum.Enum):
    """What a put's failed transfers say about the segment the put preferred."""

    BAD = "bad"  # it refuses a dial, or failed a whole call and cannot be dialled
    FULL = "full"  # it answers (or another segment is bad): Mooncake moved the rest away
    UNKNOWN = "unknown"  # no dial, part of the call stored: nothing is marked


class FailureLedger:
    """Bad, full and owner-down segment marks and lost keys, on one clock. Thread-safe.
    Bounds: ``span_domain_bad_ttl_s``, ``span_lost_key_ttl_s``, ``span_lost_keys_max``."""

    def __init__(self, options: SpanOptions, clock: Callable[[], float] = time.monotonic) -> None:
        self._bad_ttl_s = options.domain_bad_ttl_s
        self._bad = TimedMarks(self._bad_ttl_s)
        self._full = TimedMarks(self._bad_ttl_s)
        self._owners_down_until = 0.0
        self._lost = TimedMarks(options.lost_key_ttl_s, options.lost_keys_max)
        self._clock = clock

    # ---- segment marks ---------------------------------------------------------------

    def transfer_failed(self, segments: Iterable[str], op: str) -> list[str]:
        """Segments a transfer (``op``) just failed on are bad. Returns those not bad before."""
        fresh = self._bad.mark(segments, self._clock())
        if fresh:
            logger.warning(
                "mooncake-span: %s failed on segment(s) %s; avoiding them and reading their "
                "keys as misses for %.0fs",
                op,
                fresh,
                self._bad_ttl_s,
            )
        return fresh

    def put_target_failed(self, segment: str, answers: bool | None, whole_call: bool) -> PutTarget:
        """The rule for the preferred segment a put failed on, and its mark. ``answers``:
        whether its transfer endpoint accepted a dial (None: it cannot be dialled, e.g.
        etcd metadata); ``whole_call``: every object of the call failed. Another
        segment marked bad explains a failure on its own."""
        others_bad = bool(self.bad_segments())
        if answers is False or (answers is None and whole_call and not others_bad):
            self.transfer_failed([segment], "batch_put_from_multi_buffers")
            return PutTarget.BAD
        if not answers and not others_bad:
            return PutTarget.UNKNOWN
        if self._full.mark([segment], self._clock()):
            logger.info(
                "mooncake-span: segment %s took only part of a put (Mooncake moved the "
                "rest elsewhere, where the transfer failed); new puts go to the next "
                "segment for %.0fs, its keys read as before",
                segment,
                self._bad_ttl_s,
            )
        return PutTarget.FULL

    def owners_down(self, segments: Iterable[str]) -> list[str]:
        """Segments whose SSD tier failed a read: bad as after a failed transfer, and
        until the mark ends every read locates its keys. Returns those not bad before."""
        now = self._clock()
        self._owners_down_until = now + self._bad_ttl_s
        fresh = self._bad.mark(segments, now)
        if fresh:
            logger.warning(
                "mooncake-span: the SSD tier of segment(s) %s does not answer reads; "
                "reading their keys as misses for %.0fs",
                fresh,
                self._bad_ttl_s,
            )
        return fresh

    @property
    def any_bad(self) -> bool:
        """True while some bad mark may still be live (no clock read)."""
        return bool(self._bad)

    def bad_segments(self) -> frozenset[str]:
        return self._bad.marked(self._clock())

    @property
    def any_full(self) -> bool:
        """True while some full mark may still be live (no clock read)."""
        return bool(self._full)

    def full_segments(self) -> frozenset[str]:
        return self._full.marked(self._clock())

    @property
    def owners_down_now(self) -> bool:
        """True while an owner-down mark holds: placement cannot say where keys are."""
        return self._clock() < self._owners_down_until

    @property
    def times_marked(self) -> int:
        """How many times a healthy segment was marked bad."""
        return self._bad.times_marked

    # ---- lost keys -------------------------------------------------------------------

    def remember_lost(self, keys: Iterable[str]) -> None:
        """Keys whose restore failed: absent until re-written or the lost-key TTL passes."""
        self._lost.mark(keys, self._clock())

    def forget_lost(self, keys: Iterable[str]) -> None:
        """Keys just written: readable again."""
        self._lost.discard(keys)

    def lost_mask(self, keys: Sequence[str]) -> list[bool]:
        return self._lost.mask(keys, self._clock())

    @property
    def lost_count(self) -> int:
        return len(self._lost)

    @property
    def quiet(self) -> bool:
        """No key known lost and no segment marked bad (no clock read)."""
        return not self._lost and not self._bad


class TimedMarks:
    """Names (segments, object keys) marked until ``ttl_s`` after their last mark; at
    most ``max_entries``, the oldest forgotten first (a lost key then looks present
    early, one more failed restore; a stored one is never hidden past the TTL).
    Entries stay in expiry order: one TTL, a monotonic clock, a re-mark moves to the
    end. Thread-safe."""

    def __init__(self, ttl_s: float, max_entries: int = 1024) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if max_entries < 1:
            raise ValueError(f"the entry bound must be >= 1, got {max_entries}")
        self._ttl_s = ttl_s
        self._max = max_entries
        self._lock = threading.Lock()
        self._until: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.times_marked = 0  # names marked while not marked

    def __len__(self) -> int:
        """Marks held, some perhaps expired (no clock read)."""
        return len(self._until)

    def mark(self, names: Iterable[str], now_s: float) -> list[str]:
        """Mark names; returns those not marked before (for logging)."""
        fresh = []
        with self._lock:
            for name in names:
                until = self._until.pop(name, None)
                if until is None or until <= now_s:
                    fresh.append(name)
                    self.times_marked += 1
                self._until[name] = now_s + self._ttl_s
                while len(self._until) > self._max:
                    self._until.popitem(last=False)
        return fresh

    def discard(self, names: Iterable[str]) -> None:
        if not self._until:  # the common case: nothing marked, no lock
            return
        with self._lock:
            for name in names:
                self._until.pop(name, None)

    def marked(self, now_s: float) -> frozenset[str]:
        with self._lock:
            self._expire(now_s)
            return frozenset(self._until)

    def mask(self, names: Sequence[str], now_s: float) -> list[bool]:
        if not self._until:
            return [False] * len(names)
        with self._lock:
            self._expire(now_s)
            return [name in self._until for name in names]

    def _expire(self, now_s: float) -> None:
        while self._until and next(iter(self._until.values())) <= now_s:
            self._until.popitem(last=False)


# ---- the put pause ---------------------------------------------------------------

# The client's counter (failed_objects_total{code=...}) of puts not sent in a pause.
FULL_SKIPPED_LABEL = "FULL_COOLDOWN_SKIPPED"
# What a put skipped in a pause reads as: the answer that started it.
SKIPPED_CODE = int(ErrorCode.NO_AVAILABLE_HANDLE)
# One log line per this many seconds at most, however often the cluster fills.
LOG_INTERVAL_S = 60.0
# Refused calls in a row (nothing stored, a no-space answer) before puts pause:
# eviction runs within ~10 ms of a refusal, so one or two refusals say little.
STREAK_TO_PAUSE = 3
# The first pause: about one period of Mooncake's eviction thread (10 ms).
FIRST_PAUSE_S = 0.01

# Why a backup's object was not written.
STORED = "stored"  # already in the cluster (the existence query before the put)
COOLDOWN = "cooldown"  # not sent: a pause after refused puts (the cluster was not asked)
REFUSED = "refused"  # sent; the cluster answered no space
UNREACHABLE = "unreachable"  # not sent: the chain's prefix is not in the cluster
SKIP_REASONS = (STORED, COOLDOWN, REFUSED, UNREACHABLE)


class PutPressure:
    """Whether puts pause, how many pauses began, and why backup objects were
    not written. Thread-safe."""

    def __init__(self, max_pause_s: float, now_s: Callable[[], float] = time.monotonic) -> None:
        if max_pause_s < 0:
            raise ValueError(f"max_pause_s must be >= 0, got {max_pause_s}")
        self._max_pause_s = max_pause_s
        self._now_s = now_s
        self._lock = threading.Lock()
        self._streak = 0  # refused calls in a row
        self._pause_s = 0.0  # length of the current pause (0: none yet)
        self._until_s: float | None = None  # end of the current pause
        self._last_log_s: float | None = None
        self._unlogged = 0  # pauses started since the last log line
        self._skipped: collections.Counter[str] = collections.Counter()
        self.skipped_total = 0  # every count() adds to it: the metrics' cue to look
        self.cooldowns_started = 0

    @property
    def cooling(self) -> bool:
        """True while puts should be skipped (never with ``max_pause_s`` 0). Only
        reads: once the pause is over the next put is the probe, and its answer
        (``record``) ends the pause or starts a longer one."""
        until_s = self._until_s  # read once, without the lock: record() rebinds it
        return until_s is not None and self._now_s() < until_s

    def record(self, codes: list[int]) -> list[int]:
        """Take note of the answers of one native put call, and pass them on. A
        call that stored an object ends the pause and the streak; one that
        stored nothing and got a no-space answer extends the streak."""
        refused = sum(1 for c in codes if is_no_space(c))
        stored = 0 in codes
        if refused:
            self.count(REFUSED, refused)
        if stored:
            if self._streak or self._until_s is not None:
                with self._lock:
                    self._streak, self._pause_s, self._until_s = 0, 0.0, None
        elif refused and self._max_pause_s:
            self._refused(codes[next(i for i, c in enumerate(codes) if is_no_space(c))])
        return codes

    def count(self, reason: str, n: int) -> None:
        """Count ``n`` backup objects not written, for ``reason`` (``SKIP_REASONS``)."""
        if reason not in SKIP_REASONS:
            raise ValueError(f"unknown skip reason {reason!r}; one of {SKIP_REASONS}")
        with self._lock:
            self._skipped[reason] += n
            self.skipped_total += n

    def skip(self, n: int) -> list[int]:
        """``n`` objects not sent in a pause: counted (``COOLDOWN``), and each answered
        as the refusal that started the pause (``SKIPPED_CODE``)."""
        self.count(COOLDOWN, n)
        return [SKIPPED_CODE] * n

    def skipped(self) -> dict[str, int]:
        """A copy of the counts of backup objects not written, by reason."""
        with self._lock:
            return dict(self._skipped)

    def _refused(self, code: int) -> None:
        with self._lock:
            self._streak += 1
            now = self._now_s()
            if self._streak < STREAK_TO_PAUSE:
                return
            if self._until_s is not None and now < self._until_s:
                return  # a call sent before this pause began: the pause stands
            # No pause yet, or this call was the probe after one: (re)start, doubled.
            self._pause_s = min(2 * self._pause_s or FIRST_PAUSE_S, self._max_pause_s)
            self._until_s = now + self._pause_s
            self.cooldowns_started += 1
            self._unlogged += 1
            if self._last_log_s is not None and now - self._last_log_s < LOG_INTERVAL_S:
                return
            started, streak, pause_s = self._unlogged, self._streak, self._pause_s
            self._unlogged = 0
            self._last_log_s = now
        logger.warning(
            "mooncake-span: cluster full (%d put calls in a row refused with %s); pausing "
            "backups of new keys for %.3fs, doubling while probes are refused, at most %.1fs "
            "(%d pause(s) since the last such line)",
            streak,
            ErrorCode(code).name,
            pause_s,
            self._max_pause_s,
            started,
        )


class DomainRouter:
    def __init__(self, options: SpanOptions, ledger: FailureLedger) -> None:
        # With placement, replicas are copies under their own keys (one per
        # segment) so that a read can skip a dead copy; without it, Mooncake's.
        self.copies = options.replica_num if options.placement else 1
        # The replicas Mooncake itself makes of each object a put sends.
        self.mooncake_replicas = 1 if options.placement else options.replica_num
        self.ledger = ledger
        # The live segment list placement chooses from; None: Mooncake places objects.
        self.directory: SegmentDirectory | None = None
        self._max_buffers = options.max_buffers_per_call
        # The placement key of an object key (place_by; None: the key itself).
        self._domain_of: Callable[[str], str] | None = None
        # Set once a put was placed by prefix chain (direct_groups, put_groups):
        # from then on a read that names no chain cannot compute where its keys
        # are (domain_of gives the per-key answer), so while a segment is bad the
        # master is asked.
        self.chained = False

    def segments(self) -> tuple[str, ...]:
        """The live segments placement chooses from (empty: Mooncake places objects)."""
        return self.directory.segments if self.directory is not None else ()

    def copy_keys(self, key: str) -> list[str]:
        return [copy_key(key, r) for r in range(self.copies)]

    def place_by(self, domain_of: Callable[[str], str] | None) -> None:
        self._domain_of = domain_of

    @property
    def untroubled(self) -> bool:
        """One copy per key, no key known lost and no segment marked bad: every key
        can be asked about as it is (the common case, without the clock)."""
        return self.copies == 1 and self.ledger.quiet

    # ---- routing ---------------------------------------------------------------

    def direct(self, keys: Sequence[str]) -> bool:
        """True when the objects can go to Mooncake in the caller's order, cut only
        by the buffer budget (``calls``): one copy per key, no segment marked bad,
        no key named twice."""
        return self.copies == 1 and not self.ledger.any_bad and len(set(keys)) == len(keys)

    def direct_put(self, keys: Sequence[str]) -> bool:
        """``direct``, and no segment is marked full (puts move off it)."""
        return self.direct(keys) and not self.ledger.any_full

    def calls(self, batch: PlanBatch, max_objects: int = 0) -> list[range]:
        """Consecutive objects per native call, each within the buffer budget and,
        if ``max_objects`` is set, at most that many objects."""
        counts = list(map(len, batch.ptrs))
        if sum(counts) <= self._max_buffers and not 0 < max_objects < len(counts):
            return [range(len(counts))]
        calls = split_calls(counts, self._max_buffers)
        if max_objects > 0:
            calls = [
                range(start, min(start + max_objects, call.stop))
                for call in calls
                for start in range(call.start, call.stop, max_objects)
            ]
        return calls

    def direct_groups(
        self,
        keys: Sequence[str],
        domains: Sequence[str] | None = None,
        steps: Sequence[int] | None = None,
    ) -> list[tuple[str, list[int] | None]]:
        """(segment, positions in keys) per segment a direct put writes to; positions
        None: all of them. Segment "": Mooncake places the objects (no segment list).
        ``domains``: the placement key of every key, if the caller has them;
        ``steps``: their chain steps (a prefix chain's keys share its root's domain)."""
        if steps is not None:
            self.chained = True
        segments = self.segments()
        if len(segments) <= 1:
            return [(segments[0] if segments else "", None)]
        placed = self._domains(keys, domains, steps) or keys
        if steps is None:
            chosen_of = np.argmax(segment_weights(placed, segments), axis=1)
        else:
            chosen_of = rankings(placed, segments, steps)[:, 0]
        rows: dict[int, list[int]] = {}
        for i, chosen in enumerate(chosen_of.tolist()):
            rows.setdefault(chosen, []).append(i)
        return [(segments[chosen], positions) for chosen, positions in rows.items()]

    def put_groups(
        self,
        keys: Sequence[str],
        domains: Sequence[str] | None = None,
        steps: Sequence[int] | None = None,
    ) -> dict[str, list[tuple[int, str]]]:
        """Segment -> [(index into keys, object key)]: every copy of every key."""
        if steps is not None:
            self.chained = True
        segments = self.segments()
        return put_targets(
            keys,
            self._domains(keys, domains, steps) if segments else None,
            segments,
            self.copies,
            self.ledger.bad_segments() | self.ledger.full_segments(),
            steps,
        )

    def read_rows(
        self,
        keys: Sequence[str],
        locate: Callable[[list[str]], dict[str, set[str]]],
        domains: Sequence[str] | None = None,
        steps: Sequence[int] | None = None,
    ) -> list[list[str]]:
        """Per key, the copies to try, in order; [] when all sit in bad failure domains.
        Placement is computed only while some segment is bad, and ``locate`` is
        called only if a key was placed on a bad segment, or if its placement is
        unknown: a read naming no chain (``domains``/``steps``) once puts were
        placed by chain, and any key while an SSD owner is down."""
        bad = self.ledger.bad_segments()
        if not bad:
            return [self.copy_keys(key) for key in keys]
        if (domains is None and self.chained) or self.ledger.owners_down_now:
            rows = copy_candidates(keys, None, (), self.copies)  # every copy: ask the master
        else:
            placed = self._domains(keys, domains, steps)
            rows = copy_candidates(keys, placed, self.segments(), self.copies, steps)
        suspects = suspect_copies(rows, bad)
        return live_copies(rows, bad, locate(suspects) if suspects else {})

    def _domains(
        self,
        keys: Sequence[str],
        given: Sequence[str] | None = None,
        steps: Sequence[int] | None = None,
    ) -> Sequence[str] | None:
        if steps is not None and (given is None or len(steps) != len(keys)):
            raise ValueError(f"chain steps for {len(keys)} keys need a domain and a step each")
        if given is not None:
            if len(given) != len(keys):
                raise ValueError(f"{len(given)} placement domains for {len(keys)} keys")
            return given
        return list(map(self._domain_of, keys)) if self._domain_of is not None else None
