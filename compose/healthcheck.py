#!/usr/bin/env python3
"""Container health check for the shardmesh services: one `grpc.health.v1.Health/Check` call.

    shardmesh-healthcheck HOST:PORT [--service NAME] [--timeout SECONDS] [--alive]
                          [--tls-cert PEM --tls-key PEM --tls-ca PEM]

Exit 0 when the server answers SERVING; with `--alive`, when it answers at all (a stage worker says
NOT_SERVING while it loads its shard or waits as a standby, and is alive all the same). Exit 1
otherwise, with one line on stderr saying why. The image installs this file as
/usr/local/bin/shardmesh-healthcheck; the compose files in this folder use it.

Health needs no token, but a service that runs mutual TLS completes no handshake without a client certificate
signed by the mesh's CA, so a probe must present one: the `--tls-*` flags, else $SHARDMESH_TLS_CERT / _KEY / _CA,
else the service's own files from its environment (SHARDMESH_COORDINATOR_TLS_CERT, ..._WORKER_..., ..._GATEWAY_...):
inside a service's container the check needs no flags, as before.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

TLS_FIELDS = ("cert", "key", "ca")
SERVICE_PREFIXES = ("SHARDMESH_TLS_", "SHARDMESH_COORDINATOR_TLS_", "SHARDMESH_WORKER_TLS_", "SHARDMESH_GATEWAY_TLS_")


def tls_from_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The first complete set of TLS files named by the environment, as {cert, key, ca}; {} when there is none."""
    environ = dict(os.environ) if environ is None else environ
    for prefix in SERVICE_PREFIXES:
        files = {f: environ.get(prefix + f.upper(), "") for f in TLS_FIELDS}
        if all(files.values()):
            return files
    return {}


def _channel(address: str, tls: dict[str, str]) -> object:
    import grpc

    if not tls:
        return grpc.insecure_channel(address)
    cert, key, ca = (Path(tls[f]).read_bytes() for f in TLS_FIELDS)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(ca, key, cert))


def check(address: str, service: str = "", timeout: float = 3.0, alive: bool = False,
          tls: dict[str, str] | None = None) -> tuple[bool, str]:  # fmt: skip
    """(healthy, what the server said or why it could not be asked). `tls`: {cert, key, ca} PEM paths for a
    server that runs mutual TLS."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        channel = _channel(address, tls or {})
    except OSError as e:
        return False, f"{address}: cannot read the TLS files: {e}"
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as e:
            return False, f"{address}: {e.code().name}: {e.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return alive or reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address}: {status}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="shardmesh-healthcheck", description=__doc__.splitlines()[0])
    p.add_argument("address", help="host:port of the service's gRPC server")
    p.add_argument("--service", default="", help="health service name (default: the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")
    p.add_argument("--alive", action="store_true", help="any answer is healthy, SERVING or not")
    for f in TLS_FIELDS:
        p.add_argument(f"--tls-{f}", help=f"mutual TLS: the probe's {'CA' if f == 'ca' else f} (PEM)")
    args = p.parse_args(argv)
    given = {f: getattr(args, f"tls_{f}") for f in TLS_FIELDS}
    if any(given.values()) and not all(given.values()):
        p.error("--tls-cert, --tls-key and --tls-ca go together")
    tls = given if all(given.values()) else tls_from_env()
    healthy, said = check(args.address, args.service, args.timeout, args.alive, tls)
    if not healthy:
        print(f"unhealthy: {said}", file=sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
