"""The stage-worker process: a StageWorker gRPC server around `StageWorkerCore`, plus its ties to the
coordinator (register, heartbeat, watch topology) and its life cycle (health, SIGTERM).

Threads: gRPC handlers (Step, Release, GetShardInfo); a heartbeat loop; a topology watch that hands
the newest version to a placement thread, which does the slow part (load weights, join groups)
so the watch keeps reading and heartbeats keep flowing while a shard loads.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2

from shardmesh import log, procs, rpc, telemetry
from shardmesh.flags import env_flags
from shardmesh.proto.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, worker_pb2, worker_pb2_grpc
from shardmesh.topology import ShardState, Topology, dtype_to_pb
from shardworker import heap
from shardworker.sampling import SamplingParams
from shardworker.service import StageWorkerCore, StepEntry, StepRefused, StepResult

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["StageWorker"].full_name
ENV_PREFIX = "SHARDMESH_WORKER_"
_STATUS = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "not_ready": grpc.StatusCode.FAILED_PRECONDITION,
    "peer_lost": grpc.StatusCode.UNAVAILABLE,
}
R = TypeVar("R")


def _maps_errors(method: Callable[..., R]) -> Callable[..., R]:
    """Refusals become their status code with the message naming the field; nothing else leaks."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> R:
        try:
            return method(self, request, context)
        except StepRefused as e:
            context.abort(_STATUS[e.kind], str(e))
        except ValueError as e:  # e.g. SamplingParams bounds
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        raise AssertionError("unreachable")

    return wrapper


def entry_from_pb(pb: worker_pb2.BatchEntry) -> StepEntry:
    s = pb.sampling
    try:
        sampling = SamplingParams(s.temperature, s.top_p if s.top_p else 1.0, s.top_k,
                                  s.seed if s.HasField("seed") else None)  # fmt: skip
    except ValueError as e:
        raise StepRefused("invalid", f"entries.sampling: {e}") from None
    return StepEntry(pb.request_id, pb.slot, pb.start_pos, pb.num_tokens, tuple(pb.token_ids), sampling,
                     pb.skip_sampling)  # fmt: skip


def entries_of(request: worker_pb2.StepRequest) -> tuple[list[StepEntry], StepRefused | None]:
    """The step's entries, converted before its turn (off the pipeline's critical path), or the
    refusal of a bad one, which the step raises in its turn so that the steps after it keep their order."""
    try:
        return [entry_from_pb(e) for e in request.entries], None
    except StepRefused as e:
        return [], e


class StageWorkerServicer(worker_pb2_grpc.StageWorkerServicer):
    def __init__(self, core: StageWorkerCore, metrics: Any = None) -> None:
        self.core = core
        self.metrics = metrics  # shardworker.metrics.WorkerMetrics, or None when --metrics-port is 0

    @_maps_errors
    def Step(self, request: worker_pb2.StepRequest, context: grpc.ServicerContext) -> worker_pb2.StepResponse:
        tracer = telemetry.tracer()
        parents = telemetry.step_parents(context.invocation_metadata()) if tracer is not None else ()
        start_ns = time.time_ns() if parents else 0
        entries, refused = entries_of(request)
        waited = 0.0
        try:
            with self.core.turn(request.topology_version, request.step_id, request.after_step_id,
                                lambda: not context.is_active()) as waited:  # fmt: skip
                if refused is not None:
                    raise refused
                result = self.core.step(request.topology_version, entries)
        except StepRefused as e:
            if self.metrics is not None:
                self.metrics.failed(e.kind)
            if parents:
                self._spans(parents, start_ns, request, entries, None, waited, f"{e.kind}: {e}")
            raise
        if self.metrics is not None:
            self.metrics.observe(result, sum(e.num_tokens for e in entries))
        if parents:
            self._spans(parents, start_ns, request, entries, result, waited)
        tokens = [worker_pb2.SampledToken(request_id=s.request_id, token_id=s.token_id, logprob=s.logprob)
                  for s in result.sampled]  # fmt: skip
        return worker_pb2.StepResponse(step_id=request.step_id, tokens=tokens,
                                       compute_ms=(result.elapsed_s - result.comm.recv_wait_s) * 1e3,
                                       recv_wait_ms=result.comm.recv_wait_s * 1e3,
                                       order_wait_ms=waited * 1e3)  # fmt: skip

    def _spans(self, parents: Any, start_ns: int, request: worker_pb2.StepRequest, entries: list[StepEntry],
               result: StepResult | None, order_wait_s: float, error: str = "") -> None:  # fmt: skip
        from shardworker.metrics import record_step_spans

        record_step_spans(telemetry.tracer(), parents, start_ns, time.time_ns(), self.core.worker_id, request.step_id,
                          request.topology_version, entries, result, error, after_step_id=request.after_step_id,
                          order_wait_s=order_wait_s)  # fmt: skip

    @_maps_errors
    def Release(self, request: worker_pb2.ReleaseRequest, context: grpc.ServicerContext) -> worker_pb2.ReleaseResponse:
        free = self.core.release([(s.request_id, s.slot) for s in request.sequences])
        return worker_pb2.ReleaseResponse(free_slots=free)

    @_maps_errors
    def GetShardInfo(self, request: worker_pb2.GetShardInfoRequest, context: grpc.ServicerContext) -> Any:
        i = self.core.info()
        out = worker_pb2.ShardInfo(
            worker_id=self.core.worker_id, topology_version=i["applied_version"], state=i["state"].to_pb(),
            device=_device_pb(self.core.device.type), weights_bytes=i["weights_bytes"],
            kv_cache_bytes=i["kv_cache_bytes"], total_slots=i["total_slots"], free_slots=i["free_slots"],
            max_context=i["max_context"],
        )  # fmt: skip
        p = i["placement"]
        if p is not None:
            out.stage, out.num_stages = p.stage, p.num_stages
            out.layer_start, out.layer_end = p.spec.layer_start, p.spec.layer_end
            out.tp_rank, out.tp_size = p.spec.tp_rank, p.spec.tp_size
            out.dtype = dtype_to_pb(p.dtype)
        return out

    @_maps_errors
    def Calibrate(self, request: worker_pb2.CalibrateRequest, context: grpc.ServicerContext) -> Any:
        r = self.core.calibrate(request.topology_version, request.decode_batch, request.prefill_tokens,
                                request.iterations)  # fmt: skip
        t = r["timing"]
        return worker_pb2.CalibrateResponse(
            decode_ms=t.decode.total_ms, decode_layers_ms=t.decode.layers_ms, prefill_ms=t.prefill.total_ms,
            memory_bytes=t.memory_bytes, peak_memory_bytes=t.peak_memory_bytes,
            weights_bytes=r["weights_bytes"], kv_cache_bytes=r["kv_cache_bytes"], num_layers=r["num_layers"],
        )  # fmt: skip


def _device_pb(kind: str) -> common_pb2.Device:
    if kind == "cuda":
        import torch

        props = torch.cuda.get_device_properties(0)
        return common_pb2.Device(type=common_pb2.DEVICE_TYPE_CUDA, name=props.name, memory_bytes=props.total_memory)
    import psutil

    return common_pb2.Device(type=common_pb2.DEVICE_TYPE_CPU, name="cpu", memory_bytes=psutil.virtual_memory().total)


@dataclass(frozen=True)
class WorkerConfig:
    coordinator: str
    listen: str
    advertise: str | None
    worker_id: str | None
    device: str
    labels: dict[str, str]
    group_timeout_s: float
    max_message_bytes: int
    metrics_port: int = 0  # 0: no metrics endpoint
    otlp_endpoint: str | None = None


class WorkerProcess:
    def __init__(self, cfg: WorkerConfig, logger: Any) -> None:
        import torch

        self.cfg, self.log = cfg, logger
        self.stopping = threading.Event()
        self.worker_id = cfg.worker_id or ""
        self.core: StageWorkerCore | None = None
        self.device = torch.device(cfg.device)
        self.address = ""
        self.heartbeat_s = 1.0
        self._latest: Topology | None = None
        self._latest_cv = threading.Condition()
        self._health = health.HealthServicer(
            experimental_non_blocking=True, experimental_thread_pool=futures.ThreadPoolExecutor(max_workers=2)
        )
        self._channel = grpc.insecure_channel(cfg.coordinator, options=rpc.message_options(cfg.max_message_bytes))
        self._coord = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._server = rpc.new_server(SERVICE_NAME, self._health, cfg.max_message_bytes, threads=8)
        self._watch_call: Any = None
        self._metrics_server: Any = None
        self.metrics: Any = None
        self.metrics_address = ""
        self.failed = False

    # ---- start-up ------------------------------------------------------------------------------------

    def start(self) -> None:
        port = rpc.bind(self._server, self.cfg.listen)
        host = self.cfg.listen.rpartition(":")[0]
        self.address = self.cfg.advertise or f"{host}:{port}"
        self._set_health(False)
        if self.cfg.metrics_port:
            self._start_metrics(host)
        self._register()  # before serving Step, so the core exists
        assert self.core is not None
        worker_pb2_grpc.add_StageWorkerServicer_to_server(StageWorkerServicer(self.core, self.metrics), self._server)
        self._server.start()
        self.log.info("listening", address=self.address, coordinator=self.cfg.coordinator,
                      metrics=self.metrics_address or "off",
                      **telemetry.describe_tracing(self.cfg.otlp_endpoint))  # fmt: skip
        for target, name in ((self._heartbeat_loop, "heartbeat"), (self._watch_loop, "watch"),
                             (self._placement_loop, "placement")):  # fmt: skip
            threading.Thread(target=target, name=name, daemon=True).start()

    def _start_metrics(self, listen_host: str) -> None:
        """Serve /metrics and register its address as the `metrics` label, so tools find it in the topology."""
        from shardworker.metrics import WorkerMetrics

        def info() -> dict[str, Any]:
            core = self.core
            if core is not None:
                return core.info()
            return {"weights_bytes": 0, "kv_cache_bytes": 0, "total_slots": 0, "free_slots": 0, "placement": None,
                    "state": ShardState.PENDING}  # fmt: skip

        self.metrics = WorkerMetrics(info, lambda: self.worker_id, self.device.type)
        bind = listen_host.strip("[]")
        self._metrics_server = telemetry.serve_metrics(self.metrics.registry, bind, self.cfg.metrics_port)
        advertised = self.address.rpartition(":")[0]
        if advertised.strip("[]") in ("", "0.0.0.0", "::"):
            import socket

            advertised = socket.gethostname()
        self.metrics_address = f"{advertised}:{self._metrics_server.server_port}"

    def _register(self) -> None:
        """Register, retrying while the coordinator starts; keeps our id so a restart takes its slot back."""
        labels = dict(self.cfg.labels)
        if self.metrics_address:
            labels[telemetry.METRICS_LABEL] = self.metrics_address
        req = coordinator_pb2.RegisterRequest(address=self.address, device=_device_pb(self.device.type),
                                              labels=labels)  # fmt: skip
        if self.worker_id:
            req.worker_id = self.worker_id
        delay = 0.1
        while not self.stopping.is_set():
            try:
                resp = self._coord.Register(req, timeout=5)
                break
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise RuntimeError(f"coordinator refused registration: {e.code().name}: {e.details()}") from None
                self.stopping.wait(delay)
                delay = min(2.0, delay * 2)
        else:
            return
        self.worker_id = resp.worker_id
        self.heartbeat_s = resp.heartbeat_interval.ToTimedelta().total_seconds() or 1.0
        log.bind_identity(worker_id=self.worker_id)
        if self.core is None:
            self.core = StageWorkerCore(self.worker_id, self.device, self.log, self.cfg.group_timeout_s)
        self.log.info("registered", heartbeat_s=self.heartbeat_s)
        self._offer(Topology.from_pb(resp.topology))

    # ---- loops ---------------------------------------------------------------------------------------

    def _offer(self, topology: Topology) -> None:
        with self._latest_cv:
            if self._latest is None or topology.version > self._latest.version:
                self._latest = topology
                self._latest_cv.notify_all()

    def _placement_loop(self) -> None:
        applied = 0

        def newer() -> bool:
            return self.stopping.is_set() or (self._latest is not None and self._latest.version > applied)

        while not self.stopping.is_set():
            with self._latest_cv:
                self._latest_cv.wait_for(newer, timeout=1.0)
                topology = self._latest
            if topology is None or topology.version <= applied or self.stopping.is_set():
                continue
            applied = topology.version
            assert self.core is not None
            self.core.apply(topology)
            self._heartbeat_once()  # report the new state at once rather than at the next tick

    def _watch_loop(self) -> None:
        delay = 0.1
        while not self.stopping.is_set():
            after = self._latest.version if self._latest else 0
            try:
                self._watch_call = self._coord.WatchTopology(coordinator_pb2.WatchTopologyRequest(after_version=after))
                for pb in self._watch_call:
                    self._offer(Topology.from_pb(pb))
                    delay = 0.1
            except grpc.RpcError as e:
                if self.stopping.is_set():
                    return
                self.log.warning("watch_lost", code=e.code().name)
            self.stopping.wait(delay)
            delay = min(2.0, delay * 2)

    def _heartbeat_loop(self) -> None:
        while not self.stopping.wait(self.heartbeat_s):
            self._heartbeat_once()

    def _heartbeat_once(self) -> None:
        core = self.core
        if core is None or self.stopping.is_set():
            return
        i = core.info()
        steps = core.stats.steps
        load = coordinator_pb2.LoadStats(
            active_sequences=i["active_sequences"], free_slots=i["free_slots"], total_slots=i["total_slots"],
            weights_bytes=i["weights_bytes"], kv_cache_bytes=i["kv_cache_bytes"], steps_total=steps,
            mean_step_ms=(core.stats.compute_s / steps * 1e3) if steps else 0.0,
        )  # fmt: skip
        req = coordinator_pb2.HeartbeatRequest(worker_id=self.worker_id, state=i["state"].to_pb(),
                                               applied_topology_version=i["applied_version"], load=load,
                                               detail=i["detail"])  # fmt: skip
        self._set_health(i["state"] is ShardState.READY)
        try:
            resp = self._coord.Heartbeat(req, timeout=max(1.0, self.heartbeat_s))
        except grpc.RpcError as e:
            self.log.warning("heartbeat_failed", code=e.code().name)
            return
        if not resp.known:
            self.log.warning("coordinator_forgot_us")
            self._register()

    def _set_health(self, ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE_NAME):
            self._health.set(service, status)

    # ---- shutdown ------------------------------------------------------------------------------------

    def stop(self, grace: float = 2.0) -> None:
        """NOT_SERVING, leave the mesh (so the coordinator need not wait for a timeout), drain, exit."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        self._health.enter_graceful_shutdown()
        with self._latest_cv:
            self._latest_cv.notify_all()
        if self._watch_call is not None:
            self._watch_call.cancel()
        if self.worker_id:
            # The coordinator may be gone already; its heartbeat timeout covers us then.
            with contextlib.suppress(grpc.RpcError):
                self._coord.Deregister(coordinator_pb2.DeregisterRequest(worker_id=self.worker_id), timeout=1.0)
        self._server.stop(grace).wait(grace + 1.0)
        if self.core is not None:
            self.core.close()
        self._channel.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        telemetry.shutdown_tracing()
        self.log.info("shutdown_complete")


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
