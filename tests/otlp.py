"""Tiny OTLP trace receivers for tests, on 127.0.0.1: gRPC (`TraceService/Export`, the
`opentelemetry-proto` package's generated stubs) and HTTP (`POST /v1/traces`, protobuf body), both
decoding into flat `Span` records; plus a text waterfall of one trace."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class Span:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    status: int  # 0 unset, 1 ok, 2 error
    events: tuple[str, ...]
    via: str  # "grpc" | "http": which receiver got it

    @property
    def service(self) -> str:
        return str(self.resource.get("service.name", ""))

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attrs(kvs: Iterable[Any]) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class Collector:
    """Spans from every receiver, thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[Span] = []

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest, via: str) -> None:
        out = []
        for rs in request.resource_spans:
            resource = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    out.append(Span(s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name,
                                    s.start_time_unix_nano, s.end_time_unix_nano, _attrs(s.attributes), resource,
                                    s.status.code, tuple(e.name for e in s.events), via))  # fmt: skip
        with self._lock:
            self._spans.extend(out)

    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, predicate: Callable[[list[Span]], bool], timeout: float = 20.0) -> list[Span]:
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans()
            if predicate(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, collector: Collector) -> None:
        self.collector = collector

    def Export(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.collector.add(request, "grpc")
        return trace_service_pb2.ExportTraceServiceResponse()


class GrpcReceiver:
    def __init__(self, collector: Collector) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(collector), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.stop(0)


class HttpReceiver:
    def __init__(self, collector: Collector) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces" or "protobuf" not in self.headers.get("Content-Type", ""):
                    self.send_response(404)
                    self.end_headers()
                    return
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                collector.add(request, "http")
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _label(s: Span) -> str:
    a = s.attributes
    if s.name == "worker.step":
        ms = {k: a.get(f"shardmesh.{k}", 0) for k in ("step.compute_ms", "link.recv_wait_ms", "link.send_ms",
                                                      "tp.collective_ms")}  # fmt: skip
        return (f"worker.step s{a.get('shardmesh.stage')} tp{a.get('shardmesh.tp_rank')} "
                f"L{a.get('shardmesh.layer_start')}-{a.get('shardmesh.layer_end', 1) - 1}: "
                f"compute {ms['step.compute_ms']:.1f}, recv wait {ms['link.recv_wait_ms']:.1f} "
                f"({a.get('shardmesh.link.bytes_in', 0)} B), send {ms['link.send_ms']:.1f} "
                f"({a.get('shardmesh.link.bytes_out', 0)} B), tp {ms['tp.collective_ms']:.1f} ms")  # fmt: skip
    if s.name.startswith("step."):
        return f"{s.name} #{a.get('shardmesh.step_id')} ({a.get('shardmesh.entry.tokens')} tokens)"
    return s.name


def waterfall(spans: list[Span], trace_id: str, width: int = 32) -> str:
    """One trace as text: offset from its first span, duration, a bar, and the tree by indentation."""
    mine = [s for s in spans if s.trace_id == trace_id]
    if not mine:
        return ""
    t0 = min(s.start_ns for s in mine)
    total = max(s.end_ns for s in mine) - t0 or 1
    children: dict[str, list[Span]] = {}
    ids = {s.span_id for s in mine}
    for s in mine:
        children.setdefault(s.parent_id if s.parent_id in ids else "", []).append(s)
    lines = [f"{'offset':>9} {'duration':>9}  {'':{width}}  span (service)"]

    def walk(parent: str, depth: int) -> None:
        def order(x: Span) -> tuple[int, int, int]:
            return x.start_ns, x.attributes.get("shardmesh.stage", 0), x.attributes.get("shardmesh.tp_rank", 0)

        for s in sorted(children.get(parent, []), key=order):
            a = int(width * (s.start_ns - t0) / total)
            b = max(a + 1, int(width * (s.end_ns - t0) / total))
            bar = " " * a + "#" * (b - a) + " " * (width - b)
            lines.append(f"{(s.start_ns - t0) / 1e6:7.2f}ms {s.duration_ms:7.2f}ms  {bar}  {'  ' * depth}"
                         f"{_label(s)} ({s.service})")  # fmt: skip
            walk(s.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)
