"""Reads an SSD tier answers, and what their failures mean. Pure: no native calls.

An object whose DRAM copy was evicted keeps a ``LOCAL_DISK`` replica on the
storage node that held it; a reader asks that owner over RPC, the owner loads
the object into its registered read buffer and the reader pulls it
(``store/ssd_tier.py``). Two failures are the tier's own:

* the owner's read buffer cannot hold a call's share (``BUFFER_OVERFLOW``,
  every object of that owner in the call, at once): the objects are asked
  again in halves (``overflowed``), down to one object per call;
* the owner is down but not yet expired at the master (up to its
  ``client_ttl``): existence queries still answer yes and each read blocks
  about 4.3 s in Mooncake's RPC retries before ``RPC_FAIL``. The master still
  answers, which tells this apart from a dead master; ``disk_only`` says which
  of the failed objects had nothing but a disk replica. The client then marks
  the owner's segment bad (its DRAM segment, still listed), so reads and hit
  queries skip that owner's keys at once instead of paying 4.3 s per call,
  until the mark's TTL runs out.

A replica descriptor does not name a disk replica's owner (``query_key`` and
``batch_get_replica_desc`` leave it out in 0.3.13.post1), and placement cannot
tell it (a put lands on another segment when the preferred one is full): the
master's admin server can (``segments.fetch_disk_owners``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mooncake_span.errors import ErrorCode

OVERFLOW = int(ErrorCode.BUFFER_OVERFLOW)
OWNER_RPC_FAILED = int(ErrorCode.RPC_FAIL)
# The client's counter (failed_objects_total{code=...}) of reads from an SSD owner that was down.
OWNER_DOWN_LABEL = "SSD_OWNER_DOWN"


def overflowed(codes: Sequence[int]) -> list[int]:
    """Positions of objects an owner's read buffer could not take in this call."""
    return [i for i, code in enumerate(codes) if code == OVERFLOW]


def halves(positions: Sequence[int]) -> list[list[int]]:
    middle = len(positions) // 2
    return [list(positions[:middle]), list(positions[middle:])]


def owner_failures(codes: Sequence[int]) -> list[int]:
    """Positions of objects whose read failed at the RPC layer (a dead master, or a dead owner)."""
    return [i for i, code in enumerate(codes) if code == OWNER_RPC_FAILED]


def disk_only(found: Mapping[str, Sequence[Any]] | None) -> set[str]:
    """Object keys whose replicas (``batch_get_replica_desc``) are all on an owner's disk."""
    return {
        key
        for key, replicas in (found or {}).items()
        if replicas and all(replica.is_local_disk_replica() for replica in replicas)
    }
