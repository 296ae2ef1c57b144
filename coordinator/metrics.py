"""The coordinator's Prometheus metrics, all read at scrape time from the registry and the current topology."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from coordinator.registry import Registry
from shardmesh.core.topology import ShardState, WorkerState


class CoordinatorCollector:
    def __init__(self, registry: Registry, clock: Any = time.monotonic) -> None:
        self._registry, self._clock = registry, clock

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        topology = self._registry.store.current()
        workers = self._registry.workers()
        now = self._clock()
        yield GaugeMetricFamily("shardmesh_topology_version", "Version of the published topology", topology.version)
        yield GaugeMetricFamily("shardmesh_topology_complete", "1 while every shard is READY", int(topology.complete))
        healthy = GaugeMetricFamily("shardmesh_worker_healthy", "1 while the worker's shard is READY",
                                    labels=["worker_id", "stage", "tp_rank", "address"])  # fmt: skip
        age = GaugeMetricFamily("shardmesh_worker_heartbeat_age_seconds", "Seconds since the worker's last heartbeat",
                                labels=["worker_id"])  # fmt: skip
        slots = GaugeMetricFamily("shardmesh_slots", "Shard slots by state", labels=["state"])
        counts = dict.fromkeys(["vacant", *(s.value for s in ShardState)], 0)
        placed = set()
        for stage, shard in topology.shards():
            if shard.vacant:
                counts["vacant"] += 1
                continue
            counts[shard.state.value] += 1
            placed.add(shard.worker_id)
            healthy.add_metric([shard.worker_id, str(stage.index), str(shard.tp_rank), shard.address],
                               int(shard.state is ShardState.READY))  # fmt: skip
        for worker_id, record in workers.items():
            if worker_id not in placed:  # a standby: healthy while it heartbeats
                healthy.add_metric([worker_id, "standby", "", record.address], int(not record.timed_out))
            age.add_metric([worker_id], max(0.0, now - record.last_seen))
        for state, n in counts.items():
            slots.add_metric([state], n)
        yield healthy
        yield age
        yield slots
        yield GaugeMetricFamily("shardmesh_registered_workers", "Workers registered (placed and standby)", len(workers))
        by_state = GaugeMetricFamily("shardmesh_workers", "Registered workers by state (serving, spare, loading, "
                                     "draining, lost)", labels=["state"])  # fmt: skip
        for state in WorkerState:
            by_state.add_metric([state.value], sum(1 for w in topology.workers if w.state is state))
        yield by_state
        yield GaugeMetricFamily("shardmesh_epoch", "Rendezvous epoch of the placement (0: none)", topology.epoch)
        changes = CounterMetricFamily("shardmesh_topology_changes", "New placements (rendezvous epochs), by what "
                                      "caused them: join, lost, drain, leave, replan, rebalance, resplit",
                                      labels=["reason"])  # fmt: skip
        for reason, n in sorted(self._registry.change_counts().items()):
            changes.add_metric([reason], n)
        yield changes
        yield from _balance(topology)


def _balance(topology: Any) -> Iterator[Any]:
    """The balance check of the current placement: its verdict, and each stage's measured time and layers."""
    from prometheus_client.core import GaugeMetricFamily

    c = topology.calibration
    yield GaugeMetricFamily("shardmesh_balance_passed", "1 when the balance check of the current placement passed",
                            int(topology.serving))  # fmt: skip
    yield GaugeMetricFamily("shardmesh_balance_stage_ratio", "Slowest stage's decode pass over the fastest's, as "
                            "last measured", c.stage_ratio)  # fmt: skip
    decode = GaugeMetricFamily("shardmesh_stage_decode_seconds", "Measured time of one decode pass of the stage "
                               "(balance check)", labels=["stage"])  # fmt: skip
    layers = GaugeMetricFamily("shardmesh_stage_layers", "Decoder layers the stage holds", labels=["stage"])
    for s in topology.stages:
        layers.add_metric([str(s.index)], s.num_layers)
    for s in c.stages:
        decode.add_metric([str(s.index)], s.decode_ms / 1000)
    yield decode
    yield layers
