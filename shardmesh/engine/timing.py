"""Time one shard's own forward passes: the per-stage numbers of the balance check before serving.

The coordinator asks every shard of a stage at once (tensor-parallel collectives are part of a
stage's cost) and the stages one after another, so each stage is timed alone, the way it runs on
its own device in a deployment. Passes use the shard's real weights and KV cache on synthetic
input: token ids on the first stage, random hidden states elsewhere. Nothing is sent to the next
stage, so stages do not wait for each other and a stage's time is its own.

The layers are also timed on their own (the same input through the decoder layers alone): the
difference is what the embedding and the LM head cost, which stays with the first and last stage
wherever the layers go. That is what lets the coordinator predict a better split.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil
import torch
from torch import Tensor

from shardmesh.core.step import Segment, blocks_for
from shardmesh.engine.batch import BatchLayout
from shardmesh.engine.kv_cache import AnyKVCache, PagedKVCache
from shardmesh.engine.model import Transformer


@dataclass(frozen=True)
class PassTimes:
    total_ms: float  # median of the timed passes, embedding / head included
    layers_ms: float | None  # median of the decoder layers alone (decode passes only)


@dataclass(frozen=True)
class ShardTiming:
    decode: PassTimes
    prefill: PassTimes
    memory_bytes: int
    peak_memory_bytes: int


def calibrate_shard(
    model: Transformer, cache: AnyKVCache, device: torch.device, *, decode_batch: int, prefill_tokens: int,
    iterations: int,
) -> ShardTiming:  # fmt: skip
    """Time `iterations` decode passes (`decode_batch` sequences × 1 token, each at the position after a
    `prefill_tokens` prompt) and prefill passes (one sequence of `prefill_tokens`), after a warm-up of each.

    Writes into KV slots [0, decode_batch), or the first blocks of a paged cache: call it only while no sequence
    holds them (a paged cache's blocks may hold a cached prefix: its holder must forget it).
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    pos = min(prefill_tokens, model.max_len - 1)  # decode at the position a prompt of that length leaves
    prefill, decode = _layouts(cache, decode_batch, prefill_tokens, pos, device)
    gen = torch.Generator().manual_seed(0)
    # Only decode passes are split into layers and the rest: the split by speed balances decode steps,
    # which is where a serving pipeline spends its time.
    prefill_times = _time(model, cache, prefill, _inputs(model, prefill_tokens, gen, device), iterations, device,
                          layers_too=False)  # fmt: skip
    decode_times = _time(model, cache, decode, _inputs(model, decode_batch, gen, device), iterations, device,
                         layers_too=True)  # fmt: skip
    memory, peak = _memory(device)
    return ShardTiming(decode_times, prefill_times, memory, peak)


def _layouts(cache: AnyKVCache, decode_batch: int, prefill_tokens: int, pos: int,
             device: torch.device) -> tuple[BatchLayout, BatchLayout]:  # fmt: skip
    """The prefill pass's layout and the decode pass's (`decode_batch` sequences at `pos`). In a paged cache each
    decode sequence gets blocks of its own when the pool holds them all, as distinct sequences read; otherwise
    they share the blocks before `pos` (a common prefix) and each writes its own last block, at an earlier
    `pos` if even that does not fit. ValueError when the pool has fewer blocks than `decode_batch`."""
    if not cache.block_size:
        return (BatchLayout.build([Segment(0, 0, prefill_tokens)], device),
                BatchLayout.build([Segment(slot, pos, 1) for slot in range(decode_batch)], device))  # fmt: skip
    assert isinstance(cache, PagedKVCache)
    bs, pool = cache.block_size, cache.num_blocks
    if decode_batch > pool:
        raise ValueError(f"decode_batch: {decode_batch} sequences need a block each to write, the KV cache has {pool}")
    prefill = Segment(0, 0, prefill_tokens, tuple(range(blocks_for(prefill_tokens, bs))))
    own = pos // bs + 1  # blocks covering [0, pos]
    if decode_batch * own <= pool:
        tables = [tuple(range(i * own, (i + 1) * own)) for i in range(decode_batch)]
    else:
        pos = min(pos, (pool - decode_batch) * bs)
        shared = tuple(range(pos // bs))
        tables = [(*shared, len(shared) + i) for i in range(decode_batch)]
    decode = [Segment(i, pos, 1, table) for i, table in enumerate(tables)]
    return BatchLayout.build([prefill], device, bs), BatchLayout.build(decode, device, bs)


def _inputs(model: Transformer, n: int, gen: torch.Generator, device: torch.device) -> tuple[Tensor, Tensor]:
    """(what the stage's forward takes, what its layers take): ids and their embeddings on the first
    stage, the same random hidden states (at the scale of real activations) elsewhere."""
    cfg = model.cfg
    dtype = model.dtype
    hidden = (torch.randn(n, cfg.hidden_size, generator=gen) * 0.5).to(device=device, dtype=dtype)
    if model.model.embed_tokens is None:
        return hidden, hidden
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen).to(device)
    with torch.inference_mode():
        return ids, model.model.embed_tokens(ids)


def _time(
    model: Transformer, cache: AnyKVCache, batch: BatchLayout, inputs: tuple[Tensor, Tensor], iterations: int,
    device: torch.device, layers_too: bool,
) -> PassTimes:  # fmt: skip
    forward_in, layers_in = inputs
    assert model.rope_cos is not None and model.rope_sin is not None
    cos = model.rope_cos[batch.positions].unsqueeze(1)
    sin = model.rope_sin[batch.positions].unsqueeze(1)

    def layers_only() -> None:
        x = layers_in
        for layer in model.model.layers.values():
            x = layer(x, batch, cache, cos, sin)

    def whole() -> None:
        model(forward_in, batch, cache)

    if not layers_too:
        return PassTimes(_median_ms((whole,), iterations, device)[0], None)
    whole_ms, layers_ms = _median_ms((whole, layers_only), iterations, device)
    # The layers are part of the whole pass; on a busy host the two medians can cross by noise.
    return PassTimes(whole_ms, min(layers_ms, whole_ms))


def _median_ms(fns: tuple[Callable[[], None], ...], iterations: int, device: torch.device) -> list[float]:
    """Median wall time of each of `fns`, run interleaved so that drift (frequency, other processes) hits all alike."""
    times: list[list[float]] = [[] for _ in fns]
    with torch.inference_mode():
        for i in range(iterations + 1):  # the first round warms caches and allocators: not counted
            for fn, out in zip(fns, times, strict=True):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                fn()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i:
                    out.append((time.perf_counter() - t0) * 1000)
    return [statistics.median(t) for t in times]


def _memory(device: torch.device) -> tuple[int, int]:
    """(now, high-water mark): process RSS on CPU; the caching allocator's reserved bytes on CUDA."""
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device), torch.cuda.max_memory_reserved(device)
    rss = psutil.Process().memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return rss, max(rss, peak)
