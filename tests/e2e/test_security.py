"""A mesh that lets no one in: `shardmesh up --tls` with API keys (a tiny random checkpoint, one stage worker), driven
from outside as a client, an operator and an intruder would.

One mesh serves the whole module. With the mesh's client certificate and a key, it answers as `transformers` does,
over gRPC and HTTPS alike. A client without a certificate, or with one another CA signed, gets no connection; one
without a key gets UNAUTHENTICATED (HTTP 401), one with a wrong key PERMISSION_DENIED (403). Workers without a
certificate of the mesh's CA, or without the join token, never register: the coordinator's log never names them.
Health answers without any token. Last, the gateway's certificate is replaced on disk by a new one from the same CA:
new connections are served with it, by the same process.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shardmesh.proto.v1 import coordinator_pb2, coordinator_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from shardmesh.rpc import tls
from shardmesh_cli import certs
from tests.checkpoints import make_checkpoint, reference_greedy
from tests.meshes import Mesh, Spawner
from tests.unit.gateway.fakes import VOCAB, write_tokenizer
from tests.waiting import wait_until

PROMPT = [1, 17, 5, 42, 33, 8]
KEYS = ("first-key-0123456789", "second-key-abcdefghij")
TIMEOUT_S = 60.0
HANDSHAKE_S = 5.0  # a refused handshake fails at once; the bound only guards against a hang


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("security") / "tiny"
    make_checkpoint(directory, "llama-mha-untied", num_layers=2, seed=1, vocab_size=VOCAB, eos_token_id=VOCAB - 1)
    return write_tokenizer(directory)


@pytest.fixture(scope="module")
def material(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The mesh's CA and certificates, made by `shardmesh certs init` (which `up --tls` then reuses)."""
    directory = tmp_path_factory.mktemp("tls")
    done = subprocess.run([sys.executable, "-m", "shardmesh_cli", "certs", "init", str(directory)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return directory


@pytest.fixture(scope="module")
def intruder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another CA's material: certificates as good as the mesh's, but signed by a CA the mesh does not trust."""
    directory = tmp_path_factory.mktemp("other-ca")
    certs.init(directory)
    return directory


@pytest.fixture(scope="module")
def mesh(model: Path, material: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text("# one key per line\n" + "\n".join(KEYS) + "\n")
    m = Mesh(model, 1, 1, tmp_path_factory.mktemp("security-up"), "--tls", "--tls-dir", str(material),
             "--api-key-file", str(keys))  # fmt: skip
    m.keys = keys  # type: ignore[attr-defined]
    try:
        yield m
    finally:
        m.close()


def files(directory: Path, name: str, ca: Path | None = None) -> tls.TlsFiles:
    return tls.TlsFiles(directory / f"{name}.pem", directory / f"{name}.key", ca or directory / "ca.pem")


def gateway_stub(mesh: Mesh, material: Path, key: str | None = KEYS[0],
                 client: tls.TlsFiles | None = None) -> gateway_pb2_grpc.GatewayStub:  # fmt: skip
    channel = tls.channel(mesh.address, client or files(material, "client"), token=key)
    return gateway_pb2_grpc.GatewayStub(channel)


def greedy(n: int) -> gateway_pb2.GenerateRequest:
    params = gateway_pb2.SamplingParams(max_new_tokens=n, temperature=0.0)
    return gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=PROMPT), params=params)


def https(mesh: Mesh, material: Path, path: str, body: dict[str, Any] | None = None,
          key: str | None = KEYS[0]) -> tuple[int, dict[str, Any]]:  # fmt: skip
    """An HTTPS request to the gateway's HTTP API, checking its certificate against the mesh's CA (no client
    certificate: HTTP takes API keys)."""
    context = ssl.create_default_context(cafile=str(material / "ca.pem"))
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(mesh.http_url().removesuffix("/v1") + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def refused(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def test_up_tls_serves_as_transformers_over_grpc_and_https(mesh: Mesh, material: Path, model: Path) -> None:
    assert mesh.http_url().startswith("https://")
    answer = gateway_stub(mesh, material).Generate(greedy(12), timeout=TIMEOUT_S)
    assert list(answer.token_ids) == reference_greedy(model, PROMPT, 12)[0]
    stream = gateway_stub(mesh, material, KEYS[1]).GenerateStream(greedy(12), timeout=TIMEOUT_S)
    streamed = [m.token_id for m in stream]
    assert streamed == list(answer.token_ids), "the second key of the file is as good as the first"
    status, body = https(mesh, material, "/v1/completions",
                         {"model": str(model), "prompt": PROMPT, "max_tokens": 12, "temperature": 0})  # fmt: skip
    assert status == 200, body
    assert body["choices"][0]["text"] == answer.text
    # the tools reach the coordinator with the client certificate (GetTopology needs no join token)
    client = files(material, "client").as_flags()
    done = mesh.command("status", "--json", *client, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["serving"] is True
    done = mesh.command("status", "--timeout", "3", timeout=60)
    assert done.returncode == 2 and "UNAVAILABLE" in done.stderr, "no certificate, no answer"


def test_clients_without_a_certificate_of_the_mesh_get_no_connection(mesh: Mesh, material: Path,
                                                                     intruder: Path) -> None:  # fmt: skip
    def generate(channel: grpc.Channel) -> None:
        with channel:
            key = [("authorization", f"Bearer {KEYS[0]}")]
            gateway_pb2_grpc.GatewayStub(channel).Generate(greedy(1), timeout=HANDSHAKE_S, metadata=key)

    plaintext = refused(lambda: generate(grpc.insecure_channel(mesh.address)))
    assert plaintext.code() is grpc.StatusCode.UNAVAILABLE
    no_cert = grpc.ssl_channel_credentials((material / "ca.pem").read_bytes())  # trusts the mesh, presents nothing
    no_cert_error = refused(lambda: generate(grpc.secure_channel(mesh.address, no_cert)))
    assert no_cert_error.code() is grpc.StatusCode.UNAVAILABLE
    other = files(intruder, "client", ca=material / "ca.pem")  # trusts the mesh, presents another CA's certificate
    assert refused(lambda: generate(tls.channel(mesh.address, other))).code() is grpc.StatusCode.UNAVAILABLE
    # and at the TLS level: no session without a certificate of the mesh's CA; with the mesh's, the server speaks
    host, port = mesh.address.rsplit(":", 1)
    assert not tls_session(host, int(port), material, None) and not tls_session(host, int(port), material, other)
    assert tls_session(host, int(port), material, files(material, "client"))
    assert gateway_stub(mesh, material).Generate(greedy(1), timeout=TIMEOUT_S).token_ids  # the mesh's own: served


def test_api_keys_missing_wrong_rotated(mesh: Mesh, material: Path, model: Path) -> None:
    missing = refused(lambda: gateway_stub(mesh, material, key=None).Generate(greedy(1), timeout=TIMEOUT_S))
    assert missing.code() is grpc.StatusCode.UNAUTHENTICATED
    assert missing.details() == "no API key: send authorization: Bearer <key>"
    close_guess = KEYS[0][:-1] + "X"
    wrong = refused(lambda: gateway_stub(mesh, material, key=close_guess).Generate(greedy(1), timeout=TIMEOUT_S))
    assert wrong.code() is grpc.StatusCode.PERMISSION_DENIED and wrong.details() == "API key not accepted"
    keyless = gateway_stub(mesh, material, key=None)
    stream = refused(lambda: list(keyless.GenerateStream(greedy(1), timeout=TIMEOUT_S)))
    assert stream.code() is grpc.StatusCode.UNAUTHENTICATED
    body = {"model": str(model), "prompt": PROMPT, "max_tokens": 1}
    status, answer = https(mesh, material, "/v1/completions", body, key=None)
    assert status == 401 and answer["error"]["message"] == "no API key: send authorization: Bearer <key>"
    status, answer = https(mesh, material, "/v1/completions", body, key=close_guess)
    assert status == 403 and answer["error"]["message"] == "API key not accepted"
    assert close_guess not in mesh.log("gateway") and KEYS[0] not in mesh.log("gateway"), "keys are never logged"
    # the key file is re-read when it changes: a new key works at once, a removed one no longer does
    fresh = "rotated-key-9876543210"
    mesh.keys.write_text(f"{KEYS[1]}\n{fresh}\n")  # type: ignore[attr-defined]
    assert gateway_stub(mesh, material, key=fresh).Generate(greedy(1), timeout=TIMEOUT_S).token_ids
    assert https(mesh, material, "/v1/completions", body, key=fresh)[0] == 200
    revoked = refused(lambda: gateway_stub(mesh, material, key=KEYS[0]).Generate(greedy(1), timeout=TIMEOUT_S))
    assert revoked.code() is grpc.StatusCode.PERMISSION_DENIED
    mesh.keys.write_text("\n".join(KEYS) + "\n")  # type: ignore[attr-defined]


def test_health_answers_without_a_token(mesh: Mesh, material: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    client = files(material, "client")
    for address in (mesh.address, mesh.coordinator):
        with tls.channel(address, client) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert https(mesh, material, "/health", key=None)[0] == 200
    # the image's probe: with a client certificate from its flags, or from the service's own environment
    from tests.e2e.test_compose import COMPOSE_DIR

    spec = importlib.util.spec_from_file_location("probe", COMPOSE_DIR / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    for key in list(probe.os.environ):
        if key.startswith("SHARDMESH_"):
            monkeypatch.delenv(key)
    assert probe.main(["--timeout", "3", mesh.address]) == 1, "no certificate: no handshake"
    assert probe.main([mesh.address, *client.as_flags()]) == 0
    gateway = files(material, "gateway")
    for flag, path in zip(("CERT", "KEY", "CA"), (gateway.cert, gateway.key, gateway.ca), strict=True):
        monkeypatch.setenv(f"SHARDMESH_GATEWAY_TLS_{flag}", str(path))
    assert probe.main([mesh.address]) == 0, "in the gateway's container, its own files"


def test_workers_without_the_mesh_credentials_never_register(mesh: Mesh, material: Path, intruder: Path,
                                                             tmp_path: Path) -> None:  # fmt: skip
    token = (material / "join-token").read_text().strip()
    worker = files(material, "worker").as_flags()
    spawner = Spawner(tmp_path)
    try:
        no_token = spawner.worker(mesh.coordinator, "no-token", "--speed", "1", *worker)
        other_ca = spawner.worker(mesh.coordinator, "other-ca", "--speed", "1",
                                  *files(intruder, "worker", ca=material / "ca.pem").as_flags(),
                                  "--join-token-file", str(material / "join-token"))  # fmt: skip
        plaintext = spawner.worker(mesh.coordinator, "plaintext", "--speed", "1",
                                   "--join-token-file", str(material / "join-token"))  # fmt: skip
        assert no_token.wait(timeout=TIMEOUT_S) == 1, "refused, not retried"
        assert "UNAUTHENTICATED: no join token" in (tmp_path / "no-token.log").read_text()
        for name in ("other-ca", "plaintext"):  # refused at the handshake: the worker keeps trying, in vain
            wait_until(lambda n=name: "coordinator_unreachable" in (tmp_path / f"{n}.log").read_text(), TIMEOUT_S)
        assert other_ca.poll() is None and plaintext.poll() is None
        # a caller with the mesh's certificate but a wrong token, or none, is refused by the coordinator too
        register = coordinator_pb2.RegisterRequest(address="127.0.0.1:1", worker_id="wrong-token", pid=1)
        for presented, code in ((token[:-1] + "x", grpc.StatusCode.PERMISSION_DENIED),
                                (None, grpc.StatusCode.UNAUTHENTICATED)):  # fmt: skip
            with tls.channel(mesh.coordinator, files(material, "worker"), token=presented) as channel:
                stub = coordinator_pb2_grpc.CoordinatorStub(channel)
                error = refused(lambda stub=stub: stub.Register(register, timeout=TIMEOUT_S))
            assert error.code() is code and token not in error.details()
            assert "join token" in error.details()
    finally:
        spawner.close()
    registered = [json.loads(line).get("worker_id") for line in mesh.log("coordinator").splitlines()
                  if line.startswith("{") and json.loads(line).get("event") == "worker_registered"]  # fmt: skip
    assert registered == ["worker-0"], registered
    assert token not in mesh.log("coordinator")


def test_a_replaced_certificate_is_served_to_new_connections(mesh: Mesh, material: Path) -> None:
    """Last: replaces the gateway's certificate (a new key, the same CA), without restarting anything."""
    host, port = mesh.address.rsplit(":", 1)
    before = served_certificate(host, int(port), material)
    assert before == der(material / "gateway.pem")
    done = subprocess.run([sys.executable, "-m", "shardmesh_cli", "certs", "issue", str(material), "gateway"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    after = der(material / "gateway.pem")
    assert after != before
    assert served_certificate(host, int(port), material) == after
    http_host, http_port = mesh.http_url().removeprefix("https://").removesuffix("/v1").rsplit(":", 1)
    assert ssl.PEM_cert_to_DER_cert(ssl.get_server_certificate((http_host, int(http_port)))) == after
    assert gateway_stub(mesh, material).Generate(greedy(1), timeout=TIMEOUT_S).token_ids
    assert '"tls_reloaded"' in mesh.log("gateway")


def tls_session(host: str, port: int, material: Path, cert: tls.TlsFiles | None) -> bool:
    """Whether a TLS client presenting `cert` (None: nothing) gets a session with the server at host:port: under TLS
    1.3 a refused client certificate shows as an alert or a closed connection at the first read, after the client's
    side of the handshake; an accepted one gets the server's first HTTP/2 frame."""
    context = ssl.create_default_context(cafile=str(material / "ca.pem"))
    context.set_alpn_protocols(["h2"])
    if cert is not None:
        context.load_cert_chain(cert.cert, cert.key)
    try:
        with socket.create_connection((host, port), timeout=HANDSHAKE_S) as raw, \
                context.wrap_socket(raw, server_hostname=host) as s:  # fmt: skip
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            return bool(s.recv(9))
    except (ssl.SSLError, ConnectionError):
        return False


def der(pem: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pem.read_text())


def served_certificate(host: str, port: int, material: Path) -> bytes:
    """The certificate a gRPC port presents to a new connection, seen through Python's ssl module with the mesh's
    client certificate (mutual TLS: without one the server ends the handshake)."""
    context = ssl.create_default_context(cafile=str(material / "ca.pem"))
    context.load_cert_chain(material / "client.pem", material / "client.key")
    context.set_alpn_protocols(["h2"])
    with socket.create_connection((host, port), timeout=HANDSHAKE_S) as raw, \
            context.wrap_socket(raw, server_hostname=host) as s:  # fmt: skip
        cert = s.getpeercert(binary_form=True)
    assert cert is not None
    return cert
