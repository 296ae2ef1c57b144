"""`shardmesh status` and `shardmesh top` on the workers beyond the slots: `--json`'s workers with the slot each
holds, and the spares, drains and lost workers the table and top's header show."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from shardmesh.core.topology import Topology, WorkerState
from shardmesh_cli import status, top
from shardmesh_cli.main import main
from tests.unit.cli.fake_coordinator import Script, serve, topology, worker

DETAIL = "waiting for a spare to take stage 0 tp rank 1"


def _mesh() -> Topology:
    return topology(
        worker(0, WorkerState.SERVING, 0),
        worker(1, WorkerState.DRAINING, 1, DETAIL),
        worker(2, WorkerState.LOADING, 2),
        worker(3, WorkerState.SERVING, 3),
        worker(4, WorkerState.SPARE),
        worker(5, WorkerState.LOST, None, "no heartbeat for 10 s"),
    )


def test_status_json_lists_every_worker_with_the_slot_it_holds(capsys: pytest.CaptureFixture[str]) -> None:
    with serve(Script([_mesh()])) as coordinator:
        assert main(["status", "--coordinator", coordinator, "--json"]) == 1  # not complete: not serving
    out = json.loads(capsys.readouterr().out)  # the whole of stdout is one JSON object
    assert out["topology_version"] == 7 and out["epoch"] == 3
    assert [w["worker_id"] for w in out["workers"]] == [f"worker-{i}" for i in range(6)]  # topology order
    assert out["workers"][1] == {"worker_id": "worker-1", "address": "127.0.0.1:5001", "pid": 101,
                                 "state": "draining", "stage": 0, "layer_start": 0, "layer_end": 6, "tp_rank": 1,
                                 "detail": DETAIL, "preparing_rank": None}  # fmt: skip
    slots = [(w["state"], w["stage"], w["layer_start"], w["layer_end"], w["tp_rank"]) for w in out["workers"]]
    assert slots == [("serving", 0, 0, 6, 0), ("draining", 0, 0, 6, 1), ("loading", 1, 6, 10, 0),
                     ("serving", 1, 6, 10, 1), ("spare", None, None, None, None),
                     ("lost", None, None, None, None)]  # fmt: skip
    assert out["pp"] == 2 and out["stages"][1]["shards"][0]["state"] == "ready"  # the topology itself follows


def test_status_json_epoch_is_0_without_a_rendezvous() -> None:
    out = status.as_json(topology(worker(4, WorkerState.SPARE), epoch=None))
    assert out["epoch"] == 0 and out["workers"][0]["state"] == "spare" and out["workers"][0]["stage"] is None
    json.dumps(out)  # plain JSON types only


def test_status_table_lists_spares_drains_and_lost_workers_after_the_stages() -> None:
    lines = status.render(_mesh()).splitlines()
    assert lines[0].startswith("topology v7 (epoch 3): pp=2 tp=2")
    others = lines.index(next(line for line in lines if line.startswith("state ")))
    assert others > max(i for i, line in enumerate(lines) if "worker-3" in line)  # after the stage table
    assert [line.split()[:2] for line in lines[others + 1 : others + 4]] == [
        ["spare", "worker-4"], ["draining", "worker-1"], ["lost", "worker-5"]]  # fmt: skip
    assert lines[others + 2].endswith(DETAIL) and lines[others + 3].endswith("no heartbeat for 10 s")
    assert "127.0.0.1:5004" in lines[others + 1] and "104" in lines[others + 1]
    split = replace(_mesh(), tp_split=(3, 1))  # uneven shares are said, and survive the wire
    assert status.render(split).startswith("topology v7 (epoch 3): pp=2 tp=2 (MLP and vocabulary split 3,1), ")
    assert Topology.from_pb(split.to_pb()) == split and Topology.from_pb(_mesh().to_pb()).tp_split == ()
    assert not any(line.startswith("state ") for line in status.render(topology(worker(0, WorkerState.SERVING, 0))
                                                                        ).splitlines())  # fmt: skip


def test_top_header_shows_the_epoch_and_spare_draining_lost_counts() -> None:
    frame = top.render(top.Snapshot(0.0, 0.0, topology=_mesh()), None, "127.0.0.1:50051", None)
    assert frame.splitlines()[1] == "epoch 3  workers 6: 1 spare, 1 draining, 1 lost"


def test_a_hot_spare_shows_the_rank_it_holds_ahead() -> None:
    hot = replace(worker(4, WorkerState.SPARE), preparing_rank=3)
    assert status.as_json(topology(hot))["workers"][0]["preparing_rank"] == 3
    line = next(line for line in status.render(topology(hot)).splitlines() if "worker-4" in line)
    assert line.endswith("hot: holds stage 1 tp rank 1 ahead of need")
