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
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from coordinator import placement, rebalance
from coordinator.replan import MemoryCheck
from shardmesh.core.errors import FailedPrecondition, InvalidArgument, NotFound
from shardmesh.core.layout import check_split, split_layers
from shardmesh.core.topology import (
    Calibration,
    CalibrationStatus,
    HeldShard,
    ModelSpec,
    ServingLimits,
    ShardState,
    Topology,
    TopologyStore,
    WorkerState,
)
from shardmesh.proto.v1 import common_pb2, coordinator_pb2

_WORKER_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
_LABEL_KEY = re.compile(r"[A-Za-z0-9._/-]{1,63}")
MAX_LABELS, MAX_LABEL_VALUE = 32, 256
MAX_REPORTED = 1024  # worker ids in one ReportFailure
PREPARE_TIMEOUT_S = 60.0  # a drain hands the slot over after this even if the spare never said it was prepared
LOST_RETENTION = 20  # heartbeat timeouts a lost worker without a slot stays listed (as LOST) before it is forgotten


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
    uuid: str = ""  # the GPU's UUID; "" for cpu (or a worker that does not say)
    index: int = 0  # cuda:N as the worker's process knows it

    @classmethod
    def from_pb(cls, pb: common_pb2.Device) -> Device:
        if pb.type == common_pb2.DEVICE_TYPE_UNSPECIFIED or pb.type not in common_pb2.DeviceType.values():
            raise InvalidArgument("device.type", "must be DEVICE_TYPE_CPU or DEVICE_TYPE_CUDA")
        if len(pb.uuid) > 256:
            raise InvalidArgument("device.uuid", f"at most 256 characters, got {len(pb.uuid)}")
        return cls(common_pb2.DeviceType.Name(pb.type).removeprefix("DEVICE_TYPE_").lower(), pb.name, pb.memory_bytes,
                   pb.uuid, pb.index)  # fmt: skip

    def describe(self) -> str:
        return f"{self.type}:{self.index}" if self.type == "cuda" else self.type


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
    pid: int = 0
    last_version: int = 0  # the newest version it saw, maybe from an earlier coordinator
    held: HeldShard | None = None  # what it holds from an earlier coordinator
    speed: rebalance.Speed = field(default_factory=rebalance.Speed)

    @classmethod
    def from_pb(cls, pb: coordinator_pb2.RegisterRequest) -> Registration:
        parse_address(pb.address)
        if not 0 <= pb.speed_gflops < 1e12:  # also refuses NaN
            raise InvalidArgument("speed_gflops", f"must be a GFLOP/s figure >= 0, got {pb.speed_gflops}")
        if len(pb.speed_class) > 256:
            raise InvalidArgument("speed_class", f"at most 256 characters, got {len(pb.speed_class)}")
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
        held = HeldShard.from_pb(pb.held) if pb.HasField("held") else None
        if held is not None and (held.epoch < 1 or held.layer_end <= held.layer_start):
            raise InvalidArgument("held", f"epoch must be >= 1 and layer_end > layer_start, got {held}")
        return cls(pb.address, Device.from_pb(pb.device), tuple(sorted(pb.labels.items())), requested, pb.pid,
                   pb.last_topology_version, held, rebalance.Speed(pb.speed_gflops, pb.speed_class))  # fmt: skip


@dataclass(frozen=True)
class HeartbeatReport:
    worker_id: str
    state: ShardState
    applied_version: int
    load: Load
    detail: str = ""
    prepared_rank: int | None = None
    kv_cache_id: str = ""

    @classmethod
    def from_pb(cls, pb: coordinator_pb2.HeartbeatRequest) -> HeartbeatReport:
        check_worker_id(pb.worker_id)
        try:
            state = ShardState.from_pb(pb.state)
        except ValueError as e:
            raise InvalidArgument("state", str(e)) from None
        prepared = pb.prepared_rank if pb.HasField("prepared_rank") else None
        return cls(pb.worker_id, state, pb.applied_topology_version, Load.from_pb(pb.load), pb.detail[:1024],
                   prepared, pb.kv_cache_id[:64])  # fmt: skip


@dataclass(frozen=True)
class Preparing:
    """A spare asked to load the weights of `rank`: for a drain's hand-over, or `ahead` of any need (a hot spare)."""

    rank: int
    since: float  # monotonic seconds: a drain hands over after PREPARE_TIMEOUT_S regardless
    ahead: bool = False


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
    timed_out: bool = False  # lost: silent for longer than the timeout, or unreachable when reported failed
    load: Load = field(default_factory=Load)
    pid: int = 0
    held: HeldShard | None = None  # claimed at registration (after a coordinator restart)
    draining: bool = False
    detail: str = ""  # why it is lost, or what its drain waits for
    lost_at: float = 0.0
    prepared_rank: int | None = None  # a spare: the rank whose weights it reports loaded
    preparing: Preparing | None = None  # a spare asked to load a rank's weights
    kv_cache_id: str = ""  # as last reported: published with the slot it holds
    speed: rebalance.Speed = field(default_factory=rebalance.Speed)

    def view(self) -> placement.WorkerView:
        return placement.WorkerView(self.worker_id, self.address, self.incarnation, self.reported,
                                    self.applied_version, self.timed_out, self.labels, self.pid, self.draining,
                                    self.detail, self.prepared_rank,
                                    self.preparing.rank if self.preparing else None, self.kv_cache_id,
                                    self.preparing.ahead if self.preparing else False)  # fmt: skip


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
        recovery_grace: float = 0.0,
        memory_check: MemoryCheck | None = None,
        replan_after: float = 10.0,
        regrow_interval: float = 10.0,
        rebalance_gain: float = 1.3,
        rebalance_interval: float = 30.0,
        tp_split: tuple[int, ...] = (),
    ) -> None:
        self._model, self._pp, self._tp, self._limits = model, pp, tp, limits
        if tp_split and len(tp_split) != tp:
            raise ValueError(f"tp_split {tp_split} needs {tp} shares, one per tensor-parallel rank")
        self._tp_split = tuple(tp_split)
        self._split: placement.Split = tuple(split or split_layers(model.num_layers, pp))
        check_split(self._split, model.num_layers, pp)
        if requires is not None and len(requires) != pp * tp:
            raise ValueError(f"need label requirements for {pp * tp} slots, got {len(requires)}")
        self._requires = tuple(requires) if requires is not None else None
        self._calibration: Calibration | None = None  # the latest result, for the epoch it names
        # The split and each rank's device when a balance check last passed: a new epoch with the same split on the
        # same devices (a spare of the same kind in a lost or drained worker's slot) needs no new check.
        self._passed_on: tuple[placement.Split, tuple[tuple[str, str], ...]] | None = None
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
        self._established = False  # a placement got an epoch in this coordinator's life
        self._floor = 0  # the highest version a registering worker saw (an earlier coordinator's)
        self.changes: Counter[str] = Counter()  # new rendezvous epochs, by what caused them
        # Soft state: a restarted coordinator learns the placement back from the workers that re-register and
        # claim what they hold. Until a placement is established or `recovery_grace` has passed, claimed slots
        # wait for their claimants and watchers are told nothing (they keep serving the last topology they had).
        self._recovery_ends = clock() + recovery_grace
        # Re-planning (coordinator/replan.py): off without a memory check, and when a plan pins ranks to nodes.
        self._memory_check = memory_check if requires is None else None
        self._target = (pp, self._split)  # the planned pipeline, which the mesh grows back to
        self._replan_after, self._regrow_interval = replan_after, regrow_interval
        # A rank handed over from a serving worker -> (that worker, the new holder): the new holder copies its KV
        # cache at the next rendezvous (ShardAssignment.kv_from), so the gateway replays nothing on that stage.
        self._kv_from: dict[int, tuple[str, str]] = {}
        # Moving a slot onto a faster spare (coordinator/rebalance.py): at least this predicted gain (0: never),
        # at most one move per interval, one at a time, make-before-break.
        self._rebalance_gain, self._rebalance_interval = rebalance_gain, rebalance_interval
        self._move: tuple[rebalance.Move, float] | None = None  # planned, and since when its spare prepares
        self._last_move = float("-inf")
        self._reason_override = ""  # what the next new epoch is counted as, when not the caller's reason
        self._stuck_since: float | None = None  # since when a slot has had no holder that serves
        self._last_replan = float("-inf")
        self._replan_blocked = ""  # why the survivors cannot take the model over, for status
        self.settled = threading.Event()
        if recovery_grace <= 0:
            self.settled.set()
        self.store = TopologyStore(self._build(version=1, epoch=None))

    # -- operations -------------------------------------------------------------------------------

    def register(self, reg: Registration) -> tuple[str, Topology]:
        """Add (or re-add, after a restart) a worker; returns its id and the topology it produced."""
        with self._lock:
            now = self._clock()
            # An address names one live process: anyone else still registered there is gone.
            same_address = [w for w in self._workers.values() if w.address == reg.address]
            worker_id = reg.requested_id or (same_address[0].worker_id if same_address else self._new_id())
            self._check_own_gpu(worker_id, reg, same_address)
            for stale in same_address:
                if stale.worker_id != worker_id:
                    self._forget(stale.worker_id, reason="address_reused")
            old = self._workers.get(worker_id)
            self._incarnations += 1
            if old is None:
                self._seq += 1
            self._floor = max(self._floor, reg.last_version)
            # A worker that claims a shard is READY in that epoch (it holds no claim otherwise): saying so now keeps
            # an adopted placement serving without waiting for the worker's next heartbeat.
            reported, applied = (ShardState.READY, reg.held.epoch) if reg.held else (ShardState.PENDING, 0)
            self._workers[worker_id] = WorkerRecord(
                worker_id, reg.address, reg.device, reg.labels, old.seq if old else self._seq, self._incarnations,
                now, reported, applied, pid=reg.pid, held=reg.held, speed=reg.speed,
            )  # fmt: skip
            self._emit("worker_registered", worker_id=worker_id, address=reg.address, device=reg.device.type,
                       returning=old is not None, labels=dict(reg.labels), pid=reg.pid,
                       held=None if reg.held is None else f"epoch {reg.held.epoch} rank {reg.held.rank}")  # fmt: skip
            self._take_claimed_slot(worker_id)
            if worker_id in self._slots and self._requires is not None:
                rank = self._slots.index(worker_id)
                if not placement.fits(reg.labels, self._requires[rank]):  # came back with other labels
                    self._slots = placement.vacate(self._slots, worker_id)
                    self._emit("slot_vacated", worker_id=worker_id, rank=rank, reason="labels_changed",
                               requires=dict(self._requires[rank]))  # fmt: skip
            self._refill()
            topology = self._publish_if_changed("join")
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
            broken = report.state is ShardState.UNHEALTHY
            if broken and record.reported is not ShardState.UNHEALTHY:
                self._emit("worker_reports_unhealthy", worker_id=record.worker_id, detail=report.detail)
            detail = report.detail if broken else ("" if record.timed_out else record.detail)
            self._workers[report.worker_id] = replace(
                record, last_seen=self._clock(), reported=report.state, applied_version=report.applied_version,
                timed_out=False, load=report.load, detail=detail, prepared_rank=report.prepared_rank,
                kv_cache_id=report.kv_cache_id,
            )  # fmt: skip
            prepared = report.prepared_rank != record.prepared_rank  # a drain's spare is ready: the hand-over
            if broken or record.timed_out or prepared:
                self._refill()
            return True, self._publish_if_changed("lost" if broken else "drain" if prepared else "join").version

    def _check_own_gpu(self, worker_id: str, reg: Registration, same_address: Sequence[WorkerRecord]) -> None:
        """Refuse a second live worker on one GPU (by UUID): NCCL would refuse the pair at the next rendezvous, and
        until then both would hold memory on it. The same id re-registering (a restart) keeps its GPU; a worker that
        was at this address, or is lost, is gone and frees it."""
        uuid = reg.device.uuid
        if not uuid:
            return
        gone = {w.worker_id for w in same_address}
        holders = [w for w in self._workers.values() if w.device.uuid == uuid and not w.timed_out
                   and w.worker_id != worker_id and w.worker_id not in gone]  # fmt: skip
        if not holders:
            return
        other = holders[0]
        self._emit("registration_refused", worker_id=worker_id, reason="gpu_in_use", uuid=uuid, holder=other.worker_id)
        mine, theirs = reg.device.describe(), other.device.describe()
        where = mine if mine == theirs else f"{mine} and {theirs} in their processes"
        raise FailedPrecondition(
            f"device.uuid: {worker_id} and {other.worker_id} are both on GPU {uuid} ({where}): one GPU per rank"
        )

    def deregister(self, worker_id: str) -> int:
        """Remove a worker for good; its slot goes to the next standby. Returns the new version."""
        with self._lock:
            if worker_id not in self._workers:
                raise NotFound(f"worker_id: no registered worker {worker_id!r}")
            self._forget(worker_id, reason="deregistered")
            self._refill()
            return self._publish_if_changed("leave").version

    def expire(self) -> list[str]:
        """Mark workers silent for longer than the timeout as lost: a spare takes a lost worker's slot (without
        one, the slot waits for the worker's return, UNHEALTHY). Lost workers without a slot are forgotten after
        LOST_RETENTION timeouts. Also ends the recovery window. Returns the ids that timed out now."""
        with self._lock:
            now = self._clock()
            expired = [w for w in self._workers.values()
                       if not w.timed_out and now - w.last_seen > self.heartbeat_timeout]  # fmt: skip
            for w in expired:
                self._lose(w, f"no heartbeat for {now - w.last_seen:.1f} s", reason="heartbeat_timeout")
            stale = [w.worker_id for w in self._workers.values() if w.timed_out and w.worker_id not in self._slots
                     and now - w.lost_at > LOST_RETENTION * self.heartbeat_timeout]  # fmt: skip
            for worker_id in stale:
                self._forget(worker_id, reason="lost_retention_over")
            settling = not self.settled.is_set() and now >= self._recovery_ends
            if settling:
                self._emit("recovery_window_over", placed=sum(w is not None for w in self._slots))
                self.settled.set()
            self._refill()  # also where a re-plan falls due (`_maybe_replan`)
            self._publish_if_changed("lost" if expired or stale or settling else "replan")
            return [w.worker_id for w in expired]

    def report_lost(self, worker_ids: Sequence[str], why: str) -> tuple[list[str], int]:
        """Workers somebody saw fail and that did not answer a health check: lost now, as if their heartbeats
        had timed out. Returns the ids newly lost and the version after acting on them."""
        with self._lock:
            lost = [self._workers[i] for i in dict.fromkeys(worker_ids) if i in self._workers]
            lost = [w for w in lost if not w.timed_out]
            for w in lost:
                self._lose(w, why, reason="reported")
            if lost:
                self._refill()
            return [w.worker_id for w in lost], self._publish_if_changed("lost").version

    def drain(self, worker_id: str) -> tuple[WorkerState, str, int]:
        """Ask `worker_id` to leave: its slot goes to a spare now or when one registers; a worker without a slot
        exits at once. Returns its state, what the drain waits for and the version after the request."""
        with self._lock:
            record = self._workers.get(worker_id)
            if record is None:
                raise NotFound(f"worker_id: no registered worker {worker_id!r}")
            if not record.draining:
                self._emit("drain_requested", worker_id=worker_id, holds_slot=worker_id in self._slots)
                self._workers[worker_id] = replace(record, draining=True)
            self._refill()
            topology = self._publish_if_changed("drain")
            listed = topology.worker(worker_id)
            assert listed is not None
            return listed.state, listed.detail, topology.version

    def workers(self) -> Mapping[str, WorkerRecord]:
        with self._lock:
            return dict(self._workers)

    def change_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.changes)

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
            if calibration.passed:
                self._passed_on = (self._split, self._devices())
            self._publish_if_changed("calibration")
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
            self._publish_if_changed("calibration")  # REBALANCING, for whoever watches, before the epoch moves on
            self._emit("layers_resplit", old=[list(r) for r in self._split], new=[list(r) for r in split],
                       epoch=self._epoch)  # fmt: skip
            self._split = split
            return self._publish_if_changed("resplit")

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

    def _lose(self, w: WorkerRecord, why: str, reason: str) -> None:
        self._workers[w.worker_id] = replace(w, timed_out=True, detail=why, lost_at=self._clock())
        self._emit("worker_lost", worker_id=w.worker_id, reason=reason, detail=why,
                   held_slot=w.worker_id in self._slots)  # fmt: skip

    def _claim(self, record: WorkerRecord) -> int | None:
        return placement.claimed_rank(record.held, self._pp, self._tp, self._split)

    def _recovering(self) -> bool:
        """In the recovery window of a coordinator that replaces another: a worker said it saw topologies before."""
        return not self.settled.is_set() and self._floor > 0

    def _take_claimed_slot(self, worker_id: str) -> None:
        """Put a re-registering worker back in the slot it claims, while no placement is established yet (a
        newcomer placed there meanwhile steps back: it has nothing loaded worth keeping)."""
        record = self._workers[worker_id]
        rank = self._claim(record)
        if self._established or rank is None or worker_id in self._slots:
            return
        holder = self._slots[rank]
        if holder is not None and (holder not in self._workers or self._claim(self._workers[holder]) == rank):
            return
        if self._requires is not None and not placement.fits(record.labels, self._requires[rank]):
            return
        self._slots = (*self._slots[:rank], worker_id, *self._slots[rank + 1 :])
        self._emit("slot_reclaimed", worker_id=worker_id, rank=rank, epoch=record.held.epoch if record.held else None,
                   displaced=holder)  # fmt: skip

    def _refill(self) -> None:
        """Spares into vacant slots, then into the slots of lost and draining holders (see placement)."""
        views = {k: w.view() for k, w in self._workers.items()}
        by_seq = sorted(self._workers.values(), key=lambda w: w.seq)
        # While recovering, unclaimed workers wait: the slots are kept for the workers that held them.
        recovering = self._recovering()
        spares = [w.worker_id for w in by_seq if placement.is_spare(views[w.worker_id], self._slots)
                  and not (recovering and self._claim(w) is None)]  # fmt: skip
        before = self._slots
        labels = {w: views[w].labels for w in spares}
        self._slots = placement.fill_slots(self._slots, spares, labels, self._requires)
        for rank, (old, new) in enumerate(zip(before, self._slots, strict=True)):
            if old is None and new is not None:
                self._emit("slot_assigned", worker_id=new, rank=rank, stage=rank // self._tp, tp_rank=rank % self._tp)
        now = self._clock()
        prepared = {w: r.preparing.rank for w, r in self._workers.items()  # asked long ago: hand over regardless
                    if r.preparing and not r.preparing.ahead
                    and now - r.preparing.since >= PREPARE_TIMEOUT_S}  # fmt: skip
        prepared |= {w: r.prepared_rank for w, r in self._workers.items() if r.prepared_rank is not None}
        free = [s for s in spares if s not in self._slots]
        self._slots, moves, prepares = placement.hand_over(self._slots, views, free, self._requires, prepared)
        asked = {spare: (rank, False) for rank, spare in prepares}
        idle = [s for s in free if s not in self._slots and s not in asked]
        busy = bool(prepares or moves) or any(h is not None and placement.leaving(views[h]) for h in self._slots)
        target = self._maybe_rebalance(views, idle, now, busy)
        if target is not None:
            asked[target[0]] = (target[1], False)
        ahead = placement.ahead_of_time(len(self._slots), idle, views, {s: r for s, (r, _) in asked.items()},
                                        self._requires)  # fmt: skip
        asked |= {spare: (rank, True) for spare, rank in ahead.items() if spare not in asked}
        for worker_id, record in self._workers.items():
            want, was = asked.get(worker_id), record.preparing
            if want is None:
                if was is not None:
                    self._workers[worker_id] = replace(record, preparing=None)
            elif was is None or (was.rank, was.ahead) != want:
                # A drain's deadline counts from when the drain asked, even if the spare loaded the rank ahead.
                self._workers[worker_id] = replace(record, preparing=Preparing(want[0], now, want[1]))
                self._emit("spare_preparing", worker_id=worker_id, rank=want[0], stage=want[0] // self._tp,
                           tp_rank=want[0] % self._tp, ahead=want[1])  # fmt: skip
        for rank, old, new in moves:
            why = "draining" if views[old].draining else "lost"
            sends = self._send_kv_along(rank, old, new, views[old])
            self._emit("slot_handed_over", rank=rank, stage=rank // self._tp, tp_rank=rank % self._tp, old=old,
                       new=new, reason=why, kv_from=old if sends else None)  # fmt: skip
        self._maybe_replan(views, by_seq)
        for worker_id, record in self._workers.items():  # what each drain waits for
            if record.draining:
                detail = self._drain_detail(worker_id)
                if detail != record.detail:
                    self._workers[worker_id] = replace(record, detail=detail)

    def _maybe_rebalance(self, views: Mapping[str, placement.WorkerView], idle: Sequence[str], now: float,
                         busy: bool) -> tuple[str, int] | None:  # fmt: skip
        """Plan, advance or make a move of a slot onto a faster spare; returns (spare, rank) while its spare must
        prepare. A move is made only once the spare has loaded the slot (make-before-break), with the KV cache
        sent along (`kv_from`); it is given up when its spare or its slot's holder is needed elsewhere or gone."""
        if self._move is not None:
            move, since = self._move
            if self._slots[move.rank] != move.old or placement.leaving(views[move.old]) or move.new not in idle \
                    or now - since >= PREPARE_TIMEOUT_S:  # fmt: skip
                self._emit("rebalance_abandoned", rank=move.rank, old=move.old, new=move.new)
                self._set_detail(move.new, "")
                self._move = None
                return None
            if views[move.new].prepared_rank != move.rank:
                return move.new, move.rank
            self._slots = (*self._slots[: move.rank], move.new, *self._slots[move.rank + 1 :])
            self._send_kv_along(move.rank, move.old, move.new, views[move.old])
            self._emit("slot_moved", rank=move.rank, stage=move.rank // self._tp, tp_rank=move.rank % self._tp,
                       old=move.old, new=move.new, reason="faster", gain=round(move.gain, 2))  # fmt: skip
            self._set_detail(move.new, "")
            self._move, self._last_move, self._reason_override = None, now, "rebalance"
            return None
        if self._rebalance_gain <= 0 or busy or now - self._last_move < self._rebalance_interval:
            return None
        if (
            self._recovering()
            or self._kv_from
            or self._epoch is None
            or any(
                h is None or views[h].reported is not ShardState.READY or views[h].applied_version < self._epoch
                for h in self._slots
            )
        ):  # only a mesh that serves is rebalanced, and one change at a time
            return None
        move = rebalance.best_move(self._split, self._slots, self._tp, {w: r.speed for w, r in self._workers.items()},
                                   idle, self._requires, {w: v.labels for w, v in views.items()},
                                   self._rebalance_gain, self._fits_memory)  # fmt: skip
        if move is None:
            return None
        self._move = (move, now)
        stage, tp_rank = move.rank // self._tp, move.rank % self._tp
        self._emit("rebalance_planned", rank=move.rank, stage=stage, tp_rank=tp_rank, old=move.old, new=move.new,
                   gain=round(move.gain, 2))  # fmt: skip
        self._set_detail(move.new, f"loading stage {stage} tp rank {tp_rank} to take it over from {move.old}: "
                                   f"a {move.gain:.2f}x faster pipeline")  # fmt: skip
        return move.new, move.rank

    def _fits_memory(self, slots: placement.Slots) -> bool:
        """Whether every holder in `slots` can hold its shard of the current split (always, without a memory model)."""
        return not self._memory_refusal(self._pp, self._split, slots)

    def _memory_refusal(self, pp: int, split: placement.Split, slots: placement.Slots) -> str:
        """Why the holders in `slots` cannot hold `split` on `pp` stages by the planner's memory model; "" if they
        can, or when there is no model to ask."""
        if self._memory_check is None:
            return ""
        devices = [self._workers[w].device for w in slots if w is not None]
        return self._memory_check(pp, split, [d.memory_bytes for d in devices], [d.type for d in devices])

    def _set_detail(self, worker_id: str, detail: str) -> None:
        record = self._workers.get(worker_id)
        if record is not None and record.detail != detail:
            self._workers[worker_id] = replace(record, detail=detail)

    def _drain_detail(self, worker_id: str) -> str:
        if worker_id not in self._slots:
            return "slot handed over; exiting"
        rank = self._slots.index(worker_id)
        preparing = next((w for w, r in self._workers.items()
                          if r.preparing and not r.preparing.ahead and r.preparing.rank == rank), None)  # fmt: skip
        if preparing is not None:
            return f"serving until {preparing} has loaded stage {rank // self._tp} tp rank {rank % self._tp}"
        blocked = self._replan_blocked and f"; the other workers cannot take the model over: {self._replan_blocked}"
        return (f"waiting for a spare to take stage {rank // self._tp} tp rank {rank % self._tp} "
                f"(start one with `shardmesh worker --coordinator ...`){blocked}")  # fmt: skip

    def _maybe_replan(self, views: Mapping[str, placement.WorkerView], by_seq: Sequence[WorkerRecord]) -> None:
        """Move the model onto the healthy workers when a slot has nobody to serve it (fewer stages), and back
        onto the planned number of stages once enough workers are there again. `views` and `by_seq`: `_refill`'s
        (what they say of health and drains has not changed since)."""
        if self._memory_check is None or self._recovering():
            return
        if not self._established:  # still forming: a slot no worker has taken yet is not a lost one
            self._stuck_since = None  # (a worker that starts slowly must not shrink the plan before it registers)
            return
        now = self._clock()
        handing_over = {w.preparing.rank for w in self._workers.values()  # a spare is on its way
                        if w.preparing and not w.preparing.ahead}  # fmt: skip
        stuck = [r for r, h in enumerate(self._slots)
                 if h is None or (placement.leaving(views[h]) and r not in handing_over)]  # fmt: skip
        if not stuck:
            self._stuck_since, self._replan_blocked = None, ""
        elif self._stuck_since is None:
            self._stuck_since = now
        # Workers that can serve: today's holders that stay (in rank order, so most keep their rank), then spares.
        staying = [h for h in self._slots if h is not None and not placement.leaving(views[h])]
        spares = [w.worker_id for w in by_seq if placement.is_spare(views[w.worker_id], self._slots)]
        usable = staying + spares
        target_pp = self._target[0]
        if stuck:
            draining = any(h is not None and views[h].draining for h in self._slots)
            if not draining and now - (self._stuck_since or now) < self._replan_after:
                return  # a lost worker may come back (`up` restarts it): give it the time
            why = []
            for pp in range(min(target_pp, len(usable) // self._tp, self._pp - 1), 0, -1):
                reason = self._replan(pp, usable, "shrink")
                if not reason:
                    return
                why.append(reason)
            self._replan_blocked = why[-1] if why else f"{len(usable)} healthy worker(s) for tp={self._tp}"
        elif self._pp < target_pp and now - self._last_replan >= self._regrow_interval:
            pp = min(target_pp, len(usable) // self._tp)
            if pp > self._pp:
                self._replan(pp, usable, "grow")

    def _replan(self, pp: int, usable: Sequence[str], reason: str) -> str:
        """Serve on `pp` stages of the first workers of `usable`, if their memory holds it; else say why not."""
        split = self._target[1] if pp == self._target[0] else tuple(split_layers(self._model.num_layers, pp))
        slots = tuple(usable[: pp * self._tp])
        why = self._memory_refusal(pp, split, slots)
        if why:
            return why
        self._emit("replanned", reason=reason, old_pp=self._pp, new_pp=pp, old=[list(r) for r in self._split],
                   new=[list(r) for r in split], slots=list(slots))  # fmt: skip
        self._pp, self._split, self._slots = pp, split, slots
        self._last_replan, self._stuck_since, self._replan_blocked = self._clock(), None, ""
        return ""

    def _build(self, version: int, epoch: int | None) -> Topology:
        ordered = sorted(self._workers.values(), key=lambda w: w.seq)
        return placement.build_topology(
            version=version, model=self._model, pp=self._pp, tp=self._tp, limits=self._limits,
            store_host=self._store_host, store_port=self._store_port, slots=self._slots,
            workers={w.worker_id: w.view() for w in ordered}, epoch=epoch, split=self._split,
            requires=self._requires, calibration=self._calibration,
            kv_from={rank: old for rank, (old, _) in self._kv_from.items()}, tp_split=self._tp_split,
        )  # fmt: skip

    def _devices(self) -> tuple[tuple[str, str], ...]:
        """(type, name) of each rank's device; ("", "") for a vacant slot."""
        return tuple((self._workers[w].device.type, self._workers[w].device.name) if w in self._workers else ("", "")
                     for w in self._slots)  # fmt: skip

    def _carry_over(self, epoch: int) -> None:
        """Keep the passed balance check for a new epoch that changed only who holds a slot, not on what device.
        Measuring again would cost seconds of every request's pause in a fail-over and could not say anything new."""
        previous = self._calibration
        if previous is None or not previous.passed or self._passed_on != (self._split, self._devices()):
            return
        self._calibration = replace(
            previous, status=CalibrationStatus.CARRIED_OVER, epoch=epoch,
            message=f"the check of epoch {previous.epoch} carried over: same layer split, same devices "
                    f"({previous.status.value}: {previous.message})"[:1024],
        )  # fmt: skip
        self._emit("calibration_carried_over", epoch=epoch, previous_epoch=previous.epoch)

    def _adopt(self) -> int | None:
        """The epoch the workers kept through a coordinator restart, when every slot holder claims it; its
        balance check carries over when a gateway served on it (measuring again would need its KV slots)."""
        if self._established:
            return None
        epoch = placement.adopted_epoch(self._slots, {k: w.held for k, w in self._workers.items()})
        if epoch is None:
            return None
        claims = [self._workers[w].held for w in self._slots if w is not None]
        if any(c is not None and c.served for c in claims):
            self._calibration = Calibration(
                CalibrationStatus.CARRIED_OVER, epoch, True,
                message="not measured again: a gateway was serving this placement when the coordinator restarted",
            )  # fmt: skip
        self._emit("placement_adopted", epoch=epoch, carried_over=self._calibration is not None)
        return epoch

    def _send_kv_along(self, rank: int, old: str, new: str, holder: placement.WorkerView) -> bool:
        """A slot moved from `old` to `new`: name `old` as the new holder's KV source (ShardAssignment.kv_from) when it
        is alive and was serving (a drain, a move onto a faster worker); returns whether it was named. A lost
        holder's cache is gone with it: the gateway replays instead."""
        if holder.timed_out or holder.reported is not ShardState.READY:
            self._kv_from.pop(rank, None)
            return False
        self._kv_from[rank] = (old, new)
        return True

    def _prune_kv_from(self) -> None:
        """Forget a hand-over's KV source once it can no longer matter: the new holder left the slot or reported
        READY in the current epoch (it received the cache, or gave up and replays), or the old holder is gone."""
        for rank, (old, new) in list(self._kv_from.items()):
            holder, sender = self._workers.get(new), self._workers.get(old)
            moved_on = rank >= len(self._slots) or self._slots[rank] != new or holder is None
            ready = holder is not None and holder.reported is ShardState.READY and self._epoch is not None \
                and holder.applied_version >= self._epoch  # fmt: skip
            if moved_on or ready or sender is None or sender.timed_out:
                del self._kv_from[rank]

    def _publish_if_changed(self, reason: str) -> Topology:
        reason, self._reason_override = self._reason_override or reason, ""
        self._prune_kv_from()
        current = self.store.current()
        key = placement.placement_key(self._split, self._slots, {k: w.view() for k, w in self._workers.items()})
        version = max(current.version, self._floor) + 1
        epoch = placement.next_epoch(self._key, self._epoch, key, version)
        if key is not None and key != self._key:
            adopted = self._adopt()
            if adopted is None and epoch is not None and epoch != self._epoch:
                self._carry_over(epoch)
            epoch = adopted or epoch
        candidate = self._build(current.version, epoch)
        if candidate.same_content(current):
            return current
        published = replace(candidate, version=version)
        self.store.publish(published)
        if epoch is not None and epoch != self._epoch:
            self.changes[reason] += 1
            self._established = True
            if not self.settled.is_set():
                self._emit("recovered", epoch=epoch, version=version)
                self.settled.set()
        self._key, self._epoch = key, epoch
        vacant = sum(1 for _, sh in published.shards() if sh.vacant)
        states = [sh.state.value for _, sh in published.shards()]
        self._emit("topology_published", version=published.version, epoch=epoch, complete=published.complete,
                   vacant=vacant, states=states, calibration=published.calibration.status.value)  # fmt: skip
        return published

    def _emit(self, event: str, **fields: Any) -> None:
        if self._log is not None:
            self._log.info(event, **fields)
