"""Choosing the next token on the last stage, so full logits never leave it.

A random draw depends only on the request's seed and the position of the token drawn: each row gets one
uniform number from (seed, position) for that one draw (`uniform`), never a stream that advances step by
step, and takes the token where it falls in the cumulative weights (`draw`). So a sequence whose worker
died, replayed on another one, draws exactly what it would have (the gateway gives every sampled request
a seed), and batching cannot change a request's tokens. Penalties add the sequence's tokens before that
position (`engine.penalties`), which a replay writes again.

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
from shardmesh.engine.penalties import TokenHistory, penalise_

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


def uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) of the draw at log `position` of a request seeded `seed`: the top 53 bits of
    `draw_seed`, exact in a float64."""
    return (draw_seed(seed, position) >> 11) * 2.0**-53


def weights(logits: Tensor, params: list[SamplingParams]) -> Tensor:
    """The draws' weights over rows of (penalised) logits (rows, V), float32, zero where a token is dropped; row i
    draws as `params[i]` says (a temperature above 0). A row over its temperature is z; top-k keeps the tokens whose z
    is at least the k-th largest (ties kept); each kept token weighs exp(z - max z); top-p then keeps tokens in order
    of z (ties: the lower id first) while the weight ranked above a token is below top_p of the whole (the first
    always stays); min-p keeps weights of at least min_p (the largest is 1). This is transformers' order, and its
    warpers keep the same tokens. A row holding a NaN or no finite logit is a ValueError. All rows at once, on the
    logits' device; `cpu_kernels.sample_rows` computes the same on a CPU (its exp within an ulp or two of torch's)."""
    rows, n = logits.shape
    on = {"device": logits.device}
    z = logits.float() / torch.tensor([p.temperature for p in params], dtype=torch.float32, **on)[:, None]
    top = z.max(-1).values
    if bool((z.isnan().any(-1) | ~top.isfinite()).any()):
        raise ValueError(f"a sampled row's {cpu_kernels.NOT_FINITE}")
    e = torch.exp(z - top[:, None])
    ks = [p.top_k if 0 < p.top_k < n else 0 for p in params]
    if any(ks):  # each row's k-th largest from one top-k of the largest k (-inf where a row has none)
        kth = torch.topk(z, max(ks), dim=-1).values.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], **on)[:, None])
        kth = kth.masked_fill(torch.tensor([k == 0 for k in ks], **on)[:, None], float("-inf"))
        e = e.masked_fill(z < kth, 0.0)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, **on)[:, None]
    if bool((top_p < 1).any()):
        order = torch.sort(z, dim=-1, descending=True, stable=True).indices
        ranked = e.gather(1, order).double()
        before = torch.cat([ranked.new_zeros(rows, 1), ranked.cumsum(-1)[:, :-1]], dim=-1)
        dropped = (before >= top_p * ranked.sum(-1, keepdim=True)) & (top_p < 1)
        e = e.masked_fill(torch.zeros_like(dropped).scatter(1, order, dropped), 0.0)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, **on)[:, None]
    return e.masked_fill(e < min_p, 0.0)


def draw(rows: Tensor, params: list[SamplingParams], us: list[float], compiled: bool | None = None) -> list[int]:
    """Each row's token: the first, in id order, whose running sum of `weights` (float64) passes its uniform `us[i]`
    times their sum. One uniform per draw, from (seed, position) alone (`uniform`). `compiled`: through the compiled
    kernels (`cpu_kernels.sample_rows`) or torch, all rows at once on the rows' device; by default the kernels for CPU
    rows when this process has them loaded. 16 rows of SmolLM2's 49152 logits at temperature 0.7 and top-p 0.9 had
    taken 89 ms through torch's sort, softmax and multinomial, a row at a time on the CPU (docs/performance.md,
    "Sampled draws in one pass")."""
    if compiled is None:
        compiled = rows.device.type == "cpu" and cpu_kernels.loaded()
    if compiled:
        ids = cpu_kernels.sample_rows(rows.float().cpu(), draw_table(params), torch.tensor(us, dtype=torch.float64))
        ids = ids.tolist()
        if min(ids, default=0) < 0:
            raise ValueError(f"a sampled row's {cpu_kernels.NOT_FINITE}")
        return ids
    cum = weights(rows, params).double().cumsum(-1)
    u = torch.tensor(us, dtype=torch.float64, device=rows.device)
    found = torch.searchsorted(cum, (u * cum[:, -1])[:, None], right=True)[:, 0]
    # Past the end only by rounding: the last kept token, where the running sum first reaches its total.
    return torch.where(found < cum.shape[-1], found, cum.argmax(-1)).tolist()


def draw_table(params: list[SamplingParams]) -> Tensor:
    """The compiled draws' settings, a row each (float64): temperature (0: greedy), top_k, top_p, min_p."""
    return torch.tensor([[p.temperature, p.top_k, p.top_p, p.min_p] for p in params], dtype=torch.float64)


def penalty_table(params: list[SamplingParams]) -> Tensor:
    """The compiled penalties' settings, a row each (float64): repetition, frequency and presence penalties, and the
    prompt's length (where a row's completion, which frequency and presence count, begins)."""
    return torch.tensor([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty, p.prompt_len]
                         for p in params], dtype=torch.float64)  # fmt: skip


def seed_bits(params: list[SamplingParams]) -> Tensor:
    """Each row's seed as int64 (an unsigned 64-bit seed's bits; 0 for a greedy row), for the compiled draws, which
    take each step's uniform from it (`uniform`)."""
    seeds = [p.seed or 0 for p in params]
    return torch.tensor([s - (1 << 64) if s >= 1 << 63 else s for s in seeds], dtype=torch.int64)


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
        drawn = [(j, i) for j, i in enumerate(shaped) if not params[i].greedy]
        if any(params[i].seed is None for _, i in drawn):
            raise ValueError("a sampled row needs a seed (random_seed() when the request gave none)")
        if drawn:
            us = [uniform(params[i].seed, positions[i]) for _, i in drawn]  # type: ignore[arg-type]
            rows = x if len(drawn) == len(shaped) else x[[j for j, _ in drawn]]
            tokens = draw(rows, [params[i] for _, i in drawn], us)
            for (_, i), token in zip(drawn, tokens, strict=True):
                ids[i] = token
        # The model's log-probability of what was drawn in place of the greedy token: only those logits gathered
        # (copying 16 rows of 49152 to gather from took ~0.3 ms).
        at = torch.tensor(shaped, device=logits.device)
        picked = logits[at, torch.tensor([ids[i] for i in shaped], device=logits.device)].float()
        for i, lp in zip(shaped, norm.log_probs(picked[:, None], shaped)[:, 0].tolist(), strict=True):
            logprobs[i] = lp
    return Draws(ids, logprobs, _top_logprobs(logits, norm, [p.top_logprobs for p in params]))


def _penalised(logits: Tensor, params: list[SamplingParams], positions: list[int], rows: list[int],
               history: TokenHistory | None, slots: Sequence[int] | None) -> Tensor:  # fmt: skip
    """logits[rows] in float32, with the penalties of the rows that have any applied: a copy, but for all the rows
    of float32 logits without a penalty, which are `logits` itself."""
    penalised = [j for j, i in enumerate(rows) if params[i].penalized]
    every = len(rows) == logits.shape[0]  # rows are increasing, so all of them in order
    x = logits.float() if every and not penalised else logits[rows].float()
    if penalised:
        if history is None or slots is None:
            raise ValueError("a row with a penalty needs the token history and its KV slot")
        of = [rows[j] for j in penalised]
        penalise_(x, penalised, [params[i] for i in of], history, [slots[i] for i in of], [positions[i] for i in of])
    return x


def top_tokens(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Each row's k largest values of x (B, V) and their indices, largest first, a tie going to the lower index and
    NaN above every number: (B, k) each. torch.topk picks the same values but orders ties as its selection happens to
    leave them; this order is the one a compiled call of several steps keeps (`cpu_kernels`' StepTops), so that a
    request's alternatives do not depend on how its steps were grouped. On CPU through the compiled kernels when this
    process has them loaded (`cpu_kernels.top_rows`, the calls' own selection); elsewhere only the candidates (values
    at or above each row's k-th, and NaNs) are sorted."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and cpu_kernels.loaded():
        return cpu_kernels.top_rows(x, k)
    return _top_tokens_torch(x, k)


def _top_tokens_torch(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """`top_tokens` in torch ops, on any device."""
    kth = torch.topk(x, k, dim=-1).values[:, -1:]
    keep = (x >= kth) | x.isnan()  # at least k a row
    rows, ids = keep.nonzero(as_tuple=True)  # row by row, ids increasing
    values = x[rows, ids]
    order = torch.sort(values, descending=True, stable=True).indices  # ties keep their ids' order
    order = order[torch.sort(rows[order], stable=True).indices]  # then row by row, each in that order
    counts = keep.sum(-1)
    firsts = (torch.cumsum(counts, 0) - counts)[:, None] + torch.arange(k, device=x.device)
    taken = order[firsts.flatten()]
    return values[taken].view(-1, k), ids[taken].view(-1, k)


def _top_logprobs(logits: Tensor, norm: Normaliser, counts: list[int]) -> list[tuple[tuple[int, float], ...]]:
    """For each row, its `counts[i]` most likely tokens and their log-probabilities (`top_tokens`' order); one
    selection for all rows."""
    out: list[tuple[tuple[int, float], ...]] = [()] * len(counts)
    rows = [i for i, n in enumerate(counts) if n > 0]
    if not rows:
        return out
    k = min(max(counts[i] for i in rows), logits.shape[-1])
    values, indices = top_tokens(logits[rows].float(), k)
    values = norm.log_probs(values, rows)
    for i, ids, lps in zip(rows, indices.tolist(), values.tolist(), strict=True):
        out[i] = tuple(zip(ids[: counts[i]], lps[: counts[i]], strict=True))
    return out
