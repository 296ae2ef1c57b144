"""Mutual TLS as `shardmesh.rpc.tls` builds it, on a real server on 127.0.0.1: a peer without a certificate of the
mesh's CA is refused at the handshake; the three files go together and are checked up front, naming the flag; a
server certificate replaced on disk is served to the next connection, a half-written replacement is not; the HTTPS
context follows its files the same way.
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shardmesh.rpc import tls
from shardmesh.rpc.server import bind, new_server
from shardmesh_cli import certs

TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def mesh_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("ca")
    certs.init(directory)
    return directory


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("other")
    certs.init(directory)
    return directory


def files(directory: Path, name: str, ca: Path | None = None) -> tls.TlsFiles:
    return tls.TlsFiles(directory / f"{name}.pem", directory / f"{name}.key", ca or directory / "ca.pem")


class Server:
    """A health-only server on a mutual-TLS port; `tls_reloaded` log lines are counted."""

    def __init__(self, served: tls.TlsFiles) -> None:
        self.reloads: list[dict] = []

        def record(logger: object, method: str, event: dict) -> dict:
            if event["event"] in ("tls_reloaded", "tls_reload_skipped"):
                self.reloads.append(dict(event))
            raise structlog.DropEvent

        logger = structlog.wrap_logger(structlog.PrintLogger(), processors=[record])
        self.health = health.HealthServicer()
        self.server = new_server("test.v1.Nothing", self.health, 1 << 20, 2, logger)
        self.port = bind(self.server, "127.0.0.1:0", served, logger)
        self.server.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)

    def check(self, client: tls.TlsFiles | None, host: str = "127.0.0.1") -> grpc.StatusCode:
        with tls.channel(f"{host}:{self.port}", client) as channel:
            try:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
            except grpc.RpcError as e:
                return e.code()
        return grpc.StatusCode.OK

    def served_certificate(self, client: tls.TlsFiles) -> bytes:
        context = ssl.create_default_context(cafile=str(client.ca))
        context.load_cert_chain(client.cert, client.key)
        context.set_alpn_protocols(["h2"])
        with socket.create_connection(("127.0.0.1", self.port), timeout=TIMEOUT_S) as raw, \
                context.wrap_socket(raw, server_hostname="127.0.0.1") as s:  # fmt: skip
            cert = s.getpeercert(binary_form=True)
        assert cert is not None
        return cert


@pytest.fixture
def server(mesh_ca: Path, tmp_path: Path) -> Iterator[Server]:
    """Serves a copy of the coordinator's files (tests replace them)."""
    for name in ("coordinator.pem", "coordinator.key", "ca.pem"):
        (tmp_path / name).write_bytes((mesh_ca / name).read_bytes())
    s = Server(files(tmp_path, "coordinator"))
    yield s
    s.server.stop(0)


def der(path: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(path.read_text())


def test_only_certificates_of_the_mesh_ca_get_through(server: Server, mesh_ca: Path, other_ca: Path) -> None:
    assert server.check(files(mesh_ca, "client")) is grpc.StatusCode.OK
    assert server.check(files(mesh_ca, "worker"), host="localhost") is grpc.StatusCode.OK, "a SAN of every cert"
    assert server.check(None) is grpc.StatusCode.UNAVAILABLE, "plaintext"
    assert server.check(files(other_ca, "client", ca=mesh_ca / "ca.pem")) is grpc.StatusCode.UNAVAILABLE
    assert server.check(files(other_ca, "client")) is grpc.StatusCode.UNAVAILABLE, "nor does it trust the server"
    trusting = grpc.ssl_channel_credentials((mesh_ca / "ca.pem").read_bytes())  # no client certificate
    with grpc.secure_channel(f"127.0.0.1:{server.port}", trusting) as channel, pytest.raises(grpc.RpcError) as e:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE


def test_a_replaced_certificate_is_served_to_the_next_connection(server: Server, mesh_ca: Path,
                                                                 tmp_path: Path) -> None:  # fmt: skip
    client = files(mesh_ca, "client")
    assert server.served_certificate(client) == der(tmp_path / "coordinator.pem")
    ca = certs.Authority.load(mesh_ca)
    cert, key = certs.issue(ca, "coordinator")
    # half-written: the new certificate beside the old key is skipped, the old pair still served
    (tmp_path / "coordinator.pem").write_bytes(certs._pem_cert(cert))
    old = server.served_certificate(client)
    assert old != der(tmp_path / "coordinator.pem")
    assert [e["event"] for e in server.reloads] == ["tls_reload_skipped"]
    (tmp_path / "coordinator.key").write_bytes(certs._pem_key(key))
    assert server.served_certificate(client) == der(tmp_path / "coordinator.pem")
    assert [e["event"] for e in server.reloads] == ["tls_reload_skipped", "tls_reloaded"]
    assert server.check(client) is grpc.StatusCode.OK


def test_the_three_files_go_together_and_are_checked_up_front(mesh_ca: Path, tmp_path: Path) -> None:
    def given(cert: Path | None, key: Path | None, ca: Path | None) -> tls.TlsFiles | None:
        return tls.TlsFiles.from_flags(*(str(p) if p else None for p in (cert, key, ca)))

    cert, key, ca = mesh_ca / "gateway.pem", mesh_ca / "gateway.key", mesh_ca / "ca.pem"
    assert given(None, None, None) is None
    with pytest.raises(tls.TlsError, match=r"^--tls-key: needed with --tls-cert, --tls-ca"):
        given(cert, None, ca)
    with pytest.raises(tls.TlsError, match=r"^--tls-ca: cannot read .*nowhere.pem"):
        given(cert, key, tmp_path / "nowhere.pem")
    with pytest.raises(tls.TlsError, match=r"^--tls-key: .*worker.key is not the private key of --tls-cert"):
        given(cert, mesh_ca / "worker.key", ca)
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    with pytest.raises(tls.TlsError, match=r"^--tls-ca: .*junk.pem holds no CA certificate"):
        given(cert, key, tmp_path / "junk.pem")
    assert given(cert, key, ca) == files(mesh_ca, "gateway")


def test_https_context_follows_its_files(mesh_ca: Path, tmp_path: Path) -> None:
    for name in ("gateway.pem", "gateway.key", "ca.pem"):
        (tmp_path / name).write_bytes((mesh_ca / name).read_bytes())
    served = files(tmp_path, "gateway")
    context = tls.https_context(served)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve(n: int) -> None:
        for _ in range(n):
            conn, _ = listener.accept()
            try:
                with context.wrap_socket(conn, server_side=True) as s:
                    s.recv(1)
            except (ssl.SSLError, OSError):
                pass

    thread = threading.Thread(target=serve, args=(2,), daemon=True)
    thread.start()
    try:
        assert ssl.PEM_cert_to_DER_cert(ssl.get_server_certificate(("127.0.0.1", port))) == der(served.cert)
        cert, key = certs.issue(certs.Authority.load(mesh_ca), "gateway")
        certs.write_pair(tmp_path, "gateway", cert, key)
        assert ssl.PEM_cert_to_DER_cert(ssl.get_server_certificate(("127.0.0.1", port))) == der(served.cert)
    finally:
        thread.join(TIMEOUT_S)
        listener.close()
    assert not thread.is_alive()
    assert os.stat(tmp_path / "gateway.key").st_mode & 0o077 == 0, "keys are readable by their owner only"
