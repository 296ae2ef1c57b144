"""The gateway over real gRPC: its topology watcher against an in-process fake coordinator, its step
fan-out against in-process fake StageWorker servers (one per shard, each checking slots and
positions), a worker that dies and comes back, and the `shardmesh gateway` process driven by
`shardmesh generate --gateway`. No model runs here; tests/e2e/test_mesh.py does that.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.process import GatewayConfig, GatewayServer
from gateway.service_name import SERVICE_NAME
from gateway.watcher import ModelFiles
from shardmesh.core.topology import Topology, TopologyStore
from shardmesh.proto.v1 import (
    common_pb2,
    coordinator_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    worker_pb2_grpc,
)
from shardmesh_cli import main as cli
from tests.stack import ServiceProcess
from tests.unit.gateway.fakes import FakeMesh, FakeRpcError, FakeShard, LogLines, ids_of, write_tokenizer
from tests.waiting import WAIT_S

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class _Coordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """WatchTopology only, from a TopologyStore the test publishes into."""

    def __init__(self, store: TopologyStore) -> None:
        self.store = store

    def WatchTopology(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        after = request.after_version
        while context.is_active() and not self.store.closed:
            topology = self.store.wait_newer(after, timeout=0.1)
            if topology is not None:
                yield topology.to_pb()
                after = topology.version


class _Worker(worker_pb2_grpc.StageWorkerServicer):
    def __init__(self, shard: FakeShard) -> None:
        self.shard = shard

    def Step(self, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return self.shard.step(request)
        except FakeRpcError as e:
            context.abort(e.code(), e.details())

    def Release(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.shard.release(request)


def _serve(add: Callable[[grpc.Server], None], port: int = 0) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    add(server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, port


class FakeCluster:
    """A fake coordinator and one fake worker server per shard of `mesh`, on loopback."""

    def __init__(self, mesh: FakeMesh, model_dir: Path) -> None:
        self.mesh, self.model_dir = mesh, str(model_dir)
        self.store = TopologyStore(mesh.topology(1, complete=False, model_path=self.model_dir))
        self.coordinator, self.port = self._start_coordinator(0)
        self.workers: dict[int, grpc.Server] = {}
        for i in range(len(mesh.shards)):
            self.start_worker(i)

    def _start_coordinator(self, port: int) -> tuple[grpc.Server, int]:
        servicer = _Coordinator(self.store)
        return _serve(lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s), port)

    def start_worker(self, i: int) -> None:
        """(Re)start shard i's server on a fresh port with fresh state, as a restarted worker."""
        old = self.mesh.shards[i]
        shard = FakeShard(self.mesh, old.stage, old.tp_rank)
        servicer = _Worker(shard)
        server, port = _serve(lambda s: worker_pb2_grpc.add_StageWorkerServicer_to_server(servicer, s))
        shard.address = f"127.0.0.1:{port}"
        self.mesh.shards[i] = shard
        self.workers[i] = server

    def kill_worker(self, i: int) -> None:
        self.workers.pop(i).stop(0)

    def publish(self, complete: bool = True, epoch: int = 1) -> Topology:
        version = self.store.current().version + 1
        topology = self.mesh.topology(version, complete, model_path=self.model_dir, epoch=epoch)
        self.mesh.versions.add(version)
        self.store.publish(topology)
        return topology

    def close(self) -> None:
        self.store.close()
        self.coordinator.stop(0)
        for server in self.workers.values():
            server.stop(0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("gw") / "model")


@pytest.fixture
def cluster(model_dir: Path) -> Iterator[FakeCluster]:
    c = FakeCluster(FakeMesh(pp=2, tp=1, kv_slots=2, max_context=64), model_dir)
    try:
        yield c
    finally:
        c.close()


def _health(channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5).status


def _wait_health(channel: grpc.Channel, status: int, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(grpc.RpcError):
            if _health(channel) == status:
                return
        assert time.monotonic() < deadline, f"health never became {status}"
        time.sleep(0.02)


def _rpc_error(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def test_watcher_fan_out_worker_loss_and_recovery(cluster: FakeCluster, model_dir: Path) -> None:
    files = ModelFiles.load(str(model_dir))
    cluster.mesh.default_script = ids_of(files, "ok!")
    logs = LogLines()
    cfg = GatewayConfig(listen="127.0.0.1:0", coordinator=f"127.0.0.1:{cluster.port}", step_timeout=5.0)
    server = GatewayServer(cfg, logs.logger)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = gateway_pb2_grpc.GatewayStub(channel)
    request = gateway_pb2.GenerateRequest(prompt="hi", params=gateway_pb2.SamplingParams(max_new_tokens=3))
    try:
        # The first topology is incomplete: NOT_SERVING, and requests are refused naming why.
        deadline = time.monotonic() + WAIT_S
        while "not complete" not in _rpc_error(lambda: stub.Generate(request, timeout=5)).details():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        err = _rpc_error(lambda: stub.Generate(request, timeout=5))
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert err.details() == "no ready topology: topology v1 is not complete (stage 0 tp rank 0 UNHEALTHY, " \
                                "stage 1 tp rank 0 UNHEALTHY)"  # fmt: skip
        assert _health(channel) == NOT_SERVING

        cluster.publish(complete=True)
        _wait_health(channel, SERVING)
        r = stub.Generate(request, timeout=5)
        assert r.text == "ok!" and r.finish_reason == common_pb2.FINISH_REASON_LENGTH
        info = stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=5)
        assert info.ready and info.topology_version == 2 and info.has_chat_template

        # The last stage's worker dies: the request in flight waits, and so do new ones (health says NOT_SERVING,
        # so a load balancer would send them elsewhere), until the coordinator publishes a complete topology
        # again; then the waiting one replays and both finish.
        cluster.kill_worker(1)
        resuming = stub.Generate.future(request, timeout=60)  # its step fails: it waits to replay, no error
        _wait_health(channel, NOT_SERVING)
        arrived = stub.Generate.future(request, timeout=60)  # not refused: it waits for the mesh
        deadline = time.monotonic() + WAIT_S  # back in the gateway's queue, its slot kept (nothing released)
        while "requests_resuming" not in [e["event"] for e in logs.events()]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert not resuming.done() and len(cluster.mesh.shards[0].released_ids()) == 1  # the first request's

        cluster.publish(complete=False)  # the coordinator notices the silence
        cluster.start_worker(1)  # the worker restarts on another port and rejoins
        cluster.publish(complete=True, epoch=4)
        _wait_health(channel, SERVING)
        assert resuming.result(timeout=30).text == "ok!"  # replayed on the new mesh, then finished
        assert arrived.result(timeout=30).text == "ok!"
        r = stub.Generate(request, timeout=5)
        assert r.text == "ok!"
        assert cluster.mesh.shards[1].steps[-1].topology_version == 4

        # The coordinator restarts (versions begin again): the gateway keeps serving on the last
        # topology while it reconnects, then follows the new coordinator.
        cluster.coordinator.stop(0)
        assert stub.Generate(request, timeout=5).text == "ok!"
        cluster.store = TopologyStore(cluster.mesh.topology(1, True, model_path=cluster.model_dir, epoch=4))
        cluster.coordinator, _ = cluster._start_coordinator(cluster.port)
        deadline = time.monotonic() + WAIT_S
        while stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=5).topology_version != 1:
            assert time.monotonic() < deadline, "the gateway did not follow the restarted coordinator"
            time.sleep(0.05)
        assert stub.Generate(request, timeout=5).text == "ok!"
        events = [e["event"] for e in logs.events()]
        assert "coordinator_watch_lost" in events and "step_failed" in events
    finally:
        channel.close()
        server.stop(grace=0.0)


# -- the `shardmesh gateway` process and `shardmesh generate --gateway` ---------------------------------


class GatewayProcess(ServiceProcess):
    def __init__(self, args: list[str]) -> None:
        super().__init__("gateway", args, wait_s=WAIT_S)


def test_gateway_process_cli_and_sigterm(
    cluster: FakeCluster, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = ModelFiles.load(str(model_dir))
    cluster.mesh.default_script = [*ids_of(files, "Héllo!"), next(iter(files.eos_token_ids))]
    cluster.publish(complete=True)
    gw = GatewayProcess(["--listen", "127.0.0.1:0", "--coordinator", f"127.0.0.1:{cluster.port}",
                         "--shutdown-grace", "0.5"])  # fmt: skip
    try:
        address = f"127.0.0.1:{gw.wait_event('listening')['port']}"
        channel = grpc.insecure_channel(address)
        _wait_health(channel, SERVING)

        assert cli.main(["generate", "--gateway", address, "--json", "--max-new-tokens", "20", "Say hi"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out == {"token_ids": cluster.mesh.default_script, "logprobs": pytest.approx(out["logprobs"]),
                       "text": "Héllo!", "finish_reason": "stop"}  # fmt: skip
        prompt = cluster.mesh.shards[0].steps[-len(cluster.mesh.default_script)].entries[0]  # the prefill step
        assert list(prompt.token_ids) == files.tokenizer.encode_chat([{"role": "user", "content": "Say hi"}])
        assert cli.main(["generate", "--gateway", address, "--raw", "--max-new-tokens", "3", "Say hi"]) == 0
        assert capsys.readouterr().out == "Hé\n"  # streamed (3 byte tokens); --raw: no chat template
        assert cli.main(["generate", "--gateway", address, "--token-ids", "1,300"]) == 1
        err = capsys.readouterr().err
        assert err == "error: INVALID_ARGUMENT: token_ids.ids[1]: token id 300 is outside the vocabulary [0, 259)\n"
        failed = gw.wait_event("request_failed")
        assert failed["code"] == "INVALID_ARGUMENT" and failed["service"] == "gateway" and failed["request_id"]

        # SIGTERM with a request running: NOT_SERVING, the request is cancelled after the grace and
        # released, and the process exits 0 within seconds.
        cluster.mesh.step_delay = 0.05
        stub = gateway_pb2_grpc.GatewayStub(channel)
        long = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[1, 2]), request_id="long",
                                           params=gateway_pb2.SamplingParams(max_new_tokens=60))  # fmt: skip
        cluster.mesh.default_script = []
        stream = stub.GenerateStream(long, timeout=20)
        assert next(stream).index == 0
        gw.proc.send_signal(signal.SIGTERM)
        assert gw.proc.wait(timeout=10) == 0  # within seconds, before the 60 tokens' 3 s are done (cancelled below)
        assert _rpc_error(lambda: list(stream)).code() == grpc.StatusCode.CANCELLED
        assert "long" in cluster.mesh.shards[1].released_ids()
        assert any('"shutdown_complete"' in line for line in gw.lines)
        channel.close()
    finally:
        gw.kill()


def test_gateway_flags_are_checked(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli.main(["gateway", "--coordinator", "nohost"]) == 2
    assert capsys.readouterr().err == "error: --coordinator: expected host:port (port 1-65535), got 'nohost'\n"
    monkeypatch.setenv("SHARDMESH_GATEWAY_MAX_QUEUE", "0")
    assert cli.main(["gateway", "--coordinator", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err == "error: --max-queue: must be >= 1, got 0\n"
    monkeypatch.delenv("SHARDMESH_GATEWAY_MAX_QUEUE")
    assert cli.main(["gateway", "--coordinator", "127.0.0.1:1", "--pipeline-depth", "-1"]) == 2
    assert capsys.readouterr().err == "error: --pipeline-depth: must be >= 0, got -1\n"
    monkeypatch.setenv("SHARDMESH_GATEWAY_DECODE_STEPS", "65")
    assert cli.main(["gateway", "--coordinator", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err == "error: --decode-steps: must be in [1, 64], got 65\n"
    monkeypatch.delenv("SHARDMESH_GATEWAY_DECODE_STEPS")
    assert cli.main(["gateway", "--coordinator", "127.0.0.1:1", "--admission-window", "-0.001"]) == 2
    assert capsys.readouterr().err == "error: --admission-window: must be in [0, 1] seconds, got -0.001\n"
    assert cli.main(["generate", "--max-new-tokens", "3", "hi"]) == 2
    assert "--model is required" in capsys.readouterr().err
