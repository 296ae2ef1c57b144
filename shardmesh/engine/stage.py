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
from shardmesh.engine.cpu_decode import Drawn, cpu_decode
from shardmesh.engine.cuda_graph import decode_graphs
from shardmesh.engine.groups import ShardGroups, StageLink
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
             relay: Relay | None = None, tokens_from: StageLink | None = None) -> Tensor | None:  # fmt: skip
        """Run one step over the segments this stage computes (`batch`; None: none). The first stage takes
        `token_ids` (T,), or receives them over `tokens_from` (a pipeline's loop link); the last returns logits
        (B, vocab), or (T, vocab) with `all_logits`. The others send the next stage their output, or what `relay`
        says."""
        out, sent = None, False
        if batch is not None:
            received = self._received(batch, all_logits, tokens_from, relay)
            if received is None:
                out = self._computed(batch, self._input(batch, token_ids, tokens_from), all_logits)
            else:
                out, sent = received
        if self.is_last:
            return out
        if sent:  # and logged, in the call that computed it
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

    def draws_steps(self, batches: list[BatchLayout]) -> bool:
        """Whether `drawn_steps` may take these steps: a last stage on the CPU decode path, which accepts each layout
        (a pipeline's last stage also needs its links over shared memory, which only the call finds out)."""
        return (self.is_last and self.native is not None and bool(batches)
                and all(self.native.accepts(b, False) for b in batches))  # fmt: skip

    @torch.inference_mode()
    def drawn_steps(self, batches: list[BatchLayout], token_ids: Tensor, loop: StageLink | None = None,
                    draws: tuple[Tensor, Tensor] | None = None, penalties: tuple[Tensor, Tensor] | None = None,
                    top_counts: Tensor | None = None) -> Drawn | None:  # fmt: skip
        """Decode steps (`batches`, one a step) in one call of the CPU decode path, draws included (greedy, or as
        `draws` says: `sampling.draw_table` and `sampling.seed_bits` of the rows; penalised as `penalties` say; each
        row's `top_counts` alternatives kept): on a single stage (`CpuDecode.run_drawn_steps`) the first fed
        `token_ids` and each later one what the step before it drew; on a pipeline's last stage
        (`run_drawn_steps_received`) each receiving its activations, its draws sent back to the first stage over
        `loop` but the last step's. None where it cannot, and nothing ran: the caller runs `step` for each and
        samples."""
        if not self.draws_steps(batches):
            return None
        if self.is_first:
            return self.native.run_drawn_steps(batches, token_ids, draws, penalties, top_counts)
        if loop is None or self.groups.prev is None:
            return None
        return self.native.run_drawn_steps_received(batches, self.groups.prev, loop, draws, penalties, top_counts)

    def _received(self, batch: BatchLayout, all_logits: bool, tokens_from: StageLink | None,
                  relay: Relay | None) -> tuple[Tensor, bool] | None:  # fmt: skip
        """The step's output, and whether it went on to the next stage, where the CPU decode path receives the step's
        input itself, inside its call (`CpuDecode.run_received`: what the stage did after a receive from Python was
        on a pipeline's critical path), and sends it on from there unless a replay relays something else; else None
        and nothing received."""
        link = tokens_from if self.is_first else self.groups.prev
        if self.native is None or link is None or not self.native.accepts(batch, all_logits):
            return None
        log = self.log.data if self.log is not None and relay is None else None
        return self.native.run_received(batch, link, self.groups.next if relay is None else None, log)

    def _input(self, batch: BatchLayout, token_ids: Tensor | None, tokens_from: StageLink | None) -> Tensor:
        """The step's input: the first stage's token ids (given, or received over `tokens_from`), else the previous
        stage's activations."""
        if self.is_first:
            if tokens_from is not None:
                token_ids = tokens_from.recv((batch.num_tokens,), torch.int64, "cpu")
            if token_ids is None or token_ids.shape != (batch.num_tokens,):
                raise ValueError(f"first stage needs {batch.num_tokens} token ids for this batch")
            return token_ids.to(self.device)
        assert self.groups.prev is not None
        return self.groups.prev.recv((batch.num_tokens, self.model.cfg.hidden_size), self.dtype, self.device)

    def _computed(self, batch: BatchLayout, x: Tensor, all_logits: bool) -> Tensor:
        if self.graphs is not None and self.graphs.accepts(batch, all_logits):
            return self.graphs.run(batch, x)
        if self.native is not None and self.native.accepts(batch, all_logits):
            return self.native.run(batch, x)
        return self.model(x, batch, self.cache, all_logits=all_logits)

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
