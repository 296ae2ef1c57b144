"""Whether a re-planned mesh fits in its workers' memory: the planner's memory model, asked by the registry
before it moves the model onto fewer (or more) stages than it serves on now.

The registry re-plans when a slot cannot be filled by a spare: a drained worker with no spare to hand over to,
or a lost one that has not come back within `--replan-after` seconds. It then tries the largest pipeline the
healthy workers can form, down to one stage, and takes the first whose every stage fits by this check. When
workers join again, it grows back to the planned number of stages.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from shardmesh.core.topology import ModelSpec, ServingLimits

Split = tuple[tuple[int, int], ...]
MemoryCheck = Callable[[int, Split, Sequence[int], Sequence[str]], str]


def planner_check(model: ModelSpec, limits: ServingLimits, tp: int, tp_split: tuple[int, ...] = ()) -> MemoryCheck:
    """A check `(pp, split, memory per rank, device type per rank) -> why not ("" when it fits)` for `model`."""
    from shardmesh.core.units import format_bytes
    from shardmesh.planning.devices import Device
    from shardmesh.planning.memory import RuntimeCosts, load_model
    from shardmesh.planning.planner import PlanOptions, stage_capacity

    info = functools.cache(lambda: load_model(model.path))

    def check(pp: int, split: Split, memory: Sequence[int], kinds: Sequence[str]) -> str:
        if any(m <= 0 for m in memory):
            return ""  # a device that did not say how much memory it has: nothing to check against
        for s, (start, end) in enumerate(split):
            ranks = range(s * tp, (s + 1) * tp)
            group = tuple(Device(f"rank{r}", i, memory[r]) for i, r in enumerate(ranks))
            options = PlanOptions(dtype=model.dtype, quantization=model.quantization, limits=limits,
                                  runtime=RuntimeCosts.for_device(kinds[s * tp]), tp=tp, pp=pp,
                                  tp_split=tp_split)  # fmt: skip
            held = stage_capacity(info(), group, s == 0, s == pp - 1, model.num_layers, options)
            if held < end - start:
                smallest = format_bytes(min(memory[r] for r in ranks))
                return (f"at pp={pp}, stage {s} needs layers {start}-{end - 1} but its devices ({smallest}) "
                        f"hold {held}")  # fmt: skip
        return ""

    return check
