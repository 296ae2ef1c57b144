"""The gateway's view of the mesh: a thread that watches the coordinator's topologies.

Why a watch and not a lookup per request: the scheduler must know at every step which workers
form the mesh and whether it is complete, and it must notice a repaired mesh after a failure
without polling. The watcher keeps the latest topology and, when it is complete, a `MeshView` with
a stub per shard; every change is published as an immutable `MeshState` to subscribers (the
scheduler). A coordinator that goes away does not take the mesh down with it: the last topology
stays in force while the watcher reconnects with backoff.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc

from gateway.fanout import MeshView, ShardClient
from gateway.links import WorkerLinks
from gateway.stream import ReopeningStream
from shardmesh.core.topology import ShardState, Topology
from shardmesh.proto.v1 import coordinator_pb2, coordinator_pb2_grpc, worker_pb2_grpc
from shardmesh.rpc import server as rpc
from shardmesh.rpc import tls
from shardmesh.rpc.tls import Dial


@dataclass(frozen=True)
class ModelFiles:
    """The gateway's own reading of the model directory: tokenizer and end-of-sequence ids."""

    path: str
    tokenizer: Any | None  # shardmesh.models.tokenizer.Tokenizer
    eos_token_ids: frozenset[int]
    problem: str = ""  # why the tokenizer or eos ids are missing, for logs

    @classmethod
    def load(cls, path: str) -> ModelFiles:
        """Never raises: a gateway without a tokenizer still serves token ids (and says so in logs)."""
        from shardmesh.models.tokenizer import Tokenizer

        try:
            tokenizer = Tokenizer.from_dir(path)
        except (ValueError, OSError) as e:
            return cls(path, None, _config_eos_ids(path), f"tokenizer not loaded: {e}")
        if tokenizer is None:
            problem = "" if Path(path).is_dir() else f"model directory {path} is not readable here"
            return cls(path, None, _config_eos_ids(path), problem or "no tokenizer.json: token ids only")
        return cls(path, tokenizer, frozenset(tokenizer.eos_token_ids))


def _config_eos_ids(path: str) -> frozenset[int]:
    from shardmesh.core.config import ModelConfig

    try:
        return frozenset(ModelConfig.from_dir(path).eos_token_ids)
    except (ValueError, OSError):
        return frozenset()


@dataclass(frozen=True)
class MeshState:
    """One published state. `seq` counts topologies received by this gateway (coordinator versions
    restart with the coordinator, so they cannot order what the gateway saw)."""

    seq: int = 0
    topology: Topology | None = None
    view: MeshView | None = None  # set only while `topology` is complete
    model: ModelFiles | None = None
    reason: str = "waiting for the first topology from the coordinator"  # why `view` is None

    @property
    def ready(self) -> bool:
        return self.view is not None


class MeshSource(Protocol):
    """What the gateway server needs from a topology source (the watcher, or a test double)."""

    def subscribe(self, callback: Callable[[MeshState], None]) -> None: ...
    def state(self) -> MeshState: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...


def incompleteness(topology: Topology) -> str:
    """Why `topology` cannot serve, for the client-facing UNAVAILABLE message."""
    bad = [f"stage {st.index} tp rank {sh.tp_rank} {'vacant' if sh.vacant else sh.state.name}"
           for st, sh in topology.shards() if sh.vacant or sh.state is not ShardState.READY]  # fmt: skip
    detail = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
    return f"topology v{topology.version} is not complete" + (f" ({detail})" if detail else "")


def uncalibrated(topology: Topology) -> str:
    """Why a complete `topology` does not serve yet: its balance check has not passed."""
    c = topology.calibration
    return f"topology v{topology.version}: balance check {c.status.value}" + (f": {c.message}" if c.message else "")


class TopologyWatcher:
    """Follows `WatchTopology` on a thread and publishes a `MeshState` for every new topology."""

    def __init__(
        self, coordinator: str, *, logger: Any, max_message_bytes: int = 64 * 1024 * 1024,
        model_dir: str | None = None, backoff: tuple[float, float] = (0.1, 2.0), dial: Dial | None = None,
    ) -> None:  # fmt: skip
        """`dial`: TLS and the join token of the channels to the coordinator and the workers (default: plaintext)."""
        self.coordinator = coordinator
        self._log = logger
        self._options = rpc.message_options(max_message_bytes)
        self._dial = dial if dial is not None else Dial()
        self._model_dir = model_dir  # overrides the topology's model path (a gateway on another host)
        self._backoff = backoff
        self._lock = threading.Lock()
        self._state = MeshState(reason=f"waiting for the first topology from the coordinator at {coordinator}")
        self._subscribers: list[Callable[[MeshState], None]] = []
        # A channel per worker, with a health watch; a worker that vanishes is reported even while no step runs.
        self._links = WorkerLinks(logger, max_message_bytes, backoff, on_lost=self._worker_lost, dial=self._dial)
        self.report_failure: Callable[[list[str], str], None] | None = None  # set by the gateway process
        self._last_problem = ""
        self._channel: grpc.Channel | None = None
        self._stream: ReopeningStream | None = None

    def subscribe(self, callback: Callable[[MeshState], None]) -> None:
        with self._lock:
            self._subscribers.append(callback)
            state = self._state
        callback(state)

    def state(self) -> MeshState:
        with self._lock:
            return self._state

    def start(self) -> None:
        channel = self._channel = tls.channel(self.coordinator, self._dial.tls, self._options, self._dial.token)
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        # after_version 0: the first message is always the current topology, which also covers a
        # restarted coordinator whose versions began again from 1.
        request = coordinator_pb2.WatchTopologyRequest(after_version=0)
        self._stream = ReopeningStream("topology-watch", lambda: stub.WatchTopology(request), self._received,
                                       self._lost, self._backoff,
                                       ended="watch stream ended (coordinator shutting down?)")  # fmt: skip
        self._stream.start()

    def stop(self) -> None:
        if self._stream is not None:
            self._stream.stop()
        if self._channel is not None:
            self._channel.close()
        self._links.close()

    # -- the watch loop ---------------------------------------------------------------------------

    def _received(self, pb: coordinator_pb2.Topology) -> None:
        self._last_problem = ""
        try:
            self._apply(Topology.from_pb(pb))
        except ValueError as e:  # a topology we cannot parse: keep the last good one
            raise ValueError(f"bad topology from the coordinator: {e}") from None

    def _worker_lost(self, address: str, error: str) -> None:
        """Tell the coordinator (through `report_failure`) about a worker of the current topology that vanished."""
        topology, report = self.state().topology, self.report_failure
        if topology is None or report is None:
            return
        ids = [sh.worker_id for _, sh in topology.shards() if sh.address == address and sh.worker_id]
        if ids:
            report(ids, f"health watch on {address}: {error or 'unreachable'}")

    def _lost(self, problem: str, retry_s: float) -> None:
        if problem != self._last_problem:
            self._log.warning("coordinator_watch_lost", coordinator=self.coordinator, error=problem, retry_s=retry_s)
            self._last_problem = problem

    def _apply(self, topology: Topology) -> None:
        with self._lock:
            current = self._state
        if current.topology == topology:
            return  # the same version again, after a reconnect
        model = current.model
        path = self._model_dir or topology.model.path
        if model is None or model.path != path:
            model = ModelFiles.load(path)
            if model.problem:
                self._log.warning("model_files_incomplete", path=path, problem=model.problem)
        view, reason = self._view(topology)
        state = MeshState(current.seq + 1, topology, view, model, reason)
        self._log.info("topology", version=topology.version, complete=topology.complete, ready=view is not None,
                       pp=topology.pp, tp=topology.tp, reason=reason or None)  # fmt: skip
        with self._lock:
            self._state = state
            subscribers = list(self._subscribers)
        for callback in subscribers:
            callback(state)

    def _view(self, topology: Topology) -> tuple[MeshView | None, str]:
        if not topology.complete or topology.rendezvous is None:
            return None, incompleteness(topology)
        if not topology.serving:
            return None, uncalibrated(topology)
        shards: list[ShardClient] = []
        for stage, shard in topology.shards():
            if not shard.address:
                return None, incompleteness(topology)
            shards.append(ShardClient(stage.index, shard.tp_rank, shard.address, shard.worker_id,
                                      worker_pb2_grpc.StageWorkerStub(self._links.channel(shard.address)),
                                      (stage.layer_start, stage.layer_end), shard.kv_cache_id))  # fmt: skip
        if len(shards) != topology.pp * topology.tp or topology.pp < 1:
            return None, f"topology v{topology.version} has {len(shards)} shards for pp={topology.pp} tp={topology.tp}"
        limits = topology.limits
        rdv = topology.rendezvous
        placement = (rdv.host, rdv.port, rdv.prefix, tuple((s.address, s.worker_id) for s in shards))
        return MeshView(
            version=topology.version, placement=placement, pp=topology.pp, tp=topology.tp,
            kv_slots=limits.kv_slots, max_context=limits.max_context,
            max_batch_tokens=limits.max_batch_tokens or limits.max_context, vocab_size=topology.model.vocab_size,
            shards=tuple(shards), kv_block_size=limits.kv_block_size, kv_blocks=limits.kv_blocks,
        ), ""  # fmt: skip
