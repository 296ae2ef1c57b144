"""A stage worker's Prometheus metrics and per-step trace spans.

Metrics (registry served by `--metrics-port`): counters are fed once per step from the step's
`CommCounters` (never per tensor), memory and slots are read at scrape time. Nothing here runs when
metrics and tracing are off: the servicer holds None instead of these objects.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

from shardmesh.core.step import StepEntry
from shardmesh.rpc import telemetry
from shardworker.runtime import StepResult

MEMORY_KINDS = ("weights", "kv_cache", "other", "free")


class WorkerMetrics:
    def __init__(self, info: Callable[[], dict[str, Any]], worker_id: Callable[[], str], device: str) -> None:
        """`device`: the worker's, "cpu" or "cuda:N" (its memory is the one reported)."""
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.step_seconds = Histogram("shardmesh_worker_step_seconds", "One step on this shard, communication included",
                                      registry=r, buckets=telemetry.STEP_BUCKETS)  # fmt: skip
        self.phase_seconds = Counter("shardmesh_worker_step_phase_seconds", "Step time by phase", ["phase"], registry=r)
        self.step_failures = Counter(
            "shardmesh_worker_step_failures", "Steps refused or failed", ["reason"], registry=r
        )
        self.step_tokens = Counter("shardmesh_worker_step_tokens", "Tokens run through this shard", registry=r)
        labels = ["direction", "peer_stage"]
        self.link_bytes = Counter("shardmesh_link_bytes", "Activation bytes over pipeline links", labels, registry=r)
        self.link_messages = Counter("shardmesh_link_messages", "Activation messages over pipeline links", labels,
                                     registry=r)  # fmt: skip
        self.link_seconds = Histogram(
            "shardmesh_link_transfer_seconds",
            "Per message: sending until complete (sent), waiting for it to arrive (received: upstream compute "
            "+ transfer)",
            labels, registry=r, buckets=telemetry.LINK_BUCKETS,
        )  # fmt: skip
        self.collective_seconds = Counter("shardmesh_collective_seconds", "Tensor-parallel collectives, until complete",
                                          registry=r)  # fmt: skip
        self.collective_bytes = Counter(
            "shardmesh_collective_bytes", "Bytes this rank put into collectives", registry=r
        )
        self.collective_calls = Counter("shardmesh_collective_calls", "Tensor-parallel collectives run", registry=r)
        r.register(_ShardCollector(info, worker_id, device))

    def observe(self, result: StepResult, tokens: int) -> None:
        c, stage, stages = result.comm, result.placement.stage, result.placement.num_stages
        self.step_seconds.observe(result.elapsed_s)
        self.step_tokens.inc(tokens)
        for phase, seconds in (("compute", result.compute_s), ("recv_wait", c.recv_wait_s), ("send", c.send_s),
                               ("collective", c.collective_s)):  # fmt: skip
            if seconds:
                self.phase_seconds.labels(phase).inc(seconds)
        # A ring: the first stage receives from the last, and the last sends to the first, over the loop that
        # carries drawn tokens in calls of several decode steps (`ShardGroups.loop`).
        if c.recv_messages:
            peer = str((stage - 1) % stages)
            self.link_bytes.labels("received", peer).inc(c.recv_bytes)
            self.link_messages.labels("received", peer).inc(c.recv_messages)
            self.link_seconds.labels("received", peer).observe(c.recv_wait_s / c.recv_messages)
        if c.send_messages:
            peer = str((stage + 1) % stages)
            self.link_bytes.labels("sent", peer).inc(c.send_bytes)
            self.link_messages.labels("sent", peer).inc(c.send_messages)
            self.link_seconds.labels("sent", peer).observe(c.send_s / c.send_messages)
        if c.collective_calls:
            self.collective_seconds.inc(c.collective_s)
            self.collective_bytes.inc(c.collective_bytes)
            self.collective_calls.inc(c.collective_calls)

    def failed(self, reason: str) -> None:
        self.step_failures.labels(reason).inc()


class _ShardCollector:
    """Read at scrape time: memory by kind, KV slots, and which shard this is."""

    def __init__(self, info: Callable[[], dict[str, Any]], worker_id: Callable[[], str], device: str) -> None:
        import psutil

        self._info, self._worker_id, self._device = info, worker_id, device
        self._process = psutil.Process(os.getpid())

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        import psutil
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        i = self._info()
        rss = self._process.memory_info().rss
        weights, kv = int(i["weights_bytes"]), int(i["kv_cache_bytes"])
        if self._device.startswith("cuda"):  # the shard lives in device memory; RSS is reported on its own
            import torch

            # This worker's GPU, named: the scrape runs on a server thread, whose current device need not be it.
            device = torch.device(self._device)
            free, _ = torch.cuda.mem_get_info(device)
            used = torch.cuda.memory_reserved(device)
        else:
            free, used = psutil.virtual_memory().available, rss
        kind_of_device = self._device.partition(":")[0]  # the same help text on every worker of a kind
        memory = GaugeMetricFamily("shardmesh_shard_memory_bytes",
                                   f"Shard memory by kind on its device ({kind_of_device}); other = used - weights - "
                                   "kv_cache (used: process RSS on CPU, reserved memory on CUDA); free = available",
                                   labels=["kind"])  # fmt: skip
        for kind, value in zip(MEMORY_KINDS, (weights, kv, used - weights - kv, free), strict=True):
            memory.add_metric([kind], value)
        yield memory
        yield GaugeMetricFamily("shardmesh_process_resident_memory_bytes", "Resident set size of this process", rss)
        slots = GaugeMetricFamily("shardmesh_kv_slots", "KV-cache slots by state", labels=["state"])
        slots.add_metric(["used"], i["total_slots"] - i["free_slots"])
        slots.add_metric(["free"], i["free_slots"])
        yield slots
        yield from _kv_cache(i)
        info = GaugeMetricFamily("shardmesh_shard_info", "The shard this worker holds (value 1)",
                                 labels=["worker_id", "state", "stage", "layer_start", "layer_end", "tp_rank",
                                         "tp_size"])  # fmt: skip
        p = i["placement"]
        where = (
            [str(p.stage), str(p.spec.layer_start), str(p.spec.layer_end), str(p.spec.tp_rank), str(p.spec.tp_size)]
            if p is not None else ["", "", "", "", ""]
        )  # fmt: skip
        info.add_metric([self._worker_id(), i["state"].value, *where], 1)
        yield info
        moved = CounterMetricFamily("shardmesh_kv_moved_bytes", "KV-cache bytes moved to or from another worker when "
                                    "a slot was handed over (instead of replaying)", labels=["direction"])  # fmt: skip
        for direction, value in sorted(i.get("kv_moved_bytes", {}).items()):
            moved.add_metric([direction], value)
        yield moved
        yield from _offload(i)


def _kv_cache(i: dict[str, Any]) -> Iterator[Any]:
    """The KV cache as this shard allocated it: its bytes by part, and with a paged cache its blocks (the total:
    which blocks are used or hold a cached prefix is the gateway's to say, it hands them out)."""
    from prometheus_client.core import GaugeMetricFamily

    nbytes = GaugeMetricFamily("shardmesh_kv_cache_bytes", "KV-cache memory this shard allocated, by part: keys and "
                               "values, and the activation log (what it sent on, kept for replays; not on the last "
                               "stage)", labels=["part"])  # fmt: skip
    nbytes.add_metric(["keys_values"], i.get("kv_cache_bytes", 0))
    nbytes.add_metric(["activation_log"], i.get("activation_log_bytes", 0))
    yield nbytes
    if i.get("kv_blocks"):
        blocks = GaugeMetricFamily("shardmesh_kv_blocks", "Paged KV-cache blocks by state (the worker knows the "
                                   "total; the gateway, which hands them out, reports used and cached)",
                                   labels=["state"])  # fmt: skip
        blocks.add_metric(["total"], i["kv_blocks"])
        yield blocks
        yield GaugeMetricFamily("shardmesh_kv_block_tokens", "Positions per block of the paged KV cache",
                                i["kv_block_size"])  # fmt: skip


def _offload(i: dict[str, Any]) -> Iterator[Any]:
    """A worker over its memory budget (`shardmesh.engine.offload`): the bytes it streams, how fast its reads
    bring them in, how long the compute waits for them, and the read rate measured at load to compare with."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    yield CounterMetricFamily("shardmesh_offload_streamed_bytes", "Weight bytes of the layers beyond the memory "
                              "budget, streamed from the checkpoint (per step: the streamed layers' product "
                              "weights, each once)", i.get("bytes_streamed", 0))  # fmt: skip
    s = i.get("offload")  # an `offload.StreamStats`; None: nothing streams
    if s is None:
        return
    yield CounterMetricFamily("shardmesh_offload_read_bytes", "Weight bytes the streamer's reads brought in "
                              "(mapped in, or copied into its buffers; on CUDA, the copies not replayed from a "
                              "graph)", s.read_bytes)  # fmt: skip
    yield CounterMetricFamily("shardmesh_offload_read_seconds", "Time those reads took (read bytes / read seconds: "
                              "the achieved streaming rate)", s.read_seconds)  # fmt: skip
    yield CounterMetricFamily("shardmesh_offload_wait_seconds", "Time the compute thread waited for a streamed "
                              "layer's read", s.wait_seconds)  # fmt: skip
    yield GaugeMetricFamily("shardmesh_offload_bound_bytes_per_second", "The bound: the same reads' rate measured "
                            "at load with the checkpoint in the page cache (the hot rate; a cold file reads at the "
                            "disk's; on CUDA, the pinned host-to-device copy rate)",
                            s.bound_bytes_per_second)  # fmt: skip
    yield GaugeMetricFamily("shardmesh_offload_planned_bytes_per_step", "Bytes the plan streams per forward",
                            s.planned_bytes_per_step)  # fmt: skip
    yield GaugeMetricFamily("shardmesh_offload_huge_pages", "1 when the streamed layers map in huge pages",
                            int(s.huge_pages))  # fmt: skip


def record_step_spans(
    tracer: Any, parents: list[Any], start_ns: int, end_ns: int, worker_id: str, step_id: int, topology_version: int,
    entries: list[StepEntry], result: StepResult | None, error: str = "", after_step_id: int = 0,
    order_wait_s: float = 0.0,
) -> None:  # fmt: skip
    """One `worker.step` span under each traced request's gateway step span (same numbers in each:
    they are one step of one batch). The span starts when the RPC arrived; with steps in flight
    together it first waits `order_wait_s` for its turn (`after_step_id` to finish here)."""
    from opentelemetry.trace import SpanKind, Status, StatusCode

    attributes: dict[str, Any] = {
        "shardmesh.worker_id": worker_id, "shardmesh.step_id": step_id,
        "shardmesh.topology_version": topology_version, "shardmesh.batch.entries": len(entries),
        "shardmesh.batch.tokens": sum(e.num_tokens for e in entries),
        "shardmesh.step.duration_ms": (end_ns - start_ns) / 1e6, "shardmesh.step.after_step_id": after_step_id,
        "shardmesh.step.order_wait_ms": order_wait_s * 1e3,
    }  # fmt: skip
    if result is not None:
        p, c = result.placement, result.comm
        attributes.update({
            "shardmesh.stage": p.stage, "shardmesh.num_stages": p.num_stages,
            "shardmesh.layer_start": p.spec.layer_start, "shardmesh.layer_end": p.spec.layer_end,
            "shardmesh.tp_rank": p.spec.tp_rank, "shardmesh.tp_size": p.spec.tp_size,
            "shardmesh.step.engine_ms": result.elapsed_s * 1e3, "shardmesh.step.compute_ms": result.compute_s * 1e3,
            "shardmesh.link.recv_wait_ms": c.recv_wait_s * 1e3, "shardmesh.link.bytes_in": c.recv_bytes,
            "shardmesh.link.send_ms": c.send_s * 1e3, "shardmesh.link.bytes_out": c.send_bytes,
            "shardmesh.tp.collective_ms": c.collective_s * 1e3, "shardmesh.tp.collective_bytes": c.collective_bytes,
            "shardmesh.tp.collectives": c.collective_calls,
        })  # fmt: skip
        if c.recv_messages:  # a ring, as in `WorkerMetrics.observe`
            attributes["shardmesh.link.peer_stage_in"] = (p.stage - 1) % p.num_stages
        if c.send_messages:
            attributes["shardmesh.link.peer_stage_out"] = (p.stage + 1) % p.num_stages
    for parent in parents:
        span = tracer.start_span("worker.step", context=parent, kind=SpanKind.SERVER, start_time=start_ns,
                                 attributes=attributes)  # fmt: skip
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=end_ns)
