"""What the worker process tests share: hand-built topologies of a tiny checkpoint, a Coordinator gRPC server
on 127.0.0.1 that answers as the proto documents and records what workers send it, and a recording logger."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from concurrent import futures
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc

from shardmesh.core.config import ModelConfig
from shardmesh.core.layout import split_layers
from shardmesh.core.topology import (
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
from shardmesh.proto.v1 import coordinator_pb2, coordinator_pb2_grpc
from shardworker.process import WorkerConfig


def mesh(model: Path, version: int, holders: tuple[str, ...], *, epoch: int = 0, store_port: int | None = None,
         workers: tuple[MeshWorker, ...] = ()) -> Topology:  # fmt: skip
    """pp = len(holders), tp = 1, stage i held by holders[i]; a rendezvous of `epoch` when `store_port` is set."""
    cfg = ModelConfig.from_dir(model)
    pp = len(holders)
    stages = tuple(Stage(i, start, end, (ShardAssignment(0, i, holders[i], "", ShardState.READY),))
                   for i, (start, end) in enumerate(split_layers(cfg.num_layers, pp)))  # fmt: skip
    spec = ModelSpec(str(model), "float32", "LlamaForCausalLM", cfg.num_layers, cfg.hidden_size, cfg.vocab_size, 64)
    rendezvous = Rendezvous.for_epoch("127.0.0.1", store_port, epoch, pp) if store_port is not None else None
    return Topology(version, spec, pp, 1, stages, rendezvous, True, ServingLimits(4, 64, 64), workers=workers)


def worker(worker_id: str, state: WorkerState, rank: int | None = None) -> MeshWorker:
    return MeshWorker(worker_id, "127.0.0.1:1", 0, state, rank)


class Events:
    """A logger that records (level, event, fields)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def _record(self, level: str, event: str, **fields: Any) -> None:
        self.lines.append((level, event, fields))

    def debug(self, event: str, **fields: Any) -> None:
        self._record("debug", event, **fields)

    def info(self, event: str, **fields: Any) -> None:
        self._record("info", event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._record("warning", event, **fields)

    def error(self, event: str, **fields: Any) -> None:
        self._record("error", event, **fields)

    def exception(self, event: str, **fields: Any) -> None:
        self._record("exception", event, **fields)

    def events(self) -> list[str]:
        return [event for _, event, _ in self.lines]


class FakeCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """Register, Heartbeat, Deregister and WatchTopology as the proto documents them, over one topology the test
    publishes; records registrations and deregistrations. `forget()` makes heartbeats answer known=false, as a
    restarted coordinator does, until the worker registers again."""

    def __init__(self, topology: Topology, heartbeat_s: float = 0.05) -> None:
        self.heartbeat_s = heartbeat_s
        self.registrations: list[coordinator_pb2.RegisterRequest] = []
        self.deregistered: list[str] = []
        self._lock = threading.Lock()
        self._topology = topology
        self._known = True
        self._watchers: list[queue.Queue[Topology | None]] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(self, self._server)
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def close(self) -> None:
        with self._lock:
            for q in self._watchers:
                q.put(None)
        self._server.stop(0).wait()

    def publish(self, topology: Topology) -> None:
        with self._lock:
            self._topology = topology
            for q in self._watchers:
                q.put(topology)

    def forget(self) -> None:
        with self._lock:
            self._known = False

    def worker_config(self, worker_id: str) -> WorkerConfig:
        return WorkerConfig(self.address, "127.0.0.1:0", None, worker_id, "cpu", {}, 30.0, 64 * 1024 * 1024)

    # ---- the service ---------------------------------------------------------------------------------

    def Register(self, request: Any, context: Any) -> coordinator_pb2.RegisterResponse:
        with self._lock:
            self.registrations.append(request)
            self._known = True
            resp = coordinator_pb2.RegisterResponse(worker_id=request.worker_id or "w0",
                                                    topology=self._topology.to_pb())  # fmt: skip
        resp.heartbeat_interval.FromTimedelta(timedelta(seconds=self.heartbeat_s))
        return resp

    def Heartbeat(self, request: Any, context: Any) -> coordinator_pb2.HeartbeatResponse:
        with self._lock:
            return coordinator_pb2.HeartbeatResponse(known=self._known, topology_version=self._topology.version)

    def Deregister(self, request: Any, context: Any) -> coordinator_pb2.DeregisterResponse:
        with self._lock:
            self.deregistered.append(request.worker_id)
            return coordinator_pb2.DeregisterResponse(topology_version=self._topology.version)

    def WatchTopology(self, request: Any, context: Any) -> Iterator[coordinator_pb2.Topology]:
        q: queue.Queue[Topology | None] = queue.Queue()
        with self._lock:
            if self._topology.version > request.after_version:
                q.put(self._topology)
            self._watchers.append(q)
        context.add_callback(lambda: q.put(None))  # the worker cancelled the stream, or the server stops
        try:
            while (topology := q.get()) is not None:
                yield topology.to_pb()
        finally:
            with self._lock:
                self._watchers.remove(q)
