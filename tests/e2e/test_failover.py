"""A worker killed with SIGKILL while requests stream: every request finishes, with the tokens it would have had.

Over real processes: `shardmesh up` (which restarts a dead worker under the same id), 8 concurrent streams,
half greedy and half sampled with a seed, `kill -9` of one worker once every stream has tokens. The gateway
keeps each sequence's token log; on the next complete topology each one replays its log and decodes on.
The streams are compared token for token with an undisturbed run of the same requests on the same mesh.
Kept in the normal suite on purpose: a fail-over path that no test exercises rots.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from shardmesh.proto.v1 import coordinator_pb2, coordinator_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from shardmesh.rpc import procs
from tests.checkpoints import make_checkpoint

PROMPTS = [[1, 17, 5, 42, 33, 8], [1, 9, 9, 2, 60], [1, 70, 71], [1, 3, 5, 7, 11, 13, 17, 19]]
NEW_TOKENS = 160
STREAM_TIMEOUT_S = 120.0  # far above a recovery here (seconds): only a hang reaches it


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # eos 95 is rare under this seed, so the streams run to NEW_TOKENS and compare many tokens each.
    return make_checkpoint(tmp_path_factory.mktemp("failover"), "llama-gqa-tied", num_layers=4, seed=11,
                           eos_token_id=95)  # fmt: skip


def requests() -> list[gateway_pb2.GenerateRequest]:
    """4 greedy and 4 sampled requests (the sampled ones seeded: their reference is a run like any other)."""
    out = []
    for i in range(8):
        params = gateway_pb2.SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
        if i % 2:
            params = gateway_pb2.SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.9, top_p=0.95, seed=100 + i)
        out.append(gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=PROMPTS[i % len(PROMPTS)]),
                                               params=params, request_id=f"r{i}"))  # fmt: skip
    return out


class Mesh:
    """`shardmesh up`: the first line on its stdout is the gateway's address, the second the coordinator's."""

    def __init__(self, model: Path, pp: int, tp: int, log_dir: Path) -> None:
        args = ["-m", "shardmesh_cli", "up", "--model", str(model), "--pp", str(pp), "--tp", str(tp),
                "--kv-slots", "8", "--max-context", "256", "--log-dir", str(log_dir)]  # fmt: skip
        self.proc = procs.spawn(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.log_dir = log_dir
        self.address = self.proc.stdout.readline().decode().strip()
        if not self.address:
            raise RuntimeError(f"up failed: {self.proc.stderr.read().decode()[-3000:]}")
        second = self.proc.stdout.readline().decode().strip()
        assert second.startswith("coordinator: "), second
        self.coordinator = second.removeprefix("coordinator: ")
        self.channel = grpc.insecure_channel(self.address)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    def worker_pid(self, stage: int, tp_rank: int) -> int:
        """The process holding (stage, tp_rank) now, from the coordinator's topology."""
        with grpc.insecure_channel(self.coordinator) as ch:
            topology = coordinator_pb2_grpc.CoordinatorStub(ch).GetTopology(coordinator_pb2.GetTopologyRequest(),
                                                                             timeout=10)  # fmt: skip
        worker_id = topology.stages[stage].shards[tp_rank].worker_id
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            cmd = p.cmdline()
            if "--worker-id" in cmd and cmd[cmd.index("--worker-id") + 1] == worker_id:
                return p.pid
        raise AssertionError(f"no process for {worker_id}")

    def close(self) -> None:
        self.channel.close()
        procs.stop_all([self.proc], grace=15)


class Progress:
    """How many streams have received at least 3 tokens, for a kill that must land mid-stream."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.streaming = 0

    def started(self) -> None:
        with self.cv:
            self.streaming += 1
            self.cv.notify_all()

    def wait_for(self, n: int) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: self.streaming >= n, timeout=STREAM_TIMEOUT_S)


def stream_all(stub: gateway_pb2_grpc.GatewayStub, progress: Progress | None = None) -> dict[str, list[int]]:
    """Run every request at once; their tokens by request id."""
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

    threads = [threading.Thread(target=one, args=(r,)) for r in requests()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=STREAM_TIMEOUT_S + 30)
    assert not errors, errors[0]
    return results


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=lambda p: f"pp{p[0]}-tp{p[1]}")
def mesh(request, model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    pp, tp = request.param
    m = Mesh(model, pp, tp, tmp_path_factory.mktemp(f"failover{pp}{tp}"))
    yield m
    m.close()


def killed_mid_stream(mesh: Mesh, stage: int, tp_rank: int, streaming: int) -> dict[str, list[int]]:
    """Every request at once, and SIGKILL of the worker at (stage, tp_rank) once `streaming` streams have
    3 tokens; their tokens by request id."""
    progress = Progress()
    killed: list[int] = []

    def kill() -> None:
        if progress.wait_for(streaming):
            pid = mesh.worker_pid(stage, tp_rank)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    killer = threading.Thread(target=kill)
    killer.start()
    tokens = stream_all(mesh.stub, progress)
    killer.join(timeout=30)
    assert killed, "the worker was not killed"
    return tokens


def test_requests_survive_a_killed_worker_with_the_tokens_of_an_undisturbed_run(mesh: Mesh) -> None:
    reference = stream_all(mesh.stub)
    long = [k for k, tokens in reference.items() if len(tokens) >= 20]
    assert len(long) >= 4  # the greedy ones run to NEW_TOKENS; a sampled one may draw eos early
    info = mesh.stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=10)
    # pp=2: the first stage, then the last (the sampler); tp=2: the rank that is not the sampler.
    victims = [(0, 0), (1, 0)] if info.pp > 1 else [(0, 1)]
    for round_, (stage, tp_rank) in enumerate(victims, start=1):
        disturbed = killed_mid_stream(mesh, stage, tp_rank, len(long))
        assert disturbed == reference, (stage, tp_rank)  # every request, every token: none lost, repeated or changed
        resumed = (mesh.log_dir / "gateway.log").read_text().count('"event": "requests_resuming"')
        assert resumed >= round_  # the kill did land mid-stream: requests replayed their logs
