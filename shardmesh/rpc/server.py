"""The gRPC server every shardmesh service runs: same message limits, error statuses, token checks, health,
reflection, mutual TLS and bind errors."""

from __future__ import annotations

from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shardmesh.rpc import tls as mtls
from shardmesh.rpc.interceptors import ErrorInterceptor, TokenInterceptor
from shardmesh.rpc.tokens import TokenSource


def message_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Both directions, for servers and channels alike: gRPC's 4 MiB default applies to each end."""
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)]  # fmt: skip


def new_server(
    service_name: str, health_servicer: health.HealthServicer, max_message_bytes: int, threads: int, logger: Any,
    tokens: TokenSource | None = None, open_methods: tuple[str, ...] = (),
) -> grpc.Server:  # fmt: skip
    """A server with grpc.health.v1 and reflection (for grpcurl) registered, whose handlers' errors become
    statuses (`ErrorInterceptor`, logging unexpected ones to `logger`); add the service, then `bind`.

    With `tokens`, every method of `service_name` but `open_methods` needs a token they accept
    (`TokenInterceptor`); health and reflection never do, so probes need none."""
    interceptors: list[grpc.ServerInterceptor] = []
    if tokens is not None:
        interceptors.append(TokenInterceptor(service_name, tokens, logger, open_methods))
    interceptors.append(ErrorInterceptor(service_name, logger))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads), interceptors=interceptors,
                         options=message_options(max_message_bytes))  # fmt: skip
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return server


def bind(server: grpc.Server, listen: str, tls: mtls.TlsFiles | None = None, logger: Any = None) -> int:
    """Listen on `listen` (host:port, port 0 picks one); the port, or an error naming the --listen flag.

    With `tls`, the port speaks mutual TLS only (`shardmesh.rpc.tls.server_credentials`: a client certificate signed
    by the CA is required, and the files are re-read when they change; reloads are logged to `logger`)."""
    try:
        if tls is not None:
            port = server.add_secure_port(listen, mtls.server_credentials(tls, logger))
        else:
            port = server.add_insecure_port(listen)
    except RuntimeError as e:
        raise RuntimeError(f"--listen: cannot listen on {listen}: {e}") from None
    if port == 0:
        raise RuntimeError(f"--listen: cannot listen on {listen}")
    return port
