"""Who is in the mesh: registrations, heartbeats and timeouts, turned into published topologies.

`Registry` is the coordinator's only mutable state. Every operation takes its lock, updates the
worker records and slots, asks `placement` for the resulting topology and publishes it when it says
something new. Requests arrive already converted from protobuf (`Registration.from_pb`, ...), so
validation errors name the wire field the client got wrong.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from coordinator import placement
from shardmesh.core.errors import InvalidArgument, NotFound
from shardmesh.core.layout import check_split, split_layers
from shardmesh.core.topology import Calibration, ModelSpec, ServingLimits, ShardState, Topology, TopologyStore
from shardmesh.proto.v1 import common_pb2, coordinator_pb2

_WORKER_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
_LABEL_KEY = re.compile(r"[A-Za-z0-9._/-]{1,63}")
MAX_LABELS, MAX_LABEL_VALUE = 32, 256


def parse_address(text: str, field_name: str = "address") -> tuple[str, int]:
    """host:port (IPv6 hosts in brackets) -> (host, port); InvalidArgument naming `field_name` otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(field_name, f"expected host:port with a port in 1..65535, got {text!r}")
    if host.startswith("[") != host.endswith("]") or (":" in host and not host.startswith("[")):
        raise InvalidArgument(field_name, f"an IPv6 host must be in brackets, e.g. [::1]:50051, got {text!r}")
    return host, int(port)


def check_worker_id(worker_id: str, field_name: str = "worker_id") -> str:
    if not _WORKER_ID.fullmatch(worker_id):
        raise InvalidArgument(field_name, f"must be 1-64 characters from [A-Za-z0-9._-], got {worker_id!r}")
    return worker_id


@dataclass(frozen=True)
class Device:
    type: str  # "cpu" | "cuda"
    name: str
    memory_bytes: int

    @classmethod
    def from_pb(cls, pb: common_pb2.Device) -> Device:
        if pb.type == common_pb2.DEVICE_TYPE_UNSPECIFIED or pb.type not in common_pb2.DeviceType.values():
            raise InvalidArgument("device.type", "must be DEVICE_TYPE_CPU or DEVICE_TYPE_CUDA")
        return cls(common_pb2.DeviceType.Name(pb.type).removeprefix("DEVICE_TYPE_").lower(), pb.name, pb.memory_bytes)


@dataclass(frozen=True)
class Load:
    """A worker's self-reported load; kept for monitoring and for load-aware placement later."""

    active_sequences: int = 0
    free_slots: int = 0
    total_slots: int = 0
    weights_bytes: int = 0
    kv_cache_bytes: int = 0
    mean_step_ms: float = 0.0
    steps_total: int = 0

    @classmethod
    def from_pb(cls, pb: coordinator_pb2.LoadStats) -> Load:
        return cls(pb.active_sequences, pb.free_slots, pb.total_slots, pb.weights_bytes, pb.kv_cache_bytes,
                   pb.mean_step_ms, pb.steps_total)  # fmt: skip


@dataclass(frozen=True)
class Registration:
    address: str
    device: Device
    labels: tuple[tuple[str, str], ...] = ()
    requested_id: str | None = None

    @classmethod
    def from_pb(cls, pb: coordinator_pb2.RegisterRequest) -> Registration:
        parse_address(pb.address)
        if not pb.HasField("device"):
            raise InvalidArgument("device", "is required")
        if len(pb.labels) > MAX_LABELS:
            raise InvalidArgument("labels", f"at most {MAX_LABELS} labels, got {len(pb.labels)}")
        for key, value in pb.labels.items():
            if not _LABEL_KEY.fullmatch(key):
                raise InvalidArgument(f"labels[{key!r}]", "keys must be 1-63 characters from [A-Za-z0-9._/-]")
            if len(value) > MAX_LABEL_VALUE:
                raise InvalidArgument(f"labels[{key!r}]", f"values must be at most {MAX_LABEL_VALUE} characters")
        requested = check_worker_id(pb.worker_id) if pb.HasField("worker_id") else None
        return cls(pb.address, Device.from_pb(pb.device), tuple(sorted(pb.labels.items())), requested)


@dataclass(frozen=True)
class HeartbeatReport:
    worker_id: str
    state: ShardState
    applied_version: int
    load: Load
    detail: str = ""

    @classmethod
    def from_pb(cls, pb: coordinator_pb2.HeartbeatRequest) -> HeartbeatReport:
        check_worker_id(pb.worker_id)
        try:
            state = ShardState.from_pb(pb.state)
        except ValueError as e:
            raise InvalidArgument("state", str(e)) from None
        return cls(pb.worker_id, state, pb.applied_topology_version, Load.from_pb(pb.load), pb.detail[:1024])


@dataclass(frozen=True)
class WorkerRecord:
    """Everything the coordinator remembers about one worker. Replaced, never mutated."""

    worker_id: str
    address: str
    device: Device
    labels: tuple[tuple[str, str], ...]
    seq: int  # registration order, kept across re-registrations: it is the standby queue position
    incarnation: int
    last_seen: float  # monotonic seconds
    reported: ShardState = ShardState.PENDING
    applied_version: int = 0
    timed_out: bool = False
    load: Load = field(default_factory=Load)

    def view(self) -> placement.WorkerView:
        return placement.WorkerView(self.worker_id, self.address, self.incarnation, self.reported,
                                    self.applied_version, self.timed_out, self.labels)  # fmt: skip


class Registry:
    """Worker records + slots under one lock; every change republishes the topology if it changed."""

    def __init__(
        self,
        *,
        model: ModelSpec,
        pp: int,
        tp: int,
        limits: ServingLimits,
        store_host: str,
        store_port: int,
        heartbeat_timeout: float,
        split: placement.Split | None = None,
        requires: Sequence[placement.Labels] | None = None,
        clock: Callable[[], float] = time.monotonic,
        logger: Any = None,
    ) -> None:
        self._model, self._pp, self._tp, self._limits = model, pp, tp, limits
        self._split: placement.Split = tuple(split or split_layers(model.num_layers, pp))
        check_split(self._split, model.num_layers, pp)
        if requires is not None and len(requires) != pp * tp:
            raise ValueError(f"need label requirements for {pp * tp} slots, got {len(requires)}")
        self._requires = tuple(requires) if requires is not None else None
        self._calibration: Calibration | None = None  # the latest result, for the epoch it names
        self._store_host, self._store_port = store_host, store_port
        self.heartbeat_timeout = heartbeat_timeout
        self._clock = clock
        self._log = logger
        self._lock = threading.Lock()
        self._workers: dict[str, WorkerRecord] = {}
        self._slots = placement.empty_slots(pp, tp)
        self._seq = 0
        self._next_id = 0
        self._incarnations = 0
        self._key: placement.PlacementKey | None = None
        self._epoch: int | None = None
        self.store = TopologyStore(self._build(version=1, epoch=None))

    # -- operations -------------------------------------------------------------------------------

    def register(self, reg: Registration) -> tuple[str, Topology]:
        """Add (or re-add, after a restart) a worker; returns its id and the topology it produced."""
        with self._lock:
            now = self._clock()
            # An address names one live process: anyone else still registered there is gone.
            same_address = [w for w in self._workers.values() if w.address == reg.address]
            worker_id = reg.requested_id or (same_address[0].worker_id if same_address else self._new_id())
            for stale in same_address:
                if stale.worker_id != worker_id:
                    self._forget(stale.worker_id, reason="address_reused")
            old = self._workers.get(worker_id)
            self._incarnations += 1
            if old is None:
                self._seq += 1
            self._workers[worker_id] = WorkerRecord(
                worker_id, reg.address, reg.device, reg.labels, old.seq if old else self._seq, self._incarnations,
                now,
            )  # fmt: skip
            self._emit("worker_registered", worker_id=worker_id, address=reg.address, device=reg.device.type,
                       returning=old is not None, labels=dict(reg.labels))  # fmt: skip
            if worker_id in self._slots and self._requires is not None:
                rank = self._slots.index(worker_id)
                if not placement.fits(reg.labels, self._requires[rank]):  # came back with other labels
                    self._slots = placement.vacate(self._slots, worker_id)
                    self._emit("slot_vacated", worker_id=worker_id, rank=rank, reason="labels_changed",
                               requires=dict(self._requires[rank]))  # fmt: skip
            self._refill()
            topology = self._publish_if_changed()
            return worker_id, topology

    def heartbeat(self, report: HeartbeatReport) -> tuple[bool, int]:
        """Record a heartbeat; returns (known, current topology version)."""
        with self._lock:
            current = self.store.current()
            record = self._workers.get(report.worker_id)
            if record is None:
                return False, current.version
            if report.applied_version > current.version:
                raise InvalidArgument(
                    "applied_topology_version",
                    f"{report.applied_version} is newer than the current version {current.version}",
                )
            if record.timed_out:
                self._emit("worker_recovered", worker_id=record.worker_id)
            if report.state is ShardState.UNHEALTHY and record.reported is not ShardState.UNHEALTHY:
                self._emit("worker_reports_unhealthy", worker_id=record.worker_id, detail=report.detail)
            self._workers[report.worker_id] = replace(
                record, last_seen=self._clock(), reported=report.state, applied_version=report.applied_version,
                timed_out=False, load=report.load,
            )  # fmt: skip
            return True, self._publish_if_changed().version

    def deregister(self, worker_id: str) -> int:
        """Remove a worker for good; its slot goes to the next standby. Returns the new version."""
        with self._lock:
            if worker_id not in self._workers:
                raise NotFound(f"worker_id: no registered worker {worker_id!r}")
            self._forget(worker_id, reason="deregistered")
            self._refill()
            return self._publish_if_changed().version

    def expire(self) -> list[str]:
        """Mark workers silent for longer than the timeout: slot holders become UNHEALTHY (keeping
        the slot for their return), standbys are forgotten. Returns the ids that timed out now."""
        with self._lock:
            now = self._clock()
            expired = [w for w in self._workers.values()
                       if not w.timed_out and now - w.last_seen > self.heartbeat_timeout]  # fmt: skip
            for w in expired:
                silent = round(now - w.last_seen, 3)
                if w.worker_id in self._slots:
                    self._workers[w.worker_id] = replace(w, timed_out=True)
                    self._emit("worker_unhealthy", worker_id=w.worker_id, reason="heartbeat_timeout", silent_s=silent)
                else:
                    self._forget(w.worker_id, reason="heartbeat_timeout")
            if expired:
                self._publish_if_changed()
            return [w.worker_id for w in expired]

    def workers(self) -> Mapping[str, WorkerRecord]:
        with self._lock:
            return dict(self._workers)

    def split(self) -> placement.Split:
        with self._lock:
            return self._split

    def record_calibration(self, calibration: Calibration) -> bool:
        """Publish the balance check's state for its epoch; False (and nothing published) when the
        placement has moved on to another epoch meanwhile."""
        with self._lock:
            if calibration.epoch != self._epoch:
                return False
            self._calibration = calibration
            self._publish_if_changed()
            return True

    def resplit(self, split: placement.Split, calibration: Calibration) -> Topology:
        """Move layers between stages (`rebalance: by-speed`) if the placement is still the one
        `calibration` measured: a new split is a new placement, so workers reload and a new epoch
        (and a new check) follows."""
        check_split(split, self._model.num_layers, self._pp)
        with self._lock:
            if calibration.epoch != self._epoch:
                return self.store.current()
            self._calibration = calibration
            self._publish_if_changed()  # REBALANCING, for whoever watches, before the epoch moves on
            self._emit("layers_resplit", old=[list(r) for r in self._split], new=[list(r) for r in split],
                       epoch=self._epoch)  # fmt: skip
            self._split = split
            return self._publish_if_changed()

    # -- internals (lock held) --------------------------------------------------------------------

    def _new_id(self) -> str:
        """An id not in use; the counter never hands out the same one twice."""
        while f"worker-{self._next_id}" in self._workers:
            self._next_id += 1
        self._next_id += 1
        return f"worker-{self._next_id - 1}"

    def _forget(self, worker_id: str, reason: str) -> None:
        del self._workers[worker_id]
        self._slots = placement.vacate(self._slots, worker_id)
        self._emit("worker_removed", worker_id=worker_id, reason=reason)

    def _refill(self) -> None:
        standbys = sorted((w for w in self._workers.values() if not w.timed_out), key=lambda w: w.seq)
        before = self._slots
        labels = {w.worker_id: w.labels for w in standbys}
        self._slots = placement.fill_slots(self._slots, [w.worker_id for w in standbys], labels, self._requires)
        for rank, (old, new) in enumerate(zip(before, self._slots, strict=True)):
            if old is None and new is not None:
                self._emit("slot_assigned", worker_id=new, rank=rank, stage=rank // self._tp, tp_rank=rank % self._tp)

    def _build(self, version: int, epoch: int | None) -> Topology:
        return placement.build_topology(
            version=version, model=self._model, pp=self._pp, tp=self._tp, limits=self._limits,
            store_host=self._store_host, store_port=self._store_port, slots=self._slots,
            workers={w.worker_id: w.view() for w in self._workers.values()}, epoch=epoch, split=self._split,
            requires=self._requires, calibration=self._calibration,
        )  # fmt: skip

    def _publish_if_changed(self) -> Topology:
        current = self.store.current()
        key = placement.placement_key(self._split, self._slots, {k: w.view() for k, w in self._workers.items()})
        epoch = placement.next_epoch(self._key, self._epoch, key, current.version + 1)
        candidate = self._build(current.version, epoch)
        if candidate.same_content(current):
            return current
        published = replace(candidate, version=current.version + 1)
        self.store.publish(published)
        self._key, self._epoch = key, epoch
        vacant = sum(1 for _, sh in published.shards() if sh.vacant)
        states = [sh.state.value for _, sh in published.shards()]
        self._emit("topology_published", version=published.version, epoch=epoch, complete=published.complete,
                   vacant=vacant, states=states, calibration=published.calibration.status.value)  # fmt: skip
        return published

    def _emit(self, event: str, **fields: Any) -> None:
        if self._log is not None:
            self._log.info(event, **fields)
