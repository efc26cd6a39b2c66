"""Human-readable sizes ("4gb", "512mb", 1024) as byte counts: the one meaning of
"1gb" for config and CLI code alike (stdlib only)."""

from __future__ import annotations

import re
from fractions import Fraction

# Binary, "k", "kb" and "kib" alike: Mooncake's own config treats "1GB" as 1 << 30.
_UNIT_BYTES = {"": 1, "b": 1} | {
    prefix + suffix: 1 << 10 * power
    for power, prefix in enumerate("kmgt", start=1)
    for suffix in ("", "b", "ib")
}

_SIZE_RE = re.compile(r"^(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[a-z]*)$")


def parse_size_bytes(value: str | int) -> int:
    """The bytes ``value`` denotes: a non-negative int, or a string such as ``"1024"``,
    ``"512MB"`` or ``"1.5GiB"`` (units case-insensitive and binary), fractional only
    where the bytes are whole. ValueError, repeating the value, for anything else."""
    # bool is an int subclass; "True bytes" is always a caller bug.
    if isinstance(value, bool):
        raise ValueError(f"invalid size {value!r}: expected bytes as an int or a string like '4gb'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"invalid size {value!r}: sizes must be >= 0 bytes")
        return value
    if not isinstance(value, str):
        raise ValueError(
            f"invalid size {value!r}: expected an int or a string like '512mb', "
            f"got {type(value).__name__}"
        )

    match = _SIZE_RE.match(value.strip().lower())
    if match is None:
        raise ValueError(
            f"invalid size {value!r}: expected a non-negative number with an optional unit "
            f"(b, kb, mb, gb, tb), e.g. '4gb', '512mb' or '1024'"
        )
    unit = match.group("unit")
    if unit not in _UNIT_BYTES:
        raise ValueError(
            f"invalid size {value!r}: unknown unit {unit!r}; use one of b, kb, mb, gb, tb"
        )
    # Exact rational arithmetic: float rounding must not turn "1.1kb" into a size.
    size = Fraction(match.group("number")) * _UNIT_BYTES[unit]
    if size.denominator != 1:
        raise ValueError(f"invalid size {value!r}: it is not a whole number of bytes")
    return int(size)
