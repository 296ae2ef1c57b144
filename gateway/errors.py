"""Why the gateway refuses or fails a request, as plain exceptions.

The domain code (validation, scheduler, topology client) never touches gRPC status codes: it raises
or reports one of these, and `gateway.server` is the one place that maps them to status codes. The
message is what the client sees, so it names the offending field or the lost worker and never
carries a traceback.
"""

from __future__ import annotations


class GatewayError(Exception):
    """A request the gateway refuses or cannot finish; `str(e)` is the client-facing message."""


class InvalidArgument(GatewayError):
    """A bad request field; the message starts with the field's name, e.g. `params.top_p: ...`."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field_name = field_name


class Unavailable(GatewayError):
    """The mesh cannot serve now (no complete topology, a worker lost, shutting down); retrying later
    or elsewhere may succeed."""


class ResourceExhausted(GatewayError):
    """The waiting queue is full."""


class Cancelled(GatewayError):
    """The request was cancelled by the server (shutdown) where no partial result can be returned."""


class Internal(GatewayError):
    """A bug or a protocol violation by a worker; details are in the gateway's logs."""
