"""Errors of the OpenAI-compatible HTTP API: every refusal or failure as an HTTP status and OpenAI's JSON shape.

One table maps the `shardmesh.core.errors` types the gateway raises (the same ones the gRPC interceptor turns
into status codes) onto HTTP statuses, so the two front doors cannot disagree about what a failure is:

    InvalidArgument, FailedPrecondition  400  a bad field, named in `param` and at the start of `message`
    Unauthorized                         401  an API key is configured and the request carries none
    Forbidden                            403  an API key is configured and the request's is not accepted
    NotFound                             404  the request names another model (or an unknown path)
    ResourceExhausted                    429  more requests wait for a KV slot than --max-queue
    Unavailable, Cancelled               503  no complete mesh, the gateway shutting down
    Internal (anything else)             500  a bug; the traceback is in the gateway's log only

The body is OpenAI's: ``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``.
"""

from __future__ import annotations

from typing import Any

from shardmesh.core.errors import (
    Cancelled,
    FailedPrecondition,
    InvalidArgument,
    MeshError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)


class Unauthorized(Exception):
    """No API key where the gateway has keys configured. Credentials are checked before any route runs (on gRPC, by
    `shardmesh.rpc.interceptors.TokenInterceptor`), so this is not one of the `MeshError`s the services raise."""

    code = "UNAUTHENTICATED"


class Forbidden(Exception):
    """An API key the gateway does not accept."""

    code = "PERMISSION_DENIED"


ApiError = MeshError | Unauthorized | Forbidden


class NotSupportedYet(InvalidArgument):
    """A field of OpenAI's API this gateway knows but cannot honour yet: refused, never silently ignored."""

    def __init__(self, field_name: str, why: str) -> None:
        super().__init__(field_name, f"not supported yet: {why}")


class ModelNotFound(NotFound):
    """The request's `model` is not the one this mesh serves."""

    def __init__(self, asked: str, served: str) -> None:
        super().__init__(f"model: the model {asked!r} does not exist here; this gateway serves {served!r}")
        self.field_name = "model"


# (HTTP status, OpenAI error type), by the class of the error; the first match in the error's MRO wins.
_STATUS: dict[type[ApiError], tuple[int, str]] = {
    InvalidArgument: (400, "invalid_request_error"),
    FailedPrecondition: (400, "invalid_request_error"),
    Unauthorized: (401, "authentication_error"),
    Forbidden: (403, "permission_error"),
    NotFound: (404, "not_found_error"),
    ResourceExhausted: (429, "rate_limit_error"),
    Unavailable: (503, "service_unavailable_error"),
    Cancelled: (503, "service_unavailable_error"),
}
_INTERNAL = (500, "internal_server_error")

# OpenAI's `code` (a string), most specific class first.
_CODES: dict[type[ApiError], str] = {
    NotSupportedYet: "unsupported_parameter",
    InvalidArgument: "invalid_value",
    FailedPrecondition: "invalid_value",
    Unauthorized: "invalid_api_key",
    Forbidden: "invalid_api_key",
    ModelNotFound: "model_not_found",
    NotFound: "not_found",
    ResourceExhausted: "queue_full",
    Unavailable: "service_unavailable",
    Cancelled: "cancelled",
}


def status_of(error: ApiError) -> tuple[int, str]:
    """(HTTP status, OpenAI error type) for `error`."""
    for cls in type(error).__mro__:
        if cls in _STATUS:
            return _STATUS[cls]
    return _INTERNAL


def error_body(error: ApiError) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI's JSON error object for `error`. `param` is the field an `InvalidArgument`
    (or a wrong `model`) names, else null."""
    status, kind = status_of(error)
    param = getattr(error, "field_name", None)
    code = next((c for cls, c in _CODES.items() if isinstance(error, cls)), "internal_error")
    return status, {"error": {"message": str(error), "type": kind, "param": param, "code": code}}
