"""Real service processes on 127.0.0.1 for tests, always cleaned up (each dies with the test process too)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from subprocess import Popen

import grpc

from shardmesh.core.topology import Topology
from shardmesh.proto.v1 import coordinator_pb2, coordinator_pb2_grpc, worker_pb2_grpc
from shardmesh.rpc import procs
from shardmesh_cli.up import free_port, wait_serving


class ServiceProcess:
    """`shardmesh <command>` in a child process, with its JSON log lines collected as they come."""

    def __init__(self, command: str, args: list[str], wait_s: float = 30.0) -> None:
        env = {**os.environ, "SHARDMESH_LOG_LEVEL": "info"}
        self.command, self.wait_s = command, wait_s
        self.proc = subprocess.Popen([sys.executable, "-m", "shardmesh_cli", command, *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
        self.events: queue.Queue[dict] = queue.Queue()
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            with contextlib.suppress(json.JSONDecodeError):
                self.events.put(json.loads(line))

    def wait_event(self, name: str, timeout: float | None = None) -> dict:
        """The next log line whose `event` is `name`; fails at once if the process exits first."""
        timeout = self.wait_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                event = self.events.get(timeout=0.1)
            except queue.Empty:
                assert self.proc.poll() is None, f"{self.command} exited:\n{''.join(self.lines)}"
                continue
            if event.get("event") == name:
                return event
        raise AssertionError(f"no {name!r} log line within {timeout} s:\n{''.join(self.lines)}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


class Stack:
    """Start services one by one, as compose would; `close()` stops whatever is still running."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, Popen] = {}
        self.coordinator = ""
        self._files: list = []

    def spawn(self, name: str, *args: str, threads: int = 1, env: dict[str, str] | None = None) -> Popen:
        f = (self.log_dir / f"{name}.log").open("ab")
        self._files.append(f)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "SHARDMESH_LOG_LEVEL": "info", **(env or {})}
        p = procs.spawn(["-m", "shardmesh_cli", *args], env=env, stdout=f, stderr=f)
        self.procs[name] = p
        return p

    def start_coordinator(self, model: Path, pp: int, tp: int, *extra: str) -> str:
        self.coordinator = f"127.0.0.1:{free_port()}"
        self.spawn("coordinator", "coordinator", "--listen", self.coordinator, "--model", str(model), "--pp", str(pp),
                   "--tp", str(tp), "--heartbeat-interval", "0.3", *extra)  # fmt: skip
        wait_serving(self.coordinator, [("coordinator", self.procs["coordinator"])], 60, self.log_dir)
        return self.coordinator

    def start_worker(self, worker_id: str, *extra: str, env: dict[str, str] | None = None) -> Popen:
        return self.spawn(worker_id, "worker", "--coordinator", self.coordinator, "--worker-id", worker_id,
                          "--group-timeout", "20", *extra, env=env)  # fmt: skip

    def topology(self) -> Topology:
        with grpc.insecure_channel(self.coordinator) as ch:
            pb = coordinator_pb2_grpc.CoordinatorStub(ch).GetTopology(coordinator_pb2.GetTopologyRequest(), timeout=5)
        return Topology.from_pb(pb)

    def wait_complete(self, timeout: float = 120, after_version: int = 0) -> Topology:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None and not name.startswith("killed"):
                    raise RuntimeError(f"{name} exited ({p.returncode}):\n{procs.tail(self.log_dir / f'{name}.log')}")
            t = self.topology()
            if t.serving and t.version > after_version:  # complete, and the balance check passed
                return t
            time.sleep(0.2)
        raise TimeoutError(f"topology not serving after {timeout} s; logs in {self.log_dir}")

    def kill(self, name: str) -> None:
        p = self.procs.pop(name)
        p.kill()
        p.wait()
        self.procs[f"killed-{name}-{p.pid}"] = p

    def close(self) -> None:
        procs.stop_all(list(self.procs.values()))
        for f in self._files:
            f.close()


def worker_stubs(topology: Topology) -> list[worker_pb2_grpc.StageWorkerStub]:
    """One stub per shard, in global rank order."""
    return [worker_pb2_grpc.StageWorkerStub(grpc.insecure_channel(sh.address)) for _, sh in topology.shards()]
