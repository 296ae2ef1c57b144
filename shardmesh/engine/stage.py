"""One pipeline stage at work: receive activations, run the shard, pass them on (or return logits).

The same engine serves the offline launcher (`shardmesh generate`) and the stage-worker service:
whoever drives it decides the batch (`BatchLayout`), and every stage of one step must be given the
same layout, because the layout is what tells a stage the shape of the activations it receives. A replay
after a lost worker runs on some stages only: then each stage is given the segments it computes, and
what it sends on (`Relay`) is what the next stage's segments need, in their order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from shardmesh.core.step import Segment
from shardmesh.engine.batch import BatchLayout
from shardmesh.engine.cpu_decode import cpu_decode
from shardmesh.engine.cuda_graph import decode_graphs
from shardmesh.engine.groups import ShardGroups
from shardmesh.engine.kv_cache import ActivationLog, AnyKVCache
from shardmesh.engine.model import Transformer


@dataclass(frozen=True)
class Relay:
    """What a stage sends the next one when that is not simply its whole output (a replay on some stages
    only, `BatchEntry.first_stage`): in the next stage's entry order, runs of this step's output rows
    (`(first row, count)`) and rows of the activation log (a `Segment`: slot or block table, and positions)."""

    parts: tuple[tuple[int, int] | Segment, ...]


class StageEngine:
    def __init__(self, model: Transformer, groups: ShardGroups, cache: AnyKVCache, device: torch.device,
                 log: ActivationLog | None = None, cuda_graphs: bool = True,
                 compile: bool = False, native_decode: bool = True) -> None:  # fmt: skip
        """`cache` is a `KVCache` (slots) or a `PagedKVCache` (blocks; then `log`, if any, a `PagedActivationLog`
        of the same block size, and every step's layout built with `BatchLayout.build(..., block_size=...)`)."""
        if model.is_first != (groups.prev is None) or model.is_last != (groups.next is None):
            raise ValueError("model layer range and pipeline position disagree")
        if log is not None and log.block_size != cache.block_size:
            raise ValueError(f"the KV cache has block_size={cache.block_size}, the activation log {log.block_size}: "
                             f"a paged cache needs a PagedActivationLog over the same blocks")  # fmt: skip
        self.model, self.groups, self.cache, self.device = model, groups, cache, device
        self.log = log  # what this stage sent on, kept for replays (`ActivationLog`); never on the last stage
        self.dtype = model.dtype
        # Decode steps from captured CUDA graphs (`cuda_graph`) or compiled CPU layer halves (`cpu_decode`) where the
        # shard allows it, else eager.
        self.graphs = decode_graphs(model, cache, device, groups.tp.size, compile) if cuda_graphs else None
        self.native = cpu_decode(model, cache, device) if native_decode and self.graphs is None else None
        if self.graphs is not None:
            self.decode_runner = "cuda-graphs+compile" if compile else "cuda-graphs"
        else:
            self.decode_runner = "cpu-native" if self.native is not None else "eager"

    @property
    def is_first(self) -> bool:
        return self.model.is_first

    @property
    def is_last(self) -> bool:
        return self.model.is_last

    @torch.inference_mode()
    def step(self, batch: BatchLayout | None, token_ids: Tensor | None = None, all_logits: bool = False,
             relay: Relay | None = None) -> Tensor | None:  # fmt: skip
        """Run one step over the segments this stage computes (`batch`; None: none). The first stage takes
        `token_ids` (T,); the last returns logits (B, vocab), or (T, vocab) with `all_logits`. The others send
        the next stage their output, or what `relay` says."""
        out = None
        if batch is not None:
            if self.is_first:
                if token_ids is None or token_ids.shape != (batch.num_tokens,):
                    raise ValueError(f"first stage needs {batch.num_tokens} token ids for this batch")
                x = token_ids.to(self.device)
            else:
                assert self.groups.prev is not None
                x = self.groups.prev.recv((batch.num_tokens, self.model.cfg.hidden_size), self.dtype, self.device)
            if self.graphs is not None and self.graphs.accepts(batch, all_logits):
                out = self.graphs.run(batch, x)
            elif self.native is not None and self.native.accepts(batch, all_logits):
                out = self.native.run(batch, x)
            else:
                out = self.model(x, batch, self.cache, all_logits=all_logits)
            if self.is_last:
                return out
        if self.is_last:
            return None
        if relay is None:
            # The rows first, then the log: the next stage waits for the rows, and writing the log before them
            # put ~0.08 ms a token (0.14 at 16 sequences) on a pipeline's critical path (docs/performance.md,
            # "The seam's serial path, timestamped").
            self._send(out)
            self._record(batch, out)
        else:  # a replay may relay rows of the log: written first, as they would be by any later step
            self._record(batch, out)
            self._send(self._relayed(relay, out))
        return None

    def _send(self, x: Tensor | None) -> None:
        if x is not None and x.shape[0]:
            assert self.groups.next is not None
            self.groups.next.send(x)

    def _record(self, batch: BatchLayout | None, out: Tensor | None) -> None:
        if self.log is not None and batch is not None and out is not None:
            self.log.record(batch, out)

    def _relayed(self, relay: Relay, out: Tensor | None) -> Tensor | None:
        parts = []
        for part in relay.parts:
            if isinstance(part, Segment):
                if self.log is None:
                    raise ValueError("a replay asks for recorded activations, but this stage keeps no log")
                parts.append(self.log.rows(part))
            else:
                assert out is not None
                row, count = part
                parts.append(out[row : row + count])
        return torch.cat(parts) if parts else None
