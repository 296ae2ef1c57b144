"""A Coordinator gRPC server in this process, on 127.0.0.1, that answers Drain and GetTopology from a script:
enough for the commands that only ask the coordinator (`status`, `drain`, `top`)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc

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


def topology(*workers: MeshWorker, version: int = 7, epoch: int | None = 3) -> Topology:
    """pp=2 × tp=2 over 10 layers (0-5, 6-9); the slot of rank r is held by the worker listed with rank r."""
    holders = {w.rank: w for w in workers if w.rank is not None}
    stages = []
    for index, (start, end) in enumerate(((0, 6), (6, 10))):
        shards = []
        for tp_rank in range(2):
            rank = index * 2 + tp_rank
            w = holders.get(rank)
            held = ShardAssignment(tp_rank, rank, w.worker_id, w.address, ShardState.READY) if w else None
            shards.append(held or ShardAssignment(tp_rank, rank))
        stages.append(Stage(index, start, end, tuple(shards)))
    model = ModelSpec("/models/m", "float32", "LlamaForCausalLM", 10, 64, 128, 256)
    rendezvous = Rendezvous.for_epoch("127.0.0.1", 29500, epoch, 4) if epoch is not None else None
    return Topology(version, model, 2, 2, tuple(stages), rendezvous, False, ServingLimits(4, 256, 256),
                    workers=workers)  # fmt: skip


def worker(i: int, state: WorkerState, rank: int | None = None, detail: str = "") -> MeshWorker:
    return MeshWorker(f"worker-{i}", f"127.0.0.1:{5000 + i}", 100 + i, state, rank, detail)


@dataclass
class Script:
    """What the fake coordinator answers: Drain's response or error, and the topologies GetTopology returns in
    turn (the last one from then on)."""

    topologies: list[Topology]
    drain: coordinator_pb2.DrainResponse | tuple[grpc.StatusCode, str] = field(
        default_factory=lambda: coordinator_pb2.DrainResponse(
            state=WorkerState.DRAINING.to_pb(), message="waiting for a spare", topology_version=8
        )
    )
    unavailable: int = 0  # GetTopology calls to fail with UNAVAILABLE first, as while the coordinator restarts
    drained: list[str] = field(default_factory=list)  # the ids Drain was called with
    gets: int = 0  # GetTopology calls so far


class _Servicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, script: Script) -> None:
        self.script = script

    def Drain(self, request: coordinator_pb2.DrainRequest, context: grpc.ServicerContext) -> object:
        self.script.drained.append(request.worker_id)
        if isinstance(self.script.drain, tuple):
            context.abort(*self.script.drain)
        return self.script.drain

    def GetTopology(self, request: coordinator_pb2.GetTopologyRequest, context: grpc.ServicerContext) -> object:
        s = self.script
        if s.unavailable > 0:
            s.unavailable -= 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
        t = s.topologies[min(s.gets, len(s.topologies) - 1)]
        s.gets += 1
        return t.to_pb()


@contextmanager
def serve(script: Script) -> Iterator[str]:
    """The fake coordinator's host:port while the block runs."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(_Servicer(script), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)
