"""A stage worker's state, independent of gRPC: which shard it holds, which groups it is in, its steps.

Life cycle of one assignment (driven by topology versions from the coordinator):
  PENDING ──(assigned a shard)──► LOADING ──(weights read, groups formed, KV cache reserved)──► READY
A new rendezvous epoch (someone joined, restarted or left) re-forms the groups; the weights, the KV
cache and the activation log are kept when the shard is the same, and so is the cache's id
(`kv_cache_id`, in every heartbeat): a gateway that sees the same id before and after the change knows
that this shard still holds every running sequence's keys and values, and replays their logs only on the
stages that lost them. A step that fails on a broken link leaves the worker PENDING (its cache kept
aside) until the coordinator publishes a new epoch; the gateway resumes that step's requests there.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from shardmesh.core.config import ModelConfig
from shardmesh.core.dtypes import Quantization
from shardmesh.core.errors import FailedPrecondition, InvalidArgument, MeshError, ResourceExhausted, Unavailable
from shardmesh.core.layout import ShardSpec
from shardmesh.core.step import (
    MAX_DECODE_STEPS,
    Sampled,
    SamplingParams,
    Segment,
    StepEntry,
    blocks_for,
    check_block_table,
    written_blocks,
)
from shardmesh.core.topology import HeldShard, Rendezvous, ServingLimits, ShardState, Topology
from shardmesh.engine import compute_priority, kv_transfer, offload
from shardmesh.engine.batch import BatchLayout
from shardmesh.engine.groups import (
    Backend,
    ShardGroups,
    StageLink,
    build_transport_kernels,
    check_staging,
    form_groups,
    form_link,
)
from shardmesh.engine.kv_cache import ActivationLog, AnyKVCache, PagedActivationLog, PagedKVCache
from shardmesh.engine.loader import build_shard, parse_dtype
from shardmesh.engine.model import Transformer
from shardmesh.engine.penalties import TokenHistory
from shardmesh.engine.sampling import draw_table, penalty_table, random_seed, sample, seed_bits
from shardmesh.engine.stage import Relay, StageEngine
from shardmesh.engine.timing import calibrate_shard
from shardmesh.engine.tp import bind_group
from shardworker import heap
from shardworker.ordering import OrderError, StepOrder

R = TypeVar("R")


@dataclass(frozen=True)
class Placement:
    """Where this worker sits in one topology."""

    spec: ShardSpec
    stage: int
    num_stages: int
    rendezvous: Rendezvous
    limits: ServingLimits
    model_path: str
    dtype: str
    kv_from: str = ""  # the serving worker this slot was handed over from: its KV cache is copied at the join
    quantization: str = "none"

    @classmethod
    def of(cls, topology: Topology, worker_id: str) -> Placement | None:
        found = topology.find(worker_id)
        if found is None or topology.rendezvous is None:
            return None
        stage, shard = found
        spec = ShardSpec(
            stage.layer_start, stage.layer_end, topology.model.num_layers, shard.tp_rank, topology.tp, topology.tp_split
        )
        return cls(spec, stage.index, topology.pp, topology.rendezvous, topology.limits, topology.model.path,
                   topology.model.dtype, shard.kv_from, topology.model.quantization)  # fmt: skip

    @property
    def rank(self) -> int:
        return self.stage * self.spec.tp_size + self.spec.tp_rank


@dataclass
class StepStats:
    steps: int = 0
    compute_s: float = 0.0
    recv_wait_s: float = 0.0


@dataclass(frozen=True)
class CommCounters:
    """What a shard's links and collectives have moved: cumulative, or one step's share (a difference)."""

    recv_wait_s: float = 0.0  # waiting for activations from the previous stage (its compute + the transfer)
    recv_bytes: int = 0
    recv_messages: int = 0
    send_s: float = 0.0  # sending activations to the next stage
    send_bytes: int = 0
    send_messages: int = 0
    collective_s: float = 0.0  # tensor-parallel all-reduce / all-gather, until complete on this rank
    collective_bytes: int = 0
    collective_calls: int = 0

    @classmethod
    def of(cls, groups: ShardGroups) -> CommCounters:
        """The links' and the tp group's counters. The loop (`ShardGroups.loop`) counts with the first stage's
        receiving and the last stage's sending: the first stage waits on it for its next token as on `prev`."""
        tp = groups.tp
        links = [link for link in (groups.prev, groups.next, groups.loop) if link is not None]
        ins = [link for link in links if not link.is_sender]
        outs = [link for link in links if link.is_sender]
        return cls(
            sum(x.wait_s for x in ins), sum(x.bytes_received for x in ins), sum(x.messages_received for x in ins),
            sum(x.send_s for x in outs), sum(x.bytes_sent for x in outs), sum(x.messages_sent for x in outs),
            getattr(tp, "wait_s", 0.0), getattr(tp, "bytes", 0), getattr(tp, "calls", 0),
        )  # fmt: skip

    def __sub__(self, other: CommCounters) -> CommCounters:
        # Field by field with getattr: `dataclasses.astuple` deep-copies, ~0.1 ms per step for nothing.
        return CommCounters(*(getattr(self, f) - getattr(other, f) for f in _COMM_FIELDS))

    def __add__(self, other: CommCounters) -> CommCounters:
        return CommCounters(*(getattr(self, f) + getattr(other, f) for f in _COMM_FIELDS))


_COMM_FIELDS = tuple(f.name for f in fields(CommCounters))


@dataclass(frozen=True)
class StepResult:
    """One step on this shard: the sampled tokens (last stage only) and where the time went."""

    sampled: list[Sampled]  # step-major when several decode steps ran
    elapsed_s: float  # the engine step, communication included
    comm: CommCounters  # this step's share
    placement: Placement
    steps: int = 1  # decode steps run in the call

    @property
    def compute_s(self) -> float:
        """Time not spent communicating: the layers themselves (and sampling-free bookkeeping)."""
        c = self.comm
        return max(0.0, self.elapsed_s - c.recv_wait_s - c.send_s - c.collective_s)


@dataclass(frozen=True)
class _DrawnSteps:
    """A decode call's later steps run in one call (`StageWorkerCore._drawn_steps`): the seconds it took and, a list
    per step, each entry's drawn id, its log-probability and its alternatives."""

    seconds: float
    ids: list[list[int]]
    logprobs: list[list[float]]
    top_logprobs: list[list[tuple[tuple[int, float], ...]]]


@dataclass
class _Caches:
    """A shard's per-sequence state, kept from one epoch to the next while the shard is unchanged."""

    key: tuple[Any, ...]  # what it was sized for (`_cache_key`)
    kv: AnyKVCache  # by slot, or by block (`ServingLimits.kv_block_size`)
    log: ActivationLog | None  # what this stage sent on (not on the last stage), addressed as `kv` is
    cache_id: str  # names this KV cache: a new one whenever its contents are not the old ones
    seeds: dict[str, int] = field(default_factory=dict)  # for sampled requests that came without a seed
    slots: dict[int, str] = field(default_factory=dict)  # occupied KV slot -> request id
    lengths: dict[int, int] = field(default_factory=dict)  # occupied slot -> positions written (a hand-over sends them)
    blocks: dict[int, tuple[int, ...]] = field(default_factory=dict)  # paged: occupied slot -> its latest block table
    tokens: TokenHistory | None = None  # the last stage's token ids by slot and position, for the penalties

    def rows(self, slot: int, length: int, blocks: tuple[int, ...] = ()) -> list[Tensor]:
        """Views of what this shard holds for positions [0, length) of `slot` (`engine.kv_transfer.SlotRows`):
        in its slot, or for a paged cache in `blocks`, its block table (one view per block, so a receiver writes
        them back at the same block ids)."""
        if isinstance(self.kv, PagedKVCache):
            out = self._block_rows(self.kv, length, blocks)
        else:
            out = [self.kv.data[:, :, slot, :, :length]]
            if self.log is not None:
                out.append(self.log.data[slot, :length])
        if self.tokens is not None:  # the penalties count them: a cache that arrives without them would miscount
            out.append(self.tokens.data[slot, :length])
        return out

    def _block_rows(self, kv: PagedKVCache, length: int, blocks: tuple[int, ...]) -> list[Tensor]:
        """Per block of `blocks` covering [0, length): all of it, keys and values of every local layer (the pool's
        block dimension is its third, whatever the layout within a block: `PagedKVCache`), and its activation log
        rows. Whole blocks, the last one too: how positions lie within a block is the cache's business, and the
        positions past `length` it carries are written before anything reads them."""
        needed = blocks_for(length, kv.block_size)
        if len(blocks) < needed or max(blocks[:needed], default=0) >= kv.num_blocks:
            raise ValueError(f"a block table of {len(blocks)} blocks does not hold {length} positions in blocks of "
                             f"{kv.block_size} below {kv.num_blocks}")  # fmt: skip
        out = []
        for b in blocks[:needed]:
            out.append(kv.data[:, :, b])
            if self.log is not None:
                out.append(self.log.data[b])
        return out

    def record(self, e: StepEntry) -> None:
        """`e` ran here: how far its slot's cache is written, and (paged) in which blocks. A sequence that starts
        again (start_pos 0) starts afresh; otherwise the longer record stands (a replay rewrites earlier positions
        with the same table's prefix)."""
        end, held = e.start_pos + e.num_tokens, self.lengths.get(e.slot, 0)
        self.lengths[e.slot] = end if e.start_pos == 0 else max(end, held)
        if e.blocks and (e.start_pos == 0 or len(e.blocks) >= len(self.blocks.get(e.slot, ()))):
            self.blocks[e.slot] = e.blocks

    def record_end(self, slot: int, end: int) -> None:
        """A later step of a decode call wrote `slot` up to `end` (its first step was `record`ed)."""
        self.lengths[slot] = max(end, self.lengths.get(slot, 0))

    def forget(self, slot: int) -> None:
        self.lengths.pop(slot, None)
        self.blocks.pop(slot, None)

    def header(self) -> kv_transfer.Header:
        slots = tuple((slot, request_id, self.lengths.get(slot, 0)) for slot, request_id in sorted(self.slots.items()))
        blocks = {slot: self.blocks[slot] for slot, _, _ in slots if slot in self.blocks}
        return kv_transfer.Header(kv_transfer.key_digest(self.key), self.cache_id, slots, dict(self.seeds), blocks)


def _cache_key(p: Placement) -> tuple[Any, ...]:
    return _key_of(p.spec, p.num_stages, p.model_path, p.dtype, p.limits, p.quantization)


def _key_of(spec: ShardSpec, num_stages: int, model_path: str, dtype: str, limits: ServingLimits,
            quantization: str) -> tuple[Any, ...]:  # fmt: skip
    return (spec, num_stages, model_path, dtype, quantization, limits.kv_slots, limits.max_context,
            limits.kv_block_size, limits.kv_blocks)  # fmt: skip


def _kv_layout(limits: ServingLimits) -> dict[str, Any]:
    """The KV cache's layout as the worker logs and reports it."""
    if limits.paged:
        return {"kv_layout": "paged", "kv_blocks": limits.kv_blocks, "kv_block_size": limits.kv_block_size}
    return {"kv_layout": "slots", "kv_slots": limits.kv_slots, "max_context": limits.max_context}


KV_TRANSFER_TIMEOUT_S = 10.0  # connecting to the other side of a hand-over, and each message after that


def _new_cache_id() -> str:
    return secrets.token_hex(8)


@dataclass
class _Runtime:
    """A loaded shard joined to one rendezvous epoch."""

    placement: Placement
    engine: StageEngine
    groups_epoch: int
    caches: _Caches
    order: StepOrder = field(default_factory=StepOrder)  # this epoch's steps take turns in the gateway's order
    steps: int = 0  # requests' steps run in this epoch (calibration passes are not steps)

    @property
    def seeds(self) -> dict[str, int]:
        return self.caches.seeds

    @property
    def slots(self) -> dict[int, str]:
        return self.caches.slots


class StageWorkerCore:
    def __init__(self, worker_id: str, device: torch.device, logger: Any, group_timeout_s: float = 60.0,
                 order_timeout_s: float = 10.0, memory_budget: int | None = None,
                 link_staging: str = "auto", priority: str = "normal") -> None:  # fmt: skip
        check_staging(link_staging)
        self.priority = compute_priority.check(priority)  # the compute thread's scheduling priority
        self.worker_id = worker_id
        # How this worker's stage links and hand-over pairs move tensors: "auto" agrees with each peer (NCCL
        # between two GPUs, else Gloo through host memory), "host" always goes through host memory over Gloo.
        self.link_staging = link_staging
        self.memory_budget = memory_budget  # bytes of weights in memory; the rest of a shard streams (offload)
        self.device = device
        self.log = logger
        self.backend = Backend.for_device(device, timedelta(seconds=group_timeout_s))
        self.state = ShardState.PENDING
        self.applied_version = 0
        self.detail = ""
        self.prepared_rank: int | None = None  # a spare: the slot whose weights it loaded ahead (`prepare`)
        self._prepared_key: tuple[Any, ...] | None = None  # and the cache key it allocated for
        self.kv_moved = {"sent": 0, "received": 0}  # KV-cache bytes moved in hand-overs (`hand_off`, `_receive`)
        self._transfers: set[tuple[str, str, int]] = set()  # (sender, receiver, rank) tried: each happens once
        self.stats = StepStats()
        self._model: Transformer | None = None
        self._loaded_spec: tuple[Any, ...] | None = None  # what _model was built for
        self._runtime: _Runtime | None = None
        self._kept: _Caches | None = None  # the caches of the last runtime, while no runtime holds them
        self.on_cache_reset: Callable[[], None] = lambda: None  # the id changed outside an epoch change: report it
        self._lock = threading.Lock()  # one step at a time; topology changes wait for the step
        # Guards the runtime's slot and sampler bookkeeping, so that a Release (of sequences in no
        # running step) need not wait for another micro-batch's step to finish.
        self._slots_lock = threading.Lock()
        self.order_timeout_s = order_timeout_s  # how long a step waits for its predecessor to arrive
        # Epochs whose groups broke (a peer died). Their store keys still name the dead peer, so
        # rejoining would only wait out a connect timeout: only a new epoch can heal the mesh.
        self._broken_epochs: set[int] = set()
        # Every tensor operation of this worker (loading, steps, sampling, calibration) runs on this one
        # thread. Why: PyTorch's CPU kernels run on OpenMP, which gives each calling thread its own team of
        # intra-op threads. Once gRPC's handler threads have made a second team, there are more OpenMP
        # threads than cores, libgomp spins only ~100 times at a barrier before sleeping, and each of a
        # decode step's parallel products (121 for SmolLM2) pays a futex wake-up: the same SmolLM2 step
        # measured 38 ms on gRPC's threads against 25 ms on one thread. On CUDA it also keeps the device's
        # context on one thread.
        threads = torch.get_num_threads()  # the process's setting (--threads, $OMP_NUM_THREADS); per OS thread
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="compute", initializer=self._start_compute,
                                           initargs=(threads,))  # fmt: skip

    def _start_compute(self, threads: int) -> None:
        """The compute thread's set-up, before its first tensor operation: its OpenMP team is made by that
        operation and inherits the thread's scheduling priority (`shardmesh.engine.compute_priority`)."""
        torch.set_num_threads(threads)
        try:
            compute_priority.apply(self.priority)
        except OSError as e:  # `shardmesh worker` asked the OS at start; this is the same answer changing since
            self.log.warning("compute_priority_refused", asked=self.priority, reason=str(e))
        else:
            self.log.info("compute_thread", priority=compute_priority.current(), threads=threads)

    def _on_compute(self, fn: Callable[..., R], *args: Any) -> R:
        """`fn(*args)` on the compute thread; its exceptions are raised here, in the caller.

        Callers take `_lock` first and the compute thread never takes it: `apply` holds the lock while it
        waits here for a load, so a step blocking on the lock in the compute thread would deadlock it."""
        return self._compute.submit(fn, *args).result()

    def close(self) -> None:
        """Stop the compute thread once it has finished what it is running (call after the server stopped)."""
        self._compute.shutdown(wait=False, cancel_futures=True)

    # ---- topology ------------------------------------------------------------------------------------

    def apply(self, topology: Topology) -> None:
        """Act on a topology version: load and join when our placement changed, otherwise just note it."""
        placement = Placement.of(topology, self.worker_id)
        current = self._runtime
        if placement is None:
            if current is not None and topology.rendezvous is None:
                self.log.info("placement_suspended", version=topology.version)
            return
        if current is not None and current.groups_epoch == placement.rendezvous.epoch:
            return  # same placement, same groups: a state-only update
        if placement.rendezvous.epoch in self._broken_epochs:
            return  # wait for the coordinator to start a new epoch
        t0 = time.perf_counter()
        with self._lock:
            waited = time.perf_counter() - t0  # for a step of the old epoch to end
            if current is not None:  # steps waiting for a turn in the old epoch will not get one
                current.order.close(f"this worker left epoch {current.groups_epoch}")
            # Drop every reference to the old runtime before loading: it holds the KV cache (and the old
            # model, if the shard changes), which would otherwise stay alive beside the new ones. The caches
            # stay when the shard does: the running sequences' keys and values are still good.
            if current is not None:
                self._kept = current.caches
            if self._kept is not None and self._kept.key != _cache_key(placement):
                self._kept = None
            self._runtime = current = None
            self.state = ShardState.LOADING
            try:
                with heap.loading():  # the load's temporaries go back to the OS (shardworker/heap.py)
                    runtime = self._on_compute(lambda: self._join(placement, self._load(placement)))
            except Exception as e:
                self.state, self.detail = ShardState.UNHEALTHY, f"{type(e).__name__}: {e}"
                self.log.error("placement_failed", epoch=placement.rendezvous.epoch, error=self.detail)
                return
            self._runtime, self.prepared_rank = runtime, None
            self.state, self.detail = ShardState.READY, ""
            self.applied_version = max(topology.version, placement.rendezvous.epoch)
        spec = placement.spec
        self.log.info("ready", epoch=placement.rendezvous.epoch, stage=placement.stage,
                      layers=[spec.layer_start, spec.layer_end], tp_rank=spec.tp_rank,
                      waited_s=round(waited, 3), seconds=round(time.perf_counter() - t0 - waited, 3),
                      decode_runner=runtime.engine.decode_runner, **runtime.engine.groups.describe_links())  # fmt: skip

    def _load(self, p: Placement) -> Transformer:
        # The transports' kernels are built now, not inside the negotiation, where a first build would eat the peers'
        # timeout; and beside the shard's load, whose own first build (the layers' kernel) is one compiler process:
        # a fresh machine's first start compiles two kernels at a time, not one after another.
        builds = None
        if _has_peers(p):
            builds = threading.Thread(target=build_transport_kernels, args=(self.device,), name="kernel-builds",
                                      daemon=True)  # fmt: skip
            builds.start()
        try:
            return self._load_shard(p.spec, p.model_path, p.dtype, p.limits.max_context, p.quantization)
        finally:
            if builds is not None:
                builds.join()

    def _load_shard(self, spec: ShardSpec, model_path: str, dtype: str, max_context: int,
                    quantization: str) -> Transformer:  # fmt: skip
        m = self._model
        if m is not None and self._loaded_spec == (spec, model_path, dtype, max_context, quantization):
            return m
        self._model = None  # drop the old shard before reading the new one
        cfg = ModelConfig.from_dir(model_path)
        t0 = time.perf_counter()
        m = build_shard(model_path, spec, dtype=parse_dtype(dtype), device=self.device, max_len=max_context, cfg=cfg,
                        quantization=Quantization.parse(quantization), memory_budget=self.memory_budget)  # fmt: skip
        streamer = offload.streamer_of(m)
        streamed = list(streamer.plan.streamed_layers) if streamer is not None else []
        self.log.info("shard_loaded", seconds=round(time.perf_counter() - t0, 2), weights_bytes=_nbytes(m),
                      quantization=quantization, linear_kernels=m.linear_kernels, streamed_layers=streamed)  # fmt: skip
        self._model, self._loaded_spec = m, (spec, model_path, dtype, max_context, quantization)
        return m

    def prepare(self, topology: Topology) -> None:
        """Load the weights of the slot this spare is asked to prepare (`MeshWorker.preparing_rank`: a drain
        waiting to hand its slot over, or a hot spare's rank) and allocate its KV cache, so that taking the slot
        costs neither: make-before-break. Sets `prepared_rank`, which the heartbeat reports."""
        me = topology.worker(self.worker_id)
        rank = me.preparing_rank if me is not None else None
        if rank is None or self._runtime is not None or rank >= topology.pp * topology.tp:
            return
        stage = topology.stages[rank // topology.tp]
        spec = ShardSpec(stage.layer_start, stage.layer_end, topology.model.num_layers, rank % topology.tp,
                         topology.tp, topology.tp_split)  # fmt: skip
        model, limits = topology.model, topology.limits
        key = _key_of(spec, topology.pp, model.path, model.dtype, limits, model.quantization)
        if (rank, key) == (self.prepared_rank, self._prepared_key):
            return
        t0 = time.perf_counter()
        with self._lock:
            self._kept = None  # another rank's cache, if any: free it before allocating this one
            try:
                with heap.loading():
                    loaded = self._on_compute(self._load_shard, spec, model.path, model.dtype, limits.max_context,
                                              model.quantization)  # fmt: skip
                    self._kept = self._on_compute(self._new_caches, key, stage.index == topology.pp - 1, limits,
                                                  loaded)  # fmt: skip
            except Exception as e:  # the drain then hands over after its deadline; the load is tried again there
                self.log.error("prepare_failed", rank=rank, error=f"{type(e).__name__}: {e}")
                return
            self.prepared_rank, self._prepared_key = rank, key
        self.log.info("prepared", rank=rank, stage=stage.index, layers=[spec.layer_start, spec.layer_end],
                      kv_cache_bytes=self._kept.kv.nbytes, seconds=round(time.perf_counter() - t0, 3))  # fmt: skip

    def _join(self, p: Placement, model: Transformer) -> _Runtime:
        r = p.rendezvous
        # A new store client for every join, never one kept from an earlier epoch: the store is served by the
        # coordinator process, and a restarted coordinator serves a new one, usually on the same host:port. A
        # client of the old one holds a dead connection (its next request fails with "Broken pipe"; it does not
        # reconnect), so a kept client would keep every epoch after a coordinator restart from forming. The
        # process groups formed here keep a reference to their client; groups already formed need no store
        # (their Gloo pairs are connected), so a coordinator restart leaves them working. (NCCL creates a
        # communicator at a group's first use, through the store: one first used after the restart fails like a
        # lost peer, and the next epoch heals it.)
        store = dist.TCPStore(r.host, r.port, None, False, timeout=self.backend.timeout)
        caches, self._kept = self._kept, None  # `apply` kept them only if they fit `p`
        fresh = caches is None or not caches.slots  # holds no sequence: prepared ahead, or new
        caches = caches or self._new_caches(_cache_key(p), p.stage == p.num_stages - 1, p.limits, model)
        transfer = (p.kv_from, self.worker_id, p.rank)
        if p.kv_from and p.kv_from != self.worker_id and fresh and transfer not in self._transfers:
            self._transfers.add(transfer)
            self._receive(store, caches, p)
        groups = form_groups(store, r.prefix, p.spec, p.stage, p.num_stages, self.device, self.link_staging,
                             self.backend.timeout)  # fmt: skip
        bind_group(model, groups.tp)
        engine = StageEngine(model, groups, caches.kv, self.device, caches.log)
        return _Runtime(p, engine, r.epoch, caches, order=StepOrder(self.order_timeout_s))

    def _new_caches(self, key: tuple[Any, ...], last_stage: bool, limits: ServingLimits,
                    model: Transformer) -> _Caches:  # fmt: skip
        dtype, hidden = model.dtype, model.cfg.hidden_size
        kv: AnyKVCache
        log: ActivationLog | None = None
        if limits.paged:  # blocks the gateway hands out; the log by the same block ids
            kv = model.make_paged_cache(limits.kv_blocks, limits.kv_block_size, dtype, self.device)
            if not last_stage:
                log = PagedActivationLog(limits.kv_blocks, limits.kv_block_size, hidden, dtype, self.device)
        else:
            kv = model.make_cache(limits.kv_slots, dtype, self.device)
            if not last_stage:
                log = ActivationLog(limits.kv_slots, limits.max_context, hidden, dtype, self.device)
        tokens = TokenHistory(limits.kv_slots, limits.max_context, self.device) if last_stage else None  # penalties
        self.log.info("kv_cache_allocated", **_kv_layout(limits), kv_cache_bytes=kv.nbytes,
                      activation_log_bytes=log.nbytes if log is not None else 0,
                      attention_kernel=kv.attention_kernel)  # fmt: skip
        return _Caches(key, kv, log, _new_cache_id(), tokens=tokens)

    # ---- hand-overs: the KV cache goes with the slot ----------------------------------------------------

    def _pair(self, store: dist.Store, sender: str, receiver: str, rank: int,
              me: int) -> tuple[dist.ProcessGroup, torch.device]:  # fmt: skip
        """The two-rank group of one hand-over, named after both workers and the slot, which are paired once; and
        the device its messages travel on. The two workers agree on the backend as a stage link's sides do: a CUDA
        worker handing over to a CPU one (or the other way) gets Gloo, and its cache goes through host memory."""
        other = receiver if me == 0 else sender
        # A process group: the hand-over sends the cache in tensors of its own sizes (`kv_transfer`).
        pg, plan = form_link(store, f"kv/{sender}/{receiver}/rank{rank}", me, self.device, self.link_staging,
                             timedelta(seconds=KV_TRANSFER_TIMEOUT_S), f"worker {other} (hand-over of rank {rank})",
                             timeout_flag="the hand-over's timeout", share=False)  # fmt: skip
        self.log.info("kv_pair_formed", peer=other, rank=rank, link=plan.describe())
        return pg, self.device if plan.backend == "nccl" else torch.device("cpu")

    def _receive(self, store: dist.Store, caches: _Caches, p: Placement) -> None:
        """Take the KV cache (and activation log) of the worker this slot was handed over from, and its id, so
        the gateway finds this stage's cache kept and replays nothing here. On failure the cache stays empty
        under a new id, and the gateway replays this stage instead. Compute thread."""
        t0 = time.perf_counter()
        try:
            pg, wire = self._pair(store, p.kv_from, self.worker_id, p.rank, 1)
            header, received = kv_transfer.receive(pg, kv_transfer.key_digest(caches.key), caches.rows, wire)
        except (RuntimeError, ValueError) as e:  # the sender died, or its cache was sized for another shard
            self.log.warning("kv_receive_failed", source=p.kv_from, rank=p.rank, error=f"{type(e).__name__}: {e}")
            return
        caches.cache_id, caches.seeds = header.cache_id, dict(header.seeds)
        caches.slots = {slot: request_id for slot, request_id, _ in header.slots}
        caches.lengths = {slot: length for slot, _, length in header.slots}
        caches.blocks = dict(header.blocks)
        self.kv_moved["received"] += received
        self.log.info("kv_received", source=p.kv_from, rank=p.rank, sequences=len(header.slots), bytes=received,
                      tokens=sum(n for _, _, n in header.slots), kv_cache_id=header.cache_id,
                      seconds=round(time.perf_counter() - t0, 3))  # fmt: skip

    def hand_off(self, topology: Topology) -> None:
        """Send this worker's KV cache to the worker its slot was handed to (ShardAssignment.kv_from names us),
        then hold no shard: a step that still reaches this worker is refused, so nothing is computed here that
        the new holder would lack. Blocks until sent, or until the receiver is given up on."""
        r = topology.rendezvous
        if r is None:
            return
        for stage in topology.stages:
            for shard in stage.shards:
                transfer = (self.worker_id, shard.worker_id, shard.rank)
                if shard.kv_from != self.worker_id or shard.vacant or transfer in self._transfers:
                    continue
                self._transfers.add(transfer)
                with self._lock:  # after the step running now: its positions are then in the cache we send
                    rt = self._runtime
                    caches = rt.caches if rt is not None else self._kept
                    if rt is not None:
                        rt.order.close(f"this worker handed its shard over to {shard.worker_id}")
                    self._runtime, self._kept = None, None
                    self.state, self.detail = ShardState.PENDING, f"shard handed over to {shard.worker_id}"
                if caches is None:
                    self.log.warning("kv_send_skipped", target=shard.worker_id, rank=shard.rank, why="no cache held")
                    continue
                self._send(r, caches, shard.worker_id, shard.rank)

    def _send(self, r: Rendezvous, caches: _Caches, receiver: str, rank: int) -> None:
        t0 = time.perf_counter()
        try:
            store = dist.TCPStore(r.host, r.port, None, False, timeout=timedelta(seconds=KV_TRANSFER_TIMEOUT_S))
            pg, wire = self._pair(store, self.worker_id, receiver, rank, 0)
            with self._slots_lock:
                header = caches.header()
            sent = self._on_compute(kv_transfer.send, pg, header, caches.rows, wire)
        except (RuntimeError, ValueError) as e:  # the receiver never came, or died: it replays instead
            self.log.warning("kv_send_failed", target=receiver, rank=rank, error=f"{type(e).__name__}: {e}")
            return
        self.kv_moved["sent"] += sent
        self.log.info("kv_sent", target=receiver, rank=rank, sequences=len(header.slots), bytes=sent,
                      seconds=round(time.perf_counter() - t0, 3))  # fmt: skip

    # ---- steps ---------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def turn(self, topology_version: int, step_id: int, after_step_id: int,
             cancelled: Callable[[], bool] | None = None) -> Iterator[float]:  # fmt: skip
        """Hold a step until `after_step_id` has had its turn on this shard (see shardworker/ordering.py);
        yields the seconds it waited. Run the step inside the block: its turn ends when the block does.
        A step that `step` will refuse anyway (no shard, an older epoch) does not wait."""
        rt = self._runtime
        if rt is None or topology_version < rt.groups_epoch:
            yield 0.0
            return
        try:
            with rt.order.turn(step_id, after_step_id, cancelled) as waited:
                yield waited
        except OrderError as e:
            raise FailedPrecondition(str(e)) from None

    def step(self, topology_version: int, entries: list[StepEntry], decode_steps: int = 1) -> StepResult:
        """Run one step, or `decode_steps` decode steps back to back (see `_decode_steps`); returns the sampled
        tokens (last stage only) and the steps' timings and traffic. Steps run one at a time; callers that keep
        several in flight order them with `turn`."""
        with self._lock:  # taken here, never on the compute thread (see `_on_compute`)
            rt = self._runtime
            try:
                if decode_steps <= 1:
                    return self._on_compute(self._step, topology_version, entries)
                return self._on_compute(self._decode_steps, topology_version, entries, decode_steps)
            except MeshError:  # refused before anything was sent, or a lost peer (the epoch is broken already)
                raise
            except Exception as e:
                if rt is None or rt is not self._runtime or not _has_peers(rt.placement):
                    raise
                raise self._failed_part_way(rt, e, [x.request_id for x in entries]) from e

    def _decode_steps(self, topology_version: int, entries: list[StepEntry], n: int) -> StepResult:
        """`n` decode steps in one call (worker.proto `StepRequest.decode_steps`): each feeds every entry the token
        its previous step drew, at the next position, so the gateway's round trip and this worker's hop to the
        compute thread are paid once per `n` tokens. A single stage draws and embeds the token itself; in a
        pipeline the last stage sends what it drew back to the first over the loop link (`ShardGroups.loop`), and
        the stages between run their layers on the activations as in any step. The sampled tokens are step-major.
        A failure part-way fails the call: the gateway keeps none of its tokens, and the positions written lie
        past what it counts as cached."""
        rt = self._ready(topology_version)
        _validate_decode_steps(rt, entries, n)
        p, loop = rt.placement, rt.engine.groups.loop
        first, last = p.stage == 0, p.stage == p.num_stages - 1
        if loop is None and p.num_stages > 1 and (first or last):  # groups formed without `form_groups`
            raise FailedPrecondition(f"decode_steps: stage {p.stage} of {p.num_stages} has no loop link to carry "
                                     f"the drawn tokens to the first stage")  # fmt: skip
        result = self._step(topology_version, entries)  # which checks the entries as any step does
        # The later steps' layouts, all made now, each the one before a position on: made between steps, after the
        # shard's weights have streamed through the caches, each took several times as long (SmolLM2: a layout
        # built in 0.25 ms against 0.05; docs/performance.md, "Cold caches between steps").
        layouts = [BatchLayout.build([replace(e.segment, start=e.start_pos + 1) for e in entries], self.device,
                                     p.limits.kv_block_size)]  # fmt: skip
        layouts += [layouts[0].advanced(k) for k in range(1, n - 1)]
        return self._later_steps(rt, entries, result, layouts)

    def _later_steps(self, rt: _Runtime, entries: list[StepEntry], result: StepResult,
                     layouts: list[BatchLayout]) -> StepResult:  # fmt: skip
        """A decode call's steps after its first (`result`), one per layout, with what they share done once: the
        first step checked the entries and set their slots and seeds, `_validate_decode_steps` every position they
        write, so each later step is the drawn tokens, the forward and the sampling, and its counters are read once
        for all of them. Done per step through `_step`, that bookkeeping took ~0.3 ms a step, all of it with caches
        cold (docs/performance.md, "One decode call's bookkeeping once")."""
        engine, caches = rt.engine, rt.caches
        groups, loop = engine.groups, engine.groups.loop
        first, last = engine.is_first, engine.is_last
        receiving = loop is not None and not loop.is_sender  # the first stage waits on it as on `prev`
        ids: Tensor | None = None
        tokens = [s.token_id for s in result.sampled]  # what the last step drew, one per entry (the last stage)
        slots, history = [e.slot for e in entries], caches.tokens
        with self._slots_lock:
            params = [self._seeded(rt, e) for e in entries] if last else []
        penalized = [i for i, e in enumerate(entries) if e.sampling.penalized] if history is not None else []
        sampled, elapsed, forward_s = list(result.sampled), result.elapsed_s, 0.0
        before = CommCounters.of(groups)
        sending = loop is not None and last
        if sending:  # what the call's first step drew; each later step's draw is sent as soon as it is drawn
            self._send_drawn(rt, loop, tokens, entries)
        drawn = self._drawn_steps(rt, entries, params, layouts, tokens, loop if sending else None) if last else None
        if drawn is not None:  # every later step, and its draws, in one call
            elapsed, forward_s = elapsed + drawn.seconds, forward_s + drawn.seconds
            for step in zip(drawn.ids, drawn.logprobs, drawn.top_logprobs, strict=True):
                sampled += [Sampled(e.request_id, t, lp, top) for e, t, lp, top
                            in zip(entries, *step, strict=True)]  # fmt: skip
        for k, layout in enumerate(layouts if drawn is None else [], 1):
            t0 = time.perf_counter()
            try:
                if first and loop is None:  # a single stage embeds what it drew itself
                    ids = torch.tensor(tokens, dtype=torch.int64)
                for e in entries:  # how far each slot's cache is written here, as `_step` records it
                    caches.record_end(e.slot, e.start_pos + k + 1)
                t1 = time.perf_counter()
                # A pipeline's first stage: what the last stage drew comes over the loop, received in the step.
                logits = engine.step(layout, ids, tokens_from=loop if receiving else None)
            except RuntimeError as e:  # the other end of the loop, or a peer in the forward, is gone
                raise self._peer_lost(rt, e, request_ids=[x.request_id for x in entries]) from None
            t2 = time.perf_counter()
            elapsed, forward_s = elapsed + t2 - t0, forward_s + t2 - t1
            if logits is None:
                continue
            if history is not None and penalized:  # the tokens this step fed them, where: what penalties count
                history.record([slots[i] for i in penalized], [entries[i].start_pos + k for i in penalized],
                               [tokens[i] for i in penalized])  # fmt: skip
            d = sample(logits, params, [e.start_pos + k + 1 for e in entries], history, slots)
            tokens = d.token_ids
            if sending and k < len(layouts):  # before anything else: the first stage's next step waits for them
                self._send_drawn(rt, loop, tokens, entries)
            sampled += [Sampled(e.request_id, t, lp, top) for e, t, lp, top
                        in zip(entries, d.token_ids, d.logprobs, d.top_logprobs, strict=True)]  # fmt: skip
        comm = CommCounters.of(groups) - before
        rt.steps += len(layouts)
        self.stats.steps += len(layouts)
        self.stats.compute_s += forward_s - comm.recv_wait_s  # every wait, the drawn token's too, is in the step
        self.stats.recv_wait_s += comm.recv_wait_s
        return StepResult(sampled, elapsed, result.comm + comm, rt.placement, len(layouts) + 1)

    def _drawn_steps(self, rt: _Runtime, entries: list[StepEntry], params: list[SamplingParams],
                     layouts: list[BatchLayout], tokens: list[int],
                     loop: StageLink | None) -> _DrawnSteps | None:  # fmt: skip
        """The last stage, every entry greedy or sampled (seeded), penalised or not, asking for alternatives or not: a
        decode call's later steps, their draws included, in one call of its engine (`StageEngine.drawn_steps`). A
        single stage feeds the first `tokens`; a pipeline's last stage receives each step's activations and sends its
        draws over `loop`. Returns the seconds it took, and each step's drawn ids, their log-probabilities and the
        rows' alternatives (as `sampling.sample` gives them); None where it cannot, and nothing ran. Why: returning
        to Python between steps for the bookkeeping and the draw took ~0.25 ms a token, on a single stage's critical
        path, and on a pipeline's between its head and the send the first stage waits for (docs/performance.md, "A
        single stage's greedy steps in one call", "Sampled draws in one pass" for sampled rows, "Penalties inside a
        call of steps" and "Alternatives inside a call of steps")."""
        if not all(p.greedy or p.seed is not None for p in params):
            return None
        history, penalized = rt.caches.tokens, [i for i, p in enumerate(params) if p.penalized]
        if penalized and (history is None or not rt.engine.draws_steps(layouts)):
            return None  # no call to take them (a CUDA worker, a paged step it cannot take): not worth their tallies
        greedy = all(p.greedy for p in params) and not penalized
        draws = None if greedy else (draw_table(params), seed_bits(params))
        counts = [p.top_logprobs for p in params]
        top_counts = torch.tensor(counts, dtype=torch.int64) if any(counts) else None
        penalties = None
        if penalized:
            assert history is not None
            vocab = rt.engine.model.cfg.vocab_size
            penalties = self._penalties(history, vocab, entries, params, penalized, tokens)
        for e in entries:  # how far each slot's cache is written once they are done, as each step records it
            rt.caches.record_end(e.slot, e.start_pos + len(layouts) + 1)
        t0 = time.perf_counter()
        try:
            drawn = rt.engine.drawn_steps(layouts, torch.tensor(tokens, dtype=torch.int64), loop, draws, penalties,
                                          top_counts)  # fmt: skip
        except RuntimeError as e:  # as a step's failure is reported (`_later_steps`)
            raise self._peer_lost(rt, e, request_ids=[x.request_id for x in entries]) from None
        if drawn is None:
            return None
        seconds, ids = time.perf_counter() - t0, drawn.ids.tolist()
        if penalized and len(ids) > 1:  # the tokens the steps after the first fed, where the next call counts them
            assert history is not None
            fed = [(entries[i].slot, entries[i].start_pos + 2 + k, ids[k][i]) for k in range(len(ids) - 1)
                   for i in penalized]  # fmt: skip
            history.record(*(list(column) for column in zip(*fed, strict=True)))
        return _DrawnSteps(seconds, ids, drawn.logprobs(), drawn.top_logprobs(counts))

    @staticmethod
    def _penalties(history: TokenHistory, vocab: int, entries: list[StepEntry], params: list[SamplingParams],
                   penalized: list[int], tokens: list[int]) -> tuple[Tensor, Tensor]:  # fmt: skip
        """What a call of steps starts its penalties from (`CpuDecode.run_drawn_steps`): each row's penalties, and the
        penalised rows' tokens before the first draw, the one its first step feeds (`tokens`, at start_pos + 1)
        recorded first, as a step of the loop in `_later_steps` records it."""
        slots = [entries[i].slot for i in penalized]
        history.record(slots, [entries[i].start_pos + 1 for i in penalized], [tokens[i] for i in penalized])
        ends = [entries[i].start_pos + 2 for i in penalized]
        tallies = history.tallies(slots, [params[i].prompt_len for i in penalized], ends, vocab)
        tallies[:, 0] = torch.tensor(penalized, dtype=torch.int64)[tallies[:, 0]]  # the call's rows
        return penalty_table(params), tallies

    def _send_drawn(self, rt: _Runtime, loop: StageLink, tokens: list[int], entries: list[StepEntry]) -> None:
        """The last stage's draws, over the loop link to the first stage, whose next step embeds them. Sent as
        soon as they are drawn: building the step's results first put ~0.08 ms a token (0.13 at 16 sequences) on
        the pipeline's critical path (docs/performance.md, "The seam's serial path, timestamped")."""
        try:
            loop.send(torch.tensor(tokens, dtype=torch.int64))
        except RuntimeError as e:  # the first stage is gone
            raise self._peer_lost(rt, e, request_ids=[x.request_id for x in entries]) from None

    def _step(self, topology_version: int, entries: list[StepEntry]) -> StepResult:
        """One step of `entries`."""
        rt = self._ready(topology_version)
        self._validate(rt, entries)
        p = rt.placement
        computed = [e for e in entries if e.computed_by(p.stage, p.num_stages)]
        with self._slots_lock:
            for e in entries:
                if (
                    not e.sampling.greedy
                    and e.sampling.seed is None
                    and (e.start_pos == 0 or e.request_id not in rt.seeds)
                ):
                    rt.seeds[e.request_id] = random_seed()  # a gateway sends seeds; this covers clients that do not
                rt.slots[e.slot] = e.request_id
            for e in computed:  # how far each slot's cache is written here, and where: what a hand-over sends
                rt.caches.record(e)
        block_size = p.limits.kv_block_size
        batch = BatchLayout.build([e.segment for e in computed], self.device, block_size) if computed else None
        ids = torch.tensor([t for e in computed for t in e.token_ids]) if rt.engine.is_first and computed else None
        relay = _relay(entries, computed, p.stage, p.num_stages)
        before = CommCounters.of(rt.engine.groups)
        t0 = time.perf_counter()
        try:
            logits = rt.engine.step(batch, ids, relay=relay)
        except RuntimeError as e:  # a collective or link failed: a peer is gone
            # The step's requests (the gateway's `step_failed` line has their trace ids and the step id).
            raise self._peer_lost(rt, e, request_ids=[x.request_id for x in entries]) from None
        elapsed = time.perf_counter() - t0
        comm = CommCounters.of(rt.engine.groups) - before
        rt.steps += 1
        self.stats.steps += 1
        self.stats.compute_s += elapsed - comm.recv_wait_s
        self.stats.recv_wait_s += comm.recv_wait_s
        sampled: list[Sampled] = []
        if logits is not None:  # one row per computed entry (every entry that samples is computed here)
            history = rt.caches.tokens
            if history is not None:  # the positions penalised entries write: what their penalties count, now and later
                history.record_entries(e for e in computed if e.sampling.penalized)
            keep = [i for i, e in enumerate(computed) if not e.skip_sampling]
            with self._slots_lock:
                params = [self._seeded(rt, computed[i]) for i in keep]
            positions = [computed[i].start_pos + computed[i].num_tokens for i in keep]  # where each drawn token goes
            rows = logits if len(keep) == len(computed) else logits[keep]  # no copy when every row samples
            if keep:
                d = sample(rows, params, positions, history, [computed[i].slot for i in keep])
                sampled = [Sampled(computed[i].request_id, t, lp, top) for i, t, lp, top
                           in zip(keep, d.token_ids, d.logprobs, d.top_logprobs, strict=True)]  # fmt: skip
        return StepResult(sampled, elapsed, comm, rt.placement)

    @staticmethod
    def _seeded(rt: _Runtime, e: StepEntry) -> SamplingParams:
        """`e`'s sampling parameters with the seed it draws with (its own, or the one picked for it)."""
        if e.sampling.greedy or e.sampling.seed is not None:
            return e.sampling
        return replace(e.sampling, seed=rt.seeds[e.request_id])

    def _ready(self, topology_version: int) -> _Runtime:
        """The runtime a step or calibration of `topology_version` runs on; refused unless READY in an
        epoch the version does not predate. Lock held."""
        rt = self._runtime
        if rt is None or self.state is not ShardState.READY:
            raise FailedPrecondition(f"worker is {self.state.name.lower()}: {self.detail or 'no shard'}")
        if topology_version < rt.groups_epoch:
            raise FailedPrecondition(
                f"topology_version {topology_version} predates this worker's placement (epoch {rt.groups_epoch})",
            )
        return rt

    def _peer_lost(self, rt: _Runtime, error: RuntimeError, **log_fields: Any) -> Unavailable:
        """A collective or link of `rt`'s groups failed: the epoch is broken for good (only a new one heals
        it), the steps waiting for their turn in it are failed, and the caller raises what this returns.
        Lock held."""
        self._break_epoch(rt, f"process group broken: {error}")
        self.log.error("peer_lost", error=str(error), **log_fields)
        return Unavailable(f"a peer of stage {rt.placement.stage} was lost: {error}")

    def _failed_part_way(self, rt: _Runtime, error: Exception, request_ids: list[str]) -> MeshError:
        """A step raised something other than a refusal or a lost peer (a bug, or memory running out) on a shard
        with peers. Its peers may be waiting on it in a collective or a link, or be one collective apart from it
        (a pipeline's first stage waiting for a drawn token that will not come, a tensor-parallel rank at an
        all-reduce this one never reached), so the epoch is broken as for a lost peer: its groups close, and every
        peer fails now rather than at the group timeout. What this returns goes to the gateway (INTERNAL), which
        resumes the step's requests on the next epoch. Lock held."""
        what = f"{type(error).__name__}: {error}"
        self._break_epoch(rt, f"a step failed part-way: {what}")
        self.log.error("step_failed", error=what, request_ids=request_ids, exc_info=error)
        return MeshError(f"stage {rt.placement.stage} tp rank {rt.placement.spec.tp_rank} failed part-way through a "
                         f"step ({what}); its epoch is broken and the next one forms its groups anew")  # fmt: skip

    def _break_epoch(self, rt: _Runtime, detail: str) -> None:
        """`rt`'s epoch is broken for good: only a new one heals it. The steps waiting for their turn in it are
        failed, and its groups are closed so that peers still waiting on this shard fail too. Lock held."""
        self._broken_epochs.add(rt.groups_epoch)
        # The cache stays good up to the positions every step before this one wrote (this step's partial writes
        # lie past what the gateway counts as cached, and are written again): the next epoch may keep it.
        self._kept = rt.caches
        self._runtime, self.state = None, ShardState.PENDING
        self.detail = detail
        rt.order.close(detail)
        rt.engine.groups.close(detail)

    def _validate(self, rt: _Runtime, entries: list[StepEntry]) -> None:
        limits, cfg, stages = rt.placement.limits, rt.engine.model.cfg, rt.placement.num_stages
        if not entries:
            raise InvalidArgument("entries", "a step needs at least one entry")
        total = sum(e.num_tokens for e in entries)
        if total > limits.max_batch_tokens:
            raise ResourceExhausted(f"entries: {total} tokens exceed max_batch_tokens={limits.max_batch_tokens}")
        seen: set[int] = set()
        writers: dict[int, int] = {}  # paged: block -> the entry writing it in this step
        for i, e in enumerate(entries):
            where = f"entries[{i}]"
            _validate_blocks(e, i, limits, writers)
            if not 0 <= e.slot < limits.kv_slots:
                raise ResourceExhausted(f"{where}.slot: {e.slot} outside [0, {limits.kv_slots})")
            if e.slot in seen:
                raise InvalidArgument(f"{where}.slot", f"{e.slot} used twice in one step")
            seen.add(e.slot)
            if e.num_tokens < 1:
                raise InvalidArgument(f"{where}.num_tokens", "must be >= 1")
            if e.start_pos + e.num_tokens > limits.max_context:
                raise ResourceExhausted(f"{where}.start_pos: {e.start_pos} + num_tokens {e.num_tokens} "
                                        f"exceeds max_context={limits.max_context}")  # fmt: skip
            end = e.end_stage or stages
            if not e.first_stage < end <= stages:
                raise InvalidArgument(f"{where}.first_stage", f"stages [{e.first_stage}, {e.end_stage}) are not a "
                                      f"range of the {stages} stages (end_stage 0: through the last)")  # fmt: skip
            if end < stages and not e.skip_sampling:
                raise InvalidArgument(f"{where}.skip_sampling", f"must be set: end_stage {end} stops before the "
                                      f"last stage, which samples")  # fmt: skip
            if rt.engine.is_first and e.first_stage == 0:
                if len(e.token_ids) != e.num_tokens:
                    msg = f"{len(e.token_ids)} ids for num_tokens={e.num_tokens}"
                    raise InvalidArgument(f"{where}.token_ids", msg)
                bad = [t for t in e.token_ids if t >= cfg.vocab_size]
                if bad:
                    msg = f"{bad[:5]} outside the vocabulary [0, {cfg.vocab_size})"
                    raise InvalidArgument(f"{where}.token_ids", msg)

    def release(self, sequences: list[tuple[str, int]]) -> int:
        """Free the slots and seeds of ended sequences. Never waits for a running step: the
        gateway releases only sequences that are in no step in flight."""
        with self._slots_lock:
            rt = self._runtime
            if rt is None:
                return 0
            for request_id, slot in sequences:
                rt.seeds.pop(request_id, None)
                if rt.slots.get(slot) == request_id:
                    del rt.slots[slot]
                    rt.caches.forget(slot)
            return rt.placement.limits.kv_slots - len(rt.slots)

    # ---- reporting -----------------------------------------------------------------------------------

    def held(self) -> HeldShard | None:
        """The shard and groups this worker holds, as it claims them when registering with a restarted
        coordinator; None while it holds none (no placement yet, loading, or its groups broke)."""
        rt = self._runtime
        if rt is None:
            return None
        p, spec = rt.placement, rt.placement.spec
        return HeldShard(epoch=rt.groups_epoch, rank=p.stage * spec.tp_size + spec.tp_rank, pp=p.num_stages,
                         tp=spec.tp_size, layer_start=spec.layer_start, layer_end=spec.layer_end,
                         served=rt.steps > 0)  # fmt: skip

    def info(self) -> dict[str, Any]:
        rt = self._runtime
        model = self._model
        out: dict[str, Any] = {
            "state": self.state, "applied_version": self.applied_version, "detail": self.detail,
            "weights_bytes": _nbytes(model) if model is not None else 0, "kv_cache_bytes": 0,
            "total_slots": 0, "free_slots": 0, "active_sequences": 0, "placement": None, "max_context": 0,
            "kv_cache_id": "", "kv_moved_bytes": dict(self.kv_moved),
            "linear_kernels": list(model.linear_kernels) if model is not None else [],
            "bytes_streamed": offload.bytes_streamed(model) if model is not None else 0,
            "offload": offload.stats(model) if model is not None else None,
            "activation_log_bytes": 0, "kv_blocks": 0, "kv_block_size": 0, "attention_kernel": "",
        }  # fmt: skip
        if rt is not None:
            limits, log = rt.placement.limits, rt.caches.log
            kv = limits.kv_slots
            out.update(kv_cache_bytes=rt.engine.cache.nbytes, total_slots=kv, free_slots=kv - len(rt.slots),
                       active_sequences=len(rt.slots), placement=rt.placement,
                       max_context=limits.max_context, kv_cache_id=rt.caches.cache_id,
                       activation_log_bytes=log.nbytes if log is not None else 0, kv_blocks=limits.kv_blocks,
                       kv_block_size=limits.kv_block_size,
                       attention_kernel=rt.engine.cache.attention_kernel)  # fmt: skip
        return out

    # ---- calibration -----------------------------------------------------------------------------

    def calibrate(
        self, topology_version: int, decode_batch: int, prefill_tokens: int, iterations: int
    ) -> dict[str, Any]:
        """Time this shard's passes for the coordinator's balance check (`shardmesh.engine.timing`)."""
        with self._lock:
            return self._on_compute(self._calibrate, topology_version, decode_batch, prefill_tokens, iterations)

    def _calibrate(
        self, topology_version: int, decode_batch: int, prefill_tokens: int, iterations: int
    ) -> dict[str, Any]:
        rt = self._ready(topology_version)
        limits = rt.placement.limits
        if rt.slots and rt.steps:  # the passes write into KV slots: never while a sequence holds one
            raise FailedPrecondition(f"{len(rt.slots)} sequences hold KV slots; calibrate before serving")
        longest = min(limits.max_batch_tokens, limits.max_context)
        sequences = min(limits.kv_slots, limits.kv_blocks) if limits.paged else limits.kv_slots  # a block each, paged
        bounds = (("decode_batch", decode_batch, sequences), ("prefill_tokens", prefill_tokens, longest),
                  ("iterations", iterations, 100))  # fmt: skip
        for name, value, hi in bounds:
            if not 1 <= value <= hi:
                raise InvalidArgument(name, f"must be in [1, {hi}], got {value}")
        # Slots kept from the epoch before, that nothing has used in this one: the passes overwrite them, so the
        # cache gets a new id, reported before this answer, and the gateway replays those sequences. A paged cache's
        # blocks may hold a prefix the gateway keeps for reuse though no sequence holds it, which the passes
        # overwrite as well: a new id always, so the gateway forgets them.
        if rt.slots or limits.paged:
            with self._slots_lock:
                rt.caches.slots.clear()
                rt.caches.lengths.clear()
                rt.caches.blocks.clear()
                rt.caches.seeds.clear()
                rt.caches.cache_id = _new_cache_id()
            self.on_cache_reset()
        try:
            timing = calibrate_shard(rt.engine.model, rt.engine.cache, self.device, decode_batch=decode_batch,
                                     prefill_tokens=prefill_tokens, iterations=iterations)  # fmt: skip
        except RuntimeError as e:  # a tensor-parallel peer is gone: the same as in a step
            raise self._peer_lost(rt, e, during="calibration") from None
        self.log.info("calibrated", decode_ms=round(timing.decode.total_ms, 3),
                      prefill_ms=round(timing.prefill.total_ms, 3), memory_bytes=timing.memory_bytes)  # fmt: skip
        model = rt.engine.model
        return {"timing": timing, "weights_bytes": _nbytes(model), "kv_cache_bytes": rt.engine.cache.nbytes,
                "num_layers": len(model.layer_range)}  # fmt: skip


def _has_peers(p: Placement) -> bool:
    """Whether a shard at `p` shares its steps with other processes (a pipeline's other stages, its tp ranks)."""
    return p.num_stages > 1 or p.spec.tp_size > 1


def _validate_decode_steps(rt: _Runtime, entries: list[StepEntry], n: int) -> None:
    """What `decode_steps` > 1 needs beyond a step's own checks (worker.proto `StepRequest.decode_steps`)."""
    p = rt.placement
    if n > MAX_DECODE_STEPS:
        raise InvalidArgument("decode_steps", f"{n} is more than {MAX_DECODE_STEPS}")
    for i, e in enumerate(entries):
        where = f"entries[{i}]"
        wrong = {"num_tokens": e.num_tokens != 1, "skip_sampling": e.skip_sampling,
                 "first_stage": e.first_stage != 0 or e.end_stage not in (0, p.num_stages)}  # fmt: skip
        for name, bad in wrong.items():
            if bad:
                raise InvalidArgument(f"{where}.{name}", f"decode_steps={n} takes decode entries only: one token, "
                                                         f"sampled, on every stage")  # fmt: skip
        if p.spec.tp_size > 1 and not e.sampling.greedy and e.sampling.seed is None:
            raise InvalidArgument(f"{where}.sampling.seed", f"decode_steps={n} on {p.spec.tp_size} tensor-parallel "
                                  f"ranks needs a seed: each rank draws its own copy of the next token")  # fmt: skip
        if e.start_pos + n > p.limits.max_context:
            raise ResourceExhausted(f"{where}.start_pos: {e.start_pos} + decode_steps {n} exceeds "
                                    f"max_context={p.limits.max_context}")  # fmt: skip
        if p.limits.kv_block_size:
            try:
                check_block_table(e.blocks, e.start_pos, n, p.limits.kv_block_size, p.limits.kv_blocks,
                                  f"request {e.request_id!r}")  # fmt: skip
            except ValueError as err:
                raise InvalidArgument(f"{where}.blocks", f"decode_steps={n}: {err}") from None


def _validate_blocks(e: StepEntry, i: int, limits: ServingLimits, writers: dict[int, int]) -> None:
    """Entry `i`'s block table against the mesh's KV layout: required and covering its positions with ids below
    kv_blocks on a paged mesh, absent on slots; and no block written by two entries of one step (`writers`,
    filled here). INVALID_ARGUMENT naming entries[i].blocks and the numbers."""
    where, bs = f"entries[{i}]", limits.kv_block_size
    if not limits.paged:
        if e.blocks:
            raise InvalidArgument(f"{where}.blocks", f"{len(e.blocks)} block ids, but this mesh's KV cache has slots "
                                  f"(kv_block_size 0): send none")  # fmt: skip
        return
    if not e.blocks:
        raise InvalidArgument(f"{where}.blocks", f"required: this mesh's KV cache is paged (kv_block_size {bs}), "
                              f"positions [0, {e.start_pos + e.num_tokens}) need a block table")  # fmt: skip
    try:
        e.check_blocks(bs, limits.kv_blocks)
    except ValueError as err:
        raise InvalidArgument(f"{where}.blocks", str(err)) from None
    for b in written_blocks(e.blocks, e.start_pos, e.num_tokens, bs):
        if writers.setdefault(b, i) != i:
            raise InvalidArgument(f"{where}.blocks", f"block {b} is written by entries[{writers[b]}] too in this "
                                  f"step (a block has one writer)")  # fmt: skip


def _relay(entries: list[StepEntry], computed: list[StepEntry], stage: int, num_stages: int) -> Relay | None:
    """What `stage` sends the next stage, when that is not its whole output: for each entry the next stage
    computes, in order, this step's output rows, or (an entry replayed from the next stage on) the rows
    this stage recorded for those positions. None: its whole output, as for any step without a replay."""
    if stage == num_stages - 1 or all(e.first_stage == 0 and e.end_stage == 0 for e in entries):
        return None
    parts: list[tuple[int, int] | Segment] = []
    row, rows = 0, {}
    for e in computed:
        rows[id(e)], row = row, row + e.num_tokens
    for e in entries:
        if not e.computed_by(stage + 1, num_stages):
            continue
        if id(e) in rows:
            parts.append((rows[id(e)], e.num_tokens))
        else:  # first_stage == stage + 1: recorded when this stage first computed these positions
            parts.append(e.segment)
    return Relay(tuple(parts))


def _nbytes(model: Transformer) -> int:
    """Weights, with the scales of quantized ones."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
