"""The gRPC server every shardmesh service runs: same message limits, error statuses, health, reflection and
bind errors."""

from __future__ import annotations

from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shardmesh.rpc.interceptors import ErrorInterceptor


def message_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Both directions, for servers and channels alike: gRPC's 4 MiB default applies to each end."""
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)]  # fmt: skip


def new_server(
    service_name: str, health_servicer: health.HealthServicer, max_message_bytes: int, threads: int, logger: Any
) -> grpc.Server:
    """A server with grpc.health.v1 and reflection (for grpcurl) registered, whose handlers' errors become
    statuses (`ErrorInterceptor`, logging unexpected ones to `logger`); add the service, then `bind`."""
    errors = ErrorInterceptor(service_name, logger)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads), interceptors=(errors,),
                         options=message_options(max_message_bytes))  # fmt: skip
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return server


def bind(server: grpc.Server, listen: str) -> int:
    """Listen on `listen` (host:port, port 0 picks one); the port, or an error naming the --listen flag."""
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError as e:
        raise RuntimeError(f"--listen: cannot listen on {listen}: {e}") from None
    if port == 0:
        raise RuntimeError(f"--listen: cannot listen on {listen}")
    return port
