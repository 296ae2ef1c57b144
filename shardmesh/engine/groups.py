"""Where a shard sits in the mesh, and the process groups it talks over, as explicit objects.

No `torch.distributed.init_process_group`: that creates a hidden global default group, and our
topology changes at run time. Instead every group is a c10d `ProcessGroup` object built from a
store prefix that names the topology version, so a process can form new groups for a new topology
next to (and then instead of) the old ones without restarting.

Rank layout: global rank = stage * tp + tp_rank, i.e. `torch.arange(pp * tp).reshape(pp, tp)`.
A stage's tensor-parallel group is one row; rank t of stage s sends activations to rank t of s+1
(after the row-parallel all-reduce every tp rank holds the same hidden state, so each pair of
neighbours forms its own point-to-point link and no extra broadcast is needed).

Neighbouring stages may sit on different device types (a GPU stage next to one in host memory, for a
model larger than the GPU): each link agrees on its backend through the store (`negotiate_link`), NCCL
between two GPUs and Gloo otherwise, and a GPU side of a Gloo link stages its tensors through host memory.
Two CPU sides on one host (and a pipeline's two ends, for its loop) share a ring in /dev/shm instead when both
can map it (`shm_link`): a hop there is a copy and a futex wake-up, not loopback TCP and Gloo's threads.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Protocol, cast

import structlog
import torch
import torch.distributed as dist
from torch import Tensor

from shardmesh.core.layout import ShardSpec
from shardmesh.engine import shm_collective, shm_link
from shardmesh.engine.shm_collective import TRANSPORT_ENV as TP_TRANSPORT_ENV
from shardmesh.engine.shm_collective import negotiate, transport_from_env
from shardmesh.engine.shm_link import ShmLinkWire


class Collective(Protocol):
    """The collectives tensor parallelism needs, over one tensor-parallel group."""

    size: int
    rank: int

    def all_reduce(self, x: Tensor) -> Tensor: ...

    def all_reduce_add(self, partial: Tensor, x: Tensor) -> Tensor:
        """x + all_reduce(partial): a row-parallel product's end and its residual (a shared-memory group does both in
        one call, over `partial`)."""
        ...

    def all_gather(self, x: Tensor) -> Tensor: ...

    def close(self, why: str) -> None:
        """Give up the group for good (`ShardGroups.close`): peers waiting in it fail, later calls raise."""


class SingleRank:
    """A group of one: tensor parallelism degree 1. Every collective is the identity."""

    size = 1
    rank = 0

    def all_reduce(self, x: Tensor) -> Tensor:
        return x

    def all_reduce_add(self, partial: Tensor, x: Tensor) -> Tensor:
        return x + partial

    def all_gather(self, x: Tensor) -> Tensor:
        return x

    def close(self, why: str) -> None:
        """No peers, nothing to close."""


class UnboundGroup:
    """The shape of a tensor-parallel group (rank, size) before its process group exists.

    Lets a worker load its shard while its peers are still starting; `tp.bind_group` swaps in the
    real group once formed, and again whenever a new topology forms new groups. Using it for an
    actual collective is a bug, so it raises.
    """

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def all_reduce(self, x: Tensor) -> Tensor:
        if self.size == 1:
            return x
        raise RuntimeError("tensor-parallel group not formed yet")

    def all_reduce_add(self, partial: Tensor, x: Tensor) -> Tensor:
        return x + self.all_reduce(partial)

    def all_gather(self, x: Tensor) -> Tensor:
        return self.all_reduce(x)

    def close(self, why: str) -> None:
        """Not formed: nothing to close."""


class ClosedGroup:
    """What a closed collective or link holds instead of its process group (`ShardGroups.close`): every use
    raises RuntimeError, as a broken group does, and the group itself is gone."""

    def __init__(self, why: str) -> None:
        self.why = why

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"the process group was closed: {self.why}")


class GroupCollective:
    """Collectives over a c10d ProcessGroup object (Gloo or NCCL).

    Counts what it moves, for traces and metrics: `calls`, `bytes` (this rank's input to each
    collective) and `wait_s` (time until the collective completed, i.e. the transfer plus waiting for
    the slowest rank). Plain attributes, read as deltas around a step.
    """

    def __init__(self, pg: dist.ProcessGroup, rank: int, size: int) -> None:
        self.pg: dist.ProcessGroup | ClosedGroup = pg
        self.rank, self.size = rank, size
        self.calls = 0
        self.bytes = 0
        self.wait_s = 0.0

    def close(self, why: str) -> None:
        """Drop the process group, which closes its connections: a peer waiting on it fails at once."""
        self.pg = ClosedGroup(why)

    def all_reduce(self, x: Tensor) -> Tensor:
        x = x.contiguous()
        t0 = time.perf_counter()
        self.pg.allreduce([x]).wait()
        self._count(x, t0)
        return x

    def all_reduce_add(self, partial: Tensor, x: Tensor) -> Tensor:
        return x + self.all_reduce(partial)

    def all_gather(self, x: Tensor) -> Tensor:
        """Concatenate every rank's `x` along the last dim (all ranks pass the same shape)."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        t0 = time.perf_counter()
        self.pg.allgather([parts], [x]).wait()
        self._count(x, t0)
        return torch.cat(parts, dim=-1)

    def _count(self, x: Tensor, t0: float) -> None:
        self.wait_s += time.perf_counter() - t0
        self.calls += 1
        self.bytes += x.numel() * x.element_size()


STAGINGS = ("auto", "host")  # `form_groups(staging=...)`, `--link-staging`


def check_staging(staging: str, whose: str = "--link-staging") -> None:
    """Raise a ValueError naming `whose` unless `staging` is one of STAGINGS."""
    if staging not in STAGINGS:
        raise ValueError(f"{whose}: {staging!r} is not one of {', '.join(STAGINGS)}")


def device_type(device: torch.device) -> str:
    """The device type this side of a link announces to its peer. A function of its own so that tests on a
    machine without a GPU can make one side announce "cuda" and exercise the mixed-device branch."""
    return device.type


@dataclass(frozen=True)
class LinkPlan:
    """What both sides of a two-rank link agreed on (`negotiate_link`), as seen from one side."""

    backend: str  # "nccl" or "gloo"
    staged: bool  # this side copies through a host buffer around every send and recv
    local: str  # this side's device type
    peer: str  # the other side's device type
    # Both sides are plain CPU ones (no forced staging), so shared memory may carry it (`form_link`); decided
    # from both announcements, so both sides try it or neither does.
    shareable: bool = False

    def describe(self) -> str:
        how = "host-staged" if self.staged else "direct"
        return f"{self.backend} {how} ({self.local} <-> {self.peer})"


def plan_link(local: str, local_staging: str, peer: str, peer_staging: str) -> LinkPlan:
    """The backend both sides compute from the same two announcements, and this side's staging.

    NCCL only when both sides are on CUDA and neither forces host staging: NCCL moves device memory only, and
    a CPU peer has none. Otherwise Gloo, which moves host memory only: a CUDA side copies through a host buffer,
    and a side that forces staging ("host") copies even on the CPU, so that path runs without a GPU too."""
    check_staging(local_staging)
    check_staging(peer_staging, "the peer's --link-staging")
    nccl = local == peer == "cuda" and local_staging == peer_staging == "auto"
    backend = "nccl" if nccl else "gloo"
    staged = backend == "gloo" and (local == "cuda" or local_staging == "host")
    shareable = local == peer == "cpu" and local_staging == peer_staging == "auto"
    return LinkPlan(backend, staged, local, peer, shareable)


def negotiate_link(store: dist.Store, prefix: str, side: int, device: torch.device, staging: str,
                   timeout: timedelta, peer_name: str, timeout_flag: str = "--group-timeout") -> LinkPlan:  # fmt: skip
    """Announce this side's device type and staging under `prefix` (side 0 or 1) and read the other side's.

    Both sides already share the rendezvous store and the link's prefix, which names the topology version (or
    the hand-over), so the keys are fresh for every link. Raises RuntimeError naming the link and the peer when
    the peer has not announced itself within `timeout` (set by `timeout_flag`)."""
    if side not in (0, 1):
        raise ValueError(f"a link has sides 0 and 1, got {side}")
    mine = device_type(device)
    store.set(f"{prefix}/device/{side}", json.dumps({"device": mine, "staging": staging}))
    key = f"{prefix}/device/{1 - side}"
    try:
        store.wait([key], timeout)
        theirs = json.loads(store.get(key))
    except RuntimeError:  # DistStoreError: the peer never came (or the store is gone)
        raise RuntimeError(f"link {prefix}: {peer_name} did not announce its device within "
                           f"{timeout.total_seconds():g} s ({timeout_flag})") from None  # fmt: skip
    return plan_link(mine, staging, str(theirs["device"]), str(theirs["staging"]))


class HostStaging:
    """Host buffers a staged link sends from and receives into, one per dtype, grown as needed and reused.

    One flat buffer per dtype rather than one per shape: a serving stage sees a new token count in almost every
    step, and buffers by shape would pile up. Pinned when the data lives on a GPU (the copy is a DMA then); a
    CPU side that forces staging gets a plain buffer, and its copies are clones through the same code."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.dtype, bool], Tensor] = {}
        self.bytes = 0  # copied device -> host before a send plus host -> device after a recv
        self.copies = 0

    def buffer(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, pinned: bool) -> Tensor:
        numel = math.prod(shape)
        buf = self._buffers.get((dtype, pinned))
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, pin_memory=pinned)
            self._buffers[(dtype, pinned)] = buf
        return buf[:numel].view(shape)

    def to_host(self, x: Tensor) -> Tensor:
        host = self.buffer(x.shape, x.dtype, pinned=x.is_cuda)
        host.copy_(x)
        self._count(x)
        return host

    def from_host(self, host: Tensor, device: torch.device | str) -> Tensor:
        out = torch.empty(host.shape, dtype=host.dtype, device=device)
        out.copy_(host)  # a copy even on the CPU: the buffer is overwritten by the next recv
        self._count(out)
        return out

    def _count(self, x: Tensor) -> None:
        self.bytes += x.numel() * x.element_size()
        self.copies += 1


class Wire(Protocol):
    """How a link's bytes move: a process group's point-to-point calls (`GroupWire`), or a shared-memory ring
    (`shm_link.ShmLinkWire`). Both block until their copy is done."""

    def send(self, x: Tensor) -> None: ...

    def recv_into(self, out: Tensor) -> None: ...

    def close(self, why: str) -> None: ...


class GroupWire:
    """A two-rank process group's send and recv (Gloo or NCCL), to the other rank."""

    def __init__(self, pg: dist.ProcessGroup, peer: int) -> None:
        self.pg: dist.ProcessGroup | ClosedGroup = pg
        self.peer = peer

    def send(self, x: Tensor) -> None:
        self.pg.send([x], self.peer, 0).wait()  # waited for: a staging buffer is reused by the next send

    def recv_into(self, out: Tensor) -> None:
        self.pg.recv([out], self.peer, 0).wait()

    def close(self, why: str) -> None:
        """Drop the process group, which closes its connection: the peer waiting on it fails at once."""
        self.pg = ClosedGroup(why)


class StageLink:
    """A point-to-point link between rank t of stage s (sender) and rank t of stage s + 1 (receiver).

    `plan` says how (`negotiate_link`): through shared memory between two CPU sides on one host, over NCCL between
    two GPUs, or over Gloo, staged through host memory on a side whose tensors live on a GPU (or that forces it).
    `wire` moves the bytes (a `GroupWire`, or a `ShmLinkWire`); a process group is wrapped in a GroupWire.
    `staged_bytes` counts what this side copied."""

    def __init__(self, wire: Wire | dist.ProcessGroup, is_sender: bool, plan: LinkPlan | None = None) -> None:
        self.plan = plan or LinkPlan("gloo", False, "cpu", "cpu")
        self.is_sender = is_sender
        self.wire: Wire = wire if hasattr(wire, "recv_into") else GroupWire(wire, 1 if is_sender else 0)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.messages_sent = 0
        self.messages_received = 0
        self.wait_s = 0.0  # time spent in recv: compute upstream plus the transfer itself
        self.send_s = 0.0  # time spent in send, until the transfer completed
        self._staging = HostStaging() if self.plan.staged else None

    @property
    def backend(self) -> str:
        return self.plan.backend

    @property
    def staged(self) -> bool:
        return self.plan.staged

    @property
    def staged_bytes(self) -> int:
        return self._staging.bytes if self._staging is not None else 0

    def describe(self) -> str:
        return self.plan.describe()

    def close(self, why: str) -> None:
        """Close this side of the wire: the peer waiting on it fails at once."""
        self.wire.close(why)

    def send(self, x: Tensor) -> None:
        x = x.contiguous()
        t0 = time.perf_counter()
        self.wire.send(self._staging.to_host(x) if self._staging is not None else x)
        self._count_send(x.numel() * x.element_size(), time.perf_counter() - t0)

    def native_recv(self, nbytes: int) -> tuple[Any, ...] | None:
        """Arguments with which a C++ caller receives the next message, of `nbytes`, itself
        (`ShmLinkWire.native_recv`), then `received_natively`; None where this link cannot hand its receive over (not
        shared memory, staged, more than a message), and the caller receives through `recv`."""
        native = getattr(self.wire, "native_recv", None)
        return native(nbytes) if native is not None and self._staging is None else None

    def native_send(self, nbytes: int) -> tuple[Any, ...] | None:
        """`native_recv` for a send of `nbytes`, then `sent_natively`; None: the caller sends through `send`."""
        native = getattr(self.wire, "native_send", None)
        return native(nbytes) if native is not None and self._staging is None else None

    def received_natively(self, nbytes: int, status: int, waited: float) -> None:
        """After a C++ caller received `nbytes` with `native_recv`'s arguments: counted as `recv` counts, and a
        failure raises as `recv` would."""
        cast(Any, self.wire).moved_natively("recv", status, nbytes, waited)
        self._count_recv(nbytes, waited)

    def sent_natively(self, nbytes: int, status: int, seconds: float) -> None:
        """After a C++ caller sent `nbytes` with `native_send`'s arguments: counted as `send` counts, and a failure
        raises as `send` would."""
        cast(Any, self.wire).moved_natively("send", status, nbytes, seconds)
        self._count_send(nbytes, seconds)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> Tensor:
        t0 = time.perf_counter()
        if self._staging is None:
            x = torch.empty(shape, dtype=dtype, device=device)
            self.wire.recv_into(x)
        else:
            host = self._staging.buffer(shape, dtype, pinned=torch.device(device).type == "cuda")
            self.wire.recv_into(host)
            x = self._staging.from_host(host, device)
        self._count_recv(x.numel() * x.element_size(), time.perf_counter() - t0)
        return x

    def _count_send(self, nbytes: int, seconds: float) -> None:
        self.send_s += seconds
        self.bytes_sent += nbytes
        self.messages_sent += 1

    def _count_recv(self, nbytes: int, waited: float) -> None:
        self.wait_s += waited
        self.bytes_received += nbytes
        self.messages_received += 1


@dataclass
class ShardGroups:
    """Everything a shard needs to talk to its peers, passed to the code that needs it."""

    spec: ShardSpec
    stage: int
    num_stages: int
    tp: Collective
    prev: StageLink | None  # receives activations from the previous stage
    next: StageLink | None  # sends activations to the next stage
    # The last stage's drawn tokens back to the first stage, for several decode steps in one call: the last
    # stage sends, the first receives; None on a single stage and on the stages between.
    loop: StageLink | None = None

    def describe_links(self) -> dict[str, str]:
        """How each link moves its tensors, for log lines: {"prev_link": "gloo host-staged (cuda <-> cpu)", ...}."""
        links = {"prev_link": self.prev, "next_link": self.next, "loop_link": self.loop}
        return {name: link.describe() for name, link in links.items() if link is not None}

    def close(self, why: str) -> None:
        """Close this shard's side of every group and link, once its epoch is broken (a lost peer, a step that
        failed part-way): each peer still waiting on one of them fails now, rather than at the group timeout, and
        breaks its own epoch, which closes its groups in turn. Dropping a Gloo group closes its connections (the
        peer reads "Connection closed by peer"); a shared-memory group marks itself closed in its segment, which
        a waiting peer reads within a millisecond. The model may outlive the epoch with this tp group bound to it
        (`tp.bind_group`), so the group is dropped here rather than left to the garbage collector."""
        self.tp.close(why)
        for link in (self.prev, self.next, self.loop):
            if link is not None:
                link.close(why)


class Backend:
    """Builds process groups for one communication library: a stage's tp group uses its device's
    (`for_device`), a link the one both sides agreed on (`negotiate_link`)."""

    name: str

    def __init__(self, name: str, timeout: timedelta) -> None:
        if name == "nccl" and not dist.is_nccl_available():
            raise RuntimeError("backend 'nccl' requested but this torch build has no NCCL")
        if name not in ("gloo", "nccl"):
            raise ValueError(f"unknown backend {name!r}; expected 'gloo' or 'nccl'")
        self.name, self.timeout = name, timeout

    @classmethod
    def for_device(cls, device: torch.device, timeout: timedelta = timedelta(seconds=60)) -> Backend:
        return cls("nccl" if device.type == "cuda" else "gloo", timeout)

    def group(self, store: dist.Store, prefix: str, rank: int, size: int) -> dist.ProcessGroup:
        prefixed = dist.PrefixStore(prefix, store)
        if self.name == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            return dist.ProcessGroupNCCL(prefixed, rank, size, opts)
        return dist.ProcessGroupGloo(prefixed, rank, size, self.timeout)


def form_link(store: dist.Store, prefix: str, side: int, device: torch.device, staging: str, timeout: timedelta,
              peer_name: str, timeout_flag: str = "--group-timeout",
              share: bool = True) -> tuple[Wire | dist.ProcessGroup, LinkPlan]:  # fmt: skip
    """Negotiate a two-rank link under `prefix` (`negotiate_link`) and build what carries it: with `share`, a
    shared-memory ring when both sides are CPU ones that can map one segment (`shared_wire`), else a group on the
    agreed backend, side 0 being its rank 0. Both sides must pass the same `share`."""
    plan = negotiate_link(store, prefix, side, device, staging, timeout, peer_name, timeout_flag)
    if share and plan.shareable:
        wire = shared_wire(store, prefix, side, timeout)
        if wire is not None:
            return wire, replace(plan, backend="shm")
    return Backend(plan.backend, timeout).group(store, prefix, side, 2), plan


def shared_wire(store: dist.Store, prefix: str, side: int, timeout: timedelta) -> ShmLinkWire | None:
    """A shared-memory ring for the link under `prefix` when both sides can map one segment and
    $SHARDMESH_LINK_TRANSPORT allows it ("auto", the default, or "shm", which raises where it cannot work), else
    None: the link takes a process group. Both sides reach the same answer (`shm_link.negotiate`)."""
    wanted = shm_link.transport()
    wire, reason = shm_link.negotiate(store, f"{prefix}/shm", side, timeout, wanted)
    if wire is None and wanted == "shm":
        raise RuntimeError(f"{shm_link.TRANSPORT_ENV}=shm, but the two sides of link {prefix} cannot share memory: "
                           f"{reason}")  # fmt: skip
    if reason and wanted != "gloo":
        structlog.get_logger().info("link_shm_refused", link=prefix, side=side, reason=reason)
    return wire


def build_transport_kernels(device: torch.device) -> None:
    """Build (or load from the cache) the C++ kernels of the shared-memory transports a shard with peers may
    negotiate: the tp collectives on a CPU shard, and the link rings on any (the loop between a pipeline's ends is
    host memory whatever the device). A worker calls this while it loads its shard: built inside the negotiation
    instead, a first build on a fresh machine (10-15 s each on 2 cores) would eat into the time its peers wait
    there (--group-timeout). Where a kernel cannot be built the negotiation refuses shared memory, as before."""
    if device.type == "cpu":
        shm_collective.available()
    shm_link.available()


def tp_transport() -> str:
    """The CPU tensor-parallel transport asked for in $SHARDMESH_TP_TRANSPORT: "auto" (shared memory when every
    rank of the group can map one segment, else Gloo), "shm" (shared memory, or an error) or "gloo"."""
    return transport_from_env(TP_TRANSPORT_ENV)


def form_tp_collective(store: dist.Store, prefix: str, rank: int, size: int, device: torch.device,
                       timeout: timedelta) -> Collective:  # fmt: skip
    """A stage's tensor-parallel group: its device's backend (`Backend.for_device`), and on the CPU a
    shared-memory segment over it when every rank can map one (`shm_collective.negotiate`; all ranks agree).

    The Gloo group is formed in every case: the shared-memory collective hands it what it does not carry, and its
    rendezvous makes sure every rank is there before the negotiation starts."""
    wanted = tp_transport() if device.type == "cpu" else "gloo"
    pg = Backend.for_device(device, timeout).group(store, prefix, rank, size)
    group = GroupCollective(pg, rank, size)
    if device.type != "cpu":
        return group
    shm, reason = negotiate(store, f"{prefix}/shm", rank, size, timeout, group, wanted)
    if shm is None and wanted == "shm":
        raise RuntimeError(f"{TP_TRANSPORT_ENV}=shm, but the {size} ranks of tp group {prefix} cannot share "
                           f"memory: {reason}")  # fmt: skip
    structlog.get_logger().info("tp_group_formed", group=prefix, rank=rank, size=size,
                                transport=shm.describe() if shm is not None else "gloo",
                                **({"shm_refused": reason} if reason and wanted != "gloo" else {}))  # fmt: skip
    return shm if shm is not None else group


def form_groups(
    store: dist.Store, prefix: str, spec: ShardSpec, stage: int, num_stages: int, device: torch.device,
    staging: str = "auto", timeout: timedelta = timedelta(seconds=60),
) -> ShardGroups:  # fmt: skip
    """Join this shard's tensor-parallel group and its links to the neighbouring stages.

    Every shard forms, in order: its stage's tp group, the link from the previous stage, the link
    to the next, and on the first and last stage of several the loop between them (`form_loop`). Stage 0 has
    no previous link, so by induction stage s reaches its `prev` link only after stage s - 1 has formed its tp
    group, and the chain cannot deadlock; the loop comes last on both of its sides.
    `prefix` should name the topology version: groups of different versions never collide.
    The tp group uses `device`'s own backend (a stage's ranks share a device type), and on the CPU shared memory
    when all its ranks can map one segment (`form_tp_collective`, $SHARDMESH_TP_TRANSPORT); each link agrees on
    its backend with its peer (`negotiate_link`), so a CUDA stage can feed a CPU stage. `staging`: "auto",
    or "host" to force Gloo and host staging on this rank's links.
    """
    check_staging(staging)
    tp: Collective = SingleRank()
    if spec.tp_size > 1:
        tp = form_tp_collective(store, f"{prefix}/tp/stage{stage}", spec.tp_rank, spec.tp_size, device, timeout)
    prev = nxt = None
    t = spec.tp_rank
    if stage > 0:
        peer = f"stage {stage - 1} tp rank {t} (global rank {(stage - 1) * spec.tp_size + t})"
        wire, plan = form_link(store, f"{prefix}/pp/{stage - 1}-{stage}/tp{t}", 1, device, staging, timeout, peer)
        prev = StageLink(wire, is_sender=False, plan=plan)
    if stage < num_stages - 1:
        peer = f"stage {stage + 1} tp rank {t} (global rank {(stage + 1) * spec.tp_size + t})"
        wire, plan = form_link(store, f"{prefix}/pp/{stage}-{stage + 1}/tp{t}", 0, device, staging, timeout, peer)
        nxt = StageLink(wire, is_sender=True, plan=plan)
    loop = form_loop(store, prefix, spec, stage, num_stages, timeout)
    return ShardGroups(spec, stage, num_stages, tp, prev, nxt, loop)


def form_loop(store: dist.Store, prefix: str, spec: ShardSpec, stage: int, num_stages: int,
              timeout: timedelta) -> StageLink | None:  # fmt: skip
    """The link from rank t of the last stage to rank t of the first (None on a single stage and on the stages
    between): the tokens the last stage draws go back over it when a call runs several decode steps (worker.proto
    `StepRequest.decode_steps`), so the first stage can embed them without a round trip through the gateway.
    Every tp rank of the last stage draws the same token (greedy, or seeded), so each pair carries its own copy.
    Host memory whatever the stages' devices (a few token ids per step, which the last stage holds on the host
    anyway, as it samples there): a shared-memory ring when both ends can map one segment, else Gloo."""
    last, t = stage == num_stages - 1, spec.tp_rank
    if num_stages < 2 or not (stage == 0 or last):
        return None
    side, loop = 0 if last else 1, f"{prefix}/loop/tp{t}"
    wire = shared_wire(store, loop, side, timeout)
    if wire is not None:
        return StageLink(wire, is_sender=last, plan=LinkPlan("shm", False, "cpu", "cpu", True))
    pg = Backend("gloo", timeout).group(store, loop, side, 2)
    return StageLink(pg, is_sender=last, plan=LinkPlan("gloo", False, "cpu", "cpu"))
