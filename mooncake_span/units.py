"""Parsing of human-readable sizes ("4gb", "512mb", 1024) into byte counts.

Pure: no I/O, no imports beyond the standard library, so config and CLI code
can share one definition of what "1gb" means.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["parse_size_bytes"]

# Binary multiples: Mooncake's own config treats "1GB" as 1 << 30, and segment
# sizes are compared against page sizes that are powers of two.
# "k", "kb" and "kib" alike; likewise m, g and t.
_UNIT_BYTES = {"": 1, "b": 1} | {
    prefix + suffix: 1 << 10 * power
    for power, prefix in enumerate("kmgt", start=1)
    for suffix in ("", "b", "ib")
}

_SIZE_RE = re.compile(r"^(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[a-z]*)$")


def parse_size_bytes(value: str | int) -> int:
    """Return the number of bytes that ``value`` denotes.

    Accepts non-negative ints and strings such as ``"1024"``, ``"64kb"``,
    ``"512MB"``, ``"4gb"`` or ``"1.5GiB"`` (units are case-insensitive and
    binary: 1 kb = 1024 bytes). A fractional number is allowed only when it
    yields a whole number of bytes.

    Raises:
        ValueError: ``value`` is negative, empty, not a size, or has an
            unknown unit; the message repeats the offending value.
    """
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

    text = value.strip().lower()
    match = _SIZE_RE.match(text)
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
