"""Why shardmesh refuses or fails something, as plain exceptions: one hierarchy for every service.

Domain code (validation, the scheduler, the registry, a worker's runtime) never touches gRPC: it raises
one of these, and one server interceptor (`shardmesh.rpc.interceptors`) turns it into the status code
named by `code` with `str(error)` as the message. The message is what the client sees, so it names the
offending field (`params.top_p: ...`) or the lost worker, and never carries a traceback.

`code` is the name of a `grpc.StatusCode` member, kept as text so that this module imports no gRPC.
"""

from __future__ import annotations


class MeshError(Exception):
    """A request refused or not finished; `str(e)` is the client-facing message."""

    code = "INTERNAL"


class InvalidArgument(MeshError):
    """A bad request field; the message starts with the field's name, e.g. `params.top_p: ...`."""

    code = "INVALID_ARGUMENT"

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field_name = field_name


class NotFound(MeshError):
    """What the request names does not exist (an unknown worker id, a released sequence)."""

    code = "NOT_FOUND"


class FailedPrecondition(MeshError):
    """The request is well formed but the receiver is not in a state to take it (a shard still loading,
    a step for another topology version); it may succeed once that state changes."""

    code = "FAILED_PRECONDITION"


class Unavailable(MeshError):
    """The mesh cannot serve now (no complete topology, a worker lost, shutting down); retrying later
    or elsewhere may succeed."""

    code = "UNAVAILABLE"


class ResourceExhausted(MeshError):
    """A queue or a cache is full."""

    code = "RESOURCE_EXHAUSTED"


class Cancelled(MeshError):
    """The server cancelled the request (shutdown) where no partial result can be returned."""

    code = "CANCELLED"


class Internal(MeshError):
    """A bug or a protocol violation by a peer; details are in the logs."""

    code = "INTERNAL"
