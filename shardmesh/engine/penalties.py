"""Repetition, frequency and presence penalties, from each sequence's token history on the last stage.

A penalty depends on the tokens a sequence holds so far, which the last stage never sampled all of itself
(the prompt; a sequence replayed onto a new last stage after a fail-over). So it keeps them: `TokenHistory` is a
(KV slots, max context) table of token ids by position, filled from the `token_ids` every entry it computes
carries, and kept and dropped with the KV cache. By position, not by counters: a position written again (a
replay, a chunk re-sent after a failed step) overwrites what was there instead of counting twice, and the
counts at position p are those of positions [0, p) only, whatever was written past them before.

The math, per row of logits and over the tokens before the position drawn:

    repetition (transformers' RepetitionPenaltyLogitsProcessor; vLLM's repetition_penalty): for every token
        that occurs in the prompt or the completion, once however often, logit / r if logit >= 0 else logit * r
    frequency, presence (OpenAI's; vLLM's): over the completion only (positions from the prompt's end),
        logit -= frequency * count + presence * (count > 0)

applied in that order, before temperature, top-k, top-p and min-p (`engine.sampling`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from shardmesh.core.step import SamplingParams, StepEntry


class TokenHistory:
    """The token ids of every KV slot by position: `data[slot, position]` (int32; what a slot held before its
    sequence wrote a position is stale and never counted)."""

    def __init__(self, num_slots: int, max_len: int, device: torch.device | str = "cpu") -> None:
        self.data = torch.zeros((num_slots, max_len), dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def record(self, slots: Sequence[int], positions: Sequence[int], ids: Sequence[int]) -> None:
        """Token `ids[i]` at `positions[i]` of slot `slots[i]`, overwriting what the position held."""
        if not ids:
            return
        device = self.data.device
        where = torch.tensor((slots, positions), dtype=torch.long).to(device)  # one copy to the device, not two
        self.data[where[0], where[1]] = torch.tensor(ids, dtype=self.data.dtype).to(device)

    def record_entries(self, entries: Iterable[StepEntry]) -> None:
        """Every entry's `token_ids` at the positions it writes, [start_pos, start_pos + num_tokens)."""
        slots: list[int] = []
        positions: list[int] = []
        ids: list[int] = []
        for e in entries:
            slots += [e.slot] * e.num_tokens
            positions += range(e.start_pos, e.start_pos + e.num_tokens)
            ids += e.token_ids
        self.record(slots, positions, ids)

    def occurrences(self, slots: Sequence[int], starts: Sequence[int], ends: Sequence[int],
                    vocab_size: int) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """The tokens at positions [starts[r], ends[r]) of `slots[r]`, each row's distinct ones: (rows, token ids,
        counts), one entry per (row, token) that occurs (counts float32). Ids past the vocabulary (never sent by a
        gateway, which checks them) are left out."""
        keys, position, inside = self._keyed(slots, ends, vocab_size)
        inside &= position >= torch.tensor(starts, device=position.device)[:, None]
        keys, counts = torch.unique(keys[inside], return_counts=True)
        rows, tokens = keys // (vocab_size + 1), keys % (vocab_size + 1)
        known = tokens < vocab_size
        return rows[known], tokens[known], counts[known].float()

    def tallies(self, slots: Sequence[int], prompt_lens: Sequence[int], ends: Sequence[int],
                vocab_size: int) -> Tensor:  # fmt: skip
        """(m, 4) int64 on the CPU, a line per (row, token) that occurs at positions [0, ends[r]) of `slots[r]`: the
        row, the token, how often it occurs there, and how often from `prompt_lens[r]` on (its completion). What a call
        of several steps starts its penalties from (`cpu_kernels`' StepPenalties), which counts each step's draws
        itself; ids past the vocabulary are left out, as `occurrences` leaves them."""
        keys, position, inside = self._keyed(slots, ends, vocab_size)
        completion = position >= torch.tensor(prompt_lens, device=position.device)[:, None]
        found, where, counts = torch.unique(keys[inside], return_inverse=True, return_counts=True)
        generated = torch.zeros_like(counts).index_add_(0, where, completion[inside].long())
        rows, tokens = found // (vocab_size + 1), found % (vocab_size + 1)
        return torch.stack([rows, tokens, counts, generated], 1)[tokens < vocab_size].cpu()

    def _keyed(self, slots: Sequence[int], ends: Sequence[int], vocab_size: int) -> tuple[Tensor, Tensor, Tensor]:
        """The tokens of `slots[r]` up to the longest end, (R, W) each: as keys row * (vocab_size + 1) + id (an id past
        the vocabulary as vocab_size, for the callers to leave out), their positions, and whether a position lies
        before its row's end."""
        device = self.data.device
        width = max(ends)
        ids = self.data[torch.tensor(slots, device=device), :width].long()
        row = torch.arange(len(slots), device=device)[:, None].expand_as(ids)
        position = torch.arange(width, device=device).expand_as(ids)
        inside = position < torch.tensor(ends, device=device)[:, None]
        return row * (vocab_size + 1) + ids.clamp(0, vocab_size), position, inside

    def counts(self, slots: Sequence[int], starts: Sequence[int], ends: Sequence[int], vocab_size: int) -> Tensor:
        """(R, vocab_size) float32: how often each token occurs at positions [starts[r], ends[r]) of `slots[r]`."""
        rows, tokens, counts = self.occurrences(slots, starts, ends, vocab_size)
        out = torch.zeros(len(slots), vocab_size, device=self.data.device)
        out[rows, tokens] = counts
        return out


def apply_penalties(logits: Tensor, params: Sequence[SamplingParams], history: TokenHistory, slots: Sequence[int],
                    positions: Sequence[int]) -> Tensor:  # fmt: skip
    """logits (R, V) float32 with each row's penalties applied (a new tensor); row r draws the token at
    `positions[r]` of `slots[r]`, whose positions before it `history` holds."""
    x = logits.clone()
    penalise_(x, range(len(params)), params, history, slots, positions)
    return x


def penalise_(x: Tensor, rows: Sequence[int], params: Sequence[SamplingParams], history: TokenHistory,
              slots: Sequence[int], positions: Sequence[int]) -> None:  # fmt: skip
    """`apply_penalties` in place, on rows `rows` of x (float32): row rows[i] draws as params[i] says, at
    positions[i] of slots[i]. Only the logits of tokens that occur change, so only those are computed
    (`TokenHistory.occurrences`), each with the arithmetic of the formulas over whole rows: 16 rows of SmolLM2's 49152
    logits with 600 tokens each took 7.0 ms (repetition) and 10.4 ms (frequency and presence) through whole rows of
    counts and copies of them (docs/performance.md, "Sampled draws in one pass")."""
    device, vocab = x.device, x.shape[-1]
    at = torch.tensor(list(rows), device=device)
    if any(p.repetition_penalty != 1 for p in params):
        i, tokens, _ = history.occurrences(slots, [0] * len(slots), positions, vocab)  # prompt and completion
        r = torch.tensor([p.repetition_penalty for p in params], device=device)[i]
        v = x[at[i], tokens]
        x[at[i], tokens] = torch.where(v < 0, v * r, v / r)  # transformers' expression, for equal results
    if any(p.frequency_penalty or p.presence_penalty for p in params):
        i, tokens, generated = history.occurrences(slots, [p.prompt_len for p in params], positions, vocab)
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[i]
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[i]
        x[at[i], tokens] = x[at[i], tokens] - frequency * generated - presence * (generated > 0)
