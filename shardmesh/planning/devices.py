"""The devices a model is planned onto: memory each, relative speed, grouped into nodes.

Written on the command line as comma-separated groups ``[NODE:]COUNTxSIZE[@SPEED]``:

  ``4x24GiB``                          four 24 GiB devices on one node (named ``node0``)
  ``nodeA:2x80GiB,nodeB:1x48GiB``      two nodes; tensor-parallel groups never span them
  ``nodeA:2x80GiB@1,nodeA:2x40GiB@0.5`` one node with uneven devices; speed is relative (default 1)

Groups without a node name belong to ``node0``; groups naming the same node add to it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shardmesh.core.units import format_bytes, parse_bytes

DEFAULT_NODE = "node0"
_GROUP = re.compile(
    r"^(?:(?P<node>[A-Za-z0-9_.-]+):)?(?P<count>\d+)\s*[xX×]\s*(?P<size>[^@]+?)(?:@(?P<speed>[\d.]+))?$"
)


@dataclass(frozen=True)
class Device:
    """One accelerator (or one host's memory for a CPU worker)."""

    node: str
    index: int  # position within its node, 0-based
    memory: int  # bytes
    speed: float = 1.0  # relative throughput; only ratios matter

    @property
    def name(self) -> str:
        return f"{self.node}/{self.index}"

    def describe(self) -> str:
        speed = f"@{self.speed:g}" if self.speed != 1.0 else ""
        return f"{self.name} ({format_bytes(self.memory)}{speed})"


def make_devices(groups: list[tuple[str, int, int, float]]) -> tuple[Device, ...]:
    """Devices from (node, count, memory bytes, speed) groups, indexed within each node in order."""
    out: list[Device] = []
    per_node: dict[str, int] = {}
    for node, count, memory, speed in groups:
        if count < 1:
            raise ValueError(f"{node}: a device count must be >= 1, got {count}")
        if memory < 1:
            raise ValueError(f"{node}: device memory must be > 0 bytes")
        if not speed > 0:
            raise ValueError(f"{node}: device speed must be > 0, got {speed}")
        for _ in range(count):
            i = per_node.get(node, 0)
            per_node[node] = i + 1
            out.append(Device(node, i, memory, speed))
    return tuple(out)


def parse_devices(text: str) -> tuple[Device, ...]:
    """``nodeA:2x80GiB,nodeB:1x48GiB@0.5`` → devices (see the module docstring). Raises ValueError."""
    groups = []
    for raw in (g.strip() for g in text.split(",")):
        m = _GROUP.match(raw)
        if not raw or m is None:
            raise ValueError(f"--devices: expected [NODE:]COUNTxSIZE[@SPEED] groups separated by commas, e.g. "
                             f"4x24GiB or nodeA:2x80GiB,nodeB:1x48GiB; got {raw!r}")  # fmt: skip
        try:
            size = parse_bytes(m.group("size"))
            speed = float(m.group("speed")) if m.group("speed") else 1.0
        except ValueError as e:
            raise ValueError(f"--devices: {raw!r}: {e}") from None
        groups.append((m.group("node") or DEFAULT_NODE, int(m.group("count")), size, speed))
    try:
        return make_devices(groups)
    except ValueError as e:
        raise ValueError(f"--devices: {e}") from None


def nodes_of(devices: tuple[Device, ...]) -> dict[str, list[Device]]:
    """Devices by node, nodes in the order they first appear."""
    out: dict[str, list[Device]] = {}
    for d in devices:
        out.setdefault(d.node, []).append(d)
    return out


def compact_bytes(n: int) -> str:
    """The shortest exact spelling `parse_bytes` reads back: ``80GiB``, ``48GB``, or bytes."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("TB", 10**12), ("GB", 10**9), ("MB", 10**6)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return format_bytes(n).replace(" ", "")


def gb(n: float) -> str:
    """Decimal gigabytes, two decimals: what a person multiplies out by hand (parameters × bytes)."""
    return f"{n / 1e9:.2f} GB"


def describe_devices(devices: tuple[Device, ...]) -> str:
    """The compact form again: ``nodeA:2x80GiB,nodeB:1x48GiB``."""
    parts: list[str] = []
    for node, ds in nodes_of(devices).items():
        runs: list[tuple[int, float, int]] = []
        for d in ds:
            if runs and runs[-1][:2] == (d.memory, d.speed):
                runs[-1] = (d.memory, d.speed, runs[-1][2] + 1)
            else:
                runs.append((d.memory, d.speed, 1))
        for memory, speed, count in runs:
            parts.append(f"{node}:{count}x{compact_bytes(memory)}" + (f"@{speed:g}" if speed != 1.0 else ""))
    return ",".join(parts)
