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
    HeldShard,
    MeshWorker,
    ModelSpec,
    Rendezvous,
    ServingLimits,
    ShardAssignment,
    ShardState,
    Stage,
    Topology,
    WorkerState,
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
    pid: int = 0
    draining: bool = False  # asked to leave: its slot goes to a spare, then it exits
    detail: str = ""  # why it is lost, or what its drain waits for
    prepared_rank: int | None = None  # a spare that says it has loaded this rank's weights
    preparing_rank: int | None = None  # a spare asked to load this rank's weights (make-before-break, or ahead)
    kv_cache_id: str = ""  # its KV cache as it last reported it (ShardAssignment.kv_cache_id)
    ahead: bool = False  # preparing_rank is a hot spare's guess (`ahead_of_time`), not a drain's hand-over


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


def is_spare(w: WorkerView, slots: Slots) -> bool:
    """Healthy, not leaving, and holding no slot: may take one."""
    return w.worker_id not in slots and not w.timed_out and not w.draining and w.reported is not ShardState.UNHEALTHY


def leaving(w: WorkerView) -> bool:
    """A slot holder whose slot should go to a spare: lost (silent, unreachable, broken) or draining."""
    return w.timed_out or w.draining or w.reported is ShardState.UNHEALTHY


def hand_over(
    slots: Slots, workers: Mapping[str, WorkerView], spares: Sequence[str], requires: Sequence[Labels] | None = None,
    prepared: Mapping[str, int] | None = None,
) -> tuple[Slots, list[tuple[int, str, str]], list[tuple[int, str]]]:  # fmt: skip
    """Give the slot of every leaving holder (lost ones first, then by rank) to one of `spares` whose labels fit.

    A lost holder's slot moves at once (to a spare that prepared it, if any). A draining holder keeps serving
    until its spare has loaded the slot's weights (make-before-break): `prepared` maps a spare to the rank it
    has loaded (or may take without, e.g. after a deadline). Returns the new slots, the moves made as (rank, old
    holder, new holder) and the spares to prepare as (rank, spare). A leaving holder with no spare keeps its
    slot: a lost worker may come back, a draining one keeps serving.
    """
    prepared = prepared or {}
    out, moves, prepares = list(slots), [], []
    queue = [s for s in spares if s not in slots]
    leavers = [(r, h) for r, h in enumerate(slots) if h is not None and h in workers and leaving(workers[h])]
    leavers.sort(key=lambda rh: workers[rh[1]].draining)  # lost slots first: they serve nobody now
    for rank, holder in leavers:
        need = requires[rank] if requires else ()
        fitting = [c for c in queue if fits(workers[c].labels, need)]
        spare = next((c for c in fitting if prepared.get(c) == rank), None)
        spare = spare or next((c for c in fitting if workers[c].preparing_rank == rank), None)
        # A hot spare that loaded another rank ahead of time is still free for this one; one that prepares
        # another drain's slot is not.
        spare = spare or next((c for c in fitting if workers[c].preparing_rank is None or workers[c].ahead), None)
        if spare is None and not workers[holder].draining:  # a lost slot is more urgent than another's drain
            spare = next(iter(fitting), None)
        if spare is None:
            continue
        queue.remove(spare)
        if workers[holder].draining and prepared.get(spare) != rank:
            prepares.append((rank, spare))
            continue
        out[rank] = spare
        moves.append((rank, holder, spare))
    return tuple(out), moves, prepares


def ahead_of_time(
    num_ranks: int, spares: Sequence[str], workers: Mapping[str, WorkerView], busy: Mapping[str, int],
    requires: Sequence[Labels] | None = None,
) -> dict[str, int]:  # fmt: skip
    """The rank each idle spare should load ahead of time (a hot spare), so that taking a lost slot of that rank
    costs no load: the spare joins the next epoch with the weights and an empty KV cache already in memory.

    `busy` maps spares already preparing a drain's slot to that rank; they are not idle, but their rank counts as
    covered. A spare keeps the rank it has while that rank still exists and fits its labels (reloading would only
    cost memory bandwidth); the others take, round-robin, the ranks the fewest spares cover (lowest rank first),
    so that n spares cover n different ranks."""
    cover = [0] * num_ranks
    for rank in busy.values():
        if 0 <= rank < num_ranks:
            cover[rank] += 1
    out: dict[str, int] = {}
    idle = [s for s in spares if s not in busy]

    def allowed(spare: str, rank: int) -> bool:
        return fits(workers[spare].labels, requires[rank] if requires else ())

    for spare in idle:  # first, the spares whose earlier guess still holds
        rank = workers[spare].preparing_rank
        if workers[spare].ahead and rank is not None and rank < num_ranks and allowed(spare, rank):
            out[spare] = rank
            cover[rank] += 1
    for spare in idle:
        if spare in out:
            continue
        options = [r for r in range(num_ranks) if allowed(spare, r)]
        if options:
            rank = min(options, key=lambda r: (cover[r], r))
            out[spare] = rank
            cover[rank] += 1
    return out


def claimed_rank(held: HeldShard | None, pp: int, tp: int, split: Split) -> int | None:
    """The rank a worker claims after a coordinator restart, when the claim fits this coordinator's placement."""
    if held is None or (held.pp, held.tp) != (pp, tp) or not 0 <= held.rank < pp * tp:
        return None
    if split[held.rank // tp] != (held.layer_start, held.layer_end):
        return None
    return held.rank


def adopted_epoch(slots: Slots, held: Mapping[str, HeldShard | None]) -> int | None:
    """The epoch every slot holder claims to be in at its own rank, or None when they do not all agree.

    A restarted coordinator that finds the whole placement claimed this way keeps its epoch: the workers'
    process groups (and KV caches) are still the ones that epoch formed, so nothing needs re-forming."""
    epochs = set()
    for rank, holder in enumerate(slots):
        claim = held.get(holder) if holder is not None else None
        if claim is None or claim.rank != rank:
            return None
        epochs.add(claim.epoch)
    return epochs.pop() if len(epochs) == 1 else None


def worker_state(w: WorkerView, shard: ShardState | None) -> WorkerState:
    """What `w` is doing, given the state of the slot it holds (None: it holds none)."""
    if w.timed_out or w.reported is ShardState.UNHEALTHY:
        return WorkerState.LOST
    if w.draining:
        return WorkerState.DRAINING
    if shard is None:
        return WorkerState.SPARE
    return WorkerState.SERVING if shard is ShardState.READY else WorkerState.LOADING


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
    kv_from: Mapping[int, str] | None = None,
    tp_split: tuple[int, ...] = (),
) -> Topology:
    """The topology that `slots` and the workers' reports describe; `split` defaults to an even one. `kv_from`
    maps a rank just handed over from a serving worker to that worker (ShardAssignment.kv_from)."""
    if len(slots) != pp * tp:
        raise ValueError(f"expected {pp * tp} slots for pp={pp} tp={tp}, got {len(slots)}")
    split = split or tuple(split_layers(model.num_layers, pp))
    check_split(split, model.num_layers, pp)
    stages, slot_states = [], {}
    for s, (start, end) in enumerate(split):
        shards = []
        for t in range(tp):
            rank = s * tp + t
            worker = workers.get(slots[rank]) if slots[rank] is not None else None  # type: ignore[arg-type]
            if worker is not None:
                slot_states[worker.worker_id] = (rank, shard_state(worker, epoch))
            shards.append(ShardAssignment(t, rank, worker.worker_id if worker else "", worker.address if worker else "",
                                          shard_state(worker, epoch), worker.labels if worker else (),
                                          requires[rank] if requires else (),
                                          worker.kv_cache_id if worker else "",
                                          (kv_from or {}).get(rank, "") if worker else ""))  # fmt: skip
        stages.append(Stage(s, start, end, tuple(shards)))
    rendezvous = Rendezvous.for_epoch(store_host, store_port, epoch, pp * tp) if epoch is not None else None
    complete = rendezvous is not None and all(sh.state is ShardState.READY for st in stages for sh in st.shards)
    if calibration is None or epoch is None or calibration.epoch != epoch:
        calibration = pending_calibration(epoch, calibration)
    listed = tuple(
        MeshWorker(w.worker_id, w.address, w.pid, worker_state(w, slot_states.get(w.worker_id, (0, None))[1]),
                   slot_states[w.worker_id][0] if w.worker_id in slot_states else None, w.detail,
                   None if w.worker_id in slot_states else w.preparing_rank)
        for w in workers.values()
    )  # fmt: skip
    return Topology(version, model, pp, tp, tuple(stages), rendezvous, complete, limits, calibration, listed, tp_split)


_ENDED = (CalibrationStatus.BALANCED, CalibrationStatus.IMBALANCED, CalibrationStatus.REBALANCING,
          CalibrationStatus.FAILED, CalibrationStatus.CARRIED_OVER)  # fmt: skip


def pending_calibration(epoch: int | None, previous: Calibration | None) -> Calibration:
    """The check of a placement not yet measured; says how the previous placement's check ended."""
    message = "not checked yet: waiting for every shard to be READY" if epoch is None else "not checked yet"
    rebalances = 0
    if previous is not None:
        rebalances = previous.rebalances
        if previous.status in _ENDED:
            message += f" (epoch {previous.epoch}: {previous.status.value}: {previous.message})"
    return Calibration(epoch=epoch or 0, message=message, rebalances=rebalances)
