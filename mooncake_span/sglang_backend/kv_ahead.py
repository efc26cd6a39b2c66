"""The KV pool's existence answers, asked one call early.

sglang backs up a batch of a hybrid model as ``batch_set_v2`` (its sidecar
pools) and then ``batch_set_v1`` (the KV pool), with the same page keys, on its
one backup thread. When the sidecar call carries a KV-derived pool (DSA's
indexer, whose keys are the KV keys), its existence query asks about the KV
objects of those keys too (and renews the chain's KV prefix), and keeps the
answers here for the KV call that follows, which then sends no query of its
own: one master RPC less per backup. An answer is used at most once, by
the thread that asked, for exactly the same objects and within ``FRESH_S``;
otherwise the KV call asks as always. A stored answer read here is as old as
the one a put right after a query relies on: milliseconds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

# Longer than the sidecar put that separates the two calls, short against eviction.
FRESH_S = 1.0


@dataclass(frozen=True)
class KvAnswer:
    objects: list[str]
    stored: list[bool]
    reachable: bool  # the chain's prefix was wholly stored (or not checked)
    at_s: float


class KvAhead:
    """One answer per thread, taken by the next KV call of that thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._local = threading.local()
        self._clock = clock

    def keep(self, objects: list[str], stored: list[bool], reachable: bool) -> None:
        self._local.answer = KvAnswer(objects, stored, reachable, self._clock())

    def take(self, objects: list[str]) -> KvAnswer | None:
        """The kept answer if about exactly ``objects`` and fresh (used up either way)."""
        answer = getattr(self._local, "answer", None)
        self._local.answer = None
        fresh = answer is not None and self._clock() - answer.at_s <= FRESH_S
        return answer if fresh and answer.objects == objects else None
