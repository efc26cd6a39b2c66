"""Exception hierarchy and the Mooncake return codes mooncake-span acts on.

Per-key misses are data (a ``False`` in a result list), never exceptions. The
exceptions below are for whole-call failures, bad configuration and bad input;
each subclasses a builtin so generic handlers keep working.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Sequence


class MooncakeSpanError(Exception):
    """Base class of every error raised by mooncake-span."""


class ConfigError(MooncakeSpanError, ValueError):
    """A configuration value is missing, unknown or malformed."""


class GeometryError(MooncakeSpanError, ValueError):
    """A transfer does not fit the span geometry (stride, page alignment, sizes)."""


class InvalidRequestError(MooncakeSpanError, ValueError):
    """A call from sglang carries bad input (keys, host indices, tensors, transfers,
    policies): answered with the miss value and a log line; nothing stored is touched."""


class RegistrationError(MooncakeSpanError, ValueError):
    """A host pool cannot be served (unknown pool, unsupported layout, bad span factor)."""


class SetupError(MooncakeSpanError, RuntimeError):
    """The Mooncake client could not be set up or a buffer could not be registered."""


class StoreClosedError(MooncakeSpanError, RuntimeError):
    """A call arrived after ``close()``; the native client is never touched then."""


class TransportError(MooncakeSpanError, RuntimeError):
    """A whole Mooncake call failed (RPC or transfer failure, breaker open)."""


class LayoutConflictError(MooncakeSpanError, RuntimeError):
    """Another node published a different span geometry for the same key namespace."""


class ErrorCode(enum.IntEnum):
    """The subset of Mooncake's ``ErrorCode`` (mooncake-store types.h) we classify."""

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    SEGMENT_NOT_FOUND = -101
    CLIENT_NOT_FOUND = -103
    NO_AVAILABLE_HANDLE = -200
    INVALID_KEY = -400
    WRITE_FAIL = -500
    INVALID_PARAMS = -600
    ILLEGAL_CLIENT = -601
    INVALID_WRITE = -700
    INVALID_READ = -701
    INVALID_REPLICA = -702
    REPLICA_IS_NOT_READY = -703
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707
    REPLICA_IS_GONE = -712
    TRANSFER_FAIL = -800
    CHECKSUM_MISMATCH = -801
    RPC_FAIL = -900
    RPC_TIMEOUT = -901
    ETCD_OPERATION_ERROR = -1000
    UNAVAILABLE_IN_CURRENT_STATUS = -1010
    # setup with enable_ssd_offload against a master without --enable_offload=true.
    UNABLE_OFFLOAD = -1300
    # An SSD owner's object file (mooncake-store types.h, FILE_*).
    FILE_NOT_FOUND = -1100
    FILE_OPEN_FAIL = -1101
    FILE_READ_FAIL = -1102
    FILE_WRITE_FAIL = -1103
    # A tenant over its quota: no space for it. -1700 in types.h from 0.3.12 on, and
    # in the code-name table of the 0.3.13.post1 wheel's store.so.
    TENANT_QUOTA_EXCEEDED = -1700
    # mooncake-span's own, never Mooncake's: a complete read whose bytes failed
    # their seal (store/seal.py, span_object_checksums).
    SEAL_MISMATCH = -30801


# Codes that mean "the cluster (master, network, a peer) did not answer", as
# opposed to "this object is missing" or "this request was wrong".
TRANSPORT_CODES = frozenset(
    {
        ErrorCode.INTERNAL_ERROR,
        ErrorCode.TRANSFER_FAIL,
        ErrorCode.RPC_FAIL,
        ErrorCode.RPC_TIMEOUT,
        ErrorCode.ETCD_OPERATION_ERROR,
        ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS,
    }
)

# Codes that mean "this object is broken" (wrong bytes, or an SSD file gone or torn):
# a miss, and never offered again (docs/reliability.md, "Broken objects stay gone").
# Not FILE_OPEN_FAIL: running out of file descriptors says nothing about the object.
INTEGRITY_CODES = frozenset(
    {
        ErrorCode.CHECKSUM_MISMATCH,
        ErrorCode.SEAL_MISMATCH,
        ErrorCode.FILE_NOT_FOUND,
        ErrorCode.FILE_READ_FAIL,
    }
)

# Mooncake's answers to a put that mean "no space for this object now"
# (store/router.py, PutPressure, pauses puts on them).
NO_SPACE_CODES = frozenset({ErrorCode.NO_AVAILABLE_HANDLE, ErrorCode.TENANT_QUOTA_EXCEEDED})


def code_name(code: int) -> str:
    """A stable label for a native return code, known or not (for counters and logs)."""
    try:
        return ErrorCode(code).name
    except ValueError:
        return f"CODE_{code}"


def is_transport_failure(code: int) -> bool:
    """Nothing answered: not a miss, and no proof the key is absent."""
    return code in TRANSPORT_CODES


def is_transfer_failure(code: int) -> bool:
    """The data transfer with one peer (a storage node) failed: that node's failure domain."""
    return code == ErrorCode.TRANSFER_FAIL


def is_cluster_failure(code: int) -> bool:
    """A failure of the master or the RPC layer, which is what the circuit breaker is for
    (a TRANSFER_FAIL names one peer: it marks that failure domain bad instead)."""
    return is_transport_failure(code) and not is_transfer_failure(code)


def is_integrity_failure(code: int) -> bool:
    return code in INTEGRITY_CODES


def is_no_space(code: int) -> bool:
    return code in NO_SPACE_CODES


# The one translation of a data call's per-object codes into True or False per object.


def written(codes: Sequence[int]) -> list[bool]:
    """A put's codes: True where the object was stored (0)."""
    return [code == 0 for code in codes]


def read_whole(codes: Sequence[int], planned_bytes: Sequence[int]) -> list[bool]:
    """A get's codes: True only where exactly the planned bytes arrived (a
    positive code is the bytes read)."""
    return list(map(operator.eq, codes, planned_bytes))


def short_reads(codes: Sequence[int], planned_bytes: Sequence[int]) -> int:
    """How many objects of a get read some bytes, but not the planned ones."""
    return sum(1 for code, n in zip(codes, planned_bytes, strict=True) if 0 <= code != n)


def found(codes: Sequence[int]) -> list[bool]:
    """An existence query's codes: True where the object exists (1)."""
    return [code == 1 for code in codes]
