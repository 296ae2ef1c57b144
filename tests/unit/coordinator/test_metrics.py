"""The coordinator's Prometheus metrics read from the registry: workers by state, the epoch, and new placements
counted by what caused them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from coordinator.metrics import CoordinatorCollector
from tests.unit.coordinator.test_servicer import _register, _registry


def test_workers_by_state_epoch_and_topology_changes() -> None:
    reg = _registry()
    for i in range(3):
        _register(reg, i)
    reg.report_lost(["w0"], "step failed")
    metrics = CollectorRegistry()
    metrics.register(CoordinatorCollector(reg))

    def value(name: str, **labels: str) -> float | None:
        return metrics.get_sample_value(name, labels)

    assert value("shardmesh_workers", state="lost") == 1 and value("shardmesh_workers", state="spare") == 0
    assert value("shardmesh_workers", state="loading") == 2
    assert value("shardmesh_epoch") == reg.store.current().epoch > 0
    assert value("shardmesh_topology_changes_total", reason="join") == 1
    assert value("shardmesh_topology_changes_total", reason="lost") == 1
