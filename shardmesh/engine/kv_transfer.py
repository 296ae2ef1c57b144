"""Moving a shard's per-sequence state (KV cache rows, activation log rows) to the worker that takes its slot.

Why: when a serving worker hands its slot over (a drain, a move onto a faster worker), the running sequences'
keys and values for its layers exist only in its memory. Sending them costs a few milliseconds per thousand
cached tokens over a link; replaying the sequences on the new holder costs a forward pass over every cached
token. The old holder is still alive in a hand-over, so we send.

Over one two-rank process group (`groups.form_link`: NCCL between two GPU workers, else Gloo; rank 0 sends, rank 1
receives), four messages:
  1. the header's length (int64), 2. the header (JSON, uint8): the sender's cache key digest, the cache id and
  the occupied slots with how many positions each holds (and, for a paged cache, each one's block table), 3. the
  receiver's answer (int64: 1 takes it, 0 refuses a cache sized for another shard), 4. every slot's rows,
  flattened into one tensor per dtype.
Both sides cut their own buffers into the same views (`SlotRows`), so only lengths and block tables travel in the
header. A paged cache's views are its blocks, at the same ids on both sides (block ids are mesh-wide: the gateway's
tables name them for every stage). A prefix block that several sequences share is sent once per sequence, and
written as many times with the same rows: simpler than deduplicating, and prefixes are a small part of a cache.

The messages travel on the `wire` device both functions are given: the cache's own device over NCCL, the CPU over
Gloo (which moves host memory only). A GPU cache on a Gloo pair, as between a CUDA and a CPU worker, is then staged
through host memory: each dtype's rows are copied to the host in one piece before they are sent, and written back
to the GPU views from the host tensor they arrive in.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

# The views of one slot's first `length` positions, in a fixed order, in every buffer a shard keeps per slot:
# (slot, length, block table) -> views; the table is () for a slot cache, the blocks holding them for a paged one.
SlotRows = Callable[[int, int, tuple[int, ...]], Sequence[Tensor]]


@dataclass(frozen=True)
class Header:
    """What the receiver needs before the rows: whether they fit its buffers, and the bookkeeping that goes
    with them."""

    key_digest: str  # `key_digest` of the sender's cache key: the receiver's must be the same
    cache_id: str  # the receiver adopts it: its cache now holds what the sender's held
    slots: tuple[tuple[int, str, int], ...]  # (slot, request id, positions held)
    seeds: dict[str, int]  # seeds picked for sampled requests that came without one
    blocks: dict[int, tuple[int, ...]] = field(default_factory=dict)  # slot -> block table (a paged cache)

    def to_bytes(self) -> bytes:
        blocks = {str(slot): table for slot, table in self.blocks.items()}
        return json.dumps({"key": self.key_digest, "cache_id": self.cache_id, "slots": self.slots,
                           "seeds": self.seeds, "blocks": blocks}).encode()  # fmt: skip

    @classmethod
    def from_bytes(cls, raw: bytes) -> Header:
        d = json.loads(raw)
        return cls(d["key"], d["cache_id"], tuple((int(s), str(r), int(n)) for s, r, n in d["slots"]),
                   {str(k): int(v) for k, v in d["seeds"].items()},
                   {int(k): tuple(int(b) for b in v) for k, v in d.get("blocks", {}).items()})  # fmt: skip


def key_digest(key: Any) -> str:
    """A stable digest of a cache key (the shard, the stage count, the model, dtype, slots, context, KV layout)."""
    return hashlib.sha256(repr(key).encode()).hexdigest()[:32]


def _flat(parts: Sequence[Tensor]) -> dict[torch.dtype, Tensor]:
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in parts:
        by_dtype.setdefault(t.dtype, []).append(t.reshape(-1))
    return {dtype: torch.cat(ts) for dtype, ts in by_dtype.items()}


def _views(rows: SlotRows, header: Header) -> list[Tensor]:
    tables = header.blocks
    return [v for slot, _, length in header.slots if length > 0 for v in rows(slot, length, tables.get(slot, ()))]


def send(pg: dist.ProcessGroup, header: Header, rows: SlotRows, device: torch.device) -> int:
    """Send `header` and the rows it lists to rank 1 of `pg`; returns the bytes of rows sent (0: refused).
    `device`: the wire device (see the module's docstring), whatever device the rows are on."""
    raw = torch.frombuffer(bytearray(header.to_bytes()), dtype=torch.uint8).to(device)
    pg.send([torch.tensor([raw.numel()], dtype=torch.int64, device=device)], 1, 0).wait()
    pg.send([raw], 1, 0).wait()
    answer = torch.zeros(1, dtype=torch.int64, device=device)
    pg.recv([answer], 1, 0).wait()
    if int(answer.item()) != 1:
        return 0
    sent = 0
    for _, flat in sorted(_flat(_views(rows, header)).items(), key=lambda kv: str(kv[0])):
        pg.send([flat.to(device).contiguous()], 1, 0).wait()  # staged through host memory: a GPU cache over Gloo
        sent += flat.numel() * flat.element_size()
    return sent


def receive(pg: dist.ProcessGroup, my_key_digest: str, rows: SlotRows, device: torch.device) -> tuple[Header, int]:
    """Receive from rank 0 of `pg` into the views `rows` gives; returns the header and the bytes received.
    `device`: the wire device; the views may be on another (the copy into them moves the rows there).
    Raises ValueError (after telling the sender) when the sender's cache was sized for another shard."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    pg.recv([size], 0, 0).wait()
    raw = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    pg.recv([raw], 0, 0).wait()
    header = Header.from_bytes(bytes(raw.cpu().numpy().tobytes()))
    ok = header.key_digest == my_key_digest
    pg.send([torch.tensor([1 if ok else 0], dtype=torch.int64, device=device)], 0, 0).wait()
    if not ok:
        raise ValueError(f"the sender's cache was sized for another shard (key {header.key_digest}, "
                         f"ours {my_key_digest})")  # fmt: skip
    views = _views(rows, header)
    received = 0
    for dtype, numel in sorted(_sizes(views).items(), key=lambda kv: str(kv[0])):
        flat = torch.empty(numel, dtype=dtype, device=device)
        pg.recv([flat], 0, 0).wait()
        offset = 0
        for v in (v for v in views if v.dtype == dtype):
            v.copy_(flat[offset : offset + v.numel()].view(v.shape))  # host -> GPU when staged
            offset += v.numel()
        received += flat.numel() * flat.element_size()
    return header, received


def _sizes(views: Sequence[Tensor]) -> dict[torch.dtype, int]:
    out: dict[torch.dtype, int] = {}
    for v in views:
        out[v.dtype] = out.get(v.dtype, 0) + v.numel()
    return out
