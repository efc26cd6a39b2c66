"""Which objects a hit query probes, round by round. Pure.

Mooncake 0.3.13 leases every existing object ``batch_is_exist`` finds (about
10 s; eviction skips it), so a query probes only what its answer can depend
on, in at most twice sglang's existence RPCs: docs/architecture.md, "Hit queries".
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncake_span.span.hits import BLOCK_GROUPS, block_group_pages

# Upstream sends one KV RPC, plus one for the sidecars when KV hit.
KV_ROUNDS_ALONE = 2
KV_ROUNDS_WITH_SIDECARS = 3


@dataclass(frozen=True)
class ProbePolicy:
    """KV probe chunks: ``first_chunk_keys``, then the rest of the query over the
    remaining rounds, in equal chunks (``growth`` 0) or each chunk ``growth``
    times the one before until the round cap gives the last chunk the rest.

    Why one key, then equal chunks: docs/benchmarks.md, "2026-12-01: hit
    queries and leases".
    """

    first_chunk_keys: int = 1
    growth: int = 0

    def __post_init__(self) -> None:
        if self.first_chunk_keys < 1:
            raise ValueError(
                f"probe first_chunk_keys must be >= 1 key, got {self.first_chunk_keys}"
            )
        if self.growth < 0:
            raise ValueError(f"probe growth must be >= 0 (0: equal chunks), got {self.growth}")

    def chunks(self, total_keys: int, max_rounds: int) -> list[tuple[int, int]]:
        """``[start, end)`` key ranges of the KV rounds, covering ``0..total_keys``."""
        if max_rounds < 1:
            raise ValueError(f"a hit query needs at least one probe round, got {max_rounds}")
        out: list[tuple[int, int]] = []
        start = 0
        while start < total_keys:
            rounds_left = max_rounds - len(out)
            if not out:
                size = self.first_chunk_keys
            elif self.growth:
                size = self.first_chunk_keys * self.growth ** len(out)
            else:
                size = -(-(total_keys - start) // rounds_left)  # ceil: the rest, evenly
            end = total_keys if rounds_left == 1 else min(total_keys, start + size)
            out.append((start, end))
            start = end
        return out


def sidecar_pages(policy: str, kv_pages: int, block_pages: int = 0, group_pages: int = 0) -> int:
    """Leading pages of a sidecar pool whose existence can change the hit answer:
    all of the KV prefix, except that a BLOCK_GROUPS pool counts whole groups only."""
    if policy == BLOCK_GROUPS:
        return block_group_pages([True] * kv_pages, block_pages, group_pages)
    return kv_pages


@dataclass
class ProbeTally:
    """What one hit query asked the master: existence rounds and objects named."""

    rpcs: int = 0
    objects: int = 0

    def add(self, objects: int, rpcs: int = 1) -> None:
        """A round sent in ``rpcs`` native RPCs (the store client splits long queries
        and may ask where suspect copies are); a round naming no objects sends nothing."""
        if objects:
            self.rpcs += rpcs
            self.objects += objects
