"""Choosing the next token on the last stage, so full logits never leave it.

The reported log-probability is always that of the *model's* distribution (log-softmax of the raw
logits, in float32), whatever temperature / top-k / top-p shaped the draw, so two requests that
pick the same token report the same number.
"""

from __future__ import annotations

import torch
from torch import Tensor

from shardmesh.core.step import SamplingParams


def generator(params: SamplingParams) -> torch.Generator | None:
    """A per-request random stream: same seed, same tokens, however requests are batched."""
    if params.greedy:
        return None
    g = torch.Generator()
    g.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return g


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


def sample(
    logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> tuple[list[int], list[float]]:
    """logits (B, V) float32 → one token id and its model log-probability per row."""
    if len(params) != len(generators) or len(params) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits, {len(params)} params, {len(generators)} generators")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    # Greedy rows in one argmax: one op, not one per row (a per-row loop cost ~1 ms of a 16-row step).
    ids = logits.argmax(-1).tolist()
    for i, (p, g) in enumerate(zip(params, generators, strict=True)):
        if not p.greedy:
            probs = _shape(logits[i].float().cpu(), p).softmax(-1)
            ids[i] = int(torch.multinomial(probs, 1, generator=g))
    chosen = logprobs.gather(1, torch.tensor(ids, device=logits.device)[:, None])[:, 0]
    return ids, chosen.tolist()
