"""Device specs on the command line: nodes, counts, sizes and speeds, and the compact form printed back."""

from __future__ import annotations

import pytest

from shardmesh.planning.devices import describe_devices, parse_devices

GiB = 2**30


def test_device_specs() -> None:
    ds = parse_devices("4x24GiB")
    assert [d.name for d in ds] == ["node0/0", "node0/1", "node0/2", "node0/3"] and {d.memory for d in ds} == {24 * GiB}
    ds = parse_devices("nodeA:2x80GiB,nodeB:1x48GiB@0.5,nodeA:1x40GiB")
    assert [(d.name, d.memory // GiB, d.speed) for d in ds] == [
        ("nodeA/0", 80, 1.0), ("nodeA/1", 80, 1.0), ("nodeB/0", 48, 0.5), ("nodeA/2", 40, 1.0)]  # fmt: skip
    assert describe_devices(ds) == "nodeA:2x80GiB,nodeA:1x40GiB,nodeB:1x48GiB@0.5"
    for bad, why in (("4x", "COUNTxSIZE"), ("0x8GiB", "count must be >= 1"), ("2x8 parsecs", "size like"),
                     ("a:2x8GiB@0", "speed must be > 0")):  # fmt: skip
        with pytest.raises(ValueError, match=why):
            parse_devices(bad)
