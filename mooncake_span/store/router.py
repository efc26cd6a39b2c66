"""Which objects a store call touches, and on which segment. No I/O.

``DomainRouter`` decides, per call, from the client's ``FailureLedger``
(``failure_ledger.py``: bad, full and owner-down segments, lost keys) and the
number of copies per key:

* whether the call can go to Mooncake as the caller built it: one copy per
  key, no segment marked bad, no key named twice. That is nearly every call
  of a healthy cluster; it costs a few C-level passes over the keys instead
  of per-object Python, and the objects go in consecutive slices of at most
  ``max_buffers_per_call`` buffers (one native call when they fit);
* which segment each object of a put is placed on (rendezvous hashing of its
  domain key, rotated by its chain step when the caller knows its prefix
  chain: ``domains.py``);
* which copies of a key are worth a read while some segment is bad.

Where the master says a suspect object lives is an RPC; ``DomainCalls`` makes
it and passes the answer in (``locate``). The live segments are the segment
directory's (``segments.py``), read, never asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from mooncake_span.config import SpanOptions
from mooncake_span.span.plan import PlanBatch, split_calls
from mooncake_span.store.domains import (
    copy_candidates,
    copy_key,
    first_choices,
    live_copies,
    put_targets,
    segment_weights,
    suspect_copies,
)
from mooncake_span.store.failure_ledger import FailureLedger
from mooncake_span.store.segments import SegmentDirectory

# Object key -> the segments the master reports holding it.
Locate = Callable[[list[str]], dict[str, set[str]]]


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
        # The placement key of an object key: objects with one domain share a
        # segment. Given through place_by (the client passes on the backend's
        # KeySchema.domain_of); None: the key itself.
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
        """The object keys of every copy of ``key``."""
        return [copy_key(key, r) for r in range(self.copies)]

    def place_by(self, domain_of: Callable[[str], str] | None) -> None:
        """Place objects by ``domain_of(object key)`` (None: by the key itself)."""
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
            chosen_of = first_choices(placed, segments, steps)
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
        locate: Locate,
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
            if self.copies == 1:
                return [[key] for key in keys]
            return [[copy_key(key, r) for r in range(self.copies)] for key in keys]
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
