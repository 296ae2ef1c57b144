"""The stage-worker process: a StageWorker gRPC server around `StageWorkerCore`, plus its ties to the
coordinator (register, heartbeat, watch topology) and its life cycle (health, SIGTERM).

Threads: gRPC handlers (Step, Release, GetShardInfo); a heartbeat loop; a topology watch that hands
the newest version to a placement thread, which does the slow part (load weights, join groups)
so the watch keeps reading and heartbeats keep flowing while a shard loads.

A drained worker (see `should_exit`) sets `exit_requested`; `serve_until_signal` waits on that event as on
a signal, then stops the process in order and `shardmesh worker` exits 0.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from shardmesh.core.topology import ShardState, Topology, WorkerState
from shardmesh.proto.v1 import coordinator_pb2, coordinator_pb2_grpc, worker_pb2_grpc
from shardmesh.rpc import log, telemetry
from shardmesh.rpc import server as rpc
from shardmesh.rpc.tls import Dial, TlsFiles
from shardmesh.rpc.tokens import TokenSource
from shardworker.runtime import StageWorkerCore
from shardworker.servicer import SERVICE_NAME, StageWorkerServicer, device_pb


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
    speed_gflops: float | None = None  # declared (`--speed`); None: measured at start
    tls: TlsFiles | None = None  # mutual TLS on the gRPC port and the channel to the coordinator; None: plaintext
    join_tokens: TokenSource | None = None  # what callers of StageWorker must present; None: nothing
    join_token: str | None = field(default=None, repr=False)  # presented to the coordinator
    memory_budget: int | None = None  # bytes of weights in memory (`shardmesh.engine.offload`); None: the whole shard
    link_staging: str = "auto"  # --link-staging: "host" forces Gloo + host staging on links and hand-overs
    compute_priority: str = "normal"  # --compute-priority: the compute thread's (`shardmesh.engine.compute_priority`)


def should_exit(topology: Topology, worker_id: str) -> bool:
    """Whether `topology` tells this worker to leave: it is DRAINING and its slot has moved to another.
    A draining worker that still holds its slot (no spare has taken it yet) keeps serving."""
    me = topology.worker(worker_id)
    return me is not None and me.state is WorkerState.DRAINING and topology.find(worker_id) is None


class WorkerProcess:
    def __init__(self, cfg: WorkerConfig, logger: Any) -> None:
        import torch

        self.cfg, self.log = cfg, logger
        self.stopping = threading.Event()
        # Ends serving: `serve_until_signal` waits on it (a signal sets it too), then calls `stop` on the main
        # thread and returns True (exit 0). A drained worker sets it rather than calling `stop` itself, so its
        # shutdown takes the same single path as a SIGTERM's.
        self.exit_requested = threading.Event()
        self.worker_id = cfg.worker_id or ""
        self.core: StageWorkerCore | None = None
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda":
            # Before any CUDA work (the speed test, the weights, NCCL): this process's default device is its own GPU,
            # so nothing it allocates without naming a device lands on GPU 0, which another rank may hold.
            torch.cuda.set_device(self.device)
        self.address = ""
        self.heartbeat_s = 1.0
        self._latest: Topology | None = None
        self._latest_cv = threading.Condition()
        self._health = health.HealthServicer(
            experimental_non_blocking=True, experimental_thread_pool=futures.ThreadPoolExecutor(max_workers=2)
        )
        dial = Dial(cfg.tls, cfg.join_token, tuple(rpc.message_options(cfg.max_message_bytes)))
        self._channel = dial.channel(cfg.coordinator)
        self._coord = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._server = rpc.new_server(SERVICE_NAME, self._health, cfg.max_message_bytes, threads=8, logger=logger,
                                      tokens=cfg.join_tokens)  # fmt: skip
        self._watch_call: Any = None
        self._metrics_server: Any = None
        self.metrics: Any = None
        self.metrics_address = ""
        self.speed: tuple[float, str] = (0.0, "")  # GFLOP/s and speed class, as registered

    # ---- start-up ------------------------------------------------------------------------------------

    def start(self) -> None:
        port = rpc.bind(self._server, self.cfg.listen, self.cfg.tls, self.log)
        host = self.cfg.listen.rpartition(":")[0]
        self.address = self.cfg.advertise or f"{host}:{port}"
        self._set_health(False)
        if self.cfg.metrics_port:
            self._start_metrics(host)
        self.speed = self._measure_speed()
        self._register()  # before serving Step, so the core exists
        assert self.core is not None
        worker_pb2_grpc.add_StageWorkerServicer_to_server(StageWorkerServicer(self.core, self.metrics), self._server)
        self._server.start()
        self.log.info("listening", address=self.address, coordinator=self.cfg.coordinator,
                      metrics=self.metrics_address or "off", tls="mutual" if self.cfg.tls else "off",
                      join_token="required" if self.cfg.join_tokens else "off",
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

        self.metrics = WorkerMetrics(info, lambda: self.worker_id, str(self.device))
        bind = listen_host.strip("[]")
        self._metrics_server = telemetry.serve_metrics(self.metrics.registry, bind, self.cfg.metrics_port)
        advertised = self.address.rpartition(":")[0]
        if advertised.strip("[]") in ("", "0.0.0.0", "::"):
            import socket

            advertised = socket.gethostname()
        self.metrics_address = f"{advertised}:{self._metrics_server.server_port}"

    def _measure_speed(self) -> tuple[float, str]:
        """(GFLOP/s, speed class): as declared, or measured now, before any weights are loaded."""
        if self.cfg.speed_gflops is not None:
            return self.cfg.speed_gflops, ""
        from shardmesh.engine.speed import measure_gflops, speed_class

        gflops = measure_gflops(self.device)
        self.log.info("speed_measured", gflops=round(gflops, 1))
        return gflops, speed_class(self.device, device_pb(self.device).name)

    def _register(self) -> None:
        """Register, retrying while the coordinator starts; keeps our id so a restart takes its slot back.

        Also called when a heartbeat finds that the coordinator forgot us (it restarted): then the request
        carries the newest version we saw, so the new coordinator numbers its topologies after it, and the
        shard and groups we hold, so it can keep them (soft state) instead of reloading and re-forming."""
        labels = dict(self.cfg.labels)
        if self.metrics_address:
            labels[telemetry.METRICS_LABEL] = self.metrics_address
        latest = self._latest
        req = coordinator_pb2.RegisterRequest(address=self.address, device=device_pb(self.device),
                                              labels=labels, pid=os.getpid(),
                                              last_topology_version=latest.version if latest else 0,
                                              speed_gflops=self.speed[0], speed_class=self.speed[1])  # fmt: skip
        if self.worker_id:
            req.worker_id = self.worker_id
        held = self.core.held() if self.core is not None else None
        if held is not None:
            req.held.CopyFrom(held.to_pb())
        delay, said = 0.1, ""
        while not self.stopping.is_set():
            try:
                resp = self._coord.Register(req, timeout=5)
                break
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise RuntimeError(f"coordinator refused registration: {e.code().name}: {e.details()}") from None
                if e.code().name != said:  # not up yet, or refused at the TLS handshake: say so once, keep trying
                    said = e.code().name
                    self.log.warning("coordinator_unreachable", coordinator=self.cfg.coordinator, code=said,
                                     error=e.details())  # fmt: skip
                self.stopping.wait(delay)
                delay = min(2.0, delay * 2)
        else:
            return
        self.worker_id = resp.worker_id
        self.heartbeat_s = resp.heartbeat_interval.ToTimedelta().total_seconds() or 1.0
        log.bind_identity(worker_id=self.worker_id)
        if self.core is None:
            self.core = StageWorkerCore(self.worker_id, self.device, self.log, self.cfg.group_timeout_s,
                                        memory_budget=self.cfg.memory_budget,
                                        link_staging=self.cfg.link_staging,
                                        priority=self.cfg.compute_priority)  # fmt: skip
            self.core.on_cache_reset = self._heartbeat_once  # the coordinator must know before the calibration ends
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
            self.core.hand_off(topology)  # our slot went to another worker: our KV cache goes with it
            if should_exit(topology, self.worker_id):
                self.log.info("drained", worker_id=self.worker_id, version=topology.version)
                self.exit_requested.set()
                return
            self.core.apply(topology)
            self.core.prepare(topology)  # a spare asked to load a draining worker's slot ahead of the hand-over
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
                                               detail=i["detail"], kv_cache_id=i["kv_cache_id"])  # fmt: skip
        if core.prepared_rank is not None:
            req.prepared_rank = core.prepared_rank
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
