"""The running coordinator: `CoordinatorServer` owns everything with a life cycle: the c10d TCPStore workers
rendezvous on, the registry, the gRPC server (the servicer in `coordinator.servicer`) with health and
reflection, the thread that notices silent workers, and the balance check before serving.
"""

from __future__ import annotations

import functools
import threading
from concurrent import futures
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from coordinator.calibration import CalibrationConfig, Calibrator, memory_caps
from coordinator.placement import Labels, Split
from coordinator.registry import Registry
from coordinator.replan import planner_check
from coordinator.servicer import SERVICE_NAME, CoordinatorServicer, unreachable
from shardmesh.core.topology import ModelSpec, ServingLimits, Topology
from shardmesh.proto.v1 import coordinator_pb2_grpc
from shardmesh.rpc import server as rpc
from shardmesh.rpc import telemetry
from shardmesh.rpc.tls import Dial, TlsFiles
from shardmesh.rpc.tokens import TokenSource


@dataclass(frozen=True)
class CoordinatorConfig:
    listen: str  # host:port for gRPC; port 0 picks a free one
    model: ModelSpec
    pp: int
    tp: int
    limits: ServingLimits
    heartbeat_interval: float  # seconds
    heartbeat_timeout: float  # seconds without a heartbeat before a worker is UNHEALTHY
    store_host: str  # host workers reach the rendezvous store at
    store_port: int = 0  # 0 picks a free one
    max_message_bytes: int = 64 * 1024 * 1024
    metrics_port: int = 0  # 0: no metrics endpoint
    otlp_endpoint: str | None = None
    split: Split | None = None  # layer range per stage; None: even
    requires: tuple[Labels, ...] | None = None  # labels each rank's worker must have (from a manifest's plan)
    tp_split: tuple[int, ...] = ()  # each tp rank's share of the MLP columns and vocabulary (--tp-split); () even
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    # How long a (re)started coordinator waits for workers to claim back the slots they hold before it
    # places anyone else there; the first established placement ends it early.
    recovery_grace: float = 0.0
    # Seconds a slot may have nobody serving it (a lost worker, no spare) before the model is re-planned onto
    # the healthy workers; a drain without a spare re-plans at once. Negative: never re-plan.
    replan_after: float = 10.0
    # Moving a slot onto a faster spare: the least predicted speed-up (0: never), and seconds between two moves.
    rebalance_gain: float = 1.3
    rebalance_interval: float = 30.0
    # Mutual TLS on the gRPC port and on the channels to the workers (None: plaintext); the join tokens a worker or
    # gateway must present (None: none needed), and the one presented to the workers.
    tls: TlsFiles | None = None
    join_tokens: TokenSource | None = None
    join_token: str | None = field(default=None, repr=False)

    @property
    def thread_pool_size(self) -> int:
        """Every open WatchTopology stream holds a server thread, and one watch per worker (plus
        gateways) is normal: size the pool so watches never starve heartbeats."""
        return 32 + 2 * self.pp * self.tp


class CoordinatorServer:
    """The running coordinator: `start()`, then `stop()` (from a signal handler's thread of control)."""

    def __init__(self, cfg: CoordinatorConfig, logger: Any) -> None:
        self.cfg = cfg
        self._log = logger
        self._stopping = threading.Event()
        self._store: Any = None  # torch.distributed.TCPStore, kept alive while we serve
        self._server: grpc.Server | None = None
        self._health = health.HealthServicer(
            experimental_non_blocking=True, experimental_thread_pool=futures.ThreadPoolExecutor(max_workers=2)
        )
        self._monitor: threading.Thread | None = None
        self._metrics_server: Any = None
        self.registry: Registry | None = None
        self.calibrator: Calibrator | None = None
        self.port = 0
        self.metrics_port = 0

    def start(self) -> None:
        import torch.distributed as dist  # heavy import, only where the store is made

        cfg = self.cfg
        self._store = dist.TCPStore(cfg.store_host, cfg.store_port, None, True,
                                    timeout=timedelta(seconds=60), wait_for_workers=False)  # fmt: skip
        self.registry = Registry(
            model=cfg.model, pp=cfg.pp, tp=cfg.tp, limits=cfg.limits, store_host=cfg.store_host,
            store_port=self._store.port, heartbeat_timeout=cfg.heartbeat_timeout, split=cfg.split,
            requires=cfg.requires, tp_split=cfg.tp_split, logger=self._log, recovery_grace=cfg.recovery_grace,
            memory_check=planner_check(cfg.model, cfg.limits, cfg.tp, cfg.tp_split) if cfg.replan_after >= 0 else None,
            replan_after=max(0.0, cfg.replan_after), rebalance_gain=cfg.rebalance_gain,
            rebalance_interval=cfg.rebalance_interval,
        )  # fmt: skip
        # Every method but GetTopology (read-only, for `shardmesh status` and `top`) needs the join token.
        server = rpc.new_server(SERVICE_NAME, self._health, cfg.max_message_bytes, cfg.thread_pool_size, self._log,
                                tokens=cfg.join_tokens, open_methods=("GetTopology",))  # fmt: skip
        dial = Dial(cfg.tls, cfg.join_token, tuple(rpc.message_options(cfg.max_message_bytes)))
        probe = functools.partial(unreachable, dial=dial.channel)
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(
            CoordinatorServicer(self.registry, cfg.heartbeat_interval, self._log, probe=probe), server
        )
        self.port = rpc.bind(server, cfg.listen, cfg.tls, self._log)
        if cfg.metrics_port:
            self._start_metrics(cfg.listen.rpartition(":")[0].strip("[]"), cfg.metrics_port)
        server.start()
        self._server = server
        for service in ("", SERVICE_NAME):
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._monitor = threading.Thread(target=self._watch_heartbeats, name="heartbeat-monitor", daemon=True)
        self._monitor.start()
        self.calibrator = Calibrator(self.registry, cfg.calibration, self._log, cfg.max_message_bytes, self._caps,
                                     dial=dial.channel)  # fmt: skip
        self.calibrator.start()
        host = cfg.listen.rpartition(":")[0]
        self._log.info(
            "listening", address=f"{host}:{self.port}", port=self.port, store_host=cfg.store_host,
            store_port=self._store.port, pp=cfg.pp, tp=cfg.tp, model=cfg.model.path, dtype=cfg.model.dtype,
            served_model_name=cfg.model.name, heartbeat_interval_s=cfg.heartbeat_interval,
            heartbeat_timeout_s=cfg.heartbeat_timeout,
            metrics_port=self.metrics_port or "off", layers=[list(r) for r in self.registry.split()],
            rank_nodes=[dict(r).get("node", "") for r in cfg.requires] if cfg.requires else None,
            rebalance=cfg.calibration.rebalance, max_stage_ratio=cfg.calibration.max_stage_ratio,
            require_balance=cfg.calibration.require_balance, tls="mutual" if cfg.tls else "off",
            join_token="required" if cfg.join_tokens else "off", **telemetry.describe_tracing(cfg.otlp_endpoint),
        )  # fmt: skip

    def _start_metrics(self, host: str, port: int) -> None:
        from prometheus_client import CollectorRegistry

        from coordinator.metrics import CoordinatorCollector

        assert self.registry is not None
        registry = CollectorRegistry(auto_describe=True)
        registry.register(CoordinatorCollector(self.registry))
        self._metrics_server = telemetry.serve_metrics(registry, host, port)
        self.metrics_port = self._metrics_server.server_port

    def _caps(self, t: Topology) -> list[int] | None:
        assert self.registry is not None
        workers = self.registry.workers().values()
        return memory_caps(t, {w.worker_id: w.device.memory_bytes for w in workers},
                           {w.worker_id: w.device.type for w in workers})  # fmt: skip

    def _watch_heartbeats(self) -> None:
        assert self.registry is not None
        period = min(1.0, max(0.02, self.cfg.heartbeat_timeout / 8))
        while not self._stopping.wait(period):
            self.registry.expire()

    def stop(self, grace: float = 2.0) -> None:
        """NOT_SERVING first (so load balancers and workers look elsewhere), end the watch streams,
        then let in-flight unary calls finish for up to `grace` seconds."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._log.info("shutdown_started", grace_s=grace)
        self._health.enter_graceful_shutdown()
        if self.registry is not None:
            self.registry.store.close()
        if self.calibrator is not None:
            self.calibrator.stop()
        if self._server is not None:
            self._server.stop(grace).wait(grace + 1.0)
        if self._monitor is not None:
            self._monitor.join(timeout=1.0)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        telemetry.shutdown_tracing()
        self._log.info("shutdown_complete")
