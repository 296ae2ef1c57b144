"""The balance check before serving: time every stage with real forward passes, judge the balance,
and (with `rebalance: by-speed`) move layers so that the stages take equal time.

Why the coordinator does this: a pipeline runs at the pace of its slowest stage, and even a split
that is even in layers is rarely even in time. The last stage also holds the LM head (for SmolLM2
a fifth of all weights), devices differ, and a "speed" in a manifest is a guess. Measuring once,
before the gateway serves, turns the guess into numbers a person can read (`shardmesh status`).

Flow, per rendezvous epoch (each new placement is checked again):
  topology complete ──► RUNNING ──► stages timed one after another (every tp rank of a stage at once)
      ──► BALANCED or IMBALANCED (passed unless balance is required)
      ──► or REBALANCING: a new split is published, the workers reload, a new epoch is checked.
A shard that cannot be timed makes it FAILED (not passed); it is tried again after `retry_s`.

`judge` and the split arithmetic are pure; `Calibrator` owns the thread and the RPCs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import grpc

from coordinator.registry import Registry
from shardmesh.core.layout import REBALANCES, layer_counts, layer_ranges, predicted_ms, split_by_speed
from shardmesh.core.topology import Calibration, CalibrationStatus, ShardCalibration, StageCalibration, Topology
from shardmesh.proto.v1 import worker_pb2, worker_pb2_grpc
from shardmesh.rpc import server as rpc

# A re-split must promise at least this much off the slowest stage; measurement noise must not move layers.
MIN_GAIN = 0.10


@dataclass(frozen=True)
class CalibrationConfig:
    max_stage_ratio: float = 1.25  # slowest stage's decode time over the fastest's, beyond which it is reported
    rebalance: str = "none"  # "by-speed": re-split layers by the measured times
    require_balance: bool = False  # True: an IMBALANCED placement does not serve
    iterations: int = 5  # timed passes of each kind per shard
    decode_batch: int = 8  # sequences per decode pass (capped at the KV slots)
    prefill_tokens: int = 64  # tokens per prefill pass (capped at max_batch_tokens and the context)
    max_rebalances: int = 2  # re-splits per coordinator life: a bound on chasing noise
    timeout_s: float = 120.0  # per stage
    retry_s: float = 5.0  # after a FAILED check

    def __post_init__(self) -> None:
        if not self.max_stage_ratio >= 1.0:
            raise ValueError(f"max_stage_ratio: must be >= 1.0, got {self.max_stage_ratio}")
        if self.rebalance not in REBALANCES:
            raise ValueError(f"rebalance: must be one of {', '.join(REBALANCES)}, got {self.rebalance!r}")
        if not 1 <= self.iterations <= 100:
            raise ValueError(f"iterations: must be in [1, 100], got {self.iterations}")


class CalibrationFailed(Exception):
    """A shard could not be timed; the message names it and says why."""


def pass_sizes(topology: Topology, cfg: CalibrationConfig) -> tuple[int, int]:
    """(decode batch, prefill tokens) within what every shard allocated (a paged cache: a block per sequence)."""
    lim = topology.limits
    sequences = min(lim.kv_slots, lim.kv_blocks) if lim.paged else lim.kv_slots
    return (max(1, min(cfg.decode_batch, sequences)),
            max(1, min(cfg.prefill_tokens, lim.max_batch_tokens, lim.max_context - 1)))  # fmt: skip


def measure(
    topology: Topology, stub_for: Callable[[str], Any], cfg: CalibrationConfig, device_memory: Mapping[str, int]
) -> tuple[StageCalibration, ...]:
    """Time every stage, one after another; all tensor-parallel ranks of a stage at once."""
    decode_batch, prefill_tokens = pass_sizes(topology, cfg)
    request = worker_pb2.CalibrateRequest(topology_version=topology.version, decode_batch=decode_batch,
                                          prefill_tokens=prefill_tokens, iterations=cfg.iterations)  # fmt: skip
    stages = []
    for stage in topology.stages:
        calls = [(sh, stub_for(sh.address).Calibrate.future(request, timeout=cfg.timeout_s)) for sh in stage.shards]
        shards, layers_ms = [], []
        for sh, call in calls:
            try:
                r = call.result()
            except grpc.RpcError as e:
                for _, other in calls:
                    other.cancel()
                raise CalibrationFailed(f"stage {stage.index} tp rank {sh.tp_rank} ({sh.worker_id} at {sh.address}): "
                                        f"{e.code().name}: {e.details()}") from None  # fmt: skip
            shards.append(ShardCalibration(sh.rank, sh.worker_id, r.decode_ms, r.prefill_ms, r.memory_bytes,
                                           r.peak_memory_bytes, device_memory.get(sh.worker_id, 0), r.weights_bytes,
                                           r.kv_cache_bytes))  # fmt: skip
            layers_ms.append(r.decode_layers_ms)
        stages.append(StageCalibration(
            stage.index, stage.layer_start, stage.layer_end, max(s.decode_ms for s in shards), max(layers_ms),
            max(s.prefill_ms for s in shards), tuple(shards),
        ))  # fmt: skip
    return tuple(stages)


def stage_costs(stages: Sequence[StageCalibration]) -> tuple[list[float], list[float]]:
    """The linear cost model the measurements give: per stage, the fixed ms (embedding, final norm and LM
    head: they stay with the stage) and the ms per decoder layer."""
    fixed = [max(0.0, s.decode_ms - s.decode_layers_ms) for s in stages]
    per_layer = [s.decode_layers_ms / s.num_layers for s in stages]
    return fixed, per_layer


def speed_split(stages: Sequence[StageCalibration], num_layers: int, caps: Sequence[int] | None = None) -> list[int]:
    """Layer counts per stage that equalise the measured decode times (see `split_by_speed`)."""
    return layer_counts(split_by_speed(num_layers, *stage_costs(stages), caps))


def judge(
    epoch: int, stages: tuple[StageCalibration, ...], cfg: CalibrationConfig, num_layers: int,
    decode_batch: int, prefill_tokens: int, caps: Sequence[int] | None = None, rebalances: int = 0,
) -> Calibration:  # fmt: skip
    """BALANCED or IMBALANCED, with the numbers and the split the speeds call for."""
    times = [s.decode_ms for s in stages]
    ratio = max(times) / min(times) if min(times) > 0 else float("inf")
    split = speed_split(stages, num_layers, caps)
    balanced = ratio <= cfg.max_stage_ratio
    if len(stages) == 1:
        message = f"one stage: {times[0]:.2f} ms per decode pass of {decode_batch}"
    elif balanced:
        message = (f"stages within {ratio:.2f}× of each other (limit {cfg.max_stage_ratio:g}×): "
                   + ", ".join(f"stage {s.index} {s.decode_ms:.2f} ms" for s in stages))  # fmt: skip
    else:
        slow = max(stages, key=lambda s: s.decode_ms)
        fast = min(stages, key=lambda s: s.decode_ms)
        message = (f"stage {slow.index} (layers {slow.layer_start}-{slow.layer_end - 1}) takes {slow.decode_ms:.2f} ms "
                   f"per decode pass of {decode_batch}, {ratio:.2f}× stage {fast.index}'s {fast.decode_ms:.2f} ms "
                   f"(limit {cfg.max_stage_ratio:g}×); layer counts by measured speed: {split} "
                   f"(now {[s.num_layers for s in stages]})")  # fmt: skip
        if cfg.rebalance == "none":
            message += "; deploy that with --rebalance by-speed (manifest: placement.rebalance: by-speed)"
    status = CalibrationStatus.BALANCED if balanced else CalibrationStatus.IMBALANCED
    return Calibration(status, epoch, balanced or not cfg.require_balance, stages, round(ratio, 4),
                       cfg.max_stage_ratio, message, decode_batch, prefill_tokens, tuple(split),
                       rebalances)  # fmt: skip


def worth_moving(c: Calibration) -> bool:
    """Whether the speed split differs from the current one and promises a real gain."""
    current = [s.num_layers for s in c.stages]
    if list(c.speed_split) == current:
        return False
    now = max(s.decode_ms for s in c.stages)
    after = max(predicted_ms(layer_ranges(c.speed_split), *stage_costs(c.stages)))
    return after < (1 - MIN_GAIN) * now


class Calibrator:
    """Watches the registry's topologies and checks every new complete placement, on its own thread."""

    def __init__(
        self, registry: Registry, cfg: CalibrationConfig, logger: Any, max_message_bytes: int,
        caps: Callable[[Topology], Sequence[int] | None] = lambda t: None,
        dial: Callable[[str], grpc.Channel] | None = None,
    ) -> None:  # fmt: skip
        """`dial(address)`: a channel to a worker (`shardmesh.rpc.tls.Dial.channel`, TLS and token as configured);
        default plaintext."""
        self._registry = registry
        self.cfg = cfg
        self._log = logger
        self._options = rpc.message_options(max_message_bytes)
        self._dial = dial or (lambda address: grpc.insecure_channel(address, options=self._options))
        self._caps = caps  # layers each stage's memory holds (the planner's model), or None: unbounded
        self._channels: dict[str, grpc.Channel] = {}
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._rebalances = 0
        self._failed_at: dict[int, float] = {}  # epoch -> when its check last failed

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="calibrator", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        for channel in list(self._channels.values()):  # cancels a check in flight: shutdown must not wait for it
            channel.close()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _stub(self, address: str) -> Any:
        if address not in self._channels:
            self._channels[address] = self._dial(address)
        return worker_pb2_grpc.StageWorkerStub(self._channels[address])

    def _run(self) -> None:
        store, seen = self._registry.store, 0
        while not self._stopping.is_set():
            topology = store.wait_newer(seen, timeout=0.5)
            if topology is not None:
                seen = topology.version
            current = store.current()
            if self._due(current):
                try:
                    self.check(current)
                except Exception:  # a bug here must not stop later checks, nor the coordinator
                    self._log.exception("calibration_error")

    def _due(self, t: Topology) -> bool:
        if not t.complete or t.rendezvous is None or t.calibration.epoch != t.rendezvous.epoch:
            return False
        if t.calibration.status is CalibrationStatus.PENDING:
            return True
        failed = self._failed_at.get(t.rendezvous.epoch)
        return (t.calibration.status is CalibrationStatus.FAILED and failed is not None
                and time.monotonic() - failed >= self.cfg.retry_s)  # fmt: skip

    def check(self, t: Topology) -> Calibration:
        """Run the check on complete topology `t` and publish the outcome (or the re-split)."""
        assert t.rendezvous is not None
        epoch = t.rendezvous.epoch
        decode_batch, prefill_tokens = pass_sizes(t, self.cfg)
        base = Calibration(CalibrationStatus.RUNNING, epoch, False, max_stage_ratio=self.cfg.max_stage_ratio,
                           decode_batch=decode_batch, prefill_tokens=prefill_tokens,
                           rebalances=self._rebalances)  # fmt: skip
        if not self._registry.record_calibration(base):
            return base
        memory = {w.worker_id: w.device.memory_bytes for w in self._registry.workers().values()}
        started = time.monotonic()
        try:
            stages = measure(t, self._stub, self.cfg, memory)
        except CalibrationFailed as e:
            self._failed_at[epoch] = time.monotonic()
            failed = replace(base, status=CalibrationStatus.FAILED, message=f"{e}; retrying in {self.cfg.retry_s:g} s")
            self._log.warning("calibration_failed", epoch=epoch, error=str(e))
            self._registry.record_calibration(failed)
            return failed
        try:
            caps = self._caps(t)
        except Exception as e:  # the memory model is advice here: measure anyway
            self._log.warning("calibration_caps_unknown", error=str(e))
            caps = None
        if caps is not None and (len(caps) != t.pp or sum(caps) < t.model.num_layers):
            caps = None  # the model says the current split cannot fit, yet it runs: trust the run
        result = judge(epoch, stages, self.cfg, t.model.num_layers, decode_batch, prefill_tokens, caps,
                       self._rebalances)  # fmt: skip
        self._log.info(
            "calibrated", epoch=epoch, status=result.status.value, passed=result.passed, stage_ratio=result.stage_ratio,
            seconds=round(time.monotonic() - started, 2), decode_ms=[round(s.decode_ms, 3) for s in stages],
            prefill_ms=[round(s.prefill_ms, 3) for s in stages], layers=[s.num_layers for s in stages],
            speed_split=list(result.speed_split), memory_bytes=[sh.memory_bytes for s in stages for sh in s.shards],
        )  # fmt: skip
        if (result.status is CalibrationStatus.IMBALANCED and self.cfg.rebalance == "by-speed"
                and self._rebalances < self.cfg.max_rebalances and worth_moving(result)):  # fmt: skip
            self._rebalances += 1
            moving = replace(result, status=CalibrationStatus.REBALANCING, passed=False, rebalances=self._rebalances,
                             message=f"{result.message}; re-splitting layers {[s.num_layers for s in stages]} -> "
                                     f"{list(result.speed_split)}")  # fmt: skip
            self._log.warning("rebalancing", epoch=epoch, message=moving.message)
            self._registry.resplit(tuple(layer_ranges(result.speed_split)), moving)
            return moving
        if result.status is CalibrationStatus.IMBALANCED:
            self._log.warning("stages_imbalanced", epoch=epoch, message=result.message, passed=result.passed)
        self._registry.record_calibration(result)
        return result


def memory_caps(t: Topology, device_memory: Mapping[str, int], device_type: Mapping[str, str]) -> list[int] | None:
    """The most layers each stage's devices hold by the planner's memory model (the tightest rank of the
    stage decides); None when a device did not say how much memory it has."""
    from shardmesh.planning.devices import Device
    from shardmesh.planning.memory import RuntimeCosts, load_model
    from shardmesh.planning.planner import PlanOptions, stage_capacity

    if any(not device_memory.get(sh.worker_id) for _, sh in t.shards()):
        return None
    model = load_model(t.model.path)
    caps = []
    for stage in t.stages:
        group = tuple(Device(sh.worker_id, i, device_memory[sh.worker_id]) for i, sh in enumerate(stage.shards))
        kind = device_type.get(stage.shards[0].worker_id, "cpu")
        options = PlanOptions(dtype=t.model.dtype, quantization=t.model.quantization, limits=t.limits,
                              runtime=RuntimeCosts.for_device(kind), tp=t.tp, pp=t.pp, tp_split=t.tp_split)  # fmt: skip
        first, last = stage.index == 0, stage.index == t.pp - 1
        caps.append(stage_capacity(model, group, first, last, t.model.num_layers, options))
    return caps if min(caps) >= 1 else None
