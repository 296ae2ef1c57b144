"""Placement rules on plain values: who fills which slot, which epoch a placement gets, what state each slot
shows, and the topology they make."""

from __future__ import annotations

import pytest

from coordinator import placement
from coordinator.placement import WorkerView
from shardmesh.core.topology import ModelSpec, Rendezvous, ServingLimits, ShardState, Topology

MODEL = ModelSpec("/models/tiny", "float32", "LlamaForCausalLM", 4, 32, 100, 128)
LIMITS = ServingLimits(kv_slots=4, max_context=128, max_batch_tokens=128)
PENDING, LOADING, READY, UNHEALTHY = ShardState.PENDING, ShardState.LOADING, ShardState.READY, ShardState.UNHEALTHY


def view(worker_id: str, reported: ShardState = READY, applied: int = 0, timed_out: bool = False, inc: int = 1):
    return WorkerView(worker_id, f"10.0.0.1:{5000 + len(worker_id)}", inc, reported, applied, timed_out)


def test_fill_slots_lowest_rank_first_in_registration_order() -> None:
    assert placement.fill_slots((None,) * 4, ["a", "b", "c", "d", "e"]) == ("a", "b", "c", "d")
    assert placement.fill_slots(("a", None, "c", None), ["a", "e", "c", "f", "g"]) == ("a", "e", "c", "f")
    assert placement.fill_slots(("a", None), []) == ("a", None)
    assert placement.vacate(("a", "b", "a"), "a") == (None, "b", None)


def test_epoch_survives_state_changes_and_changes_with_placement() -> None:
    key = (("a", 1), ("b", 2))
    assert placement.next_epoch(None, None, None, 5) is None  # vacancies: no rendezvous at all
    assert placement.next_epoch(None, None, key, 5) == 5  # first full placement: named after its version
    assert placement.next_epoch(key, 5, key, 9) == 5  # same processes in the same ranks: same groups
    assert placement.next_epoch(key, 5, (("a", 1), ("b", 3)), 9) == 9  # b restarted: new groups


def test_placement_key_needs_every_slot_and_tracks_incarnations_and_the_split() -> None:
    workers = {"a": view("a", inc=3), "b": view("b", inc=4)}
    split = ((0, 2), (2, 4))
    assert placement.placement_key(split, ("a", None), workers) is None
    key = placement.placement_key(split, ("b", "a"), workers)
    assert key == (split, (("b", 4), ("a", 3)))
    moved = placement.placement_key(((0, 3), (3, 4)), ("b", "a"), workers)
    assert moved != key and placement.next_epoch(key, 5, moved, 9) == 9  # a new split is a new placement


def test_fill_slots_honours_label_requirements() -> None:
    labels = {"a": (("node", "B"),), "b": (("node", "A"),), "c": (("node", "A"), ("zone", "1")), "d": ()}
    requires = ((("node", "A"),), (("node", "A"),), (("node", "B"),), ())
    # a (node B) waits for rank 2; d (no labels) only fits the unconstrained rank 3
    assert placement.fill_slots((None,) * 4, ["a", "b", "c", "d"], labels, requires) == ("b", "c", "a", "d")
    assert placement.fill_slots((None,) * 4, ["d", "a"], labels, requires) == (None, None, "a", "d")
    assert placement.fits((("node", "A"), ("zone", "1")), (("node", "A"),))
    assert not placement.fits((), (("node", "A"),))


@pytest.mark.parametrize(
    ("worker", "epoch", "expected"),
    [
        (None, 3, PENDING),  # vacant
        (view("a", READY, applied=3), 3, READY),
        (view("a", READY, applied=2), 3, PENDING),  # ready for an older placement: must rejoin
        (view("a", READY, applied=7), None, PENDING),  # no rendezvous yet
        (view("a", LOADING, applied=0), None, LOADING),
        (view("a", PENDING, applied=3), 3, PENDING),
        (view("a", READY, applied=3, timed_out=True), 3, UNHEALTHY),
        (view("a", UNHEALTHY, applied=3), 3, UNHEALTHY),
    ],
)
def test_shard_state(worker: WorkerView | None, epoch: int | None, expected: ShardState) -> None:
    assert placement.shard_state(worker, epoch) is expected


def _build(slots: placement.Slots, workers: dict[str, WorkerView], epoch: int | None, version: int = 7) -> Topology:
    return placement.build_topology(version=version, model=MODEL, pp=2, tp=2, limits=LIMITS, store_host="127.0.0.1",
                                    store_port=29500, slots=slots, workers=workers, epoch=epoch)  # fmt: skip


def test_build_topology_is_stage_major_with_split_layers() -> None:
    workers = {w: view(w, READY, applied=7) for w in "abcd"}
    topo = _build(("a", "b", "c", "d"), workers, epoch=7)
    assert [(s.index, s.layer_start, s.layer_end) for s in topo.stages] == [(0, 0, 2), (1, 2, 4)]
    assert [(st.index, sh.tp_rank, sh.rank, sh.worker_id) for st, sh in topo.shards()] == [
        (0, 0, 0, "a"), (0, 1, 1, "b"), (1, 0, 2, "c"), (1, 1, 3, "d"),
    ]  # fmt: skip
    assert topo.rendezvous == Rendezvous("127.0.0.1", 29500, "topo/v7", 7, 4)
    assert topo.complete
    assert topo.find("c") == (topo.stages[1], topo.stages[1].shards[0])
    assert topo.find("zz") is None


def test_build_topology_partial_and_unhealthy() -> None:
    workers = {w: view(w, READY, applied=7) for w in "abc"}
    partial = _build(("a", "b", "c", None), workers, epoch=None)
    assert partial.rendezvous is None and not partial.complete
    assert partial.stages[1].shards[1].vacant and partial.stages[1].shards[1].state is PENDING
    workers["d"] = view("d", READY, applied=7, timed_out=True)
    sick = _build(("a", "b", "c", "d"), workers, epoch=7)
    assert sick.rendezvous is not None and not sick.complete
    assert sick.stages[1].shards[1].state is UNHEALTHY


def test_hot_spares_spread_over_the_ranks_their_labels_allow() -> None:
    workers = {w: view(w) for w in ("a", "b", "c", "d")}
    workers["c"] = WorkerView("c", "10.0.0.1:1", 1, READY, 0, False, labels=(("node", "x"),))
    workers["d"] = WorkerView("d", "10.0.0.1:2", 1, READY, 0, False, preparing_rank=2, ahead=True)
    requires = ((), (("node", "x"),), (), ())
    # "a" prepares a drain's rank 0; "d" keeps its earlier guess (2); "b" takes the first uncovered rank it may
    # hold (3: rank 1 needs node x); "c", the only one allowed there, takes rank 1.
    ahead = placement.ahead_of_time(4, ["a", "b", "c", "d"], workers, {"a": 0}, requires)
    assert ahead == {"d": 2, "b": 3, "c": 1}
    assert placement.ahead_of_time(2, ["b"], workers, {}, None) == {"b": 0}
