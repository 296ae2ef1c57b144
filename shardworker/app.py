"""The stage-worker process: a StageWorker gRPC server around `StageWorkerCore`, plus its ties to the
coordinator (register, heartbeat, watch topology) and its life cycle (health, SIGTERM).

Threads: gRPC handlers (Step, Release, GetShardInfo); a heartbeat loop; a topology watch that hands
the newest version to a placement thread, which does the slow part (load weights, join groups)
so the watch keeps reading and heartbeats keep flowing while a shard loads.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from typing import Any

from shardmesh.rpc import log, procs, telemetry
from shardmesh.rpc.flags import env_flags
from shardworker import heap
from shardworker.process import WorkerConfig, WorkerProcess

ENV_PREFIX = "SHARDMESH_WORKER_"


def add_arguments(p: argparse.ArgumentParser) -> None:
    flag = env_flags(p, ENV_PREFIX)
    flag("--coordinator", "127.0.0.1:50051", help="host:port of the coordinator")
    flag("--listen", "127.0.0.1:0", help="host:port for this worker's gRPC server; port 0 picks a free one")
    flag("--advertise", help="host:port others reach this worker at (default: the --listen address)")
    flag("--worker-id", help="stable id; a restarted worker with the same id takes its slot back")
    flag("--device", "cpu", help="cpu, cuda or cuda:N")
    flag("--label", action="append", default=[], help="placement label key=value (repeatable), e.g. node_group=a")
    flag("--group-timeout", 60.0, type=float, help="seconds a collective or stage link may wait (default 60)")
    flag("--max-message-mb", 64, type=int, help="gRPC max send/receive message size in MiB (default 64)")
    flag("--threads", type=int, help="torch intra-op threads (default: all cores, or $OMP_NUM_THREADS)")
    flag("--log-level", help="debug, info, warning or error")
    telemetry.add_flags(flag)


def run(args: argparse.Namespace) -> int:
    labels: dict[str, str] = {}
    for item in args.label if isinstance(args.label, list) else [args.label]:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"error: --label: expected key=value, got {item!r}", file=sys.stderr)
            return 2
        labels[key] = value
    try:
        telemetry.check_metrics_port(args.metrics_port)
        telemetry.export_config(args.otlp_endpoint)
    except telemetry.TelemetryConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    elif "OMP_NUM_THREADS" in os.environ:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    logger = log.configure("shardworker", level=args.log_level)
    if not heap.keep_freed_memory():
        logger.info("malloc_defaults", detail="mallopt unavailable: freed step memory goes back to the OS")
    cfg = WorkerConfig(args.coordinator, args.listen, args.advertise, args.worker_id, args.device, labels,
                       args.group_timeout, args.max_message_mb * 1024 * 1024, args.metrics_port,
                       args.otlp_endpoint)  # fmt: skip
    resource = {"service.instance.id": args.worker_id} if args.worker_id else {}
    telemetry.setup_tracing("worker", args.otlp_endpoint, **resource)
    proc = WorkerProcess(cfg, logger)
    with procs.stop_on_signals() as stop:
        try:
            threading.Thread(target=_start_or_stop, args=(proc, stop, logger), daemon=True).start()
            while not stop.wait(0.5):
                pass
        finally:
            proc.stop()
    return 1 if proc.failed else 0


def _start_or_stop(proc: WorkerProcess, stop: threading.Event, logger: Any) -> None:
    """Start in a thread so SIGTERM during registration (coordinator not up yet) still stops us promptly."""
    try:
        proc.start()
    except Exception as e:
        logger.error("start_failed", error=str(e))
        proc.failed = True
        stop.set()
