"""Byte sizes as people write them and as the planner prints them."""

from __future__ import annotations

import pytest

from shardmesh.core.units import format_bytes, parse_bytes

GiB = 2**30


def test_sizes_parse_and_print() -> None:
    assert parse_bytes("24GiB") == 24 * GiB and parse_bytes("80GB") == 80 * 10**9 and parse_bytes(512) == 512
    assert parse_bytes("1.5 MiB") == 3 * 2**19 and parse_bytes("7") == 7
    assert format_bytes(16_060_522_496) == "14.96 GiB" and format_bytes(-3 * 2**20) == "-3.00 MiB"
    for bad in ("24 gigs", "-1GiB", "GiB", ""):
        with pytest.raises(ValueError, match="expected a size like 24GiB"):
            parse_bytes(bad)
