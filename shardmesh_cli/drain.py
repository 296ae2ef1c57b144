"""`shardmesh drain`: take a worker out of service without failing a request.

Asks the coordinator to drain WORKER_ID (`Coordinator.Drain`): a spare takes the worker's slot, the mesh
replays the running sequences there, then the worker deregisters and exits with status 0 (`shardmesh up`
does not restart it). Without a spare the worker keeps serving, DRAINING, until one registers. Unless
`--no-wait`, watches the topology until the worker has left it, printing each change of its state.

Exit codes, for scripts: 0 drained (or, with `--no-wait`, the drain was accepted), 1 not drained: the
coordinator refused or could not be asked, the worker was lost on the way, or `--timeout` passed.
"""

from __future__ import annotations

import argparse
import sys
import time

import grpc

from shardmesh.core.topology import Topology, WorkerState
from shardmesh.proto.v1 import coordinator_pb2, coordinator_pb2_grpc
from shardmesh.rpc import tokens
from shardmesh.rpc.flags import JOIN_TOKEN_ENV, UsageError, add_client_tls_flags
from shardmesh.rpc.tls import TlsError, from_args
from shardmesh.rpc.tls import channel as connect

EXIT_DRAINED, EXIT_NOT_DRAINED = 0, 1
POLL_S = 0.5  # between two looks at the topology
RPC_TIMEOUT_S = 10.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("worker_id", metavar="WORKER_ID", help="the worker to drain, as `shardmesh status` lists it")
    p.add_argument("--coordinator", required=True, help="host:port of the coordinator")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds to wait for the worker to leave the mesh (default 300)")  # fmt: skip
    p.add_argument("--no-wait", action="store_true", help="ask for the drain and exit without waiting for it")
    p.add_argument("--join-token-file", help=f"a coordinator with join tokens asks one for Drain: the file's first "
                   f"line (default: ${JOIN_TOKEN_ENV})")  # fmt: skip
    add_client_tls_flags(p)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _state_name(value: int) -> str:
    try:
        return WorkerState.from_pb(value).value
    except ValueError:
        return "unknown"


def _progress(worker_id: str, state: str, detail: str) -> str:
    return f"{worker_id}: {state}" + (f": {detail}" if detail else "")


def wait_drained(stub: coordinator_pb2_grpc.CoordinatorStub, worker_id: str, timeout: float,
                 last: tuple[str, str]) -> int:  # fmt: skip
    """Poll the topology until `worker_id` is no longer in it; `last` is the (state, detail) already printed."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            pb = stub.GetTopology(coordinator_pb2.GetTopologyRequest(), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as e:  # e.g. the coordinator restarting: its workers register again, keep watching
            seen = ("coordinator unreachable", f"{e.code().name}: {e.details()}")
        else:
            worker = Topology.from_pb(pb).worker(worker_id)
            if worker is None:
                _say(f"{worker_id} drained")
                return EXIT_DRAINED
            if worker.state is WorkerState.LOST:
                _say(f"error: {worker_id} was lost before its drain finished" +
                     (f": {worker.detail}" if worker.detail else ""))  # fmt: skip
                return EXIT_NOT_DRAINED
            seen = (worker.state.value, worker.detail)
        if seen != last:
            _say(_progress(worker_id, *seen))
            last = seen
        if time.monotonic() >= deadline:
            _say(f"error: {worker_id} not drained after {timeout:g} s; still {last[0]}" +
                 (f": {last[1]}" if last[1] else ""))  # fmt: skip
            return EXIT_NOT_DRAINED
        time.sleep(POLL_S)


def run(args: argparse.Namespace) -> int:
    if not args.timeout >= 0:
        raise UsageError(f"--timeout: must be >= 0 seconds, got {args.timeout}")
    try:
        files = from_args(args)
        token = tokens.presented(tokens.env_value(JOIN_TOKEN_ENV), args.join_token_file, "--join-token-file")
    except (TlsError, tokens.TokenError) as e:
        raise UsageError(str(e)) from None
    with connect(args.coordinator, files, token=token) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        try:
            r = stub.Drain(coordinator_pb2.DrainRequest(worker_id=args.worker_id), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as e:  # NOT_FOUND (unknown worker), INVALID_ARGUMENT, UNAVAILABLE, ...
            _say(f"error: coordinator {args.coordinator}: drain {args.worker_id}: {e.code().name}: {e.details()}")
            return EXIT_NOT_DRAINED
        state = _state_name(r.state)
        _say(f"{_progress(args.worker_id, state, r.message)} (topology v{r.topology_version})")
        if args.no_wait:
            return EXIT_DRAINED
        return wait_drained(stub, args.worker_id, args.timeout, (state, r.message))
