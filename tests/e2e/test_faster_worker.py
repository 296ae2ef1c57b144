"""A faster worker that joins a serving mesh takes over the slot of the slowest stage, make-before-break: it loads
the shard while the old holder serves, the slot moves between two steps, the old holder sends its KV cache
along and stays on as a spare. Every stream finishes with the tokens of an undisturbed run, replaying nothing.

Speeds are declared (`--speed`, here through `up`'s environment for its workers) so that the move is the test's
decision, not measurement noise: identical machines never move a slot (tests/unit/coordinator/test_rebalance.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.checkpoints import make_checkpoint
from tests.e2e.test_elastic import MESH_WAIT_S, during_streams, workers
from tests.meshes import Mesh, Spawner, stream_all
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    model = make_checkpoint(tmp_path_factory.mktemp("faster"), "llama-gqa-tied", num_layers=4, seed=11,
                            eos_token_id=95)  # fmt: skip
    m = Mesh(model, 1, 1, tmp_path_factory.mktemp("faster-up"), env={"SHARDMESH_WORKER_SPEED": "50"})
    yield m
    m.close()


def test_a_faster_worker_takes_over_the_slowest_slot_while_streams_run(mesh: Mesh, tmp_path: Path) -> None:
    reference = stream_all(mesh.stub)
    slow = mesh.holder(0, 0)
    spawner = Spawner(tmp_path)
    try:
        seen = len(mesh.log("gateway"))
        tokens = during_streams(
            mesh, lambda: spawner.worker(mesh.coordinator, "fast", "--speed", "5000", "--log-level", "info")
        )
        assert tokens == reference
        wait_until(lambda: workers(mesh).get(slow, {}).get("state") == "spare", timeout=MESH_WAIT_S)
        assert mesh.holder(0, 0) == "fast"
        moved = [json.loads(line) for line in mesh.log("coordinator").splitlines() if '"slot_moved"' in line]
        assert [(m["old"], m["new"], m["reason"], m["gain"]) for m in moved] == [(slow, "fast", "faster", 100.0)]
        assert '"event": "kv_sent"' in mesh.log(f"worker{slow.removeprefix('worker-')}")
        assert '"event": "kv_received"' in (tmp_path / "fast.log").read_text()
        gateway = mesh.log("gateway")[seen:].splitlines()
        resumed = [json.loads(line) for line in gateway if '"request_resuming"' in line]
        assert all(r["replay_tokens"] == 0 for r in resumed), resumed
        # The old holder is a spare now, and serves again as one: the mesh is whole after the move.
        assert stream_all(mesh.stub) == reference
    finally:
        spawner.close()
