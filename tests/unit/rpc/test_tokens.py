"""`TokenSource`: which tokens are accepted, from a value and from a file that is re-read when it changes, and what
a refusal says (which credential, never how close a guess came); `TokenInterceptor` and `BearerToken` on a real
server: UNAUTHENTICATED without a token, PERMISSION_DENIED with a wrong one, for unary and streaming methods alike,
while health and the open methods need none.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shardmesh.rpc import tls, tokens
from shardmesh.rpc.server import bind, new_server
from shardmesh.rpc.tokens import TokenError, TokenSource, Verdict

SERVICE = "test.v1.Guarded"
TIMEOUT_S = 10.0


def test_verdicts_for_a_fixed_key() -> None:
    keys = TokenSource("API key", ["s3cret-key"])
    assert keys.check("Bearer s3cret-key") is Verdict.OK
    assert keys.check("bearer   s3cret-key ") is Verdict.OK  # the scheme is case-insensitive, blanks are not part
    assert keys.check(None) is Verdict.MISSING
    assert keys.check("") is Verdict.MISSING
    assert keys.check("Basic s3cret-key") is Verdict.MISSING, "no bearer token at all"
    assert keys.check("Bearer ") is Verdict.MISSING
    for wrong in ("s3cret-ke", "s3cret-keyy", "S3CRET-KEY", "x"):
        assert keys.check(f"Bearer {wrong}") is Verdict.WRONG
    assert keys.refusals == {Verdict.MISSING: "no API key: send authorization: Bearer <key>",
                             Verdict.WRONG: "API key not accepted"}  # fmt: skip
    joins = TokenSource("join token", ["t"])
    assert joins.refusals[Verdict.MISSING] == "no join token: send authorization: Bearer <token>"


def test_a_file_is_read_with_comments_and_re_read_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# rotated monthly\n\n  first  \nsecond\n")
    keys = TokenSource("API key", ["from-env"], path, flag="--api-key-file")
    assert [keys.check(f"Bearer {k}") for k in ("first", "second", "from-env", "# rotated monthly")] == [
        Verdict.OK, Verdict.OK, Verdict.OK, Verdict.WRONG]  # fmt: skip
    path.write_text("third\n")
    assert keys.check("Bearer third") is Verdict.OK
    assert keys.check("Bearer first") is Verdict.WRONG, "a line removed is a key revoked"
    assert keys.check("Bearer from-env") is Verdict.OK
    path.write_text("# nothing left\n")  # an emptied file keeps the last keys (a rotation half-way through)
    assert keys.check("Bearer third") is Verdict.OK
    os.remove(path)
    assert keys.check("Bearer third") is Verdict.OK


def test_unusable_token_files_name_the_flag(tmp_path: Path) -> None:
    with pytest.raises(TokenError, match=r"^--api-key-file: cannot read .*missing"):
        TokenSource("API key", file=tmp_path / "missing", flag="--api-key-file")
    (tmp_path / "empty").write_text("# no key yet\n")
    with pytest.raises(TokenError, match=r"^--join-token-file: .*empty holds no token"):
        TokenSource("join token", file=tmp_path / "empty", flag="--join-token-file")
    assert TokenSource.optional("API key", ["", ""]) is None, "nothing given: nothing required"
    assert tokens.presented(None, None, "--join-token-file") is None
    (tmp_path / "join").write_text("# the mesh's\nfirst\nsecond\n")
    assert tokens.presented("from-env", str(tmp_path / "join"), "--join-token-file") == "first", "the file wins"
    assert tokens.presented(" from-env ", None, "--join-token-file") == "from-env"


class Guarded:
    """A server whose SERVICE needs a token but for its Open method; health is registered too."""

    def __init__(self, accepted: TokenSource) -> None:
        self.health = health.HealthServicer()
        self.server = new_server(SERVICE, self.health, 1 << 20, 4, structlog.get_logger(), tokens=accepted,
                                 open_methods=("Open",))  # fmt: skip
        self.calls: list[str] = []
        handlers = {
            "Unary": grpc.unary_unary_rpc_method_handler(self._unary),
            "Open": grpc.unary_unary_rpc_method_handler(self._unary),
            "Stream": grpc.unary_stream_rpc_method_handler(self._stream),
            "Both": grpc.stream_stream_rpc_method_handler(self._both),
        }
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self.address = f"127.0.0.1:{bind(self.server, '127.0.0.1:0')}"
        self.server.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)

    def _unary(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self.calls.append("unary")
        return b"ok"

    def _stream(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        self.calls.append("stream")
        yield b"ok"

    def _both(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        self.calls.append("both")
        for _ in requests:
            yield b"ok"


@pytest.fixture(scope="module")
def guarded() -> Iterator[Guarded]:
    g = Guarded(TokenSource("join token", ["the-token"]))
    yield g
    g.server.stop(0)


def _calls(channel: grpc.Channel) -> dict[str, object]:
    return {
        "Unary": lambda: channel.unary_unary(f"/{SERVICE}/Unary")(b"x", timeout=TIMEOUT_S),
        "Stream": lambda: list(channel.unary_stream(f"/{SERVICE}/Stream")(b"x", timeout=TIMEOUT_S)),
        "Both": lambda: list(channel.stream_stream(f"/{SERVICE}/Both")(iter([b"x"]), timeout=TIMEOUT_S)),
    }


@pytest.mark.parametrize(("token", "code", "details"), [
    (None, grpc.StatusCode.UNAUTHENTICATED, "no join token: send authorization: Bearer <token>"),
    ("the-tokeN", grpc.StatusCode.PERMISSION_DENIED, "join token not accepted"),
])  # fmt: skip
def test_calls_without_the_token_never_reach_the_handler(guarded: Guarded, token: str | None,
                                                         code: grpc.StatusCode, details: str) -> None:  # fmt: skip
    before = list(guarded.calls)
    with tls.channel(guarded.address, token=token) as channel:
        for name, call in _calls(channel).items():
            with pytest.raises(grpc.RpcError) as e:
                call()  # type: ignore[operator]
            assert (e.value.code(), e.value.details()) == (code, details), name
        assert channel.unary_unary(f"/{SERVICE}/Open")(b"x", timeout=TIMEOUT_S) == b"ok", "an open method"
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, "health needs no token"
    assert guarded.calls == [*before, "unary"], "only the open method ran"


def test_a_channel_with_the_token_reaches_every_method(guarded: Guarded) -> None:
    before = len(guarded.calls)
    with tls.channel(guarded.address, token="the-token") as channel:
        for call in _calls(channel).values():
            call()  # type: ignore[operator]
        with_metadata = channel.unary_unary(f"/{SERVICE}/Unary")(b"x", timeout=TIMEOUT_S, metadata=[("k", "v")])
        assert with_metadata == b"ok", "the token is added beside the call's own metadata"
    assert guarded.calls[before:] == ["unary", "stream", "both", "unary"]


def test_no_token_source_means_nothing_is_required() -> None:
    server = new_server(SERVICE, health.HealthServicer(), 1 << 20, 2, structlog.get_logger())
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: b"free")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Unary": handler}),))
    address = f"127.0.0.1:{bind(server, '127.0.0.1:0')}"
    server.start()
    try:
        with tls.channel(address) as channel:
            assert channel.unary_unary(f"/{SERVICE}/Unary")(b"x", timeout=TIMEOUT_S) == b"free"
    finally:
        server.stop(0)
