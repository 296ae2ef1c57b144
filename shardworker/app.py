"""`shardmesh worker`: flags (each also settable as SHARDMESH_WORKER_<FLAG>), validation, run.

Bad flags are reported as one line with exit code 2 before anything starts; a worker that cannot
start (its coordinator refused it) exits 1. The process itself is `shardworker.process.WorkerProcess`,
imported when the command runs, as torch comes with it.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from shardmesh.engine import compute_priority
from shardmesh.rpc import telemetry
from shardmesh.rpc.flags import JOIN_TOKEN_ENV, UsageError, add_tls_flags, env_flags, mesh_security

ENV_PREFIX = "SHARDMESH_WORKER_"


def add_arguments(p: argparse.ArgumentParser) -> None:
    flag = env_flags(p, ENV_PREFIX)
    flag("--coordinator", "127.0.0.1:50051", help="host:port of the coordinator")
    flag("--listen", "127.0.0.1:0", help="host:port for this worker's gRPC server; port 0 picks a free one")
    flag("--advertise", help="host:port others reach this worker at (default: the --listen address)")
    flag("--worker-id", help="stable id; a restarted worker with the same id takes its slot back")
    flag("--device", "cpu", help="cpu, or the GPU this worker computes on: cuda:N (its index among the GPUs this "
         "process sees); plain cuda takes GPU 0, as a worker in a container that sees one GPU; `shardmesh up` and "
         "a manifest's commands always give each worker an index of its own (NCCL refuses two ranks on one "
         "GPU)")  # fmt: skip
    flag("--link-staging", "auto", choices=("auto", "host"), help="how stage links move activations: auto (NCCL "
         "between two GPUs, else Gloo through host memory) or host (always Gloo through host memory)")  # fmt: skip
    flag("--label", action="append", default=[], help="placement label key=value (repeatable), e.g. node_group=a")
    flag("--group-timeout", 60.0, type=float, help="seconds a collective or stage link may wait (default 60)")
    flag("--max-message-mb", 64, type=int, help="gRPC max send/receive message size in MiB (default 64)")
    flag("--memory-budget", help="bytes of weights this worker holds in memory, e.g. 300MiB: the leading layers "
         "of its shard that fit stay, the others stream from the checkpoint every step (CPU; default: the whole "
         "shard)")  # fmt: skip
    flag("--threads", type=int, help="torch intra-op threads (default: all cores, or $OMP_NUM_THREADS)")
    flag("--cpus", help="the CPUs this worker's threads run on, e.g. 0 or 0,2-3 (default: any this process may use); "
         "`shardmesh up` pins tensor-parallel ranks that outnumber the cores, with --tp-split")  # fmt: skip
    flag("--speed", "auto", help="this worker's matrix-multiply throughput in GFLOP/s, or 'auto' to measure it at "
         "start (default); the coordinator moves a slot onto a spare that makes the pipeline faster by its "
         "--rebalance-gain")  # fmt: skip
    flag("--compute-priority", "normal", choices=compute_priority.PRIORITIES, help="the scheduling priority of the "
         "thread that runs this worker's tensor work and of its OpenMP threads: normal, or realtime (SCHED_RR 1; "
         "needs CAP_SYS_NICE or `ulimit -r` >= 1). CPU stages that take turns on shared cores lose 7-15%% of "
         "their speed to other threads without it (`shardmesh up` asks for it on CPU meshes when it may)")  # fmt: skip
    flag("--log-level", help="debug, info, warning or error")
    telemetry.add_flags(flag)
    add_tls_flags(flag, "the worker")
    flag("--join-token-file", help="the join token (the file's first line) presented to the coordinator to register; "
         "the worker also asks it of every caller of its StageWorker methods: the coordinator and the gateways "
         f"(default: ${JOIN_TOKEN_ENV}; neither: none presented or asked)")  # fmt: skip


def worker_device(spec: str, visible_gpus: int | None = None, check_visible: bool = True) -> str:
    """`--device` as the worker uses it ("cpu" or "cuda:N"), checked against the GPUs this process sees (asked of
    torch only for a GPU, so a CPU worker's flags are checked without importing it; `check_visible=False`: the
    spelling only); a UsageError otherwise."""
    from shardmesh.core import device_map

    if visible_gpus is None and check_visible:
        visible_gpus = device_map.visible_gpus_for(spec)
    try:
        return device_map.check_worker_device(spec, visible_gpus)
    except ValueError as e:
        raise UsageError(str(e)) from None


def parse_cpus(text: str, allowed: set[int] | None = None) -> set[int]:
    """ "0,2-3" -> {0, 2, 3}, each one this process may run on (`allowed`, default its affinity); a UsageError
    naming --cpus otherwise."""
    allowed = os.sched_getaffinity(0) if allowed is None else allowed
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            cpus |= set(range(int(first), int(last or first) + 1))
    except ValueError:
        raise UsageError(f"--cpus: expected CPU numbers and ranges, e.g. 0,2-3; got {text!r}") from None
    if not cpus or not cpus <= allowed:
        raise UsageError(f"--cpus: {text!r} names CPUs this process may not use (it may use "
                         f"{','.join(map(str, sorted(allowed)))})")  # fmt: skip
    return cpus


def build_config(args: argparse.Namespace) -> Any:
    """Validate the flags; returns a `WorkerConfig`."""
    from shardworker.process import WorkerConfig

    labels: dict[str, str] = {}
    for item in args.label if isinstance(args.label, list) else [args.label]:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--label: expected key=value, got {item!r}")
        labels[key] = value
    try:
        telemetry.check_metrics_port(args.metrics_port)
        telemetry.export_config(args.otlp_endpoint)
    except telemetry.TelemetryConfigError as e:
        raise UsageError(str(e)) from None
    speed: float | None = None
    if str(args.speed).strip().lower() != "auto":
        try:
            speed = float(args.speed)
        except ValueError:
            raise UsageError(f"--speed: expected 'auto' or GFLOP/s as a number, got {args.speed!r}") from None
        if not speed > 0:
            raise UsageError(f"--speed: must be > 0 GFLOP/s, got {args.speed}")
    budget: int | None = None
    if args.memory_budget:
        from shardmesh.core.units import parse_bytes

        try:
            budget = parse_bytes(args.memory_budget)
        except ValueError as e:
            raise UsageError(f"--memory-budget: {e}") from None
    if (refused := compute_priority.realtime_refused(args.compute_priority)) is not None:
        raise UsageError(refused)
    if args.cpus:
        parse_cpus(args.cpus)
    # The spelling here (a config may be checked where it does not run); the GPU itself when the worker starts (`run`).
    device = worker_device(args.device, check_visible=False)
    tls, join_tokens, join_token = mesh_security(args)
    return WorkerConfig(args.coordinator, args.listen, args.advertise, args.worker_id, device, labels,
                        args.group_timeout, args.max_message_mb * 1024 * 1024, args.metrics_port,
                        args.otlp_endpoint, speed, tls, join_tokens, join_token, budget, args.link_staging,
                        args.compute_priority)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM, SIGINT or a drain, then leave the mesh and shut down (exit 0); exit 1 if it cannot
    start."""
    from shardmesh.rpc import lifecycle, log
    from shardworker import heap
    from shardworker.process import WorkerProcess

    cfg = build_config(args)  # a UsageError reaches the command's main: one line, exit 2
    worker_device(args.device)  # the GPU it names exists here
    if args.cpus:  # every thread there is (threads started later inherit their creator's CPUs)
        cpus = parse_cpus(args.cpus)
        for task in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(task), cpus)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    elif "OMP_NUM_THREADS" in os.environ:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    logger = log.configure("shardworker", level=args.log_level)
    if not heap.keep_freed_memory():
        logger.info("malloc_defaults", detail="mallopt unavailable: freed step memory goes back to the OS")
    resource = {"service.instance.id": args.worker_id} if args.worker_id else {}
    telemetry.setup_tracing("worker", args.otlp_endpoint, **resource)
    # Started in the background: registration waits for the coordinator, and a SIGTERM meanwhile must stop us.
    worker = WorkerProcess(cfg, logger)
    started = lifecycle.serve_until_signal(worker, logger, start_in_background=True, stop=worker.exit_requested)
    return 0 if started else 1
