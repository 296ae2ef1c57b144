"""Choosing the next token on the last stage, so full logits never leave it.

A random draw depends only on the request's seed and the position of the token drawn: each row gets a
generator seeded from (seed, position) for that one draw, never a stream that advances step by step.
So a sequence whose worker died, replayed on another one, draws exactly what it would have (the
gateway gives every sampled request a seed), and batching cannot change a request's tokens.

The reported log-probability is always that of the *model's* distribution (log-softmax of the raw
logits, in float32), whatever temperature / top-k / top-p shaped the draw, so two requests that
pick the same token report the same number.
"""

from __future__ import annotations

import torch
from torch import Tensor

from shardmesh.core.step import SamplingParams

_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, position: int) -> int:
    """The generator seed of the draw at log `position` of a request seeded `seed`: SplitMix64's finaliser
    of the pair, so that neighbouring positions and seeds give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def random_seed() -> int:
    """A seed for a request that did not give one; picked once, by whoever owns the request's token log."""
    return int(torch.randint(0, 2**62, ()).item())


def _shape(logits: Tensor, p: SamplingParams) -> Tensor:
    """Temperature, then top-k, then top-p, on one row of logits (V,)."""
    x = logits / p.temperature
    if 0 < p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1:
        sorted_x, order = torch.sort(x, descending=True)
        cum = sorted_x.softmax(-1).cumsum(-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
        drop = (cum - sorted_x.softmax(-1)) >= p.top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return x


def sample(logits: Tensor, params: list[SamplingParams], positions: list[int]) -> tuple[list[int], list[float]]:
    """logits (B, V) float32 → one token id and its model log-probability per row; `positions[i]` is where
    row i's token goes in its sequence (its last input's position + 1). A sampled row needs a seed."""
    if len(params) != len(positions) or len(params) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits, {len(params)} params, {len(positions)} positions")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    # Greedy rows in one argmax: one op, not one per row (a per-row loop cost ~1 ms of a 16-row step).
    ids = logits.argmax(-1).tolist()
    for i, (p, position) in enumerate(zip(params, positions, strict=True)):
        if not p.greedy:
            if p.seed is None:
                raise ValueError("a sampled row needs a seed (random_seed() when the request gave none)")
            probs = _shape(logits[i].float().cpu(), p).softmax(-1)
            g = torch.Generator().manual_seed(draw_seed(p.seed, position))
            ids[i] = int(torch.multinomial(probs, 1, generator=g))
    chosen = logprobs.gather(1, torch.tensor(ids, device=logits.device)[:, None])[:, 0]
    return ids, chosen.tolist()
