"""Where a shard sits in the mesh, and the process groups it talks over, as explicit objects.

No `torch.distributed.init_process_group`: that creates a hidden global default group, and our
topology changes at run time. Instead every group is a c10d `ProcessGroup` object built from a
store prefix that names the topology version, so a process can form new groups for a new topology
next to (and then instead of) the old ones without restarting.

Rank layout: global rank = stage * tp + tp_rank, i.e. `torch.arange(pp * tp).reshape(pp, tp)`.
A stage's tensor-parallel group is one row; rank t of stage s sends activations to rank t of s+1
(after the row-parallel all-reduce every tp rank holds the same hidden state, so each pair of
neighbours forms its own point-to-point link and no extra broadcast is needed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from shardmesh.core.layout import ShardSpec


class Collective(Protocol):
    """The collectives tensor parallelism needs, over one tensor-parallel group."""

    size: int
    rank: int

    def all_reduce(self, x: Tensor) -> Tensor: ...

    def all_gather(self, x: Tensor) -> Tensor: ...


class SingleRank:
    """A group of one: tensor parallelism degree 1. Every collective is the identity."""

    size = 1
    rank = 0

    def all_reduce(self, x: Tensor) -> Tensor:
        return x

    def all_gather(self, x: Tensor) -> Tensor:
        return x


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

    def all_gather(self, x: Tensor) -> Tensor:
        return self.all_reduce(x)


class GroupCollective:
    """Collectives over a c10d ProcessGroup object (Gloo or NCCL).

    Counts what it moves, for traces and metrics: `calls`, `bytes` (this rank's input to each
    collective) and `wait_s` (time until the collective completed, i.e. the transfer plus waiting for
    the slowest rank). Plain attributes, read as deltas around a step.
    """

    def __init__(self, pg: dist.ProcessGroup, rank: int, size: int) -> None:
        self.pg, self.rank, self.size = pg, rank, size
        self.calls = 0
        self.bytes = 0
        self.wait_s = 0.0

    def all_reduce(self, x: Tensor) -> Tensor:
        x = x.contiguous()
        t0 = time.perf_counter()
        self.pg.allreduce([x]).wait()
        self._count(x, t0)
        return x

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


class StageLink:
    """A point-to-point link between rank t of stage s (sender) and rank t of stage s + 1 (receiver)."""

    def __init__(self, pg: dist.ProcessGroup, is_sender: bool) -> None:
        self.pg = pg
        self.peer = 1 if is_sender else 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.messages_sent = 0
        self.messages_received = 0
        self.wait_s = 0.0  # time spent in recv: compute upstream plus the transfer itself
        self.send_s = 0.0  # time spent in send, until the transfer completed

    def send(self, x: Tensor) -> None:
        x = x.contiguous()
        t0 = time.perf_counter()
        self.pg.send([x], self.peer, 0).wait()
        self.send_s += time.perf_counter() - t0
        self.bytes_sent += x.numel() * x.element_size()
        self.messages_sent += 1

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> Tensor:
        x = torch.empty(shape, dtype=dtype, device=device)
        t0 = time.perf_counter()
        self.pg.recv([x], self.peer, 0).wait()
        self.wait_s += time.perf_counter() - t0
        self.bytes_received += x.numel() * x.element_size()
        self.messages_received += 1
        return x


@dataclass
class ShardGroups:
    """Everything a shard needs to talk to its peers, passed to the code that needs it."""

    spec: ShardSpec
    stage: int
    num_stages: int
    tp: Collective
    prev: StageLink | None  # receives activations from the previous stage
    next: StageLink | None  # sends activations to the next stage


class Backend:
    """Builds process groups for one communication library; picked once, at start-up."""

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


def form_groups(
    store: dist.Store, prefix: str, spec: ShardSpec, stage: int, num_stages: int, backend: Backend
) -> ShardGroups:
    """Join this shard's tensor-parallel group and its links to the neighbouring stages.

    Every shard forms, in order: its stage's tp group, the link from the previous stage, the link
    to the next. Stage 0 has no previous link, so by induction stage s reaches its `prev` link only
    after stage s - 1 has formed its tp group, and the chain cannot deadlock.
    `prefix` should name the topology version: groups of different versions never collide.
    """
    tp: Collective = SingleRank()
    if spec.tp_size > 1:
        pg = backend.group(store, f"{prefix}/tp/stage{stage}", spec.tp_rank, spec.tp_size)
        tp = GroupCollective(pg, spec.tp_rank, spec.tp_size)
    prev = nxt = None
    if stage > 0:
        pg = backend.group(store, f"{prefix}/pp/{stage - 1}-{stage}/tp{spec.tp_rank}", 1, 2)
        prev = StageLink(pg, is_sender=False)
    if stage < num_stages - 1:
        pg = backend.group(store, f"{prefix}/pp/{stage}-{stage + 1}/tp{spec.tp_rank}", 0, 2)
        nxt = StageLink(pg, is_sender=True)
    return ShardGroups(spec, stage, num_stages, tp, prev, nxt)
