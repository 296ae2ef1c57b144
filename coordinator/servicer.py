"""The Coordinator gRPC servicer: protobuf in -> the registry's request types (which validate and name the
bad field) -> `Registry` -> protobuf out.

Refusals are raised as `shardmesh.core.errors` types; the server's interceptor (`shardmesh.rpc.interceptors`)
turns them into status codes. The process around the servicer is `coordinator.process.CoordinatorServer`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import grpc
from google.protobuf import duration_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.registry import MAX_REPORTED, HeartbeatReport, Registration, Registry, check_worker_id
from shardmesh.core.errors import InvalidArgument
from shardmesh.proto.v1 import coordinator_pb2, coordinator_pb2_grpc
from shardmesh.rpc import telemetry

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name  # "shardmesh.v1.Coordinator"
WATCH_POLL_S = 0.5  # how often an idle watch stream checks that its client is still there
PROBE_TIMEOUT_S = 1.0  # a reported worker that does not answer its health check within this is lost


def unreachable(address: str, timeout: float = PROBE_TIMEOUT_S,
                dial: Callable[[str], grpc.Channel] = grpc.insecure_channel) -> str:  # fmt: skip
    """Why the worker at `address` is unreachable ("" when it answers grpc.health.v1, whatever its status: a
    worker that is NOT_SERVING because a peer died is alive and will join the next placement). `dial`: how to
    reach it (`shardmesh.rpc.tls.Dial.channel` on a mesh with TLS)."""
    with dial(address) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return f"health check {e.code().name}"
        return ""


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
    def __init__(self, registry: Registry, heartbeat_interval: float, logger: Any = None,
                 probe: Callable[[str], str] = unreachable) -> None:  # fmt: skip
        self._registry = registry
        self._interval = heartbeat_interval
        self._log = logger
        self._probe = probe

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
        # A restarted coordinator says nothing until it has its placement back (or gave up waiting): a gateway
        # keeps serving the last topology it had rather than stop for the moments the workers take to re-register.
        while context.is_active() and not store.closed and not self._registry.settled.wait(WATCH_POLL_S):
            pass
        while context.is_active() and not store.closed:
            topology = store.wait_newer(after, timeout=WATCH_POLL_S)
            if topology is not None:
                yield topology.to_pb()
                after = topology.version

    def GetTopology(self, request: coordinator_pb2.GetTopologyRequest, context: grpc.ServicerContext) -> Any:
        return self._registry.store.current().to_pb()

    def ReportFailure(self, request: coordinator_pb2.ReportFailureRequest, context: grpc.ServicerContext) -> Any:
        ids = list(dict.fromkeys(request.worker_ids))
        if not ids or len(ids) > MAX_REPORTED:
            raise InvalidArgument("worker_ids", f"need 1..{MAX_REPORTED} worker ids, got {len(ids)}")
        for i, worker_id in enumerate(ids):
            check_worker_id(worker_id, f"worker_ids[{i}]")
        known = self._registry.workers()
        suspects = [(i, known[i].address) for i in ids if i in known and not known[i].timed_out]
        verdicts = _probe_all([a for _, a in suspects], self._probe)
        dead = {i: why for (i, _), why in zip(suspects, verdicts, strict=True) if why}
        reason = request.reason[:512]
        lost, version = self._registry.report_lost(
            list(dead),
            f"reported by {request.reporter[:128] or 'a client'} ({reason}); {', '.join(set(dead.values()))}",
        )
        if self._log is not None:
            self._log.info("failure_reported", reporter=request.reporter[:128], reason=reason, worker_ids=ids,
                           lost=lost, alive=[i for i, _ in suspects if i not in dead])  # fmt: skip
        return coordinator_pb2.ReportFailureResponse(lost=lost, topology_version=version)

    def Drain(self, request: coordinator_pb2.DrainRequest, context: grpc.ServicerContext) -> Any:
        with _membership_span("Drain", context):
            state, message, version = self._registry.drain(check_worker_id(request.worker_id))
        return coordinator_pb2.DrainResponse(state=state.to_pb(), message=message, topology_version=version)


def _probe_all(addresses: Sequence[str], probe: Callable[[str], str]) -> list[str]:
    """`probe` on every address at once: a report about a pp x tp mesh takes one probe's time, not pp x tp."""
    if not addresses:
        return []
    with ThreadPoolExecutor(min(16, len(addresses)), thread_name_prefix="probe") as pool:
        return list(pool.map(probe, addresses))
