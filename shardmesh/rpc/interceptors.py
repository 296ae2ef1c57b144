"""Where a failed RPC gets its status: one server interceptor, installed on every shardmesh server.

Handlers never call `context.abort`: they raise. A `shardmesh.core.errors.MeshError` becomes the status its
`code` names, with `str(error)` (which names the offending field) as the details. Anything else is a bug:
the client gets INTERNAL with a short message, and the traceback goes to the log only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

from shardmesh.core.errors import MeshError

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
        log, de, ser = self._log, handler.request_deserializer, handler.response_serializer
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
            return behavior(request, context)
        except Exception as e:
            _abort(context, e, method, log)

    return handler


def _streaming(behavior: Behavior, method: str, log: Any) -> Behavior:
    """A handler that yields responses: its errors surface while gRPC iterates, so wrap the iteration."""

    def handler(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from behavior(request, context)
        except Exception as e:
            _abort(context, e, method, log)

    return handler


def _abort(context: grpc.ServicerContext, error: Exception, method: str, log: Any) -> None:
    """End the RPC with `error`'s status; `context.abort` raises, so this never returns."""
    if isinstance(error, MeshError):
        context.abort(grpc.StatusCode[error.code], str(error))
    log.exception("rpc_error", method=method)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: see the server's log")
