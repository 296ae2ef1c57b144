"""Choosing the next token on the last stage, so full logits never leave it.

A random draw depends only on the request's seed and the position of the token drawn: each row gets a
generator seeded from (seed, position) for that one draw, never a stream that advances step by step.
So a sequence whose worker died, replayed on another one, draws exactly what it would have (the
gateway gives every sampled request a seed), and batching cannot change a request's tokens. Penalties
add the sequence's tokens before that position (`engine.penalties`), which a replay writes again.

A row's logits go through, in transformers' order: the penalties (repetition, frequency, presence),
then temperature, top-k, top-p and min-p; greedy takes the most likely token after the penalties.
Greedy rows without a penalty skip all of it: one argmax over the batch.

The reported log-probability is always that of the *model's* distribution (log-softmax of the raw
logits, in float32), whatever penalties / temperature / top-k / top-p / min-p shaped the draw, so two
requests that pick the same token report the same number; the top-n alternatives come from that same
distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from shardmesh.core.step import SamplingParams
from shardmesh.engine import cpu_kernels
from shardmesh.engine.penalties import TokenHistory, apply_penalties

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


@dataclass(frozen=True)
class Draws:
    """One step's draws, a row each: the token, its model log-probability, and the row's `top_logprobs` most
    likely tokens as (token id, log-probability), most likely first (empty unless asked for)."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[tuple[tuple[int, float], ...]]


def _shape(logits: Tensor, p: SamplingParams) -> Tensor:
    """Temperature, then top-k, then top-p, then min-p, on one row of (penalised) logits (V,)."""
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
    if p.min_p > 0:  # the most likely token always stays: its probability is >= min_p times itself
        probs = x.softmax(-1)
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return x


@dataclass(frozen=True)
class Normaliser:
    """What turns a step's logits into log-probabilities, a row each, without writing their log_softmax: a logit's
    log-probability is (logit - top) - logsum, as log_softmax computes it."""

    top: Tensor  # (B,) each row's largest logit
    logsum: Tensor  # (B,) log(sum(exp(logits - top))); NaN where top is not finite (log_softmax's row is NaN)

    def log_probs(self, values: Tensor, rows: list[int]) -> Tensor:
        """The log-probabilities of `values` (len(rows), k), logits of `rows`."""
        top, logsum = self.top[rows].to(values.device), self.logsum[rows].to(values.device)
        return (values - top[:, None]) - logsum[:, None]


def greedy(logits: Tensor) -> tuple[list[int], list[float], Normaliser]:
    """Each row's first largest logit (as `argmax(-1)`) and its log-probability, of (B, V) logits, and what gives any
    other logit's. On CPU through the compiled kernels when this process has them loaded (the CPU decode path loads
    them): `sample` of 16 greedy rows of SmolLM2's 49152 logits took 0.16 ms warm and 0.43 cold, against 0.58 and
    1.02 with an argmax, a log_softmax and a gather (docs/performance.md, "One decode call's bookkeeping once")."""
    x = logits.float()
    if x.device.type == "cpu" and x.dim() == 2 and cpu_kernels.loaded():
        ids, top, logsum = cpu_kernels.greedy_rows(x)
    else:
        ids = x.argmax(-1)
        top = x.gather(1, ids[:, None])[:, 0]
        logsum = torch.log(torch.exp(x - top[:, None]).sum(-1)).masked_fill(~top.isfinite(), float("nan"))
    # The argmax's log-probability is (top - top) - logsum.
    return ids.tolist(), [-v for v in logsum.tolist()], Normaliser(top, logsum)


def sample(logits: Tensor, params: list[SamplingParams], positions: list[int], history: TokenHistory | None = None,
           slots: Sequence[int] | None = None) -> Draws:  # fmt: skip
    """logits (B, V) → one token id, its model log-probability and the asked-for alternatives per row;
    `positions[i]` is where row i's token goes in its sequence (its last input's position + 1). A sampled row
    needs a seed; a row with a penalty needs `history` holding its sequence's tokens before that position, in
    KV slot `slots[i]`."""
    if len(params) != len(positions) or len(params) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits, {len(params)} params, {len(positions)} positions")
    # Greedy rows in one call, not one op per row (a per-row loop cost ~1 ms of a 16-row step).
    ids, logprobs, norm = greedy(logits)
    shaped = [i for i, p in enumerate(params) if not p.greedy or p.penalized]
    if shaped:
        x = _penalised(logits, params, positions, shaped, history, slots)
        penalised_greedy = [j for j, i in enumerate(shaped) if params[i].greedy]
        if penalised_greedy:
            for j, token in zip(penalised_greedy, x[penalised_greedy].argmax(-1).tolist(), strict=True):
                ids[shaped[j]] = token
        for j, i in enumerate(shaped):
            p = params[i]
            if p.greedy:
                continue
            if p.seed is None:
                raise ValueError("a sampled row needs a seed (random_seed() when the request gave none)")
            probs = _shape(x[j].cpu(), p).softmax(-1)
            g = torch.Generator().manual_seed(draw_seed(p.seed, positions[i]))
            ids[i] = int(torch.multinomial(probs, 1, generator=g))
        # The model's log-probability of what was drawn in place of the greedy token.
        picked = torch.tensor([ids[i] for i in shaped], device=logits.device)[:, None]
        redone = norm.log_probs(logits[shaped].float().gather(1, picked), shaped)
        for i, lp in zip(shaped, redone[:, 0].tolist(), strict=True):
            logprobs[i] = lp
    return Draws(ids, logprobs, _top_logprobs(logits, norm, [p.top_logprobs for p in params]))


def _penalised(logits: Tensor, params: list[SamplingParams], positions: list[int], rows: list[int],
               history: TokenHistory | None, slots: Sequence[int] | None) -> Tensor:  # fmt: skip
    """logits[rows] in float32, with the penalties of the rows that have any applied."""
    x = logits[rows].float()
    penalised = [j for j, i in enumerate(rows) if params[i].penalized]
    if penalised:
        if history is None or slots is None:
            raise ValueError("a row with a penalty needs the token history and its KV slot")
        of = [rows[j] for j in penalised]
        x[penalised] = apply_penalties(x[penalised], [params[i] for i in of], history, [slots[i] for i in of],
                                       [positions[i] for i in of])  # fmt: skip
    return x


def _top_logprobs(logits: Tensor, norm: Normaliser, counts: list[int]) -> list[tuple[tuple[int, float], ...]]:
    """For each row, its `counts[i]` most likely tokens and their log-probabilities; one top-k for all rows."""
    out: list[tuple[tuple[int, float], ...]] = [()] * len(counts)
    rows = [i for i, n in enumerate(counts) if n > 0]
    if not rows:
        return out
    k = min(max(counts[i] for i in rows), logits.shape[-1])
    values, indices = torch.topk(logits[rows].float(), k, dim=-1)
    values = norm.log_probs(values, rows)
    for i, ids, lps in zip(rows, indices.tolist(), values.tolist(), strict=True):
        out[i] = tuple(zip(ids[: counts[i]], lps[: counts[i]], strict=True))
    return out
