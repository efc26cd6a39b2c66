"""parse_size_bytes: the one definition of "4gb" shared by config and CLI."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake_span.units import parse_size_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("1024", 1024),
        ("64kb", 64 << 10),
        ("64KB", 64 << 10),
        ("512mb", 512 << 20),
        ("512MB", 512 << 20),
        ("4gb", 4 << 30),
        ("4GB", 4 << 30),
        ("4GiB", 4 << 30),
        ("1tb", 1 << 40),
        ("16m", 16 << 20),
        ("100b", 100),
        (" 2 gb ", 2 << 30),
        ("1.5gb", 3 << 29),
        ("0.5kb", 512),
    ],
)
def test_parses_sizes(text, expected):
    assert parse_size_bytes(text) == expected


@pytest.mark.parametrize("value", [0, 1, 4096, 1 << 40])
def test_ints_pass_through(value):
    assert parse_size_bytes(value) == value


@pytest.mark.parametrize(
    "bad",
    ["", "   ", "gb", "-1", "-4gb", "4xb", "4 g b", "1e9", "0x10", "4gb4", "1.1b", "abc", "1,024"],
)
def test_rejects_garbage_naming_the_value(bad):
    with pytest.raises(ValueError) as excinfo:
        parse_size_bytes(bad)
    assert repr(bad) in str(excinfo.value)


@pytest.mark.parametrize("bad", [-1, True, False, 1.5, None, [1]])
def test_rejects_negative_and_non_size_types(bad):
    with pytest.raises(ValueError) as excinfo:
        parse_size_bytes(bad)
    assert repr(bad) in str(excinfo.value)


@given(
    st.integers(min_value=0, max_value=1 << 20),
    st.sampled_from([("", 1), ("kb", 1 << 10), ("MB", 1 << 20), ("Gb", 1 << 30)]),
)
def test_number_times_unit(number, unit):
    suffix, multiplier = unit
    assert parse_size_bytes(f"{number}{suffix}") == number * multiplier
