"""Decode steps and prompts of a CPU shard in compiled code: one call for all its decoder layers (two per layer
where streamed weights, or a tensor-parallel all-reduce over Gloo, come between them) instead of ~70 per layer, and
one for the head.

On a CPU a decode step's weights stream in ~15-20 ms for SmolLM2, and eager PyTorch adds ~12 ms of its own: each
of a layer's ~70 small operations (norms, RoPE, the KV write, attention's reshapes, SwiGLU, residuals) costs a few
microseconds of dispatch, as much as the layer's products together. This runner computes each half of a layer
(`cpu_kernels.attention_block`, `mlp_block`) in one call over the same weights, KV cache and RoPE tables as the
eager model, which still runs every step this one does not accept (logits at every position, a paged cache for head
dims that are not whole vectors, other devices, more than 16 rows of streamed layers). It is the CPU's counterpart of
`cuda_graph`: the model stays one readable file and this is another way to execute it.
Where every layer is whole, the kernels hold all the layers' arguments (`cpu_kernels.stack_layers`) and one call
(`decode_layers`) runs them: the 60 calls of a SmolLM2 step from Python cost ~0.3 ms of cold interpreter and argument
conversion between parallel regions (docs/performance.md, "All of a stage's layers in one call").

A pipeline stage whose link is a shared-memory ring waits for its input inside that one call (`run_received`,
`decode_layers_received`): the first stage for the token the last one drew, which the call embeds, a later stage for
the activations. Everything the call needs (its arguments, the layout's checks, the buffers) is made before it
waits. A receive that returned to Python first put that Python, the call's argument conversion and the first layer's
norm on the pipeline's critical path, cold, at every hop: in stage cores the seam fell from +0.29-0.37 to
+0.07-0.12 ms a token (docs/performance.md, "The stages receive inside the layers' call"). A stage before the last
also sends its output on and writes its activation log from the same call: from Python, that work held a vCPU that
the stage it had just woken wanted for its own threads.

Tensor parallelism stays where it is: each half returns its partial sum and the row-parallel product's group
all-reduces it, then adds the bias and the residual, exactly as `tp.RowParallelLinear` and `DecoderLayer` do. Where
the group goes through shared memory and the products have no bias (a Llama's), the one call makes those
all-reduces itself (`decode_layers_reduced`, through the collective's kernel): on two cores tp=3's ranks 1 and 2
share one, and each return to Python between the halves delayed both (docs/performance.md, "A tensor-parallel
rank's layers in one call").

Eligible: a CPU shard whose decoder products all use the blocked kernels (`linear.BlockedCpuKernel`: float32 or
bfloat16; its subclass `BlockedInt8Kernel`: int8 weights of a float32 shard; kernels built). On a paged KV cache
(`PagedKVCache`), decode rows and prompts, each row attending over its sequence's blocks where they lie
(`cpu_kernels.attend_paged`, `paged_rows`); until 2026-12-02 every paged step ran eagerly, a SmolLM2 decode step
1.3-2.0x the time of the slot cache's compiled one (docs/performance.md, "A Zen 5 again; the paged KV cache through the
compiled layers"). On the slot KV cache, a step of decode rows and prompts of any length (the layer halves write every
row's key and value before any row attends, so each row sees its segment's earlier ones; more than `ROW_CHUNK` rows go
through in chunks of rows), logits of each sequence's last token. Prompts went to eager's fused attention (SDPA) above
128 tokens until the prompt rows' attention tasks were balanced between the threads; then this runner took 0.67-0.73x
eager's time at 1024 tokens and 0.66-0.68x at 2048, and a prompt's rows attending by runs took 0.86-0.96x of that again
(docs/performance.md, "Long prompts through the compiled halves"). A float32 shard under a memory budget qualifies too,
for steps of at most `STREAMED_ROWS` rows: its streamed layers' products are the row-major blocks the offload streamer
maps from the checkpoint (an int8 shard's: int8 blocks and their groups' scales from its int8 copy), which the halves
multiply as they lie (`rows`), the streamer bringing each layer in around its calls as the layer's hooks do in eager
mode (eager dispatch had been most of a hot streamed step's extra time).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from torch import Tensor

from shardmesh.core.step import CPU_ROW_CHUNK
from shardmesh.engine import cpu_kernels
from shardmesh.engine.batch import BatchLayout, PagedDecodeRows
from shardmesh.engine.groups import StageLink
from shardmesh.engine.kv_cache import AnyKVCache, PagedKVCache
from shardmesh.engine.linear import BlockedCpuKernel, LinearProduct
from shardmesh.engine.model import DecoderLayer, Transformer
from shardmesh.engine.offload import StreamedInt8Kernel, StreamedKernel
from shardmesh.engine.tp import RowParallelLinear, VocabParallelHead


def cpu_decode(model: Transformer, cache: AnyKVCache, device: torch.device) -> CpuDecode | None:
    """The runner for a shard whose decode steps it can compute (see the module docstring), else None."""
    if device.type != "cpu" or model.dtype not in (torch.float32, torch.bfloat16):
        return None
    products = [m for layer in model.model.layers.values() for m in layer.modules() if isinstance(m, LinearProduct)]
    streamed = model.dtype == torch.float32 and model.streamer is not None
    allowed = (BlockedCpuKernel, StreamedKernel) if streamed else (BlockedCpuKernel,)
    if not products or not all(isinstance(m.kernel, allowed) for m in products):
        return None
    return CpuDecode(model, cache)


# Rows a call of the layers takes at most: a longer step (a long prompt, or many) goes through them a chunk of rows at
# a time, in order, so that the halves' float32 scratch (`attention_block`'s and `mlp_block`'s, ~4 × (2 hidden + 3
# intermediate) bytes a row) stays that of ROW_CHUNK rows. Rows are independent but for the cache, and a prompt's rows
# attend over keys its earlier rows wrote before (in this chunk or an earlier one), so the output is the same to the
# bit. Each chunk reads the weights again: at 512 rows, 16 float32 prompts of 46 tokens (two chunks) took 1.025x the
# time of one call (SmolLM2, 3 alternated rounds).
ROW_CHUNK = CPU_ROW_CHUNK
# The rows a step may hold where layers are streamed (`StreamedKernel`): their products read the mapped row-major
# blocks by `rows_linear`'s loop, which beats PyTorch's product only for a few rows. SmolLM2 float32, every layer
# streamed, one prompt, this runner against eager (same host, one process): 0.70x the time at 8 tokens, 0.92x at 16,
# 1.32x at 32, 2.07x at 128.
STREAMED_ROWS = 16
# A paged step's head dims: whole vectors of either build's lanes (8 floats on AVX2, 16 on AVX-512), at most what the
# halves keep in registers; and its query heads per key-value head at most (`attend_paged`: MAX_HD, MAX_GROUP).
PAGED_LANES, PAGED_HEAD_DIM, PAGED_GROUP = 16, 256, 16


def _raise_not_finite(e: RuntimeError) -> None:
    """A draw's refusal of logits holding a NaN or no finite value, raised inside a call of several steps, as the
    ValueError `sampling.draw` raises from Python: the model's output, not a failed peer or link."""
    if cpu_kernels.NOT_FINITE in str(e):
        raise ValueError(f"a sampled row's {cpu_kernels.NOT_FINITE}") from None


@dataclass(frozen=True)
class Drawn:
    """A call of several decode steps' draws, (steps, rows) each: the drawn ids, each row's largest logit, the log of
    its exponentials' sum after it, and the drawn token's logit; a draw's log-probability is
    (picked - top) - logsum, as `sampling.sample` reports it (-logsum for a greedy row). `top_ids` and `top_values`
    (steps, rows, most) hold the alternatives the rows asked for (`top_counts`): each row's first that many largest
    logits and their ids, in `sampling.top_tokens`' order."""

    ids: Tensor
    top: Tensor
    logsum: Tensor
    picked: Tensor
    top_ids: Tensor
    top_values: Tensor

    def logprobs(self) -> list[list[float]]:
        return ((self.picked - self.top) - self.logsum).tolist()

    def top_logprobs(self, counts: list[int]) -> list[list[tuple[tuple[int, float], ...]]]:
        """Each step's alternatives, a row each: its `counts[i]` most likely tokens and their log-probabilities, as
        `sampling.sample` gives them (the same arithmetic as `Normaliser.log_probs`)."""
        steps = self.ids.shape[0]
        if self.top_ids.shape[-1] == 0:
            return [[()] * len(counts) for _ in range(steps)]
        values = (self.top_values - self.top[..., None]) - self.logsum[..., None]
        ids, lps = self.top_ids.tolist(), values.tolist()
        return [[tuple(zip(ids[k][i][:n], lps[k][i][:n], strict=True)) for i, n in enumerate(counts)]
                for k in range(steps)]  # fmt: skip


class CpuDecode:
    """Runs the decode steps of one CPU shard through `cpu_kernels`' layer halves: all layers in one call
    (`decode_layers`) where they are whole, else each half in a call of its own (`one_call=False`: always)."""

    def __init__(self, model: Transformer, cache: AnyKVCache, one_call: bool = True) -> None:
        self.model, self.cache, self.one_call = model, cache, one_call
        self.ext = cpu_kernels.module()
        self._layers: list[_LayerCalls] = []
        self._for: object = None  # the cache tensor `_layers` holds views of
        self._head: tuple[Any, ...] | None = None  # `head_block`'s arguments, gathered with `_layers`
        self._all: _Stack | None = None  # every layer's arguments held by the kernels (`decode_layers`), with `_layers`
        self.arrived = 0.0  # when `run_received`'s last message came, on time.perf_counter
        self.sending = 0.0  # how long its last send took (0: it sent nothing)
        # The last drawn call's steps on time.perf_counter: (start, end) for `run_drawn_steps`, (input there, draw
        # done) for `run_drawn_steps_received`.
        self.stamps: list[tuple[float, float]] = []

    def accepts(self, batch: BatchLayout, all_logits: bool) -> bool:
        """A step with last-token logits, of at most `STREAMED_ROWS` rows where layers are streamed: in a slot layout,
        or in a paged one that `paged_rows` takes."""
        if all_logits or (batch.block_size != 0 and not self.paged_rows(batch)):
            return False
        return self.model.streamer is None or batch.num_tokens <= STREAMED_ROWS

    def paged_rows(self, batch: BatchLayout) -> bool:
        """Whether `batch` is a paged step the layer halves attend in place (`attend_paged`): decode rows and prompts
        on this runner's paged cache, with head dims of whole vectors: 0.50-0.77x eager's time from 46 to 2048 tokens
        of prompt (SmolLM2, before its rows attended by runs; docs/performance.md)."""
        cache, cfg = self.cache, self.model.cfg
        return (isinstance(cache, PagedKVCache) and batch.block_size == cache.block_size
                and cfg.head_dim % PAGED_LANES == 0 and cfg.head_dim <= PAGED_HEAD_DIM
                and cfg.num_heads // cfg.num_kv_heads <= PAGED_GROUP)  # fmt: skip

    @torch.inference_mode()
    def run(self, batch: BatchLayout, x: Tensor) -> Tensor:
        """The shard's output for `batch` (which `accepts`): (n, vocab) float32 logits or (n, hidden) activations."""
        model = self.model
        cos, sin = model.rope_cos, model.rope_sin
        assert cos is not None and sin is not None, "call init_buffers() first"
        self.cache.check(batch)
        slots, positions = self._places(batch)
        if model.model.embed_tokens is not None:
            x = model.model.embed_tokens(x)
        calls = self._calls()
        if x.shape[0] <= ROW_CHUNK:
            x = self._layers_of(calls, x, slots, positions, cos, sin)
        else:
            x = torch.cat([self._layers_of(calls, x[r : r + ROW_CHUNK], slots[r : r + ROW_CHUNK],
                                           positions[r : r + ROW_CHUNK], cos, sin)
                           for r in range(0, x.shape[0], ROW_CHUNK)])  # fmt: skip
        return self._head_of(batch, x)

    @torch.inference_mode()
    def run_received(self, batch: BatchLayout, link: StageLink, send_to: StageLink | None = None,
                     log: Tensor | None = None) -> tuple[Tensor, bool] | None:  # fmt: skip
        """`run` with the step's input received over `link` inside the layers' call (`decode_layers_received`): the
        token ids on the first stage, else the activations; and, given `send_to`, the output sent on from the same
        call, then written to `log` (an activation log's slot-major data) if given. Everything the call needs is made
        before it waits, so that none of it is on the pipeline's critical path. Returns the output and whether the
        call sent it; or None where it cannot be (layers not in one call, more rows than a chunk, a link that is not
        shared memory): then nothing was received, and the caller receives as before."""
        model = self.model
        cos, sin = model.rope_cos, model.rope_sin
        assert cos is not None and sin is not None, "call init_buffers() first"
        self._calls()
        n, embed = batch.num_tokens, model.model.embed_tokens
        if self._all is None or self._all.reduced or n > ROW_CHUNK or batch.block_size:  # a paged log: from Python
            return None
        table = ids = None
        if embed is not None:
            table, ids = embed.weight, torch.empty((n,), dtype=torch.int64)
            if table.dtype != model.dtype or not table.is_contiguous():
                return None
        x = torch.empty((n, model.cfg.hidden_size), dtype=model.dtype)
        into = ids if ids is not None else x
        nbytes = into.numel() * into.element_size()
        recv = link.native_recv(nbytes)
        if recv is None:
            return None
        out_bytes = x.numel() * x.element_size()
        send = send_to.native_send(out_bytes) if send_to is not None and model.lm_head is None else None
        self.cache.check(batch)
        slots, positions = batch.kv_index
        try:
            x, status, waited, self.arrived, sent, sending = self.ext.decode_layers_received(
                self._all.id, x, table, ids, slots, positions, cos, sin, recv, send, log if send is not None else None
            )
        except RuntimeError as e:  # raised inside, after the receive or not: the links' counts are unknown now
            for end in (link, send_to if send is not None else None):
                if end is not None:
                    end.close(f"the layers' call that used it failed: {e}")
            raise
        self.sending = sending
        link.received_natively(nbytes, status, waited)
        if send is None:
            return self._head_of(batch, x), False
        assert send_to is not None
        send_to.sent_natively(out_bytes, sent, sending)
        return x, True

    @torch.inference_mode()
    def run_drawn_steps(self, batches: list[BatchLayout], token_ids: Tensor, draws: tuple[Tensor, Tensor] | None = None,
                        penalties: tuple[Tensor, Tensor] | None = None,
                        top_counts: Tensor | None = None) -> Drawn | None:  # fmt: skip
        """A single stage's decode steps (`batches`, which `accepts`, each of the same rows), all in one call
        (`decode_steps_drawn`): step k embeds what step k - 1 drew (`token_ids` for the first), computes at
        batches[k]'s places, and draws each row's token: its most likely, or, with `draws` (`sampling.draw_table`
        and `sampling.seed_bits` of the rows), as `sampling.draw` does at the drawn token's position. `penalties`
        (`sampling.penalty_table` of the rows and `TokenHistory.tallies` of their tokens before the first draw; they
        need `draws`) shape each draw as `sampling.sample` does, counting the call's own draws as it goes.
        `top_counts` (rows,) int64: how many alternatives each row asks for (`top_logprobs`). None where it cannot
        (layers not in one call, a head that is not a whole blocked product, more rows than a chunk): then nothing
        ran."""
        model, n = self.model, batches[0].num_tokens
        cos, sin = model.rope_cos, model.rope_sin
        assert cos is not None and sin is not None, "call init_buffers() first"
        self._calls()
        embed = model.model.embed_tokens
        if (self._all is None or self._all.reduced or self._head is None or embed is None or n > ROW_CHUNK
                or token_ids.shape != (n,) or any(b.num_tokens != n for b in batches)):  # fmt: skip
            return None
        table = embed.weight
        if table.dtype != model.dtype or not table.is_contiguous():
            return None
        slots, positions = self._step_places(batches)
        try:
            ids, top, logsum, picked, times, top_ids, top_values = self.ext.decode_steps_drawn(
                self._all.id, token_ids.to(torch.int64), table, slots, positions, cos, sin, *self._head,
                *(draws or (None, None)), *(penalties or (None, None)), top_counts,
            )  # fmt: skip
        except RuntimeError as e:
            _raise_not_finite(e)
            raise
        self.stamps = [(start, end) for start, end in times.tolist()]
        return Drawn(ids, top, logsum, picked, top_ids, top_values)

    @torch.inference_mode()
    def run_drawn_steps_received(self, batches: list[BatchLayout], link: StageLink, loop: StageLink,
                                 draws: tuple[Tensor, Tensor] | None = None,
                                 penalties: tuple[Tensor, Tensor] | None = None,
                                 top_counts: Tensor | None = None) -> Drawn | None:  # fmt: skip
        """`run_drawn_steps` on a pipeline's last stage (`decode_steps_drawn_received`): step k receives its
        activations over `link`, computes at batches[k]'s places, draws (with `penalties` and `top_counts`, as
        `run_drawn_steps`), and sends the drawn ids to the first stage over `loop`, all but the last step's. None where
        it cannot (as `run_drawn_steps`, or links not over shared memory): then nothing was received. A link that fails
        raises as a receive or send from Python would, after the steps before it are counted; the steps' stamps are in
        `stamps`."""
        model, n = self.model, batches[0].num_tokens
        cos, sin = model.rope_cos, model.rope_sin
        assert cos is not None and sin is not None, "call init_buffers() first"
        self._calls()
        if (self._all is None or self._all.reduced or self._head is None or model.model.embed_tokens is not None
                or n > ROW_CHUNK or any(b.num_tokens != n for b in batches)):  # fmt: skip
            return None
        x = torch.empty((n, model.cfg.hidden_size), dtype=model.dtype)
        in_bytes, id_bytes = x.numel() * x.element_size(), n * 8
        recv = link.native_recv(in_bytes)
        send = loop.native_send(id_bytes) if recv is not None else None
        if recv is None or send is None:
            return None
        slots, positions = self._step_places(batches)
        try:
            ids, top, logsum, picked, times, done, top_ids, top_values = self.ext.decode_steps_drawn_received(
                self._all.id, x, slots, positions, cos, sin, *self._head, recv, send, *(draws or (None, None)),
                *(penalties or (None, None)), top_counts,
            )  # fmt: skip
        except RuntimeError as e:  # raised inside, after a receive or not: the links' counts are unknown now
            for end in (link, loop):
                end.close(f"the layers' call that used it failed: {e}")
            _raise_not_finite(e)
            raise
        self.stamps = []
        last = len(batches) - 1
        for k, (status, waited, arrived, drawn_at, sent, sending) in enumerate(times[: done + 1].tolist()):
            link.received_natively(in_bytes, int(status), waited)  # raises on a failed receive
            if k < last:
                loop.sent_natively(id_bytes, int(sent), sending)  # and this on a failed send
            self.stamps.append((arrived, drawn_at))
        return Drawn(ids, top, logsum, picked, top_ids, top_values)

    def _step_places(self, batches: list[BatchLayout]) -> tuple[Tensor, Tensor]:
        """Each step's KV slots, (steps, rows), or block tables, (steps, rows, blocks) padded with block 0, and its
        positions, (steps, rows), for a call of several steps, every layout checked against the cache first."""
        for b in batches:
            self.cache.check(b)
        places = [self._places(b) for b in batches]
        positions = torch.stack([p for _, p in places])
        if not batches[0].block_size:
            return torch.stack([s for s, _ in places]), positions
        rows, width = places[0][0].shape[0], max(t.shape[1] for t, _ in places)
        tables = torch.zeros((len(places), rows, width), dtype=torch.int64)
        for k, (t, _) in enumerate(places):
            tables[k, :, : t.shape[1]] = t
        return tables, positions

    @staticmethod
    def _places(batch: BatchLayout) -> tuple[Tensor, Tensor]:
        """Where the layer halves put and read each row's key and value: its slot and position, or, in a paged step
        (`paged_rows`), its sequence's block table, (rows, blocks) int64 padded with block 0, and its position."""
        if not batch.block_size:
            return batch.kv_index
        decode = batch.decode
        assert decode is None or isinstance(decode, PagedDecodeRows), "a paged layout's decode rows are paged"
        if not batch.looped and decode is not None:  # a decode step's: the rows' tables as they are
            return decode.tables.to(torch.int64), batch.positions
        width = max([*(len(t) for t in batch.chunk_blocks), decode.tables.shape[1] if decode is not None else 0])
        tables = torch.zeros((batch.num_tokens, width), dtype=torch.int64)
        if decode is not None:
            tables[decode.rows, : decode.tables.shape[1]] = decode.tables.to(torch.int64)
        for (row, seg), blocks in zip(batch.looped, batch.chunk_blocks, strict=True):
            tables[row : row + seg.length, : len(blocks)] = blocks
        return tables, batch.positions

    def _head_of(self, batch: BatchLayout, x: Tensor) -> Tensor:
        """The shard's output from its layers' (n, hidden) output x: x itself, or on the last stage the logits of each
        sequence's last row."""
        model = self.model
        if model.lm_head is None:
            return x
        if x.shape[0] != len(batch.segments):  # a prompt's rows: the head needs each sequence's last
            x = x[batch.last_index]
        if self._head is not None:
            return self.ext.head_block(x, *self._head)
        assert model.model.norm is not None
        return model.lm_head(model.model.norm(x)).float()

    def _layers_of(self, calls: list[_LayerCalls], x: Tensor, *step: Tensor) -> Tensor:
        """x (rows, hidden) through the shard's layers: one call where it can (`decode_layers`, or a tensor-parallel
        rank's `decode_layers_reduced`), else a call per half."""
        if self._all is None:
            return self._each_layer(calls, x, *step)
        if not self._all.reduced:
            return self.ext.decode_layers(self._all.id, x, *step)
        return self._reduced(self._all, calls, x, *step)

    def _each_layer(self, calls: list[_LayerCalls], x: Tensor, *step: Tensor) -> Tensor:
        """x through every layer, a call per half, each streamed layer brought in around its calls."""
        streamer = self.model.streamer
        for c in calls:
            if c.streamed is None:
                x = self._layer(c, c.attention, c.mlp, x, *step)
                continue
            assert streamer is not None
            slot = streamer.acquire(c.index)
            try:
                attention, mlp = c.streamed_args(slot)
                x = self._layer(c, attention, mlp, x, *step)
            finally:
                streamer.release(c.index)
        return x

    def _reduced(self, stack: _Stack, calls: list[_LayerCalls], x: Tensor, *step: Tensor) -> Tensor:
        """x through a tensor-parallel rank's layers in one call, their all-reduces included, where its group's
        collectives go through shared memory (`NativeReduce`) and x fits them; else a call per half."""
        assert calls[0].o is not None
        # The group is looked up at each step, as `_reduce` does: `bind_group` may have given every product a new one.
        group = calls[0].o.group
        native = getattr(group, "native_all_reduce_add", None)
        args = native(x) if native is not None else None
        if args is None:
            return self._each_layer(calls, x, *step)
        x = x.contiguous()
        x, status, done, waited = self.ext.decode_layers_reduced(stack.id, x, *step, *args)
        cast(NativeReduce, group).reduced_natively(done, status, x.numel() * x.element_size(), waited)
        return x

    def _layer(self, c: _LayerCalls, attention: tuple, mlp: tuple, x: Tensor, *step: Tensor) -> Tensor:
        slots, positions, cos, sin = step
        out = self.ext.attention_block(x, *attention, slots, positions, cos, sin, *c.heads)
        x = _reduce(c.o, x, out) if c.o is not None else out
        out = self.ext.mlp_block(x, *mlp)
        return _reduce(c.down, x, out) if c.down is not None else out

    def _calls(self) -> list[_LayerCalls]:
        """Each layer's arguments that stay the same from step to step, gathered once (per cache tensor): looking
        them up through the modules' attributes took ~0.5 ms of a ~12 ms step (SmolLM2, bfloat16)."""
        if self._for is not self.cache.data:
            self._layers = [_LayerCalls.of(int(name), layer, self.cache.keys(i), self.cache.values(i))
                            for i, (name, layer) in enumerate(self.model.model.layers.items())]  # fmt: skip
            self._head = _head_args(self.model)
            if self._all is not None:
                self._all.drop()
            self._all = _Stack.of(self.ext, self._layers) if self.one_call else None
            self._for = self.cache.data
        return self._layers


@dataclass(frozen=True)
class _LayerCalls:
    """One decoder layer's constant arguments to `attention_block` (before and after the step's slots and positions)
    and `mlp_block`, and its row-parallel products when tensor-parallel (their group all-reduces each half's partial
    sum, looked up at each step so that a re-bound group is used), None otherwise. A streamed layer's weights exist
    only between the streamer's acquire and release, and they are the same tensors whenever the layer comes in the
    same slot: `streamed_args` builds its arguments the first time for each slot (building them took ~35 us a layer
    at each step, 5% of a step with SmolLM2's layers streamed)."""

    index: int  # the layer's number in the model (the streamer's key)
    attention: tuple[Any, ...]
    heads: tuple[Any, ...]
    mlp: tuple[Any, ...]
    o: RowParallelLinear | None
    down: RowParallelLinear | None
    streamed: tuple[DecoderLayer, Tensor, Tensor] | None  # the layer and its cache, for `streamed_args`
    by_slot: dict[int, tuple[tuple[Any, ...], tuple[Any, ...]]] = field(default_factory=dict, compare=False)

    @classmethod
    def of(cls, index: int, layer: DecoderLayer, keys: Tensor, values: Tensor) -> _LayerCalls:
        products = _products(layer)
        qkv, o, _, down = products
        o_sharded, down_sharded = isinstance(o, RowParallelLinear), isinstance(down, RowParallelLinear)
        streamed = isinstance(qkv.kernel, StreamedKernel)
        weights = ([None] if streamed else [p.weight] for p in products)  # a streamed layer's: at each step
        attention, mlp_args = _args(layer, keys, values, streamed, *weights)
        return cls(
            index, attention, (layer.self_attn.n_heads, layer.self_attn.n_kv_heads, not o_sharded, streamed), mlp_args,
            o if o_sharded else None, down if down_sharded else None,
            (layer, keys, values) if streamed else None,
        )  # fmt: skip

    def streamed_args(self, slot: int) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """`attention` and `mlp` with the streamed products' weights as the streamer handed them over just now, in
        `slot` (what `LayerStreamer.acquire` returned)."""
        args = self.by_slot.get(slot)
        if args is None:
            assert self.streamed is not None
            layer, keys, values = self.streamed
            args = self.by_slot[slot] = _args(layer, keys, values, True, *(_blocks(p) for p in _products(layer)))
        return args


class NativeReduce(Protocol):
    """A tensor-parallel group whose all-reduces a kernel may make (`shm_collective.ShmCollective`)."""

    def native_all_reduce_add(self, x: Tensor) -> tuple[Any, ...] | None: ...

    def reduced_natively(self, done: int, status: int, nbytes: int, waited: float) -> None: ...


class _Stack:
    """Every layer's arguments, converted once and held by the kernels under a number (`cpu_kernels.stack_layers`),
    until `drop` (or until the holder is collected), when no layer is streamed and they share their heads: for
    `decode_layers` when every layer is whole, for `decode_layers_reduced` (`reduced`) when each half of every layer
    ends in a row-parallel product without a bias (a tensor-parallel rank's)."""

    def __init__(self, ext: Any, id: int, reduced: bool) -> None:
        self.id, self.reduced = id, reduced
        self.drop = weakref.finalize(self, ext.drop_layers, id)

    @classmethod
    def of(cls, ext: Any, layers: list[_LayerCalls]) -> _Stack | None:
        # Whole layers add their residuals and a rank's leave them to the all-reduce; both read blocked weights: the
        # halves' `residual` and `rows` flags follow, which the two calls pass themselves.
        whole = all(c.o is None and c.down is None for c in layers)
        reduced = all(c.o is not None and c.o.bias is None and c.down is not None and c.down.bias is None
                      for c in layers)  # fmt: skip
        if not layers or not (whole or reduced) or any(c.streamed is not None or c.heads != layers[0].heads
                                                       for c in layers):  # fmt: skip
            return None
        n_heads, n_kv = layers[0].heads[:2]
        attention = [list(args) for args in zip(*(c.attention for c in layers), strict=True)]
        mlp = [list(args) for args in zip(*(c.mlp for c in layers), strict=True)]
        return cls(ext, ext.stack_layers(*attention, n_heads, n_kv, *mlp[:8]), reduced)  # mlp[8:]: those flags


def _head_args(model: Transformer) -> tuple[Any, ...] | None:
    """`head_block`'s arguments after x, when the last stage's head is a whole blocked product (a tensor-parallel
    head gathers its ranks' logits, a streamed one comes and goes: both stay eager), else None."""
    head, norm = model.lm_head, model.model.norm
    if (not isinstance(head, LinearProduct) or isinstance(head, VocabParallelHead) or norm is None
            or not isinstance(head.kernel, BlockedCpuKernel)):  # fmt: skip
        return None
    return norm.weight, norm.eps, [head.weight], head.bias, head.weight_scale


def _products(layer: DecoderLayer) -> tuple[LinearProduct, LinearProduct, LinearProduct, LinearProduct]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _args(layer: DecoderLayer, keys: Tensor, values: Tensor, rows: bool, qkv: list, o: list, gate_up: list,
          down: list) -> tuple[tuple[Any, ...], tuple[Any, ...]]:  # fmt: skip
    """A layer's arguments to `attention_block` (but the step's and the heads') and `mlp_block`, each product's weight
    as the list of tensors the halves take (`rows`: row-major blocks of a streamed layer)."""
    attn, norm, mlp, post = layer.self_attn, layer.input_layernorm, layer.mlp, layer.post_attention_layernorm
    o_sharded, down_sharded = isinstance(attn.o_proj, RowParallelLinear), isinstance(mlp.down_proj, RowParallelLinear)
    return (
        (norm.weight, norm.eps, qkv, attn.qkv_proj.bias, attn.qkv_proj.weight_scale, o,
         None if o_sharded else attn.o_proj.bias, attn.o_proj.weight_scale, keys, values),
        (post.weight, post.eps, gate_up, mlp.gate_up_proj.bias, mlp.gate_up_proj.weight_scale, down,
         None if down_sharded else mlp.down_proj.bias, mlp.down_proj.weight_scale, not down_sharded, rows),
    )  # fmt: skip


def _blocks(product: LinearProduct) -> list[Tensor]:
    """A streamed product's row-major blocks as the halves take them: float32 blocks, or int8 blocks each followed by
    its groups' scales (an int8 shard's, mapped from its int8 copy)."""
    kernel = product.kernel
    assert isinstance(kernel, StreamedKernel) and kernel.blocks is not None, "the layer is not acquired"
    if isinstance(kernel, StreamedInt8Kernel):
        assert kernel.scales is not None
        return [t for pair in zip(kernel.blocks, kernel.scales, strict=True) for t in pair]
    return kernel.blocks


def _reduce(product: RowParallelLinear, x: Tensor, partial: Tensor) -> Tensor:
    """x + all_reduce(partial) + bias: a row-parallel product's end and the residual, as the eager layer adds them;
    without a bias in one call of a shared-memory group (`all_reduce_add`)."""
    if product.bias is None:
        return product.group.all_reduce_add(partial, x)
    return x + (product.group.all_reduce(partial) + product.bias)
