"""Where a failed RPC gets its status, and where a call without the right token is refused: server interceptors,
installed on every shardmesh server (`shardmesh.rpc.server.new_server`).

Handlers never call `context.abort`: they raise. A `shardmesh.core.errors.MeshError` becomes the status its
`code` names, with `str(error)` (which names the offending field) as the details. Anything else is a bug:
the client gets INTERNAL with a short message, and the traceback goes to the log only.

`TokenInterceptor` runs first: a call that needs a token (an API key, the join token) and lacks it never reaches
the handler (see `shardmesh.rpc.tokens`); `BearerToken` is its client side, adding the token to a channel's calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc

from shardmesh.core.errors import InvalidArgument, MeshError
from shardmesh.rpc.tokens import TokenSource, Verdict

Behavior = Callable[[Any, grpc.ServicerContext], Any]


class ErrorInterceptor(grpc.ServerInterceptor):
    """Wraps each method of `service` (e.g. "shardmesh.v1.Gateway"), unary and streaming alike, so that what
    it raises becomes a status. Other services on the server (health, reflection) pass untouched: they set
    their own codes, and health's non-blocking Watch must reach gRPC unwrapped."""

    def __init__(self, service: str, logger: Any) -> None:
        self._prefix = f"/{service}/"
        self._log = logger

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:  # fmt: skip
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(self._prefix):  # None: unknown, gRPC answers UNIMPLEMENTED
            return handler
        log, de, ser = self._log, _tolerant(handler.request_deserializer), handler.response_serializer
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(_returning(handler.unary_unary, method, log), de, ser)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(_returning(handler.stream_unary, method, log), de, ser)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(_streaming(handler.unary_stream, method, log), de, ser)
        return grpc.stream_stream_rpc_method_handler(_streaming(handler.stream_stream, method, log), de, ser)


def _returning(behavior: Behavior, method: str, log: Any) -> Behavior:
    """A handler that returns one response: its errors surface when it is called."""

    def handler(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return behavior(_parsed(request), context)
        except Exception as e:
            _abort(context, e, method, log)

    return handler


def _streaming(behavior: Behavior, method: str, log: Any) -> Behavior:
    """A handler that yields responses: its errors surface while gRPC iterates, so wrap the iteration."""

    def handler(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from behavior(_parsed(request), context)
        except Exception as e:
            _abort(context, e, method, log)

    return handler


class _Malformed:
    """What a request's bytes became when they were not a valid message (bad wire format, invalid UTF-8 in a
    string field): gRPC would answer INTERNAL for a deserializer that raises, so it returns this instead, and the
    handler's wrapper answers INVALID_ARGUMENT."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as e:  # google.protobuf.message.DecodeError, or a UnicodeDecodeError inside it
            return _Malformed(f"{type(e).__name__}: {e}"[:200])

    return parse


def _parsed(request: Any) -> Any:
    """`request`, unless its bytes did not parse (only unary requests: no method here streams its requests)."""
    if isinstance(request, _Malformed):
        raise InvalidArgument("request", f"not a valid message of this method's request type ({request.reason})")
    return request


def _abort(context: grpc.ServicerContext, error: Exception, method: str, log: Any) -> None:
    """End the RPC with `error`'s status; `context.abort` raises, so this never returns."""
    if isinstance(error, MeshError):
        context.abort(grpc.StatusCode[error.code], str(error))
    log.exception("rpc_error", method=method)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: see the server's log")


# -- tokens -------------------------------------------------------------------------------------------------------

_REFUSAL_CODES = {Verdict.MISSING: grpc.StatusCode.UNAUTHENTICATED, Verdict.WRONG: grpc.StatusCode.PERMISSION_DENIED}


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses a call to `service` (e.g. "shardmesh.v1.Gateway") that does not carry a token `tokens` accepts, before
    its handler runs, so servicers never see credentials: UNAUTHENTICATED when the call has no `authorization:
    Bearer ...` metadata, PERMISSION_DENIED when its token is not accepted, with a message that names the credential
    and nothing else. Methods in `open_methods` (by name, e.g. "GetTopology") and every other service on the server
    (grpc.health.v1 for probes, reflection) take no token. An accepted call gets its handler untouched."""

    def __init__(self, service: str, tokens: TokenSource, logger: Any = None,
                 open_methods: Iterable[str] = ()) -> None:  # fmt: skip
        self._prefix = f"/{service}/"
        self._tokens = tokens
        self._log = logger
        self._open = frozenset(f"/{service}/{m}" for m in open_methods)

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:  # fmt: skip
        method = handler_call_details.method
        handler = continuation(handler_call_details)
        if handler is None or not method.startswith(self._prefix) or method in self._open:
            return handler
        metadata = handler_call_details.invocation_metadata or ()
        authorization = next((v for k, v in metadata if k == "authorization"), None)
        verdict = self._tokens.check(authorization if isinstance(authorization, str) else None)
        if verdict is Verdict.OK:
            return handler
        code, message = _REFUSAL_CODES[verdict], self._tokens.refusals[verdict]
        if self._log is not None:  # which method and why, never the token
            self._log.info("call_refused", method=method, credential=self._tokens.what, reason=verdict.value)
        return _refusing(handler, code, message)


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that ends the call with `code` without reading the request."""

    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    def refuse_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        context.abort(code, message)
        yield  # never reached: a generator, as gRPC expects of a streaming handler

    ser = handler.response_serializer
    if handler.response_streaming:
        if handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse_stream, None, ser)
        return grpc.unary_stream_rpc_method_handler(refuse_stream, None, ser)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, None, ser)
    return grpc.unary_unary_rpc_method_handler(refuse, None, ser)


class BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                  grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):  # fmt: skip
    """A client interceptor adding `authorization: Bearer <token>` to every call of a channel."""

    def __init__(self, token: str) -> None:
        self._entry = ("authorization", f"Bearer {token}")

    def _details(self, details: Any) -> Any:
        return _CallDetails(details, (*(details.metadata or ()), self._entry))

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, details: Any, metadata: tuple[tuple[str, str], ...]) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = details.wait_for_ready
        self.compression = details.compression
