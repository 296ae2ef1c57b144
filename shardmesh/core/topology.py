"""The mesh as versioned, immutable data, and the one place the current version lives.

A `Topology` is a frozen value: every change (a worker joins, turns READY, stops heartbeating)
produces a new one with `version + 1`, published through `TopologyStore`. Consumers compare versions
instead of sharing mutable state, which is what lets joining, draining and rebalancing change the
mesh at run time without changing this shape. `to_pb` / `from_pb` are the only bridge to the wire
format, so the rest of the coordinator never handles protobuf messages.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, TypeVar

from shardmesh.core.dtypes import DType, Quantization
from shardmesh.proto.v1 import common_pb2, coordinator_pb2

E = TypeVar("E", bound=enum.Enum)


def _member_of(cls: type[E], pb_enum: Any, prefix: str, value: int) -> E:
    """The member of `cls` that the protobuf enum value `value` names (`prefix` + the member's name); ValueError
    listing the members for UNSPECIFIED and unknown values."""
    name = pb_enum.Name(value) if value in pb_enum.values() else str(value)
    member = name.removeprefix(prefix)
    if not name.startswith(prefix) or member not in cls.__members__:
        raise ValueError(f"must be one of {', '.join(cls.__members__)}, got {name}")
    return cls[member]


class ShardState(enum.Enum):
    """A slot's life cycle; mirrors `shardmesh.v1.ShardState` without the UNSPECIFIED value."""

    PENDING = "pending"
    LOADING = "loading"
    READY = "ready"
    UNHEALTHY = "unhealthy"

    def to_pb(self) -> common_pb2.ShardState.ValueType:
        return common_pb2.ShardState.Value(f"SHARD_STATE_{self.name}")

    @classmethod
    def from_pb(cls, value: int) -> ShardState:
        """Raises ValueError for UNSPECIFIED and unknown values."""
        return _member_of(cls, common_pb2.ShardState, "SHARD_STATE_", value)


@dataclass(frozen=True)
class ModelSpec:
    """The model every shard loads: a directory plus the few config numbers consumers need up front."""

    path: str
    dtype: str  # a `DType` name
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_context: int
    served_model_name: str = ""  # the coordinator's --model as given; "" when not known (then `name` is the path)
    quantization: str = "none"  # a `Quantization` name

    @property
    def name(self) -> str:
        """What clients call the model (the OpenAI-compatible API's model id, unless the gateway renames it)."""
        return self.served_model_name or self.path

    def to_pb(self) -> common_pb2.ModelSpec:
        return common_pb2.ModelSpec(
            path=self.path, dtype=DType.parse(self.dtype).to_pb(), architecture=self.architecture,
            num_layers=self.num_layers, hidden_size=self.hidden_size, vocab_size=self.vocab_size,
            max_context=self.max_context, served_model_name=self.served_model_name,
            quantization=Quantization.parse(self.quantization).value,
        )  # fmt: skip

    @classmethod
    def from_pb(cls, pb: common_pb2.ModelSpec) -> ModelSpec:
        return cls(pb.path, DType.from_pb(pb.dtype), pb.architecture, pb.num_layers, pb.hidden_size,
                   pb.vocab_size, pb.max_context, pb.served_model_name,
                   Quantization.parse(pb.quantization).value)  # fmt: skip


@dataclass(frozen=True)
class ShardAssignment:
    """One tensor-parallel slot of a stage; `worker_id == ""` while nobody holds it."""

    tp_rank: int
    rank: int
    worker_id: str = ""
    address: str = ""
    state: ShardState = ShardState.PENDING
    labels: tuple[tuple[str, str], ...] = ()  # the holder's registration labels, sorted by key
    requires: tuple[tuple[str, str], ...] = ()  # labels a worker needs to hold this slot (from the plan)
    kv_cache_id: str = ""  # the holder's KV cache as it last reported it (kept across epochs): see the proto
    kv_from: str = ""  # the serving worker this slot was handed over from, whose KV cache the holder copies

    @property
    def vacant(self) -> bool:
        return not self.worker_id

    def label(self, key: str, default: str = "") -> str:
        return next((v for k, v in self.labels if k == key), default)

    def to_pb(self) -> coordinator_pb2.ShardAssignment:
        return coordinator_pb2.ShardAssignment(
            tp_rank=self.tp_rank, rank=self.rank, worker_id=self.worker_id, address=self.address,
            state=self.state.to_pb(), labels=dict(self.labels), requires=dict(self.requires),
            kv_cache_id=self.kv_cache_id, kv_from=self.kv_from,
        )  # fmt: skip

    @classmethod
    def from_pb(cls, pb: coordinator_pb2.ShardAssignment) -> ShardAssignment:
        return cls(pb.tp_rank, pb.rank, pb.worker_id, pb.address, ShardState.from_pb(pb.state),
                   tuple(sorted(pb.labels.items())), tuple(sorted(pb.requires.items())), pb.kv_cache_id,
                   pb.kv_from)  # fmt: skip


@dataclass(frozen=True)
class Stage:
    """Layers [layer_start, layer_end) of the pipeline, split over `len(shards)` tensor-parallel ranks."""

    index: int
    layer_start: int
    layer_end: int
    shards: tuple[ShardAssignment, ...]

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    def to_pb(self) -> coordinator_pb2.Stage:
        return coordinator_pb2.Stage(index=self.index, layer_start=self.layer_start, layer_end=self.layer_end,
                                     shards=[s.to_pb() for s in self.shards])  # fmt: skip

    @classmethod
    def from_pb(cls, pb: coordinator_pb2.Stage) -> Stage:
        return cls(pb.index, pb.layer_start, pb.layer_end, tuple(ShardAssignment.from_pb(s) for s in pb.shards))


@dataclass(frozen=True)
class Rendezvous:
    """Where one placement's process groups meet: a c10d TCPStore and a key prefix naming the placement.

    The prefix names the epoch (the version that introduced the placement), not every version: shard
    state changes must not make workers tear down groups that are still valid.
    """

    host: str
    port: int
    prefix: str
    epoch: int
    world_size: int

    @classmethod
    def for_epoch(cls, host: str, port: int, epoch: int, world_size: int) -> Rendezvous:
        return cls(host, port, f"topo/v{epoch}", epoch, world_size)

    def to_pb(self) -> coordinator_pb2.Rendezvous:
        return coordinator_pb2.Rendezvous(host=self.host, port=self.port, prefix=self.prefix, epoch=self.epoch,
                                          world_size=self.world_size)  # fmt: skip

    @classmethod
    def from_pb(cls, pb: coordinator_pb2.Rendezvous) -> Rendezvous:
        return cls(pb.host, pb.port, pb.prefix, pb.epoch, pb.world_size)


@dataclass(frozen=True)
class ServingLimits:
    """What every shard allocates for, so that all stages agree on slots and lengths (and what the planner
    sizes KV caches and activations by): KV slots (sequences in flight), tokens per sequence (prompt +
    completion), tokens per step over the batch, and how the KV cache is laid out.

    `kv_block_size` 0: a slot cache, `kv_slots` × `max_context` positions. Otherwise a paged cache of `kv_blocks`
    blocks of `kv_block_size` positions on every shard (the same block ids on every stage, each for its own
    layers), which the gateway hands out to sequences; `kv_slots` then bounds only the sequences in flight (their
    per-slot state is small), and memory is counted in blocks."""

    kv_slots: int
    max_context: int
    max_batch_tokens: int
    kv_block_size: int = 0  # tokens per block of a paged KV cache; 0: the slot cache
    kv_blocks: int = 0  # blocks per shard of a paged KV cache; 0 with the slot cache

    def __post_init__(self) -> None:
        for name in ("kv_slots", "max_context", "max_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_block_size < 0:
            raise ValueError(f"kv_block_size must be >= 0 (0: slots), got {self.kv_block_size}")
        if not self.paged:
            if self.kv_blocks:
                raise ValueError(f"kv_blocks must be 0 with the slot cache (kv_block_size 0), got {self.kv_blocks}")
            return
        if self.kv_blocks < 1:
            raise ValueError(f"kv_blocks must be >= 1 with kv_block_size {self.kv_block_size}, got {self.kv_blocks}")
        if self.kv_blocks * self.kv_block_size < self.max_context:
            needed = -(-self.max_context // self.kv_block_size)
            raise ValueError(f"kv_blocks: {self.kv_blocks} blocks × {self.kv_block_size} tokens = "
                             f"{self.kv_blocks * self.kv_block_size} tokens, fewer than one sequence of max_context "
                             f"{self.max_context} needs ({needed} blocks)")  # fmt: skip

    @property
    def paged(self) -> bool:
        """A paged KV cache (blocks and block tables) rather than slots."""
        return self.kv_block_size > 0

    def to_pb(self) -> coordinator_pb2.ServingLimits:
        return coordinator_pb2.ServingLimits(kv_slots=self.kv_slots, max_context=self.max_context,
                                             max_batch_tokens=self.max_batch_tokens, kv_block_size=self.kv_block_size,
                                             kv_blocks=self.kv_blocks)  # fmt: skip

    @classmethod
    def from_pb(cls, pb: coordinator_pb2.ServingLimits) -> ServingLimits:
        return cls(pb.kv_slots, pb.max_context, pb.max_batch_tokens, pb.kv_block_size, pb.kv_blocks)


class CalibrationStatus(enum.Enum):
    """Where a placement's balance check stands; mirrors `shardmesh.v1.CalibrationStatus`."""

    PENDING = "pending"
    RUNNING = "running"
    BALANCED = "balanced"
    IMBALANCED = "imbalanced"
    REBALANCING = "rebalancing"
    FAILED = "failed"
    CARRIED_OVER = "carried-over"  # served before a coordinator restart; not measured again

    def to_pb(self) -> coordinator_pb2.CalibrationStatus.ValueType:
        return coordinator_pb2.CalibrationStatus.Value(f"CALIBRATION_STATUS_{self.name}")

    @classmethod
    def from_pb(cls, value: int) -> CalibrationStatus:
        """UNSPECIFIED (an older coordinator that does not calibrate) and unknown values read as PENDING."""
        names = coordinator_pb2.CalibrationStatus
        name = names.Name(value).removeprefix("CALIBRATION_STATUS_") if value in names.values() else ""
        return cls[name] if name in cls.__members__ else cls.PENDING


@dataclass(frozen=True)
class ShardCalibration:
    """One shard's timed passes and memory (see `coordinator.proto`)."""

    rank: int
    worker_id: str
    decode_ms: float
    prefill_ms: float
    memory_bytes: int
    peak_memory_bytes: int
    device_memory_bytes: int
    weights_bytes: int
    kv_cache_bytes: int

    def to_pb(self) -> coordinator_pb2.ShardCalibration:
        return coordinator_pb2.ShardCalibration(**asdict(self))

    @classmethod
    def from_pb(cls, pb: coordinator_pb2.ShardCalibration) -> ShardCalibration:
        return cls(**{f.name: getattr(pb, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class StageCalibration:
    """One stage: as slow as its slowest tensor-parallel rank."""

    index: int
    layer_start: int
    layer_end: int
    decode_ms: float
    decode_layers_ms: float
    prefill_ms: float
    shards: tuple[ShardCalibration, ...]

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    def to_pb(self) -> coordinator_pb2.StageCalibration:
        return coordinator_pb2.StageCalibration(
            index=self.index, layer_start=self.layer_start, layer_end=self.layer_end, decode_ms=self.decode_ms,
            decode_layers_ms=self.decode_layers_ms, prefill_ms=self.prefill_ms,
            shards=[s.to_pb() for s in self.shards],
        )  # fmt: skip

    @classmethod
    def from_pb(cls, pb: coordinator_pb2.StageCalibration) -> StageCalibration:
        return cls(pb.index, pb.layer_start, pb.layer_end, pb.decode_ms, pb.decode_layers_ms, pb.prefill_ms,
                   tuple(ShardCalibration.from_pb(s) for s in pb.shards))  # fmt: skip


@dataclass(frozen=True)
class Calibration:
    """The balance check of one rendezvous epoch: what the gateway waits for before it serves."""

    status: CalibrationStatus = CalibrationStatus.PENDING
    epoch: int = 0
    passed: bool = False
    stages: tuple[StageCalibration, ...] = ()
    stage_ratio: float = 0.0
    max_stage_ratio: float = 0.0
    message: str = ""
    decode_batch: int = 0
    prefill_tokens: int = 0
    speed_split: tuple[int, ...] = ()  # layer counts per stage the measured speeds call for
    rebalances: int = 0

    def to_pb(self) -> coordinator_pb2.Calibration:
        return coordinator_pb2.Calibration(
            status=self.status.to_pb(), epoch=self.epoch, passed=self.passed, stages=[s.to_pb() for s in self.stages],
            stage_ratio=self.stage_ratio, max_stage_ratio=self.max_stage_ratio, message=self.message,
            decode_batch=self.decode_batch, prefill_tokens=self.prefill_tokens, speed_split=list(self.speed_split),
            rebalances=self.rebalances,
        )  # fmt: skip

    @classmethod
    def from_pb(cls, pb: coordinator_pb2.Calibration) -> Calibration:
        return cls(CalibrationStatus.from_pb(pb.status), pb.epoch, pb.passed,
                   tuple(StageCalibration.from_pb(s) for s in pb.stages), pb.stage_ratio, pb.max_stage_ratio,
                   pb.message, pb.decode_batch, pb.prefill_tokens, tuple(pb.speed_split), pb.rebalances)  # fmt: skip


class WorkerState(enum.Enum):
    """What one registered worker is doing; mirrors `shardmesh.v1.WorkerState` without UNSPECIFIED."""

    SERVING = "serving"  # holds a READY slot
    SPARE = "spare"  # healthy, holds no slot: takes one that is lost or drained
    LOADING = "loading"  # holds a slot that is not READY yet
    DRAINING = "draining"  # asked to leave: serves until its slot has moved, then exits
    LOST = "lost"  # silent, unreachable or broken

    def to_pb(self) -> coordinator_pb2.WorkerState.ValueType:
        return coordinator_pb2.WorkerState.Value(f"WORKER_STATE_{self.name}")

    @classmethod
    def from_pb(cls, value: int) -> WorkerState:
        """Raises ValueError for UNSPECIFIED and unknown values."""
        return _member_of(cls, coordinator_pb2.WorkerState, "WORKER_STATE_", value)


@dataclass(frozen=True)
class MeshWorker:
    """One registered worker as the topology lists it (slot holders and spares alike)."""

    worker_id: str
    address: str
    pid: int
    state: WorkerState
    rank: int | None = None  # the global rank of the slot it holds
    detail: str = ""
    preparing_rank: int | None = None  # a spare loading this rank's weights before a drain hands the slot over

    def to_pb(self) -> coordinator_pb2.MeshWorker:
        pb = coordinator_pb2.MeshWorker(worker_id=self.worker_id, address=self.address, pid=self.pid,
                                        state=self.state.to_pb(), detail=self.detail)  # fmt: skip
        if self.rank is not None:
            pb.rank = self.rank
        if self.preparing_rank is not None:
            pb.preparing_rank = self.preparing_rank
        return pb

    @classmethod
    def from_pb(cls, pb: coordinator_pb2.MeshWorker) -> MeshWorker:
        return cls(pb.worker_id, pb.address, pb.pid, WorkerState.from_pb(pb.state),
                   pb.rank if pb.HasField("rank") else None, pb.detail,
                   pb.preparing_rank if pb.HasField("preparing_rank") else None)  # fmt: skip


@dataclass(frozen=True)
class HeldShard:
    """The shard and process groups a worker holds, claimed when it registers with a restarted coordinator."""

    epoch: int
    rank: int
    pp: int
    tp: int
    layer_start: int
    layer_end: int
    served: bool = False  # it ran requests' steps in this epoch: a gateway served on it

    def to_pb(self) -> coordinator_pb2.HeldShard:
        return coordinator_pb2.HeldShard(**asdict(self))

    @classmethod
    def from_pb(cls, pb: coordinator_pb2.HeldShard) -> HeldShard:
        return cls(pb.epoch, pb.rank, pb.pp, pb.tp, pb.layer_start, pb.layer_end, pb.served)


@dataclass(frozen=True)
class Topology:
    """The whole mesh at one version. Built by `placement.build_topology`, never edited in place."""

    version: int
    model: ModelSpec
    pp: int
    tp: int
    stages: tuple[Stage, ...]
    rendezvous: Rendezvous | None  # None while any slot is vacant
    complete: bool  # every slot READY under `rendezvous`
    limits: ServingLimits
    calibration: Calibration = field(default_factory=Calibration)
    workers: tuple[MeshWorker, ...] = ()  # every registered worker, in registration order
    tp_split: tuple[int, ...] = ()  # each tp rank's share of the MLP columns and vocabulary; () even (core.heads)

    @property
    def epoch(self) -> int:
        """The rendezvous epoch, 0 while slots are vacant."""
        return self.rendezvous.epoch if self.rendezvous is not None else 0

    def worker(self, worker_id: str) -> MeshWorker | None:
        return next((w for w in self.workers if w.worker_id == worker_id), None)

    @property
    def serving(self) -> bool:
        """Complete, and the balance check of this very placement passed: what a gateway serves on."""
        c, r = self.calibration, self.rendezvous
        return self.complete and r is not None and c.passed and c.epoch == r.epoch

    def shards(self) -> Iterator[tuple[Stage, ShardAssignment]]:
        """Every slot with its stage, in global-rank order."""
        for stage in self.stages:
            for shard in stage.shards:
                yield stage, shard

    def find(self, worker_id: str) -> tuple[Stage, ShardAssignment] | None:
        """The slot `worker_id` holds, or None (not placed: a standby, or unknown)."""
        return next(((st, sh) for st, sh in self.shards() if worker_id and sh.worker_id == worker_id), None)

    def same_content(self, other: Topology) -> bool:
        """Equal apart from the version number: publishing `other` would tell nobody anything new."""
        return replace(self, version=0) == replace(other, version=0)

    def to_pb(self) -> coordinator_pb2.Topology:
        pb = coordinator_pb2.Topology(
            version=self.version, model=self.model.to_pb(), pp=self.pp, tp=self.tp,
            stages=[s.to_pb() for s in self.stages], complete=self.complete, limits=self.limits.to_pb(),
            calibration=self.calibration.to_pb(), workers=[w.to_pb() for w in self.workers], tp_split=self.tp_split,
        )  # fmt: skip
        if self.rendezvous is not None:
            pb.rendezvous.CopyFrom(self.rendezvous.to_pb())
        return pb

    @classmethod
    def from_pb(cls, pb: coordinator_pb2.Topology) -> Topology:
        return cls(
            version=pb.version, model=ModelSpec.from_pb(pb.model), pp=pb.pp, tp=pb.tp,
            stages=tuple(Stage.from_pb(s) for s in pb.stages),
            rendezvous=Rendezvous.from_pb(pb.rendezvous) if pb.HasField("rendezvous") else None,
            complete=pb.complete, limits=ServingLimits.from_pb(pb.limits),
            calibration=Calibration.from_pb(pb.calibration), workers=tuple(MeshWorker.from_pb(w) for w in pb.workers),
            tp_split=tuple(pb.tp_split),
        )  # fmt: skip


class TopologyStore:
    """Holds the current topology; watchers block on a condition variable until a newer one exists.

    A waiter asks for "newer than the version I have" and gets the newest one, so a slow watcher
    skips intermediate versions instead of queueing them, and can never see one twice.
    """

    def __init__(self, initial: Topology) -> None:
        self._cond = threading.Condition()
        self._current = initial
        self._closed = False

    def current(self) -> Topology:
        with self._cond:
            return self._current

    def publish(self, topology: Topology) -> None:
        with self._cond:
            if topology.version <= self._current.version:
                raise ValueError(f"version {topology.version} is not newer than {self._current.version}")
            self._current = topology
            self._cond.notify_all()

    def wait_newer(self, after_version: int, timeout: float | None = None) -> Topology | None:
        """The current topology once its version exceeds `after_version`; None on timeout or close.

        An `after_version` beyond the current version can only come from an earlier coordinator
        (versions restart with the process), so it is treated as 0: the caller gets the current one.
        """
        with self._cond:
            if after_version > self._current.version:
                after_version = 0
            self._cond.wait_for(lambda: self._closed or self._current.version > after_version, timeout)
            if self._closed or self._current.version <= after_version:
                return None
            return self._current

    def close(self) -> None:
        """Wake every waiter for good: used at shutdown so watch streams end at once."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed
