#!/usr/bin/env python3
"""Container health check for the shardmesh services: one `grpc.health.v1.Health/Check` call.

    shardmesh-healthcheck HOST:PORT [--service NAME] [--timeout SECONDS] [--alive]

Exit 0 when the server answers SERVING; with `--alive`, when it answers at all (a stage worker says
NOT_SERVING while it loads its shard or waits as a standby, and is alive all the same). Exit 1
otherwise, with one line on stderr saying why. The image installs this file as
/usr/local/bin/shardmesh-healthcheck; the compose files in this folder use it.
"""

from __future__ import annotations

import argparse
import sys


def check(address: str, service: str = "", timeout: float = 3.0, alive: bool = False) -> tuple[bool, str]:
    """(healthy, what the server said or why it could not be asked)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
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
    args = p.parse_args(argv)
    healthy, said = check(args.address, args.service, args.timeout, args.alive)
    if not healthy:
        print(f"unhealthy: {said}", file=sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
