"""The running gateway: `GatewayServer` owns everything with a life cycle: the topology watcher, the
scheduler thread, the failure reporter (`gateway.reporter`), the gRPC server (the servicer in
`gateway.servicer`) with health (SERVING only while a complete mesh can take requests) and reflection, and,
with `http_listen`, the OpenAI-compatible HTTP server (`gateway.openai_api` on uvicorn, `gateway.http_server`)
over the same scheduler.

Credentials: both front doors accept the same API keys (one `TokenSource`: gRPC checks them in the server's
interceptor, HTTP in its route dependency); with TLS files the gRPC port runs mutual TLS and HTTP is HTTPS; the
channels to the coordinator and the workers (one `Dial`) present the gateway's certificate and the join token.

At shutdown it turns NOT_SERVING and refuses new RPCs and HTTP connections at once; running requests get the
grace period to finish, then are cancelled (`gateway.servicer` and `gateway.openai_api` say what each returns
then).
"""

from __future__ import annotations

import socket
import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from gateway.observe import DEFAULT_TRACE_DECODE_STEPS, GatewayMetrics, GatewayObserver
from gateway.reporter import FailureReporter
from gateway.scheduler import Scheduler, SchedulerConfig
from gateway.service_name import SERVICE_NAME
from gateway.servicer import GatewayServicer
from gateway.watcher import MeshSource, TopologyWatcher
from shardmesh.proto.v1 import gateway_pb2_grpc
from shardmesh.rpc import server as rpc
from shardmesh.rpc import telemetry
from shardmesh.rpc.tls import Dial, TlsFiles
from shardmesh.rpc.tokens import TokenSource


@dataclass(frozen=True)
class GatewayConfig:
    listen: str  # host:port for gRPC; port 0 picks a free one
    coordinator: str  # host:port of the coordinator
    max_queue: int = 256
    max_message_bytes: int = 64 * 1024 * 1024
    default_max_new_tokens: int = 256
    step_timeout: float = 120.0
    resume_timeout: float = 60.0
    pipeline_depth: int = 0  # steps in flight at once; 0: one per pipeline stage
    decode_steps: int = 8  # decode steps per call with one step in flight, at most; 1: one per call
    admission_window: float = 0.002  # seconds a burst gathers after a step that took new requests in; 0: off
    prefix_caching: bool = True  # a paged mesh reuses the blocks of cached prompt prefixes
    shutdown_grace: float = 5.0
    model_dir: str | None = None  # where this gateway reads the tokenizer; default: the topology's model path
    metrics_port: int = 0  # 0: no metrics endpoint
    otlp_endpoint: str | None = None  # tracing is set up by the process (`app.run`); this is for the log line
    trace_decode_steps: int = DEFAULT_TRACE_DECODE_STEPS  # decode steps traced per request; later ones aggregated
    http_listen: str | None = None  # host:port of the OpenAI-compatible HTTP API; None: off; port 0 picks one
    served_model_name: str | None = None  # the model id over HTTP; default: the coordinator's name for the model
    api_key: str | None = None  # gRPC calls and HTTP requests to /v1 must carry `authorization: Bearer <key>`
    api_keys: TokenSource | None = None  # the keys accepted (`api_key` among them, and --api-key-file's); None: no key
    tls: TlsFiles | None = None  # mutual TLS on gRPC, both ways, and the certificate of HTTPS; None: plaintext
    join_token: str | None = field(default=None, repr=False)  # presented to the coordinator and the workers

    @property
    def thread_pool_size(self) -> int:
        """Every request holds a server thread while it waits or runs; threads are created on
        demand, so the bound only has to exceed queue + KV slots."""
        return self.max_queue + 1024


class GatewayServer:
    """The running gateway: `start()`, then `stop()` (from the main thread on a signal)."""

    def __init__(self, cfg: GatewayConfig, logger: Any, mesh_source: MeshSource | None = None) -> None:
        self.cfg = cfg
        self._log = logger
        tracer = telemetry.tracer()  # None unless the process set up tracing
        observer = None
        if tracer is not None or cfg.metrics_port:
            observer = GatewayObserver(tracer, None, cfg.trace_decode_steps)
        self.observer = observer
        self._dial = Dial(cfg.tls, cfg.join_token)
        self.reporter = FailureReporter(cfg.coordinator, logger, max_message_bytes=cfg.max_message_bytes,
                                        dial=self._dial)  # fmt: skip
        self.api_keys = cfg.api_keys or TokenSource.optional("API key", [cfg.api_key] if cfg.api_key else [])
        self.scheduler = Scheduler(
            SchedulerConfig(max_queue=cfg.max_queue, default_max_new_tokens=cfg.default_max_new_tokens,
                            step_timeout=cfg.step_timeout, resume_timeout=cfg.resume_timeout,
                            pipeline_depth=cfg.pipeline_depth, prefix_caching=cfg.prefix_caching,
                            decode_steps=cfg.decode_steps, admission_window=cfg.admission_window),
            logger, observer=observer, report_failure=self.reporter.report,
        )  # fmt: skip
        if observer is not None and cfg.metrics_port:
            observer.metrics = GatewayMetrics(self.scheduler.load, cfg.served_model_name, self.scheduler.block_stats)
        self._metrics_server: Any = None
        self.metrics_port = 0
        if mesh_source is None:
            watcher = TopologyWatcher(cfg.coordinator, logger=logger, max_message_bytes=cfg.max_message_bytes,
                                      model_dir=cfg.model_dir, dial=self._dial)  # fmt: skip
            watcher.report_failure = self.reporter.report
            mesh_source = watcher
        self.mesh_source: MeshSource = mesh_source
        self._health = health.HealthServicer(
            experimental_non_blocking=True, experimental_thread_pool=futures.ThreadPoolExecutor(max_workers=2)
        )
        self._health_lock = threading.Lock()
        self._stopping = threading.Event()
        self._server: grpc.Server | None = None
        self.port = 0
        self._openai: Any = None  # gateway.openai_api.OpenAIApi, with http_listen
        self._http: Any = None  # gateway.http_server.HttpServer, with http_listen
        self.http_port = 0

    def start(self) -> None:
        cfg = self.cfg
        server = rpc.new_server(SERVICE_NAME, self._health, cfg.max_message_bytes, cfg.thread_pool_size, self._log,
                                tokens=self.api_keys)  # fmt: skip
        servicer = GatewayServicer(self.scheduler, self._log, self.observer, cfg.served_model_name)
        gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
        self.port = rpc.bind(server, cfg.listen, cfg.tls, self._log)
        if self.observer is not None and self.observer.metrics is not None:
            self._metrics_server = telemetry.serve_metrics(
                self.observer.metrics.registry, cfg.listen.rpartition(":")[0].strip("[]"), cfg.metrics_port
            )
            self.metrics_port = self._metrics_server.server_port
        self._set_health(False)
        host = cfg.listen.rpartition(":")[0]
        shown = socket.gethostname() if host in ("", "0.0.0.0", "[::]") else host  # a wildcard names no one
        self.reporter.start(f"gateway {shown}:{self.port}")
        self.scheduler.add_ready_listener(self._set_health)
        self.scheduler.start()
        self.mesh_source.subscribe(self.scheduler.update_mesh)
        if self.observer is not None and self.observer.metrics is not None:  # the model_name label
            self.mesh_source.subscribe(self.observer.metrics.mesh_changed)
        self.mesh_source.start()
        server.start()
        self._server = server
        if cfg.http_listen is not None:
            self._start_http(cfg.http_listen)
        self._log.info("listening", address=f"{host}:{self.port}", port=self.port, coordinator=cfg.coordinator,
                       max_queue=cfg.max_queue, max_message_bytes=cfg.max_message_bytes,
                       pipeline_depth=cfg.pipeline_depth or "one per stage", decode_steps=cfg.decode_steps,
                       admission_window_s=cfg.admission_window,
                       metrics_port=self.metrics_port or "off",
                       http=self._http_url() or "off", api_key="required" if self.api_keys else "none",
                       tls="mutual" if cfg.tls else "off",
                       **telemetry.describe_tracing(cfg.otlp_endpoint))  # fmt: skip

    def _start_http(self, listen: str) -> None:
        """The OpenAI-compatible API on the same scheduler as gRPC (imported only when it is on)."""
        from gateway.http_server import HttpServer
        from gateway.openai_api import OpenAIApi

        cfg = self.cfg
        self._openai = OpenAIApi(self.scheduler, self._log, self.observer, cfg.served_model_name,
                                 max_threads=cfg.thread_pool_size, api_keys=self.api_keys)  # fmt: skip
        self._http = HttpServer(self._openai.app, listen, self._log, shutdown_timeout=cfg.shutdown_grace + 2.0,
                                tls=cfg.tls)  # fmt: skip
        self.http_port = self._http.start()

    def _http_url(self) -> str:
        if self._http is None or self.cfg.http_listen is None:
            return ""
        host = self.cfg.http_listen.rpartition(":")[0]
        scheme = "https" if self.cfg.tls else "http"
        return f"{scheme}://{host or '0.0.0.0'}:{self.http_port}/v1"

    def _set_health(self, ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        with self._health_lock:
            if self._stopping.is_set():
                return
            for service in ("", SERVICE_NAME):
                self._health.set(service, status)

    def stop(self, grace: float | None = None) -> None:
        """NOT_SERVING and refuse new RPCs at once; running requests get `grace` seconds to finish,
        then are cancelled (and released on every shard); exits within a few seconds after that."""
        grace = self.cfg.shutdown_grace if grace is None else grace
        with self._health_lock:
            if self._stopping.is_set():
                return
            self._stopping.set()
            self._health.enter_graceful_shutdown()
        self._log.info("shutdown_started", grace_s=grace)
        stopped = self._server.stop(grace + 2.0) if self._server is not None else None
        if self._http is not None:
            self._http.begin_stop()
        self.scheduler.shutdown(grace)
        self.reporter.stop()
        self.mesh_source.stop()
        if stopped is not None:
            stopped.wait(grace + 3.0)
        if self._http is not None:
            self._http.join(grace + 3.0)
            self._openai.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        self._log.info("shutdown_complete")
