"""The elastic mesh from outside, as an operator drives it: `shardmesh up --spares 1`, `kill -9`, `shardmesh drain`,
`shardmesh worker` joining, `shardmesh status --json`, and the coordinator itself killed, each while 8 greedy and
seeded streams run. Every request must finish with the tokens of an undisturbed run of the same requests.

One mesh for the module, in order: a spare takes a killed worker's slot (the killed one comes back, restarted by
`up`, as the next spare); a drain moves a shard to that spare and the drained worker exits 0, never restarted;
the coordinator is killed and restarted, and takes the placement back from the workers without reloading or
re-forming anything; a worker joins as a spare; then a seeded mix of all of it. Kept in the normal suite on
purpose: a fail-over path that no test exercises rots.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.checkpoints import make_checkpoint
from tests.meshes import Mesh, Progress, Spawner, requests, stream_all
from tests.waiting import wait_until

MESH_WAIT_S = 90.0  # a shard load, new groups or a coordinator restart take seconds here; only a bug waits longer


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # eos 95 is rare under this seed, so the streams run long and compare many tokens each.
    return make_checkpoint(tmp_path_factory.mktemp("elastic"), "llama-gqa-tied", num_layers=4, seed=11,
                           eos_token_id=95)  # fmt: skip


@pytest.fixture(scope="module")
def mesh(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = Mesh(model, 2, 1, tmp_path_factory.mktemp("elastic-up"), "--spares", "1")
    yield m
    m.close()


@pytest.fixture(scope="module")
def reference(mesh: Mesh) -> dict[str, list[int]]:
    tokens = stream_all(mesh.stub)
    assert sum(len(t) >= 20 for t in tokens.values()) >= 4  # the greedy ones run long; a sampled one may stop early
    return tokens


def during_streams(mesh: Mesh, fault: Callable[[], None], streaming: int = 4) -> dict[str, list[int]]:
    """Every request at once, and `fault()` once `streaming` streams have tokens; their tokens by request id."""
    progress = Progress()
    done: list[bool] = []
    failures: list[BaseException] = []

    def run() -> None:
        if progress.wait_for(streaming):
            try:
                fault()
                done.append(True)
            except BaseException as e:
                failures.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    tokens = stream_all(mesh.stub, progress=progress)
    thread.join(timeout=180)
    assert not failures, failures[0]
    assert done, "the fault did not happen"
    return tokens


def workers(mesh: Mesh) -> dict[str, dict]:
    return {w["worker_id"]: w for w in mesh.status()["workers"]}


def wait_for_spare(mesh: Mesh) -> str:
    """A worker that is a spare now (e.g. the one `up` restarted after a kill)."""
    found: list[str] = []

    def spare() -> bool:
        found[:] = [w for w, info in workers(mesh).items() if info["state"] == "spare"]
        return bool(found)

    wait_until(spare, timeout=MESH_WAIT_S)
    return found[0]


def wait_serving(mesh: Mesh) -> None:
    """Until the coordinator's topology serves: every slot READY, balance check passed (a draining worker serves
    until its slot moves; after a re-plan there may be fewer stages)."""
    wait_until(lambda: mesh.status()["serving"], timeout=MESH_WAIT_S)


def test_status_lists_the_spare(mesh: Mesh, reference: dict[str, list[int]]) -> None:
    status = mesh.status()
    assert status["epoch"] >= 1 and status["topology_version"] >= status["epoch"]
    serving = sorted((w["stage"], w["tp_rank"], w["layer_start"], w["layer_end"]) for w in status["workers"]
                     if w["state"] == "serving")  # fmt: skip
    assert serving == [(0, 0, 0, 2), (1, 0, 2, 4)]
    spares = [w for w in status["workers"] if w["state"] == "spare"]
    assert len(spares) == 1 and spares[0]["stage"] is None and spares[0]["pid"] > 0


def test_a_spare_takes_the_slot_of_a_killed_worker(mesh: Mesh, reference: dict[str, list[int]]) -> None:
    spare = wait_for_spare(mesh)
    victim = mesh.holder(1, 0)  # the last stage: the one that samples
    pid = mesh.process(victim).pid
    assert during_streams(mesh, lambda: os.kill(pid, signal.SIGKILL)) == reference
    assert mesh.holder(1, 0) == spare  # the spare took over, it did not wait for the restart
    assert '"event": "failure_reported"' in mesh.log("gateway")  # the gateway told the coordinator at once
    assert '"event": "slot_handed_over"' in mesh.log("coordinator")
    assert wait_for_spare(mesh) == victim  # restarted by `up`: the next spare


def test_a_drained_worker_hands_over_and_exits_0(mesh: Mesh, reference: dict[str, list[int]]) -> None:
    spare = wait_for_spare(mesh)
    wait_serving(mesh)
    victim = mesh.holder(0, 0)
    process = mesh.process(victim)
    drained: list[int] = []

    def drain() -> None:
        done = mesh.drain(victim)
        assert done.returncode == 0, done.stderr
        drained.append(done.returncode)

    seen = len(mesh.log("gateway"))
    assert during_streams(mesh, drain) == reference
    assert drained == [0] and mesh.holder(0, 0) == spare
    process.wait(timeout=MESH_WAIT_S)  # it exits (its status is `up`'s to see: `up` does not restart a status-0 exit)
    assert victim not in workers(mesh)
    victim_log = mesh.log(f"worker{victim.removeprefix('worker-')}")
    assert '"event": "drained"' in victim_log and '"event": "kv_sent"' in victim_log
    # The KV cache went with the slot, under its id: the requests that were running resume replaying nothing.
    assert '"event": "kv_received"' in mesh.log(f"worker{spare.removeprefix('worker-')}")
    resumed = [json.loads(line) for line in mesh.log("gateway")[seen:].splitlines() if '"request_resuming"' in line]
    assert all(r["replay_tokens"] == 0 for r in resumed), resumed


def test_the_mesh_serves_through_a_killed_coordinator(mesh: Mesh, reference: dict[str, list[int]]) -> None:
    wait_serving(mesh)
    before = mesh.status()
    pid = mesh.service_pid("coordinator")
    assert during_streams(mesh, lambda: os.kill(pid, signal.SIGKILL)) == reference
    after: list[dict] = []

    def back() -> bool:
        done = mesh.command("status", "--json", timeout=30)
        if done.returncode != 0:
            return False
        import json

        after[:] = [json.loads(done.stdout)]
        return bool(after[0]["serving"])

    wait_until(back, timeout=MESH_WAIT_S)
    assert after[0]["epoch"] == before["epoch"]  # the placement was taken back, not formed again
    assert after[0]["topology_version"] > before["topology_version"]  # versions never go back
    assert '"event": "placement_adopted"' in mesh.log("coordinator")
    assert stream_all(mesh.stub, requests(2, 8, prefix="after")).keys() == {"after0", "after1"}


def test_a_worker_that_joins_while_streaming_becomes_a_spare(
    mesh: Mesh, reference: dict[str, list[int]], tmp_path: Path
) -> None:  # fmt: skip
    spawner = Spawner(tmp_path)
    try:
        assert during_streams(mesh, lambda: spawner.worker(mesh.coordinator, "joiner")) == reference
        wait_until(lambda: workers(mesh).get("joiner", {}).get("state") == "spare", timeout=MESH_WAIT_S)
    finally:
        spawner.close()


def test_a_seeded_mix_of_kills_drains_and_joins(
    mesh: Mesh, reference: dict[str, list[int]], tmp_path: Path
) -> None:  # fmt: skip
    """A kill, a drain and a join in a seeded order, each on a seeded victim, each awaited before the next, while
    waves of the reference requests run back to back: every wave must match the reference."""
    rng = random.Random(1234)
    spawner = Spawner(tmp_path)
    drains: list[threading.Thread] = []
    drained: set[str] = set()
    failures: list[BaseException] = []
    progress = Progress()

    def drain(worker_id: str) -> None:  # waits for a spare when there is none yet: in the background
        done = mesh.drain(worker_id)
        if done.returncode != 0:
            failures.append(AssertionError(done.stderr))

    def undrained_serving(found: list[str]) -> bool:
        """Fill `found` with the serving workers, never one a drain was started on (its `shardmesh drain` may not
        have reached the coordinator yet); whether there are any."""
        found[:] = sorted(w for w, info in workers(mesh).items() if info["state"] == "serving" and w not in drained)
        return bool(found)

    def chaos() -> None:
        try:
            progress.wait_for(2)
            for i, action in enumerate(rng.sample(["kill", "drain", "join"], 3)):
                wait_serving(mesh)
                if action == "join":  # no victim
                    spawner.worker(mesh.coordinator, f"chaos-{i}")
                    wait_until(lambda i=i: f"chaos-{i}" in workers(mesh), timeout=MESH_WAIT_S)
                    continue
                # While a drain hands its slot over, the worker draining may be the only one serving: wait for another.
                serving: list[str] = []
                wait_until(lambda found=serving: undrained_serving(found), timeout=MESH_WAIT_S)
                victim = rng.choice(serving)
                if action == "kill":
                    os.kill(mesh.process(victim).pid, signal.SIGKILL)
                    wait_until(lambda v=victim: workers(mesh).get(v, {}).get("state") != "serving", timeout=MESH_WAIT_S)
                else:
                    drained.add(victim)
                    drains.append(threading.Thread(target=drain, args=(victim,), daemon=True))
                    drains[-1].start()
            for t in drains:
                t.join(timeout=160)
            wait_serving(mesh)
        except BaseException as e:
            failures.append(e)

    thread = threading.Thread(target=chaos, daemon=True)
    thread.start()
    waves = 0
    try:
        while thread.is_alive() or waves == 0:
            assert stream_all(mesh.stub, progress=progress) == reference, f"wave {waves}"
            waves += 1
        thread.join()
        assert not failures, failures[0]
        assert stream_all(mesh.stub) == reference  # and the mesh it left behind serves the same
    finally:
        thread.join(timeout=200)
        spawner.close()


def test_without_a_spare_a_drain_re_plans_onto_the_survivor_and_a_join_grows_back(
    model: Path, reference: dict[str, list[int]], tmp_path: Path
) -> None:  # fmt: skip
    """`up --pp 2` and no spare: draining a stage's worker moves the whole model onto the other worker (the
    planner says it fits), with no failed request; a worker that joins later brings the mesh back to 2 stages."""
    bare = Mesh(model, 2, 1, tmp_path / "logs")
    spawner = Spawner(tmp_path)
    try:
        victim = bare.holder(1, 0)
        drained: list[int] = []

        def drain() -> None:
            done = bare.drain(victim)
            assert done.returncode == 0, done.stderr
            drained.append(done.returncode)

        assert during_streams(bare, drain) == reference
        one = [w for w in bare.status()["workers"] if w["stage"] is not None]
        assert drained == [0] and [(w["stage"], w["layer_start"], w["layer_end"]) for w in one] == [(0, 0, 4)]
        assert '"event": "replanned"' in bare.log("coordinator")

        spawner.worker(bare.coordinator, "newcomer")
        wait_until(lambda: sorted((w["stage"], w["layer_start"], w["layer_end"]) for w in bare.status()["workers"]
                                  if w["stage"] is not None and w["state"] == "serving") == [(0, 0, 2), (1, 2, 4)],
                   timeout=MESH_WAIT_S)  # fmt: skip
        assert stream_all(bare.stub) == reference
    finally:
        spawner.close()
        bare.close()
