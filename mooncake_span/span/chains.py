"""Chain records: which stored keys a hit query can still reach. Pure.

A hit query stops at a chain's first missing key, and Mooncake keeps no chains;
so a sample of chains (the same roots on every node) keeps a record of its page
keys under the namespace prefix, which ``mooncake-span inspect`` checks against
the stored keys: docs/operating.md, "`mooncake-span inspect`".
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from typing import Any

CHAIN_RECORD_MARK = "__chain_"


def chain_sampled(root: str, every: int) -> bool:
    """Whether the chain rooted at page key ``root`` keeps a record: one in ``every``
    roots (0: none), by a hash every process computes alike."""
    return every > 0 and zlib.crc32(root.encode("utf-8", "surrogatepass")) % every == 0


def chain_record_key(key_prefix: str, root: str, length: int) -> str:
    """The record of the chain rooted at ``root``, ``length`` keys long, under the
    namespace's prefix (so ``clear`` removes it with the rest)."""
    if length < 1:
        raise ValueError(f"a chain record covers >= 1 key, got {length}")
    return f"{key_prefix}{CHAIN_RECORD_MARK}{root}_{length}"


def parse_chain_record_key(key: str) -> tuple[str, str, int] | None:
    """``(namespace key prefix, root, length)`` of a chain record key, else None."""
    at = key.find(CHAIN_RECORD_MARK)
    if at <= 0:
        return None
    root, _, length = key[at + len(CHAIN_RECORD_MARK) :].rpartition("_")
    if not root or not length.isdigit() or int(length) < 1:
        return None
    return key[:at], root, int(length)


def record_bytes(chain: Sequence[str]) -> bytes:
    return "\n".join(chain).encode("utf-8", "surrogatepass")


def record_keys(text: str) -> list[str]:
    return [line for line in text.split("\n") if line]


def reachable_estimate(
    chains: Iterable[Sequence[str]], stored: set[str] | frozenset[str]
) -> dict[str, Any]:
    """Over ``chains`` (each a list of page keys from its root), how many keys are
    stored and how many of those lead back to the root unbroken (``share``: None
    when no key is stored)."""
    count = held = reached = 0
    for chain in chains:
        count += 1
        flags = [key in stored for key in chain]
        held += sum(flags)
        reached += flags.index(False) if False in flags else len(flags)
    return {
        "chains_sampled": count,
        "stored_keys": held,
        "reachable_keys": reached,
        "share": round(reached / held, 4) if held else None,
    }
