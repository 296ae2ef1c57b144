"""The Gateway gRPC servicer: protobuf in -> `GenerateCall` (validated, the bad field named) ->
`prepare` against the served model -> `Scheduler.submit` -> events from the scheduler thread ->
protobuf out. The process around it is `gateway.process.GatewayServer`.

Failures are raised as `shardmesh.core.errors` types; the server's interceptor
(`shardmesh.rpc.interceptors`) turns them into status codes. Here each failed request is logged
once, as one JSON line bound to the request's id, counted, and ends its trace.

Cancellation: a client that cancels (or whose deadline passes) fires the RPC's termination
callback, which cancels the request; the scheduler drops it at the next step boundary and
releases its slot on every shard. At shutdown, a request that has no token yet (still queued, or
admitted but not past its prompt when the grace period ends) fails with UNAVAILABLE: it was not served,
and may be sent again. A unary `Generate` that has tokens and still runs after the grace period gets
a response with the tokens so far and finish_reason CANCELLED; a `GenerateStream` ends with status
CANCELLED instead, because a stream's summary must ride on a token message and the stream's last
token has already been sent.
"""

from __future__ import annotations

import contextlib
import queue
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from gateway import memory
from gateway.observe import GatewayObserver, RequestTrace, served_model
from gateway.requests import GenerateCall, GenerateParams, PromptInput, prepare, request_id_of
from gateway.results import EndEvent, Event, FinishReason, RequestHandle, Summary, TokenEvent, is_last
from gateway.scheduler import Scheduler
from shardmesh.core.errors import Cancelled, Internal, InvalidArgument, MeshError, Unavailable
from shardmesh.proto.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from shardmesh.rpc import telemetry

EVENT_POLL_S = 1.0  # how often a waiting RPC checks that the scheduler is still alive

_FINISH = {
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.EOS: common_pb2.FINISH_REASON_EOS,
    FinishReason.STOP_STRING: common_pb2.FINISH_REASON_STOP_STRING,
    FinishReason.STOP_TOKEN: common_pb2.FINISH_REASON_STOP_TOKEN,
    FinishReason.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
}


def _alternatives(event: TokenEvent) -> list[common_pb2.TokenLogprob]:
    return [common_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in event.top_logprobs]


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
    def __init__(self, scheduler: Scheduler, logger: Any, observer: GatewayObserver | None = None,
                 served_model_name: str | None = None) -> None:  # fmt: skip
        self._scheduler = scheduler
        self._log = logger
        self._obs = observer
        self._served_name = served_model_name  # the name clients know the model by (`--served-model-name`)
        memory.release_freed_memory()  # what large requests leave in the server threads' arenas (once per process)

    @contextlib.contextmanager
    def _request(self, request: gateway_pb2.GenerateRequest, context: grpc.ServicerContext,
                 method: str) -> Iterator[_Call]:  # fmt: skip
        """Bind the request id and trace id to every log line, trace the RPC (when tracing is on), and
        log and count a failure once. An unexpected error is re-raised as `Internal` naming the request
        id, so the client can find the traceback, which only the log has.

        The trace id is the request span's when tracing is on; otherwise the client's `traceparent`'s
        when it sent one, so its logs still join ours; otherwise a fresh one, for log correlation only.
        """
        refusal: InvalidArgument | None = None
        try:
            request_id = request_id_of(request)
        except InvalidArgument as e:  # refused, and logged under an id of ours (its own may not be printable)
            request_id, refusal = f"refused-{uuid.uuid4().hex}", e
        metadata = context.invocation_metadata()
        obs = self._obs
        trace = obs.start_request(method, metadata, request_id) if obs is not None else None
        trace_id = trace.trace_id if trace is not None else (telemetry.client_trace_id(metadata) or
                                                              telemetry.new_trace_id())  # fmt: skip
        error: BaseException | None = None
        code = ""
        with structlog.contextvars.bound_contextvars(request_id=request_id, trace_id=trace_id):
            context.set_trailing_metadata((("request-id", request_id), ("trace-id", trace_id)))
            try:
                if refusal is not None:
                    raise refusal
                yield _Call(request_id, trace_id, trace)
            except MeshError as e:
                error, code = e, e.code
                self._log.warning("request_failed", code=code, error=str(e))
                raise
            except Exception as e:
                error, code = e, Internal.code
                self._log.exception("request_error")
                raise Internal(f"internal error (request_id {request_id}; see gateway logs)") from e
            finally:
                if obs is not None and code:
                    obs.request_errored(code)
                if trace is not None:
                    GatewayObserver.end_request(trace, error, code)

    def _start(self, request: gateway_pb2.GenerateRequest, call: _Call, arrival: float) -> RequestHandle:
        started_ns = time.time_ns() if call.trace is not None else 0
        generate = GenerateCall(call.request_id, PromptInput.from_pb(request), GenerateParams.of_request(request))
        prepared = prepare(generate, self._scheduler.serving_context(), arrival)
        if call.trace is not None:
            call.trace.prepared(started_ns, len(prepared.prompt_ids))
            model = self._served_name or served_model(self._scheduler.snapshot()[0])
            call.trace.requested(generate.input.kind, prepared, model)
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
                    if event.top_logprobs:
                        response.top_logprobs.add(alternatives=_alternatives(event))
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
                    text_delta=event.text_delta, top_logprobs=_alternatives(event),
                )  # fmt: skip
                if event.summary is not None:
                    message.summary.CopyFrom(_summary_pb(event.summary))
                yield message

    def GetModelInfo(self, request: gateway_pb2.GetModelInfoRequest, context: grpc.ServicerContext) -> Any:
        state, ready = self._scheduler.snapshot()
        if state.topology is None:
            raise Unavailable(state.reason)
        topology, model = state.topology, state.model
        return gateway_pb2.ModelInfo(
            model=topology.model.to_pb(), pp=topology.pp, tp=topology.tp, topology_version=topology.version,
            ready=ready, eos_token_ids=sorted(model.eos_token_ids) if model else [],
            has_chat_template=bool(model and model.tokenizer is not None and model.tokenizer.chat_template),
            max_context=topology.limits.max_context,
        )  # fmt: skip
