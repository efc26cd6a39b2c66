"""argparse value types the command-line tools share: an error names what was wrong."""

from __future__ import annotations

import argparse
import functools

from mooncake_span.units import parse_size_bytes


def size_arg(text: str) -> int:
    try:
        return parse_size_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {value}")
    return value


positive_int_arg = functools.partial(_int_at_least, least=1)
non_negative_int_arg = functools.partial(_int_at_least, least=0)
