"""The Coordinator gRPC servicer: protobuf in -> the registry's request types (which validate and name the
bad field) -> `Registry` -> protobuf out.

Refusals are raised as `shardmesh.core.errors` types; the server's interceptor (`shardmesh.rpc.interceptors`)
turns them into status codes. The process around the servicer is `coordinator.process.CoordinatorServer`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import grpc
from google.protobuf import duration_pb2

from coordinator.registry import HeartbeatReport, Registration, Registry, check_worker_id
from shardmesh.proto.v1 import coordinator_pb2, coordinator_pb2_grpc
from shardmesh.rpc import telemetry

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name  # "shardmesh.v1.Coordinator"
WATCH_POLL_S = 0.5  # how often an idle watch stream checks that its client is still there


def _duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromTimedelta(timedelta(seconds=seconds))
    return d


@contextlib.contextmanager
def _membership_span(method: str, context: grpc.ServicerContext) -> Iterator[Any]:
    """A span for a membership change (Register, Deregister: rare, unlike heartbeats); None when tracing is off."""
    tracer = telemetry.tracer()
    if tracer is None:
        yield None
        return
    from opentelemetry.trace import SpanKind

    parent = telemetry.extract(context.invocation_metadata())
    attributes = {"rpc.system": "grpc", "rpc.service": SERVICE_NAME, "rpc.method": method}
    with tracer.start_as_current_span(f"{SERVICE_NAME}/{method}", context=parent, kind=SpanKind.SERVER,
                                      attributes=attributes) as span:  # fmt: skip
        yield span


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, registry: Registry, heartbeat_interval: float) -> None:
        self._registry = registry
        self._interval = heartbeat_interval

    def Register(self, request: coordinator_pb2.RegisterRequest, context: grpc.ServicerContext) -> Any:
        with _membership_span("Register", context) as span:
            worker_id, topology = self._registry.register(Registration.from_pb(request))
            if span is not None:
                span.set_attributes({"shardmesh.worker_id": worker_id, "shardmesh.address": request.address,
                                     "shardmesh.topology_version": topology.version})  # fmt: skip
        return coordinator_pb2.RegisterResponse(
            worker_id=worker_id, heartbeat_interval=_duration(self._interval),
            heartbeat_timeout=_duration(self._registry.heartbeat_timeout), topology=topology.to_pb(),
        )  # fmt: skip

    def Heartbeat(self, request: coordinator_pb2.HeartbeatRequest, context: grpc.ServicerContext) -> Any:
        known, version = self._registry.heartbeat(HeartbeatReport.from_pb(request))
        return coordinator_pb2.HeartbeatResponse(known=known, topology_version=version)

    def Deregister(self, request: coordinator_pb2.DeregisterRequest, context: grpc.ServicerContext) -> Any:
        with _membership_span("Deregister", context) as span:
            version = self._registry.deregister(check_worker_id(request.worker_id))
            if span is not None:
                span.set_attributes({"shardmesh.worker_id": request.worker_id, "shardmesh.topology_version": version})
        return coordinator_pb2.DeregisterResponse(topology_version=version)

    def WatchTopology(
        self, request: coordinator_pb2.WatchTopologyRequest, context: grpc.ServicerContext
    ) -> Iterator[coordinator_pb2.Topology]:
        store, after = self._registry.store, request.after_version
        while context.is_active() and not store.closed:
            topology = store.wait_newer(after, timeout=WATCH_POLL_S)
            if topology is not None:
                yield topology.to_pb()
                after = topology.version

    def GetTopology(self, request: coordinator_pb2.GetTopologyRequest, context: grpc.ServicerContext) -> Any:
        return self._registry.store.current().to_pb()
