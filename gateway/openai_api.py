"""The OpenAI-compatible HTTP API of the gateway (FastAPI): the routes, the API key, errors, streaming.

    POST /v1/chat/completions   messages through the model's chat template; streamed (SSE) or whole
    POST /v1/completions        prompt: a string or a list of token ids; streamed (SSE) or whole
    GET  /v1/models             the one served model (and GET /v1/models/{id})
    GET  /health                200 while the gateway serves, 503 otherwise (no API key needed)

Like the gRPC servicer, a route is thin: JSON body -> `GenerateCall` (`gateway/openai_schema.py`, the shared
checks of `gateway/requests.py`) -> `prepare` -> `Scheduler.submit` -> events -> JSON out
(`gateway/openai_render.py`). There is no second code path for generation. Failures are raised as
`shardmesh.core.errors` types and turned into statuses in one place (`gateway/openai_errors.py`); FastAPI's
422 for a malformed body becomes a 400 naming the field, like every other refusal.

Traces: one span per generation request, named and described by OpenTelemetry's HTTP server conventions
(`POST /v1/chat/completions`, `http.route`, `http.response.status_code`, ...), with the children (prepare, queue,
steps) and GenAI attributes (`gen_ai.request.model` the served name) an RPC's span has (`gateway.observe`).

Threads: the scheduler hands events over a blocking queue (`RequestHandle.events`); the routes wait for them on
a thread pool of their own so that the event loop never blocks, one pool thread per request waiting.

Cancellation: a client that disconnects cancels its request everywhere (`RequestHandle.cancel`, as the gRPC
servicer does when an RPC ends): a task watches the connection for `http.disconnect` while the request runs,
streamed or not, and a stream that stops being read cancels it too. The scheduler drops it at the next step
boundary and releases its KV slot on every shard. A request the gateway cancels at shutdown answers 503
(whole), or ends its stream with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.body_limit import MAX_BODY_BYTES, BodyLimit, max_body_bytes
from gateway.observe import GatewayObserver, RequestTrace
from gateway.openai_errors import ApiError, Forbidden, ModelNotFound, Unauthorized, error_body
from gateway.openai_render import Answer, Kind
from gateway.openai_schema import ChatCompletionRequest, CompletionRequest
from gateway.requests import MAX_REQUEST_ID_CHARS, GenerateCall, PreparedRequest, prepare
from gateway.results import EndEvent, Event, RequestHandle, is_last
from gateway.scheduler import Scheduler
from shardmesh.core.errors import Cancelled, Internal, InvalidArgument, MeshError, NotFound, Unavailable
from shardmesh.rpc import telemetry
from shardmesh.rpc.tokens import TokenSource, Verdict

EVENT_POLL_S = 1.0  # how often a waiting request checks that the scheduler is still alive
REQUEST_ID_HEADER = "x-request-id"
_RESPONSE_ID_PREFIX = {"chat": "chatcmpl-", "text": "cmpl-"}
_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}  # no proxy buffering of the stream

T = TypeVar("T")
Body = ChatCompletionRequest | CompletionRequest


@dataclass
class _Call:
    """One HTTP request as the API tracks it: ids for logs and responses, and its spans (tracing on only)."""

    request_id: str
    trace_id: str
    trace: RequestTrace | None
    ended: bool = False
    streaming: bool = False  # the response has started (200, server-sent events): a failure is an event in it

    def end(self, error: MeshError | None = None, client_gone: bool = False) -> None:
        """End the request span as OpenTelemetry's HTTP server conventions say: `http.response.status_code` (not
        when the client went away first), `error.type` naming a failure (its status code name, as the gRPC spans
        and the GenAI conventions have it), and status ERROR only for a failure of the server's (a 5xx): a refused
        request is the client's error."""
        if self.trace is not None and not self.ended:
            span, status = self.trace.span, error_body(error)[0] if error is not None else 200
            if not client_gone:
                span.set_attribute("http.response.status_code", 200 if self.streaming else status)
            if error is not None:
                span.set_attribute("error.type", error.code)
                if status >= 500 and not client_gone:
                    from opentelemetry.trace import Status, StatusCode

                    span.set_status(Status(StatusCode.ERROR, f"{error.code}: {error}"))
            span.end()
        self.ended = True


class OpenAIApi:
    """The FastAPI app (`app`) over one scheduler; `close()` after the HTTP server has stopped."""

    def __init__(self, scheduler: Scheduler, logger: Any, observer: GatewayObserver | None = None,
                 served_model_name: str | None = None, api_key: str | None = None,
                 max_threads: int = 1024, api_keys: TokenSource | None = None) -> None:  # fmt: skip
        self._scheduler = scheduler
        self._log = logger
        self._obs = observer
        self._served_model_name = served_model_name or None
        # The keys the gRPC API accepts too (one `TokenSource`, from --api-key, $SHARDMESH_API_KEY, --api-key-file)
        self._api_keys = api_keys or TokenSource.optional("API key", [api_key] if api_key else [])
        self._created = int(time.time())
        # Request threads wait on the scheduler's queues; created on demand, like the gRPC server's.
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="http-request")
        self.app = self._build()

    def close(self) -> None:
        """Ends the request threads (each returns within EVENT_POLL_S); call once no request runs."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _build(self) -> FastAPI:
        app = FastAPI(title="shardmesh", summary="The OpenAI-compatible API of a shardmesh gateway")
        app.add_exception_handler(MeshError, self._on_error)  # type: ignore[arg-type]
        app.add_exception_handler(Unauthorized, self._on_error)  # type: ignore[arg-type]
        app.add_exception_handler(Forbidden, self._on_error)  # type: ignore[arg-type]
        app.add_exception_handler(RequestValidationError, self._on_invalid_body)  # type: ignore[arg-type]
        app.add_exception_handler(StarletteHTTPException, self._on_http_error)  # type: ignore[arg-type]
        app.add_middleware(BodyLimit, max_bytes=self._max_body_bytes, logger=self._log)  # type: ignore[arg-type]
        v1 = APIRouter(prefix="/v1", dependencies=[Depends(self._authorize)])
        v1.add_api_route("/chat/completions", self.chat_completions, methods=["POST"], response_model=None)
        v1.add_api_route("/completions", self.completions, methods=["POST"], response_model=None)
        v1.add_api_route("/models", self.models, methods=["GET"], response_model=None)
        v1.add_api_route("/models/{model:path}", self.model, methods=["GET"], response_model=None)
        app.include_router(v1)
        app.add_api_route("/health", self.health, methods=["GET"], response_model=None)
        return app

    # -- routes -----------------------------------------------------------------------------------------------

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        return await self._generate(request, body, "chat")

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        return await self._generate(request, body, "text")

    async def models(self) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, model: str) -> Response:
        card = self._model_card()
        if model != card["id"]:
            raise ModelNotFound(model, card["id"])
        return JSONResponse(card)

    async def health(self) -> Response:
        """200 only while the gateway takes requests (as its gRPC health says SERVING); 503 saying why not."""
        if self._scheduler.snapshot()[1]:
            return JSONResponse({"status": "serving"})
        try:
            self._scheduler.serving_context()  # raises Unavailable with the reason, except while the mesh changes
            reason = "the mesh is changing (a worker was lost, drained or replaced): requests wait for it"
        except Unavailable as e:
            reason = str(e)
        status, body = error_body(Unavailable(reason))
        return JSONResponse(body, status_code=status)

    # -- generation -------------------------------------------------------------------------------------------

    async def _generate(self, request: Request, body: Body, kind: Kind) -> Response:
        arrival = time.monotonic()
        call = self._call(request)
        try:
            model = self._served_name()
            if body.model and body.model != model:
                raise ModelNotFound(body.model, model)
            generate = body.generate_call(call.request_id)
            options = body.options()
            handle, prepared = await self._submitted(lambda: self._start(body, generate, call, model, arrival))
        except MeshError as e:
            call.end(e)
            raise
        except Exception as e:
            raise self._internal(call, e) from e
        answer = Answer(kind, _RESPONSE_ID_PREFIX[kind] + call.request_id, model, options, prepared.tokenizer)
        headers = {REQUEST_ID_HEADER: call.request_id}
        if options.stream:
            call.streaming = True
            return _EventStream(self._stream(request, handle, body, answer, call), handle, headers=headers)
        try:
            async with self._watched(request, handle, body) as events:
                async for event in events:
                    if isinstance(event, EndEvent):
                        raise Cancelled("request cancelled: the gateway is shutting down")
                    answer.add(event)
        except MeshError as e:
            call.end(e)
            raise
        except Exception as e:
            raise self._internal(call, e) from e
        call.end()
        return JSONResponse(answer.body(), headers=headers)

    def _start(self, body: Body, generate: GenerateCall, call: _Call, model: str,
               arrival: float) -> tuple[RequestHandle, PreparedRequest]:  # fmt: skip
        """Chat template, tokenization and checks against the served model, then the queue (a pool thread)."""
        started_ns = time.time_ns() if call.trace is not None else 0
        with body.openai_names():
            prepared = prepare(generate, self._scheduler.serving_context(), arrival)
        if call.trace is not None:
            call.trace.prepared(started_ns, len(prepared.prompt_ids))
            call.trace.requested(generate.input.kind, prepared, model)
        return self._scheduler.submit(prepared, call.trace, call.trace_id), prepared

    async def _stream(self, request: Request, handle: RequestHandle, body: Body, answer: Answer,
                      call: _Call) -> AsyncIterator[str]:  # fmt: skip
        """Server-sent events: `data: {chunk}` per token (a chat stream opens with the role), the usage chunk when
        asked for, then `data: [DONE]`. A failure after the first byte cannot change the status any more: it is
        sent as `data: {"error": {...}}` (vLLM's way, which the openai client raises), then `data: [DONE]`."""
        failure: MeshError | None = None
        ended = False
        try:
            async with self._watched(request, handle, body) as events:
                opening = answer.opening()
                if opening is not None:
                    yield _sse(opening)
                async for event in events:
                    if isinstance(event, EndEvent):
                        raise Cancelled("request cancelled: the gateway is shutting down")
                    chunk = answer.chunk(event)
                    if chunk is not None:
                        yield _sse(chunk)
            ended = True
        except MeshError as e:
            ended, failure = True, e
        except Exception as e:
            ended, failure = True, self._internal(call, e)
        finally:
            if not ended:  # the client stopped reading (it went away), or the server cancelled the response
                call.end(Cancelled("the client went away"), client_gone=True)
        if failure is not None:
            self._failed(failure, call.request_id, call.trace_id)
            call.end(failure)
            yield _sse(error_body(failure)[1])
        else:
            call.end()
            usage = answer.usage_chunk()
            if usage is not None:
                yield _sse(usage)
        yield "data: [DONE]\n\n"

    @contextlib.asynccontextmanager
    async def _watched(self, request: Request, handle: RequestHandle,
                       body: Body) -> AsyncIterator[AsyncIterator[Event]]:  # fmt: skip
        """The request's events while a task watches the connection: a client that disconnects, or a response that
        ends before the request's last event (a failure, the server stopping it), cancels the request everywhere;
        the scheduler drops it at the next step boundary and releases its KV slot on every shard."""

        async def watch() -> None:  # the request body is in: the next message is the client going away
            while (await request.receive())["type"] != "http.disconnect":
                pass
            handle.cancel()

        watcher = asyncio.ensure_future(watch())
        events = self._events(handle, body)
        try:
            yield events
        finally:
            watcher.cancel()
            await events.aclose()
            handle.cancel()  # a no-op once the request has ended

    async def _events(self, handle: RequestHandle, body: Body) -> AsyncIterator[Event]:
        """The request's events, waited for on a pool thread; a failure is raised, naming OpenAI's field."""
        while True:
            event = await self._in_thread(lambda: _next_event(handle))
            if event is None:
                if not self._scheduler.alive:
                    handle.cancel()
                    raise Internal("the scheduler stopped")
                continue
            if isinstance(event, EndEvent) and event.error is not None:
                raise body.renamed(event.error)
            yield event
            if is_last(event):
                return

    async def _in_thread(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def _submitted(self, start: Callable[[], tuple[RequestHandle, T]]) -> tuple[RequestHandle, T]:
        """`start()` on a pool thread; should the route be cancelled meanwhile, the request it submits is cancelled
        as soon as it exists."""
        started = self._pool.submit(start)
        try:
            return await asyncio.wrap_future(started)
        except asyncio.CancelledError:
            started.add_done_callback(_cancel_submitted)
            raise

    # -- requests: ids, model, key ----------------------------------------------------------------------------

    def _call(self, request: Request) -> _Call:
        """The request's id (the client's X-Request-Id, or a fresh one) and trace, as the gRPC servicer keeps them."""
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        request.state.request_id = request_id[:MAX_REQUEST_ID_CHARS]  # for the error's log line
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidArgument(REQUEST_ID_HEADER, f"at most {MAX_REQUEST_ID_CHARS} characters, got "
                                                     f"{len(request_id)}")  # fmt: skip
        metadata = list(request.headers.items())  # lower-case names, as gRPC metadata has them
        tracer = self._obs.tracer if self._obs is not None else None
        trace = RequestTrace(tracer, _server_span(tracer, request, metadata, request_id)) if tracer else None
        if trace is not None:
            trace_id = trace.trace_id
        else:
            trace_id = telemetry.client_trace_id(metadata) or telemetry.new_trace_id()
        request.state.trace_id = trace_id
        return _Call(request_id, trace_id, trace)

    def _max_body_bytes(self) -> int:
        """The most request body worth reading for the model served now (`gateway/body_limit.py`)."""
        try:
            return max_body_bytes(self._scheduler.serving_context())
        except MeshError:  # nothing served: the request will be refused once read, whatever its size
            return MAX_BODY_BYTES

    def _served_name(self) -> str:
        """`--served-model-name`, else the coordinator's name for the model (its --model as given)."""
        if self._served_model_name:
            return self._served_model_name
        state, _ = self._scheduler.snapshot()
        if state.topology is None:
            raise Unavailable(state.reason)
        return state.topology.model.name

    def _model_card(self) -> dict[str, Any]:
        card: dict[str, Any] = {"id": self._served_name(), "object": "model", "created": self._created,
                                "owned_by": "shardmesh"}  # fmt: skip
        topology = self._scheduler.snapshot()[0].topology
        if topology is not None:
            card.update(root=topology.model.path, max_model_len=topology.limits.max_context)
        return card

    async def _authorize(self, request: Request) -> None:
        """With API keys configured, every /v1 request must carry `Authorization: Bearer KEY` with one of them: 401
        without, 403 with a key not accepted (compared in constant time; the message never says how close it was)."""
        if self._api_keys is None:
            return
        verdict = self._api_keys.check(request.headers.get("authorization"))
        if verdict is not Verdict.OK:
            refusal = Unauthorized if verdict is Verdict.MISSING else Forbidden
            raise refusal(self._api_keys.refusals[verdict])

    # -- errors -----------------------------------------------------------------------------------------------

    def _failed(self, error: ApiError, request_id: str | None, trace_id: str | None) -> None:
        """Log and count a refused or failed request once, as the gRPC servicer does."""
        self._log.warning("request_failed", api="openai", request_id=request_id, trace_id=trace_id, code=error.code,
                          error=str(error))  # fmt: skip
        if self._obs is not None:
            self._obs.request_errored(error.code)

    def _internal(self, call: _Call, error: Exception) -> Internal:
        """A bug: the traceback goes to the log, the client gets the request id to find it."""
        with structlog.contextvars.bound_contextvars(request_id=call.request_id, trace_id=call.trace_id):
            self._log.exception("request_error", api="openai")
        internal = Internal(f"internal error (request_id {call.request_id}; see gateway logs)")
        call.end(internal)
        return internal

    async def _on_error(self, request: Request, error: ApiError) -> Response:
        self._failed(error, getattr(request.state, "request_id", None), getattr(request.state, "trace_id", None))
        status, body = error_body(error)
        headers = {"www-authenticate": "Bearer"} if isinstance(error, Unauthorized) else None
        return JSONResponse(body, status_code=status, headers=headers)

    async def _on_invalid_body(self, request: Request, error: RequestValidationError) -> Response:
        """FastAPI's 422 becomes a 400 naming the first bad field, in OpenAI's error shape."""
        return await self._on_error(request, invalid_body(error.errors()))

    async def _on_http_error(self, request: Request, error: StarletteHTTPException) -> Response:
        """An unknown path (404) or method (405), in OpenAI's error shape."""
        message = f"{request.method} {request.url.path}: {error.detail}"
        status, body = error_body(NotFound(message)) if error.status_code == 404 else (error.status_code, None)
        if body is None:
            body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                              "code": str(error.status_code)}}  # fmt: skip
        return JSONResponse(body, status_code=status, headers=getattr(error, "headers", None))


# -- helpers --------------------------------------------------------------------------------------------------


class _EventStream(StreamingResponse):
    """Server-sent events whose end, however it comes (the last chunk, the client gone, the server stopping), ends
    the request too: even a body iterator that was never started (a client gone at once) cancels it."""

    def __init__(self, content: AsyncIterator[str], handle: RequestHandle, headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={**headers, **_SSE_HEADERS})
        self._handle = handle

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._handle.cancel()  # a no-op once the request has ended


def _server_span(tracer: Any, request: Request, metadata: list[tuple[str, str]], request_id: str) -> Any:
    """The request's span, under the client's `traceparent`, named and described as OpenTelemetry's HTTP server
    conventions say: `{method} {route}` (`POST /v1/chat/completions`), `http.request.method`, `http.route`,
    `url.path`, `url.scheme`, `server.address` / `server.port` (from the Host header), `client.address`,
    `network.protocol.version`, `user_agent.original`. The GenAI attributes are added once it is prepared."""
    from opentelemetry.trace import SpanKind

    route = getattr(request.scope.get("route"), "path", request.url.path)
    attributes: dict[str, Any] = {
        "http.request.method": request.method, "http.route": route, "url.path": request.url.path,
        "url.scheme": request.url.scheme, "network.protocol.version": request.scope.get("http_version", "1.1"),
        "shardmesh.request_id": request_id,
    }  # fmt: skip
    if request.url.hostname:
        attributes["server.address"] = request.url.hostname
    if request.url.port:
        attributes["server.port"] = request.url.port
    if request.client is not None:
        attributes["client.address"] = request.client.host
    if "user-agent" in request.headers:
        attributes["user_agent.original"] = request.headers["user-agent"]
    return tracer.start_span(f"{request.method} {route}", context=telemetry.extract(metadata), kind=SpanKind.SERVER,
                             attributes=attributes)  # fmt: skip


def _cancel_submitted(started: Future) -> None:
    if not started.cancelled() and started.exception() is None:
        started.result()[0].cancel()


def _next_event(handle: RequestHandle) -> Event | None:
    try:
        return handle.events.get(timeout=EVENT_POLL_S)
    except queue.Empty:
        return None


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


# pydantic's names for the members of a union, which it adds to an error's location (`stop.list[str]`)
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _param(loc: tuple[Any, ...]) -> str:
    """`("body", "messages", 0, "content")` -> `messages[0].content`; union members' tags are left out."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_TAGS or "[" in str(part) or "-" in str(part):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


def invalid_body(errors: list[dict[str, Any]] | Any) -> InvalidArgument:
    """The first bad field of a request body that did not validate, as InvalidArgument naming it; the messages of
    the same field's union members are joined (`stop: must be a string, or a list of strings`)."""
    errors = list(errors)
    first = errors[0]
    param = _param(tuple(first.get("loc", ())))
    kind = first.get("type", "")
    if kind == "json_invalid":
        return InvalidArgument("body", f"not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}")
    if not param and kind in ("model_attributes_type", "dict_type", "missing"):
        return InvalidArgument("body", "must be a JSON object, sent with the header 'Content-Type: application/json'")
    if kind == "missing":
        return InvalidArgument(param, "is required")
    messages = [e["msg"] for e in errors if _param(tuple(e.get("loc", ()))) == param and e.get("type") != "missing"]
    text = " or ".join(dict.fromkeys(m[:1].lower() + m[1:] for m in messages))
    return InvalidArgument(param, f"{text}, got {first.get('input')!r}")
