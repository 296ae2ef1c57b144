"""`ErrorInterceptor` on a real server built by `new_server`: what a handler raises is the status a client
sees, for unary and streaming methods; anything that is not a `MeshError` is INTERNAL with a short
message, its traceback in the log only; other services on the server are left alone.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import structlog
from grpc_health.v1 import health

from shardmesh.core.errors import (
    Cancelled,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    MeshError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from shardmesh.proto.v1 import gateway_pb2
from shardmesh.rpc.server import bind, new_server

SERVICE = "test.v1.Probe"
OTHER = "test.v1.Other"  # on the same server, not the interceptor's service
TIMEOUT_S = 10.0

REFUSALS = [
    (InvalidArgument("params.top_p", "must be in (0, 1], got 2.0"), grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound("worker_id: no registered worker 'ghost'"), grpc.StatusCode.NOT_FOUND),
    (FailedPrecondition("after_step_id: step 99 did not arrive"), grpc.StatusCode.FAILED_PRECONDITION),
    (Unavailable("a peer of stage 1 was lost"), grpc.StatusCode.UNAVAILABLE),
    (ResourceExhausted("entries[0].slot: 4 outside [0, 4)"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Cancelled("request cancelled: the gateway is shutting down"), grpc.StatusCode.CANCELLED),
    (Internal("the scheduler stopped"), grpc.StatusCode.INTERNAL),
]


class Probe:
    """Handlers raising whatever the test sets in `error` (the stream after its first message)."""

    def __init__(self) -> None:
        self.error: Exception | None = None

    def unary(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        if self.error is not None:
            raise self.error
        return b"ok:" + request

    def stream(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield b"first"
        if self.error is not None:
            raise self.error
        yield b"second"


class Served:
    def __init__(self) -> None:
        self.log = io.StringIO()
        logger = structlog.wrap_logger(structlog.PrintLogger(self.log),
                                       processors=[structlog.processors.format_exc_info,
                                                   structlog.processors.JSONRenderer()])  # fmt: skip
        self.probe = Probe()
        self.server = new_server(SERVICE, health.HealthServicer(), 1 << 20, 4, logger)
        for service in (SERVICE, OTHER):
            self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {
                "Unary": grpc.unary_unary_rpc_method_handler(self.probe.unary),
                "Stream": grpc.unary_stream_rpc_method_handler(self.probe.stream),
                # A method with a message type: its request bytes are parsed before the handler runs.
                "Typed": grpc.unary_unary_rpc_method_handler(
                    lambda request, context: request.SerializeToString(), gateway_pb2.GenerateRequest.FromString),
                "TypedStream": grpc.unary_stream_rpc_method_handler(
                    lambda request, context: iter([request.SerializeToString()]),
                    gateway_pb2.GenerateRequest.FromString),
            }),))  # fmt: skip
        port = bind(self.server, "127.0.0.1:0")
        self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")

    def unary(self, service: str = SERVICE) -> Callable[..., Any]:
        return self.channel.unary_unary(f"/{service}/Unary")

    def stream(self, service: str = SERVICE) -> Callable[..., Any]:
        return self.channel.unary_stream(f"/{service}/Stream")

    def events(self) -> list[dict]:
        return [json.loads(line) for line in self.log.getvalue().splitlines()]

    def close(self) -> None:
        self.channel.close()
        self.server.stop(0)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.close()


@pytest.fixture(autouse=True)
def no_error(served: Served) -> None:
    served.probe.error = None


def _rpc_error(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def test_a_handler_that_raises_nothing_answers(served: Served) -> None:
    assert served.unary()(b"x", timeout=TIMEOUT_S) == b"ok:x"
    assert list(served.stream()(b"x", timeout=TIMEOUT_S)) == [b"first", b"second"]


@pytest.mark.parametrize(("error", "code"), REFUSALS, ids=[type(e).__name__ for e, _ in REFUSALS])
def test_a_mesh_error_from_a_unary_handler_is_its_status(served: Served, error: MeshError,
                                                         code: grpc.StatusCode) -> None:  # fmt: skip
    served.probe.error = error
    e = _rpc_error(lambda: served.unary()(b"x", timeout=TIMEOUT_S))
    assert (e.code(), e.details()) == (code, str(error))


@pytest.mark.parametrize(("error", "code"), REFUSALS, ids=[type(e).__name__ for e, _ in REFUSALS])
def test_a_mesh_error_from_a_stream_ends_it_with_its_status_after_what_was_sent(
    served: Served, error: MeshError, code: grpc.StatusCode
) -> None:
    served.probe.error = error
    call = served.stream()(b"x", timeout=TIMEOUT_S)
    assert next(call) == b"first"
    e = _rpc_error(lambda: next(call))
    assert (e.code(), e.details()) == (code, str(error))


def test_an_invalid_argument_names_its_field(served: Served) -> None:
    served.probe.error = InvalidArgument("entries[0].token_ids", "[500] outside the vocabulary [0, 259)")
    e = _rpc_error(lambda: served.unary()(b"x", timeout=TIMEOUT_S))
    assert e.details() == "entries[0].token_ids: [500] outside the vocabulary [0, 259)"


@pytest.mark.parametrize("method", ["Unary", "Stream"])
def test_an_unexpected_error_is_internal_with_its_traceback_only_in_the_log(served: Served, method: str) -> None:
    served.probe.error = KeyError("secret-detail")
    call = served.unary() if method == "Unary" else (lambda *a, **kw: list(served.stream()(*a, **kw)))
    e = _rpc_error(lambda: call(b"x", timeout=TIMEOUT_S))
    assert e.code() == grpc.StatusCode.INTERNAL
    assert e.details() == f"internal error in /{SERVICE}/{method}: see the server's log"
    assert "secret-detail" not in e.details() and "Traceback" not in e.details()
    logged = [ev for ev in served.events() if ev["event"] == "rpc_error" and ev["method"] == f"/{SERVICE}/{method}"]
    assert logged and "Traceback" in logged[-1]["exception"] and "secret-detail" in logged[-1]["exception"]


def test_other_services_on_the_server_are_not_wrapped(served: Served) -> None:
    """gRPC's own handling applies there: an exception is UNKNOWN, not the MeshError's code."""
    served.probe.error = Unavailable("not mapped here")
    e = _rpc_error(lambda: served.unary(OTHER)(b"x", timeout=TIMEOUT_S))
    assert e.code() == grpc.StatusCode.UNKNOWN


def test_an_unknown_method_is_unimplemented(served: Served) -> None:
    e = _rpc_error(lambda: served.channel.unary_unary(f"/{SERVICE}/Missing")(b"x", timeout=TIMEOUT_S))
    assert e.code() == grpc.StatusCode.UNIMPLEMENTED


def test_every_mesh_error_names_a_grpc_status_and_is_covered_above() -> None:
    """`code` is kept as text (shardmesh.core imports no gRPC), so a misspelt one would only fail at abort time."""
    for cls in (MeshError, *MeshError.__subclasses__()):
        assert cls.code in grpc.StatusCode.__members__, cls
    assert {type(e) for e, _ in REFUSALS} == set(MeshError.__subclasses__())


@pytest.mark.parametrize("data", [b"\xff\xff\xff", b"\x0a\x02\xc3\x28", b"\x12\x05ab"],
                         ids=["bad-wire-format", "invalid-utf8-in-a-string", "truncated"])  # fmt: skip
def test_bytes_that_are_not_the_request_message_are_invalid_argument_not_internal(served: Served, data: bytes) -> None:
    for call in (
        served.channel.unary_unary(f"/{SERVICE}/Typed"),
        lambda d, timeout: list(served.channel.unary_stream(f"/{SERVICE}/TypedStream")(d, timeout=timeout)),
    ):
        e = _rpc_error(lambda call=call: call(data, timeout=TIMEOUT_S))
        assert e.code() is grpc.StatusCode.INVALID_ARGUMENT, e.details()
        assert e.details().startswith("request: not a valid message")
    valid = gateway_pb2.GenerateRequest(prompt="hi").SerializeToString()
    assert served.channel.unary_unary(f"/{SERVICE}/Typed")(valid, timeout=TIMEOUT_S) == valid
