"""Placement policy as pure functions: who holds which slot, what state each slot shows, and when
the shards must form new process groups.

Nothing here has a clock, a lock or a network: the registry feeds in its records and publishes what
comes out, so every rule can be tested on plain values.

Policy v1: the mesh is pp × tp slots in global-rank order (rank = stage * tp + tp_rank, the layout
`shardmesh.engine.groups` uses). Registered workers fill vacant slots lowest rank first, in
registration order; workers beyond pp * tp wait as standbys and fill slots that are vacated. A
slot may require labels (a manifest's plan puts rank r on node N: it requires {"node": N}); only a
worker registered with those labels takes it. A worker that stops heartbeating keeps its slot
(marked UNHEALTHY), so it can take it back when it restarts.

The layer split is data too: the planner's (possibly uneven) split, or the one calibration measured
(`rebalance: by-speed`). It is part of the placement key, so a new split starts a new epoch and the
workers reload their layers before forming new groups.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shardmesh.core.layout import check_split, split_layers
from shardmesh.core.topology import (
    Calibration,
    CalibrationStatus,
    ModelSpec,
    Rendezvous,
    ServingLimits,
    ShardAssignment,
    ShardState,
    Stage,
    Topology,
)

Slots = tuple[str | None, ...]  # global rank -> id of the worker holding it, None when vacant
Split = tuple[tuple[int, int], ...]  # half-open layer range per stage
Labels = tuple[tuple[str, str], ...]  # sorted (key, value) pairs
# The layer split, then (worker id, incarnation) per rank
PlacementKey = tuple[Split, tuple[tuple[str, int], ...]]


@dataclass(frozen=True)
class WorkerView:
    """What placement needs to know about one registered worker."""

    worker_id: str
    address: str
    incarnation: int  # bumps on every registration: a restarted process must rejoin its groups
    reported: ShardState  # the state the worker last reported
    applied_version: int  # the newest topology version the worker says it has acted on
    timed_out: bool  # heartbeats stopped for longer than the timeout
    labels: tuple[tuple[str, str], ...] = ()  # as registered; published with the slot it holds


def empty_slots(pp: int, tp: int) -> Slots:
    return (None,) * (pp * tp)


def fits(labels: Labels, requires: Labels) -> bool:
    """Whether a worker registered with `labels` may hold a slot that requires `requires`."""
    return set(requires) <= set(labels)


def fill_slots(
    slots: Slots, candidates: Sequence[str], labels: Mapping[str, Labels] | None = None,
    requires: Sequence[Labels] | None = None,
) -> Slots:  # fmt: skip
    """Give vacant slots, lowest rank first, to the first of `candidates` (in their order) not already
    placed whose `labels` have what the slot `requires`."""
    placed = {w for w in slots if w is not None}
    queue = [c for c in dict.fromkeys(candidates) if c not in placed]
    out: list[str | None] = []
    for rank, holder in enumerate(slots):
        if holder is None:
            need = requires[rank] if requires else ()
            holder = next((c for c in queue if fits((labels or {}).get(c, ()), need)), None)
            if holder is not None:
                queue.remove(holder)
        out.append(holder)
    return tuple(out)


def vacate(slots: Slots, worker_id: str) -> Slots:
    return tuple(None if w == worker_id else w for w in slots)


def placement_key(split: Split, slots: Slots, workers: Mapping[str, WorkerView]) -> PlacementKey | None:
    """The layer split and who holds every rank, down to the process; None while any slot is vacant."""
    if any(w is None for w in slots):
        return None
    return split, tuple((w, workers[w].incarnation) for w in slots if w is not None)


def next_epoch(
    prev_key: PlacementKey | None, prev_epoch: int | None, key: PlacementKey | None, next_version: int
) -> int | None:
    """The rendezvous epoch for a topology with placement `key`, about to be published as `next_version`.

    Unchanged placement keeps its epoch (and so its process groups); a new one starts an epoch named
    after the version that introduces it; no epoch at all while slots are vacant.
    """
    if key is None:
        return None
    if key == prev_key and prev_epoch is not None:
        return prev_epoch
    return next_version


def shard_state(worker: WorkerView | None, epoch: int | None) -> ShardState:
    """The state a slot shows. READY only counts for the current epoch: a worker whose groups belong
    to an older placement must rejoin first, so until it reports having applied the epoch it is PENDING."""
    if worker is None:
        return ShardState.PENDING
    if worker.timed_out or worker.reported is ShardState.UNHEALTHY:
        return ShardState.UNHEALTHY
    if worker.reported is ShardState.LOADING:
        return ShardState.LOADING
    if worker.reported is ShardState.READY and epoch is not None and worker.applied_version >= epoch:
        return ShardState.READY
    return ShardState.PENDING


def build_topology(
    *,
    version: int,
    model: ModelSpec,
    pp: int,
    tp: int,
    limits: ServingLimits,
    store_host: str,
    store_port: int,
    slots: Slots,
    workers: Mapping[str, WorkerView],
    epoch: int | None,
    split: Split | None = None,
    requires: Sequence[Labels] | None = None,
    calibration: Calibration | None = None,
) -> Topology:
    """The topology that `slots` and the workers' reports describe; `split` defaults to an even one."""
    if len(slots) != pp * tp:
        raise ValueError(f"expected {pp * tp} slots for pp={pp} tp={tp}, got {len(slots)}")
    split = split or tuple(split_layers(model.num_layers, pp))
    check_split(split, model.num_layers, pp)
    stages = []
    for s, (start, end) in enumerate(split):
        shards = []
        for t in range(tp):
            rank = s * tp + t
            worker = workers.get(slots[rank]) if slots[rank] is not None else None  # type: ignore[arg-type]
            shards.append(ShardAssignment(t, rank, worker.worker_id if worker else "", worker.address if worker else "",
                                          shard_state(worker, epoch), worker.labels if worker else (),
                                          requires[rank] if requires else ()))  # fmt: skip
        stages.append(Stage(s, start, end, tuple(shards)))
    rendezvous = Rendezvous.for_epoch(store_host, store_port, epoch, pp * tp) if epoch is not None else None
    complete = rendezvous is not None and all(sh.state is ShardState.READY for st in stages for sh in st.shards)
    if calibration is None or epoch is None or calibration.epoch != epoch:
        calibration = pending_calibration(epoch, calibration)
    return Topology(version, model, pp, tp, tuple(stages), rendezvous, complete, limits, calibration)


_ENDED = (CalibrationStatus.BALANCED, CalibrationStatus.IMBALANCED, CalibrationStatus.REBALANCING,
          CalibrationStatus.FAILED)  # fmt: skip


def pending_calibration(epoch: int | None, previous: Calibration | None) -> Calibration:
    """The check of a placement not yet measured; says how the previous placement's check ended."""
    message = "not checked yet: waiting for every shard to be READY" if epoch is None else "not checked yet"
    rebalances = 0
    if previous is not None:
        rebalances = previous.rebalances
        if previous.status in _ENDED:
            message += f" (epoch {previous.epoch}: {previous.status.value}: {previous.message})"
    return Calibration(epoch=epoch or 0, message=message, rebalances=rebalances)
