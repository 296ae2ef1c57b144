"""The Gateway gRPC service and the process around it.

The servicer only translates: protobuf in -> `GenerateCall` (validated, the bad field named) ->
`prepare` against the served model -> `Scheduler.submit` -> events from the scheduler thread ->
protobuf out. Domain errors become status codes in `_STATUS`, the one place they are mapped, and
every error is logged once, as one JSON line bound to the request's id. `GatewayServer` owns
everything with a life cycle: the topology watcher, the scheduler thread, and the gRPC server
with health (SERVING only while a complete mesh can take requests) and reflection.

Cancellation: a client that cancels (or whose deadline passes) fires the RPC's termination
callback, which cancels the request; the scheduler drops it at the next step boundary and
releases its slot on every shard. At shutdown, a unary `Generate` still running after the grace
period gets a response with the tokens so far and finish_reason CANCELLED; a `GenerateStream` ends
with status CANCELLED instead, because a stream's summary must ride on a token message and the
stream's last token has already been sent.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2

from gateway.errors import Cancelled, GatewayError, Internal, InvalidArgument, ResourceExhausted, Unavailable
from gateway.observe import DEFAULT_TRACE_DECODE_STEPS, GatewayMetrics, GatewayObserver, RequestTrace
from gateway.requests import GenerateCall, GenerateParams, PromptInput, prepare, request_id_of
from gateway.results import EndEvent, Event, FinishReason, RequestHandle, Summary, TokenEvent, is_last
from gateway.scheduler import Scheduler, SchedulerConfig
from gateway.topology import MeshSource, TopologyWatcher
from shardmesh import rpc, telemetry
from shardmesh.proto.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name  # "shardmesh.v1.Gateway"
EVENT_POLL_S = 1.0  # how often a waiting RPC checks that the scheduler is still alive

_STATUS: dict[type[GatewayError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Cancelled: grpc.StatusCode.CANCELLED,
    Internal: grpc.StatusCode.INTERNAL,
}
_FINISH = {
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
}


def status_for(error: GatewayError) -> grpc.StatusCode:
    return next((code for cls, code in _STATUS.items() if isinstance(error, cls)), grpc.StatusCode.INTERNAL)


@dataclass(frozen=True)
class GatewayConfig:
    listen: str  # host:port for gRPC; port 0 picks a free one
    coordinator: str  # host:port of the coordinator
    max_queue: int = 256
    max_message_bytes: int = 64 * 1024 * 1024
    default_max_new_tokens: int = 256
    step_timeout: float = 120.0
    pipeline_depth: int = 0  # steps in flight at once; 0: one per pipeline stage
    shutdown_grace: float = 5.0
    model_dir: str | None = None  # where this gateway reads the tokenizer; default: the topology's model path
    metrics_port: int = 0  # 0: no metrics endpoint
    otlp_endpoint: str | None = None  # tracing is set up by the process (`app.run`); this is for the log line
    trace_decode_steps: int = DEFAULT_TRACE_DECODE_STEPS  # decode steps traced per request; later ones aggregated

    @property
    def thread_pool_size(self) -> int:
        """Every request holds a server thread while it waits or runs; threads are created on
        demand, so the bound only has to exceed queue + KV slots."""
        return self.max_queue + 1024


def _summary_pb(summary: Summary) -> gateway_pb2.StreamSummary:
    t = summary.timings
    return gateway_pb2.StreamSummary(
        finish_reason=_FINISH[summary.finish_reason],
        usage=gateway_pb2.Usage(prompt_tokens=summary.prompt_tokens, completion_tokens=summary.completion_tokens),
        timings=gateway_pb2.Timings(queue_ms=t.queue_ms, time_to_first_token_ms=t.time_to_first_token_ms,
                                    inter_token_ms=t.inter_token_ms, mean_inter_token_ms=t.mean_inter_token_ms,
                                    total_ms=t.total_ms),
    )  # fmt: skip


@dataclass(frozen=True)
class _Call:
    """One RPC as the servicer tracks it: the request id, its trace id (always set, for logs) and
    its spans (tracing on only)."""

    request_id: str
    trace_id: str
    trace: RequestTrace | None


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, scheduler: Scheduler, logger: Any, observer: GatewayObserver | None = None) -> None:
        self._scheduler = scheduler
        self._log = logger
        self._obs = observer

    @contextlib.contextmanager
    def _request(self, request: gateway_pb2.GenerateRequest, context: grpc.ServicerContext,
                 method: str) -> Iterator[_Call]:  # fmt: skip
        """Bind the request id and trace id to every log line, trace the RPC (when tracing is on), and
        turn any failure into one status + one log line.

        The trace id is the request span's when tracing is on; otherwise the client's `traceparent`'s
        when it sent one, so its logs still join ours; otherwise a fresh one, for log correlation only.
        """
        refusal: InvalidArgument | None = None
        try:
            request_id = request_id_of(request)
        except InvalidArgument as e:  # a too-long id: refuse it, logged under a shortened one
            request_id, refusal = request.request_id[:32] + "...", e
        metadata = context.invocation_metadata()
        obs = self._obs
        trace = obs.start_request(method, metadata, request_id) if obs is not None else None
        trace_id = trace.trace_id if trace is not None else (telemetry.client_trace_id(metadata) or
                                                              telemetry.new_trace_id())  # fmt: skip
        error: BaseException | None = None
        code_name = ""
        with structlog.contextvars.bound_contextvars(request_id=request_id, trace_id=trace_id):
            context.set_trailing_metadata((("request-id", request_id), ("trace-id", trace_id)))
            try:
                if refusal is not None:
                    raise refusal
                yield _Call(request_id, trace_id, trace)
            except GatewayError as e:
                code = status_for(e)
                error, code_name = e, code.name
                self._log.warning("request_failed", code=code.name, error=str(e))
                if obs is not None:
                    obs.request_errored(code.name)
                context.abort(code, str(e))
            except Exception as e:
                error, code_name = e, grpc.StatusCode.INTERNAL.name
                self._log.exception("request_error")
                if obs is not None:
                    obs.request_errored(code_name)
                context.abort(grpc.StatusCode.INTERNAL, f"internal error (request_id {request_id}; see gateway logs)")
            finally:
                if trace is not None:
                    GatewayObserver.end_request(trace, error, code_name)

    def _start(self, request: gateway_pb2.GenerateRequest, call: _Call, arrival: float) -> RequestHandle:
        started_ns = time.time_ns() if call.trace is not None else 0
        generate = GenerateCall(call.request_id, PromptInput.from_pb(request), GenerateParams.of_request(request))
        prepared = prepare(generate, self._scheduler.serving_context(), arrival)
        if call.trace is not None:
            call.trace.prepared(started_ns, len(prepared.prompt_ids))
        return self._scheduler.submit(prepared, call.trace, call.trace_id)

    def _events(self, handle: RequestHandle, context: grpc.ServicerContext) -> Iterator[Event]:
        if not context.add_callback(handle.cancel):
            handle.cancel()  # the RPC already ended
        while True:
            try:
                event = handle.events.get(timeout=EVENT_POLL_S)
            except queue.Empty:
                if not self._scheduler.alive:
                    handle.cancel()
                    raise Internal("the scheduler stopped") from None
                continue
            if isinstance(event, EndEvent) and event.error is not None:
                raise event.error
            yield event
            if is_last(event):
                return

    def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.ServicerContext) -> Any:
        arrival = time.monotonic()
        with self._request(request, context, "Generate") as call:
            handle = self._start(request, call, arrival)
            response = gateway_pb2.GenerateResponse(request_id=call.request_id)
            text: list[str] = []
            for event in self._events(handle, context):
                if isinstance(event, TokenEvent):
                    response.token_ids.append(event.token_id)
                    response.logprobs.append(event.logprob)
                text.append(event.text_delta)
                if event.summary is not None:
                    summary = _summary_pb(event.summary)
                    response.finish_reason = summary.finish_reason
                    response.usage.CopyFrom(summary.usage)
                    response.timings.CopyFrom(summary.timings)
            response.text = "".join(text)
            return response

    def GenerateStream(
        self, request: gateway_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[gateway_pb2.GenerateStreamResponse]:
        arrival = time.monotonic()
        with self._request(request, context, "GenerateStream") as call:
            handle = self._start(request, call, arrival)
            request_id = call.request_id
            for event in self._events(handle, context):
                if isinstance(event, EndEvent):  # cancelled: by the client (gone) or by shutdown
                    if context.is_active():
                        raise Cancelled("request cancelled: the gateway is shutting down")
                    return
                message = gateway_pb2.GenerateStreamResponse(
                    request_id=request_id, index=event.index, token_id=event.token_id, logprob=event.logprob,
                    text_delta=event.text_delta,
                )  # fmt: skip
                if event.summary is not None:
                    message.summary.CopyFrom(_summary_pb(event.summary))
                yield message

    def GetModelInfo(self, request: gateway_pb2.GetModelInfoRequest, context: grpc.ServicerContext) -> Any:
        state, ready = self._scheduler.snapshot()
        if state.topology is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, state.reason)
        topology, model = state.topology, state.model
        return gateway_pb2.ModelInfo(
            model=topology.model.to_pb(), pp=topology.pp, tp=topology.tp, topology_version=topology.version,
            ready=ready, eos_token_ids=sorted(model.eos_token_ids) if model else [],
            has_chat_template=bool(model and model.tokenizer is not None and model.tokenizer.chat_template),
            max_context=topology.limits.max_context,
        )  # fmt: skip


class GatewayServer:
    """The running gateway: `start()`, then `stop()` (from the main thread on a signal)."""

    def __init__(self, cfg: GatewayConfig, logger: Any, mesh_source: MeshSource | None = None) -> None:
        self.cfg = cfg
        self._log = logger
        tracer = telemetry.tracer()  # None unless the process set up tracing
        observer = None
        if tracer is not None or cfg.metrics_port:
            observer = GatewayObserver(tracer, None, cfg.trace_decode_steps)
        self.observer = observer
        self.scheduler = Scheduler(
            SchedulerConfig(max_queue=cfg.max_queue, default_max_new_tokens=cfg.default_max_new_tokens,
                            step_timeout=cfg.step_timeout, pipeline_depth=cfg.pipeline_depth),
            logger, observer=observer,
        )  # fmt: skip
        if observer is not None and cfg.metrics_port:
            observer.metrics = GatewayMetrics(self.scheduler.load)
        self._metrics_server: Any = None
        self.metrics_port = 0
        self.mesh_source: MeshSource = mesh_source or TopologyWatcher(
            cfg.coordinator, logger=logger, max_message_bytes=cfg.max_message_bytes, model_dir=cfg.model_dir
        )
        self._health = health.HealthServicer(
            experimental_non_blocking=True, experimental_thread_pool=futures.ThreadPoolExecutor(max_workers=2)
        )
        self._health_lock = threading.Lock()
        self._stopping = threading.Event()
        self._server: grpc.Server | None = None
        self.port = 0

    def start(self) -> None:
        cfg = self.cfg
        server = rpc.new_server(SERVICE_NAME, self._health, cfg.max_message_bytes, cfg.thread_pool_size)
        servicer = GatewayServicer(self.scheduler, self._log, self.observer)
        gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
        self.port = rpc.bind(server, cfg.listen)
        if self.observer is not None and self.observer.metrics is not None:
            self._metrics_server = telemetry.serve_metrics(
                self.observer.metrics.registry, cfg.listen.rpartition(":")[0].strip("[]"), cfg.metrics_port
            )
            self.metrics_port = self._metrics_server.server_port
        self._set_health(False)
        self.scheduler.add_ready_listener(self._set_health)
        self.scheduler.start()
        self.mesh_source.subscribe(self.scheduler.update_mesh)
        self.mesh_source.start()
        server.start()
        self._server = server
        host = cfg.listen.rpartition(":")[0]
        self._log.info("listening", address=f"{host}:{self.port}", port=self.port, coordinator=cfg.coordinator,
                       max_queue=cfg.max_queue, max_message_bytes=cfg.max_message_bytes,
                       pipeline_depth=cfg.pipeline_depth or "one per stage", metrics_port=self.metrics_port or "off",
                       **telemetry.describe_tracing(cfg.otlp_endpoint))  # fmt: skip

    def _set_health(self, ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        with self._health_lock:
            if self._stopping.is_set():
                return
            for service in ("", SERVICE_NAME):
                self._health.set(service, status)

    def stop(self, grace: float | None = None) -> None:
        """NOT_SERVING and refuse new RPCs at once; running requests get `grace` seconds to finish,
        then are cancelled (and released on every shard); exits within a few seconds after that."""
        grace = self.cfg.shutdown_grace if grace is None else grace
        with self._health_lock:
            if self._stopping.is_set():
                return
            self._stopping.set()
            self._health.enter_graceful_shutdown()
        self._log.info("shutdown_started", grace_s=grace)
        stopped = self._server.stop(grace + 2.0) if self._server is not None else None
        self.scheduler.shutdown(grace)
        self.mesh_source.stop()
        if stopped is not None:
            stopped.wait(grace + 3.0)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        self._log.info("shutdown_complete")
