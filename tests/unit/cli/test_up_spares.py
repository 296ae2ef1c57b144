"""`shardmesh up --spares` and up's supervisor: the spare workers' commands, the coordinator's fixed ports, and
what the supervisor does with each kind of death (fake processes; one supervisor pass at a time, no sleeping)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from shardmesh_cli import up
from shardmesh_cli.main import build_parser, main


def _up_args(*extra: str, log_dir: Path | None = None) -> argparse.Namespace:
    argv = ["up", "--model", "m", "--pp", "2", "--tp", "2", *extra]
    return build_parser().parse_args(argv + (["--log-dir", str(log_dir)] if log_dir else []))


def test_spares_are_workers_after_the_stage_workers_with_the_same_flags() -> None:
    commands = up.worker_commands(_up_args("--spares", "2", "--metrics"), "127.0.0.1:50051")
    assert [name for name, _ in commands] == [f"worker{i}" for i in range(6)]
    for i, (_, argv) in enumerate(commands):
        assert argv == ["worker", "--coordinator", "127.0.0.1:50051", "--worker-id", f"worker-{i}", "--device",
                        "cpu", "--metrics-port", "-1"]  # fmt: skip
    assert len(up.worker_commands(_up_args(), "127.0.0.1:50051")) == 4  # none by default


def test_spares_get_no_node_label_of_the_plan() -> None:
    args = _up_args("--spares", "1")
    args.rank_nodes = "a,a,b,b"
    labels = [argv[argv.index("--label") + 1] if "--label" in argv else None
              for _, argv in up.worker_commands(args, "c:1")]  # fmt: skip
    assert labels == ["node=a", "node=a", "node=b", "node=b", None]


def test_negative_spares_are_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--model", "smollm2-135m-instruct", "--spares", "-1"]) == 2
    assert "error: --spares: must be >= 0, got -1" in capsys.readouterr().err
    assert "spares" not in up.MANIFEST_FLAGS  # a plain flag next to --manifest, not a manifest field


def test_startup_line_counts_the_spares() -> None:
    assert up._workers_phrase(_up_args()) == "4 stage workers (pp=2, tp=2)"
    assert up._workers_phrase(_up_args("--spares", "1")) == "4 stage workers (pp=2, tp=2) + 1 spare"
    assert up._workers_phrase(_up_args("--spares", "3")) == "4 stage workers (pp=2, tp=2) + 3 spares"


class FakeProcess:
    """A child that runs (returncode None) until a test sets its exit status; `stopped` records terminate()."""

    def __init__(self, argv: list[str], stopped: list[str]) -> None:
        self.argv, self.stopped, self.returncode = argv, stopped, None

    def poll(self) -> int | None:
        return self.returncode

    def terminate(self) -> None:
        self.stopped.append(self.argv[2])
        self.returncode = -15

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode


@dataclass
class Spawned:
    """Every FakeProcess `procs.spawn` started, and the order stop() terminated them in (by service)."""

    processes: list[FakeProcess] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)

    def services(self) -> list[str]:
        return [p.argv[2] for p in self.processes]


@pytest.fixture
def spawned(monkeypatch: pytest.MonkeyPatch) -> Spawned:
    """LocalMesh as it is, over fake processes: procs.spawn starts nothing."""
    out = Spawned()

    def spawn(argv: list[str], **kwargs: object) -> FakeProcess:
        out.processes.append(FakeProcess(list(argv), out.stopped))
        return out.processes[-1]

    monkeypatch.setattr(up.procs, "spawn", spawn)
    return out


def _mesh(tmp_path: Path, spawned: Spawned) -> up.LocalMesh:
    mesh = up.LocalMesh(tmp_path)
    for name in ("coordinator", "worker0", "worker1", "gateway"):
        mesh.spawn(name, [name.rstrip("01"), "--flag"])
    spawned.processes.clear()
    return mesh


def _die(mesh: up.LocalMesh, name: str, returncode: int | None) -> None:
    dict(mesh.children)[name].returncode = returncode


def test_start_mesh_gives_the_coordinator_a_fixed_store_port_and_starts_the_spares(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spawned: Spawned
) -> None:
    monkeypatch.setattr(up, "wait_serving", lambda *a, **k: None)
    mesh = up.start_mesh(_up_args("--spares", "1", log_dir=tmp_path), Path("/models/m"))
    assert [name for name, _ in mesh.children] == ["coordinator", *(f"worker{i}" for i in range(5)), "gateway"]
    coordinator = mesh.commands["coordinator"][0]
    assert coordinator[coordinator.index("--listen") + 1] == mesh.coordinator
    assert int(coordinator[coordinator.index("--store-port") + 1]) > 0  # chosen once: a restart reuses it
    assert mesh.commands["worker4"][0][4] == "worker-4" and mesh.commands["worker4"][1] == mesh.commands["worker0"][1]
    mesh.stop()

    manifest_args = _up_args(log_dir=tmp_path)
    manifest_args.store_port = 29555  # a manifest's services.coordinator.store_port stands
    mesh = up.start_mesh(manifest_args, Path("/models/m"))
    coordinator = mesh.commands["coordinator"][0]
    assert coordinator[coordinator.index("--store-port") + 1] == "29555"
    mesh.stop()


def test_a_worker_that_exits_0_was_drained_and_is_not_restarted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spawned: Spawned
) -> None:
    mesh = _mesh(tmp_path, spawned)
    _die(mesh, "worker1", 0)
    restarts: dict[str, int] = {}
    assert up.supervise_once(mesh, restarts, 3) is None
    assert capsys.readouterr().err == "worker1 drained and exited (status 0); not restarting it\n"
    assert spawned.processes == [] and restarts == {} and "worker1" not in dict(mesh.children)
    assert up.supervise_once(mesh, restarts, 3) is None and capsys.readouterr().err == ""  # said once
    mesh.stop()


def test_a_dead_worker_or_coordinator_is_restarted_until_max_restarts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spawned: Spawned
) -> None:
    mesh = _mesh(tmp_path, spawned)
    restarts: dict[str, int] = {}
    _die(mesh, "worker0", -9)
    assert up.supervise_once(mesh, restarts, 2) is None and spawned.services() == ["worker"]
    for attempt in (1, 2):
        _die(mesh, "coordinator", 1)
        assert up.supervise_once(mesh, restarts, 2) is None
        assert f"coordinator exited with code 1; restarting it ({attempt}/2)" in capsys.readouterr().err
    assert restarts == {"worker0": 1, "coordinator": 2}
    assert [p.argv for p in spawned.processes[1:]] == [["-m", "shardmesh_cli", "coordinator", "--flag"]] * 2
    assert dict(mesh.children)["coordinator"] is spawned.processes[-1]
    _die(mesh, "coordinator", 1)
    assert up.supervise_once(mesh, restarts, 2) == 1  # out of restarts
    assert "error: coordinator exited with code 1" in capsys.readouterr().err

    _die(mesh, "coordinator", None)  # running again, to be stopped: restarted ones keep their place in the order
    mesh.stop()
    assert spawned.stopped == ["gateway", "worker", "worker", "coordinator"]


@pytest.mark.parametrize("returncode", [0, 1, -15])
def test_a_dead_gateway_ends_the_mesh(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spawned: Spawned, returncode: int
) -> None:
    mesh = _mesh(tmp_path, spawned)
    _die(mesh, "gateway", returncode)
    naps: list[float] = []
    assert up._supervise(mesh, 3, sleep=naps.append) == 1
    assert naps == [0.5] and spawned.processes == []
    assert f"error: gateway exited with code {returncode}; logs in {tmp_path}" in capsys.readouterr().err
    mesh.stop()


def test_with_spares_a_dead_worker_is_restarted_once_the_spare_has_had_the_cores(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spawned: Spawned
) -> None:
    mesh = _mesh(tmp_path, spawned)
    mesh.worker_restart_delay = 3.0
    restarts: dict[str, int] = {}
    _die(mesh, "worker1", -9)
    assert up.supervise_once(mesh, restarts, 3, now=100.0) is None and spawned.processes == []  # noticed
    assert up.supervise_once(mesh, restarts, 3, now=102.9) is None and spawned.processes == []
    _die(mesh, "coordinator", 1)  # the coordinator is never held back
    assert up.supervise_once(mesh, restarts, 3, now=103.0) is None
    assert spawned.services() == ["coordinator", "worker"] and restarts == {"coordinator": 1, "worker1": 1}
    assert "worker1 exited with code -9; restarting it (1/3)" in capsys.readouterr().err
    _die(mesh, "coordinator", None)
    mesh.stop()
