"""What every service serves at /metrics (`telemetry.serve_metrics`): its own `shardmesh_*` metrics and the standard
`process_*` ones, for the registries the gateway, a worker and the coordinator build (as their processes do)."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from shardmesh.core.topology import ShardState
from shardmesh.rpc import telemetry


def _gateway() -> Any:
    from gateway.observe import GatewayMetrics

    return GatewayMetrics(lambda: (0, 0, 4, True)).registry


def _worker() -> Any:
    from shardworker.metrics import WorkerMetrics

    # What a worker reports before it holds a shard.
    idle = {"weights_bytes": 0, "kv_cache_bytes": 0, "total_slots": 0, "free_slots": 0, "placement": None,
            "state": ShardState.PENDING}  # fmt: skip
    return WorkerMetrics(lambda: idle, lambda: "w0", "cpu").registry


def _coordinator() -> Any:
    from coordinator.metrics import CoordinatorCollector
    from tests.unit.coordinator.test_servicer import _registry

    registry = CollectorRegistry(auto_describe=True)  # as coordinator.process assembles it
    registry.register(CoordinatorCollector(_registry()))
    return registry


@pytest.mark.parametrize("build,own", [(_gateway, "shardmesh_kv_cache_usage_ratio"),
                                       (_worker, "shardmesh_process_resident_memory_bytes"),
                                       (_coordinator, "shardmesh_topology_version")])  # fmt: skip
def test_every_service_serves_the_process_metrics(build: Callable[[], Any], own: str) -> None:
    server = telemetry.serve_metrics(build(), "127.0.0.1", -1)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5) as r:
            text = r.read().decode()
    finally:
        server.shutdown()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["process_cpu_seconds_total"] > 0 and samples["process_resident_memory_bytes"] > 0
    assert samples["process_start_time_seconds"] > 0 and samples["process_open_fds"] > 0
    assert own in samples


def test_the_process_metrics_leave_the_service_registry_as_it_is() -> None:
    registry = _gateway()
    telemetry.exposition(registry)
    assert registry.get_sample_value("process_cpu_seconds_total") is None  # the service's own registry stays its own
    assert telemetry.exposition(registry).get_sample_value("process_cpu_seconds_total") > 0  # and can be served twice


def test_a_worker_counts_the_kv_bytes_it_moved_in_hand_overs() -> None:
    from shardworker.metrics import WorkerMetrics

    info = {"weights_bytes": 0, "kv_cache_bytes": 0, "total_slots": 0, "free_slots": 0, "placement": None,
            "state": ShardState.PENDING, "kv_moved_bytes": {"sent": 0, "received": 74304}}  # fmt: skip
    text = generate_latest(WorkerMetrics(lambda: info, lambda: "w0", "cpu").registry).decode()
    samples = {(s.name, s.labels.get("direction")): s.value for f in text_string_to_metric_families(text)
               for s in f.samples}  # fmt: skip
    assert samples[("shardmesh_kv_moved_bytes_total", "received")] == 74304
    assert samples[("shardmesh_kv_moved_bytes_total", "sent")] == 0


def test_a_worker_counts_the_weight_bytes_it_streamed() -> None:
    from shardworker.metrics import WorkerMetrics

    info = {"weights_bytes": 0, "kv_cache_bytes": 0, "total_slots": 0, "free_slots": 0, "placement": None,
            "state": ShardState.READY, "bytes_streamed": 3 * 1_179_648}  # fmt: skip
    text = generate_latest(WorkerMetrics(lambda: info, lambda: "w0", "cpu").registry).decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["shardmesh_offload_streamed_bytes_total"] == 3 * 1_179_648
