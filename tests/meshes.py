"""A `shardmesh up` mesh driven from outside, as an operator would: its addresses from stdout, its processes by
worker id, `shardmesh status --json` and `shardmesh drain`; and many streams at once, with a progress signal
for a fault that must land mid-stream. Shared by the fail-over and elastic-mesh tests."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import psutil

from shardmesh.proto.v1 import gateway_pb2, gateway_pb2_grpc
from shardmesh.rpc import procs

PROMPTS = [[1, 17, 5, 42, 33, 8], [1, 9, 9, 2, 60], [1, 70, 71], [1, 3, 5, 7, 11, 13, 17, 19]]
STREAM_TIMEOUT_S = 120.0  # far above a recovery here (seconds): only a hang reaches it


def requests(n: int = 8, new_tokens: int = 160, prefix: str = "r") -> list[gateway_pb2.GenerateRequest]:
    """Half greedy, half sampled with a seed (a seeded request's reference is a run like any other)."""
    out = []
    for i in range(n):
        params = gateway_pb2.SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
        if i % 2:
            params = gateway_pb2.SamplingParams(max_new_tokens=new_tokens, temperature=0.9, top_p=0.95, seed=100 + i)
        out.append(gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=PROMPTS[i % len(PROMPTS)]),
                                               params=params, request_id=f"{prefix}{i}"))  # fmt: skip
    return out


class Mesh:
    """`shardmesh up`: the first line on its stdout is the gateway's address, the second the coordinator's."""

    def __init__(self, model: Path, pp: int, tp: int, log_dir: Path, *extra: str,
                 env: dict[str, str] | None = None) -> None:  # fmt: skip
        args = ["-m", "shardmesh_cli", "up", "--model", str(model), "--pp", str(pp), "--tp", str(tp),
                "--kv-slots", "8", "--max-context", "256", "--log-dir", str(log_dir), *extra]  # fmt: skip
        # info: the tests read what the services did from their log lines
        env = {**os.environ, "SHARDMESH_LOG_LEVEL": "info", **(env or {})}
        self.proc = procs.spawn(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.log_dir = log_dir
        self.address = self.proc.stdout.readline().decode().strip()
        if not self.address:
            raise RuntimeError(f"up failed: {self.proc.stderr.read().decode()[-3000:]}")
        second = self.proc.stdout.readline().decode().strip()
        assert second.startswith("coordinator: "), second
        self.coordinator = second.removeprefix("coordinator: ")
        self.channel = grpc.insecure_channel(self.address)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    def http_url(self) -> str:
        """The OpenAI-compatible API's base URL: the third line on `up`'s stdout (`http: http://HOST:PORT/v1`), read
        on first use (`up` prints it unless --no-http)."""
        if not getattr(self, "_http_url", ""):
            line = self.proc.stdout.readline().decode().strip()
            assert line.startswith("http: "), line
            self._http_url = line.removeprefix("http: ")
        return self._http_url

    def command(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        """`shardmesh ARGS` against this mesh's coordinator, as an operator runs it."""
        return subprocess.run([sys.executable, "-m", "shardmesh_cli", *args, "--coordinator", self.coordinator],
                              capture_output=True, text=True, timeout=timeout)  # fmt: skip

    def drain(self, worker_id: str) -> subprocess.CompletedProcess[str]:
        """`shardmesh drain WORKER_ID`, waiting (up to 120 s) until the worker has left."""
        return self.command("drain", worker_id, "--timeout", "120", timeout=150)

    def status(self) -> dict[str, Any]:
        """`shardmesh status --json` (which exits 1 while the mesh does not serve, e.g. during a hand-over)."""
        done = self.command("status", "--json", timeout=30)
        assert done.returncode in (0, 1) and done.stdout, done.stderr
        return json.loads(done.stdout)

    def holder(self, stage: int, tp_rank: int) -> str:
        """The id of the worker serving (stage, tp_rank) now."""
        return next(w["worker_id"] for w in self.status()["workers"]
                    if w["stage"] == stage and w["tp_rank"] == tp_rank)  # fmt: skip

    def process(self, worker_id: str) -> psutil.Process:
        """The worker process started (by `up`) under `worker_id`."""
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            cmd = p.cmdline()
            if "--worker-id" in cmd and cmd[cmd.index("--worker-id") + 1] == worker_id:
                return p
        raise AssertionError(f"no process for {worker_id}")

    def worker_pid(self, stage: int, tp_rank: int) -> int:
        """The process holding (stage, tp_rank) now."""
        return self.process(self.holder(stage, tp_rank)).pid

    def service_pid(self, name: str) -> int:
        """The pid of `up`'s coordinator or gateway."""
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            cmd = p.cmdline()
            if "shardmesh_cli" in cmd and name in cmd:
                return p.pid
        raise AssertionError(f"no {name} process")

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text()

    def close(self) -> None:
        self.channel.close()
        procs.stop_all([self.proc], grace=15)


class Progress:
    """How many streams have received at least 3 tokens, for a fault that must land mid-stream. `at_n(n, action)`
    runs `action` in the stream thread that makes it n, before that thread reads on: a fault as quick as a signal
    lands with no thread to wake in between (a short stream can end while a waiting thread is scheduled, on a busy
    machine)."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.streaming = 0
        self._actions: dict[int, Callable[[], None]] = {}

    def at_n(self, n: int, action: Callable[[], None]) -> None:
        with self.cv:
            self._actions[n] = action

    def started(self) -> None:
        with self.cv:
            self.streaming += 1
            action = self._actions.pop(self.streaming, None)
            if action is not None:
                action()
            self.cv.notify_all()

    def wait_for(self, n: int) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: self.streaming >= n, timeout=STREAM_TIMEOUT_S)


def stream_all(stub: gateway_pb2_grpc.GatewayStub, reqs: list[gateway_pb2.GenerateRequest] | None = None,
               progress: Progress | None = None) -> dict[str, list[int]]:  # fmt: skip
    """Run every request at once; their tokens by request id. Any stream's error fails the caller."""
    results: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def one(req: gateway_pb2.GenerateRequest) -> None:
        tokens: list[int] = []
        try:
            for msg in stub.GenerateStream(req, timeout=STREAM_TIMEOUT_S):
                tokens.append(msg.token_id)
                if progress is not None and len(tokens) == 3:  # (those that get that far)
                    progress.started()
            results[req.request_id] = tokens
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(r,)) for r in (reqs if reqs is not None else requests())]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=STREAM_TIMEOUT_S + 30)
    assert not errors, errors[0]
    return results


class Spawner:
    """Starts `shardmesh` processes from one thread that outlives them. `procs.spawn` ties each child to the
    thread that started it (PR_SET_PDEATHSIG fires when that *thread* ends), so a worker started from a
    short-lived fault thread would be stopped as soon as the fault is done. `close()` stops them all."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[subprocess.Popen] = []
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="spawner", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            name, args, result = item
            log = (self.log_dir / f"{name}.log").open("ab")
            result.put(procs.spawn(["-m", "shardmesh_cli", *args], stdout=log, stderr=log))

    def worker(self, coordinator: str, worker_id: str, *extra: str) -> subprocess.Popen:
        """`shardmesh worker --coordinator C --worker-id ID [EXTRA...]`, logging to LOG_DIR/ID.log."""
        result: queue.Queue = queue.Queue()
        self._queue.put((worker_id, ["worker", "--coordinator", coordinator, "--worker-id", worker_id, *extra],
                         result))  # fmt: skip
        p = result.get(timeout=30)
        self.started.append(p)
        return p

    def close(self) -> None:
        procs.stop_all(self.started, grace=10)
        self._queue.put(None)
        self._thread.join(timeout=10)
