"""Traces and metrics for every shardmesh service: one setup, shared by coordinator, workers and gateway.

**Traces** are OpenTelemetry spans exported over OTLP (gRPC or HTTP/protobuf). Tracing is on only when
an exporter is configured, by `--otlp-endpoint` or by the standard variables:

- `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`: where to send (an endpoint
  configured this way, or by the flag, turns tracing on);
- `OTEL_EXPORTER_OTLP_PROTOCOL` / `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`: `grpc` (default) or `http/protobuf`;
- `OTEL_TRACES_EXPORTER`: `otlp`, `console` (spans as JSON on stdout) or `none` (off whatever else is set);
  unlike the SDK's own default (`otlp`), unset means "only if an endpoint is configured", so a service
  without a collector never spends a cycle on spans;
- `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER(_ARG)`, `OTEL_BSP_*`,
  `OTEL_PROPAGATORS`, `OTEL_EXPORTER_OTLP_HEADERS` and the rest are read by the SDK as usual;
  `OTEL_SDK_DISABLED=true` turns everything off.

When tracing is off, `tracer()` is None and callers skip all span work with one test; nothing is
imported from the OpenTelemetry SDK.

Trace context travels in gRPC metadata as W3C `traceparent` / `tracestate` (the configured
propagators). One gateway step serves several requests, each with its own trace; the Step RPC then
carries every traced request's step span: the first as `traceparent`, all of them in
`shardmesh-traceparents` (comma-separated `traceparent` values), and a worker records one span per
parent (see README, "Observability").

**Metrics** are Prometheus text exposition on `http://HOST:PORT/metrics` (`--metrics-port`, 0 = off,
-1 = a free port the OS picks: workers publish theirs in the topology), one registry per process;
the metric objects live next to the code they measure (gateway/observe.py, shardworker/metrics.py,
coordinator/metrics.py), and `serve_metrics` adds the standard `process_*` collector to each.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

TRACEPARENTS_KEY = "shardmesh-traceparents"  # every parent of a batched step, for the workers
METRICS_LABEL = "metrics"  # the registration label a worker publishes its metrics host:port under
EXPORTERS = ("otlp", "console")
PROTOCOLS = ("grpc", "http/protobuf")

_tracer: Any = None  # opentelemetry.trace.Tracer while tracing is on
_provider: Any = None  # opentelemetry.sdk.trace.TracerProvider


def add_flags(flag: Callable[..., None]) -> None:
    """`--otlp-endpoint` and `--metrics-port`, for a service's `env_flags`-style `flag` function."""
    flag("--otlp-endpoint", help="send traces over OTLP to this endpoint: http://HOST:4317 for gRPC, or "
                                 "http://HOST:4318 with OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf (default: the "
                                 "OTEL_EXPORTER_OTLP_* variables; tracing is off when neither is set)")  # fmt: skip
    flag("--metrics-port", 0, type=int,
         help="serve Prometheus metrics on this port at /metrics (0 = off, the default; -1 = any free port, logged, "
              "and published in the topology by workers)")  # fmt: skip


class TelemetryConfigError(ValueError):
    """A bad tracing or metrics setting, named."""


@dataclass(frozen=True)
class ExportConfig:
    """Which span exporters to build. `endpoint` None: the OTLP exporter reads the OTEL_* variables itself."""

    exporters: tuple[str, ...]
    protocol: str
    endpoint: str | None


def export_config(endpoint_flag: str | None, env: Mapping[str, str] = os.environ) -> ExportConfig | None:
    """What to export, from the flag and the environment; None when tracing is off."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    names = tuple(n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip())
    if "none" in names:
        return None
    configured = (
        endpoint_flag or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )
    if not names:
        if not configured:
            return None
        names = ("otlp",)
    unknown = sorted(set(names) - set(EXPORTERS))
    if unknown:
        raise TelemetryConfigError(f"OTEL_TRACES_EXPORTER: unsupported {unknown}; expected otlp, console or none")
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    protocol = protocol.strip()
    if protocol not in PROTOCOLS:
        raise TelemetryConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL: must be grpc or http/protobuf, got {protocol!r}")
    endpoint = None
    if endpoint_flag:
        endpoint = endpoint_flag if "://" in endpoint_flag else f"http://{endpoint_flag}"
        parsed = urlparse(endpoint)
        if not parsed.hostname or parsed.scheme not in ("http", "https"):
            raise TelemetryConfigError(f"--otlp-endpoint: expected [http[s]://]HOST:PORT, got {endpoint_flag!r}")
        if protocol == "http/protobuf" and parsed.path in ("", "/"):
            endpoint = endpoint.rstrip("/") + "/v1/traces"  # the flag names the collector, as the variable does
    return ExportConfig(names, protocol, endpoint)


def setup_tracing(service: str, endpoint: str | None = None, **resource: Any) -> bool:
    """Configure this process's tracer for `service` ("gateway", "worker", ...); True when tracing is on."""
    global _tracer, _provider
    cfg = export_config(endpoint)
    if cfg is None:
        return False
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {"service.namespace": "shardmesh", "process.pid": os.getpid(), **resource}
    if not os.environ.get("OTEL_SERVICE_NAME"):  # the variable wins over our default name
        attributes["service.name"] = f"shardmesh-{service}"
    provider = TracerProvider(resource=Resource.create(attributes))  # sampler: OTEL_TRACES_SAMPLER, parent-based
    for name in cfg.exporters:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name, cfg)))
    trace.set_tracer_provider(provider)
    _provider, _tracer = provider, provider.get_tracer("shardmesh")
    return True


def _exporter(name: str, cfg: ExportConfig) -> Any:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if cfg.protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter(endpoint=cfg.endpoint)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

    return GrpcExporter(endpoint=cfg.endpoint)


def tracer() -> Any:
    """The process's tracer, or None when tracing is off (the one test hot paths make)."""
    return _tracer


def shutdown_tracing() -> None:
    """Export what is still buffered, then stop; called when a service stops."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


def describe_tracing(endpoint: str | None) -> dict[str, Any]:
    """For the service's `listening` log line."""
    try:
        cfg = export_config(endpoint)
    except TelemetryConfigError as e:
        return {"tracing": f"error: {e}"}
    if cfg is None:
        return {"tracing": "off"}
    return {"tracing": ",".join(cfg.exporters), "otlp_protocol": cfg.protocol, "otlp_endpoint": cfg.endpoint or "env"}


# -- propagation -------------------------------------------------------------------------------------------


def _carrier(metadata: Iterable[tuple[str, Any]] | None) -> dict[str, str]:
    return {k: v for k, v in (metadata or ()) if isinstance(v, str)}


def extract(metadata: Iterable[tuple[str, Any]] | None) -> Any:
    """The caller's trace context from gRPC metadata (an empty context when there is none)."""
    from opentelemetry import propagate

    return propagate.extract(_carrier(metadata))


def inject(span: Any) -> list[tuple[str, str]]:
    """gRPC metadata that makes `span` the parent of what the callee records."""
    from opentelemetry import propagate, trace

    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return list(carrier.items())


def traceparent(span: Any) -> str:
    """The W3C `traceparent` value naming `span`."""
    c = span.get_span_context()
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"


def step_metadata(spans: Sequence[Any]) -> list[tuple[str, str]]:
    """Metadata for a Step RPC serving several traced requests: the first span as the standard parent,
    every one of them under `shardmesh-traceparents`."""
    metadata = inject(spans[0])
    if len(spans) > 1:
        metadata.append((TRACEPARENTS_KEY, ",".join(traceparent(s) for s in spans)))
    return metadata


def step_parents(metadata: Iterable[tuple[str, Any]] | None) -> list[Any]:
    """The contexts a worker's step span(s) belong under: one per traced request of the step; empty
    for a step nobody traces (the worker then records nothing)."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = _carrier(metadata)
    listed = carrier.get(TRACEPARENTS_KEY)
    if listed:
        w3c = TraceContextTextMapPropagator()
        contexts = [w3c.extract({"traceparent": value.strip()}) for value in listed.split(",")]
    else:
        contexts = [extract(carrier.items())]
    return [c for c in contexts if trace.get_current_span(c).get_span_context().is_valid]


def parse_trace_id(value: str | None) -> str | None:
    """The trace id (32 hex digits) of a W3C `traceparent` value, or None when it is not one."""
    if not value:
        return None
    parts = value.strip().split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or parts[1] == "0" * 32:
        return None
    try:
        int(parts[1], 16)
    except ValueError:
        return None
    return parts[1].lower()


def client_trace_id(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The trace id of the caller's `traceparent`, read without the SDK (tracing may be off)."""
    for key, value in metadata or ():
        if key == "traceparent" and isinstance(value, str):
            return parse_trace_id(value)
    return None


def new_trace_id() -> str:
    return secrets.token_hex(16)


def span_trace_id(span: Any) -> str:
    return f"{span.get_span_context().trace_id:032x}"


def now_ns() -> int:
    import time

    return time.time_ns()


# -- metrics -----------------------------------------------------------------------------------------------


def exposition(registry: Any) -> Any:
    """What a service serves: its own metrics (`registry`) and Prometheus' standard `process_*` ones (CPU
    seconds, resident and virtual memory, open file descriptors, start time), as every exporter has them."""
    from prometheus_client import CollectorRegistry, ProcessCollector

    served = CollectorRegistry()
    served.register(registry)  # a registry collects like any collector
    ProcessCollector(registry=served)
    return served


def serve_metrics(registry: Any, host: str, port: int) -> Any:
    """Serve `registry` and the process metrics (`exposition`) at http://host:port/metrics on a daemon thread;
    returns the server (`.shutdown()`)."""
    from prometheus_client import start_http_server

    try:
        server, _ = start_http_server(max(port, 0), addr=host or "0.0.0.0", registry=exposition(registry))
    except OSError as e:
        raise RuntimeError(f"--metrics-port: cannot listen on {host}:{port}: {e}") from None
    return server


def check_metrics_port(port: int) -> None:
    if not -1 <= port <= 65535:
        raise TelemetryConfigError(f"--metrics-port: must be in 0..65535 (0 = off) or -1 (any free port), got {port}")


# Histogram buckets (seconds): what each kind of latency spans on CPU and GPU meshes alike.
LINK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
