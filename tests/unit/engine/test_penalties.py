"""Penalties, min-p and top-n logprobs on the last stage, against `transformers`' logits processors and the formulas
vLLM and OpenAI document; the token history they count, by position."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from shardmesh.core.step import SamplingParams, StepEntry
from shardmesh.engine.penalties import TokenHistory, apply_penalties
from shardmesh.engine.sampling import sample, uniform, weights

VOCAB = 97


def _logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _histories(rows: int, seed: int) -> list[list[int]]:
    """Token logs of different lengths that repeat tokens (a small alphabet) and hold some of them once."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 12 + 20 * r, (5 + 7 * r,), generator=g).tolist() for r in range(rows)]


def _history_of(logs: list[list[int]], slots: list[int]) -> TokenHistory:
    history = TokenHistory(num_slots=8, max_len=64)
    history.data.fill_(VOCAB - 1)  # stale ids of an earlier sequence: never counted
    for slot, log in zip(slots, logs, strict=True):
        history.record([slot] * len(log), list(range(len(log))), log)
    return history


@pytest.mark.parametrize("penalties", [(1.3, 1.3, 1.3), (0.7, 1.6, 2.0), (1.0, 1.2, 0.5)])
def test_the_repetition_penalty_equals_transformers_processor(penalties: tuple[float, ...]) -> None:
    """Prompt and completion alike, once per distinct token, row by row with each row's own penalty."""
    logits, logs, slots = _logits(3, 1), _histories(3, 2), [5, 0, 3]
    history = _history_of(logs, slots)
    params = [SamplingParams(repetition_penalty=r, prompt_len=2) for r in penalties]
    got = apply_penalties(logits, params, history, slots, [len(log) for log in logs])
    for row, (log, r) in enumerate(zip(logs, penalties, strict=True)):
        expected = RepetitionPenaltyLogitsProcessor(r)(torch.tensor([log]), logits[row : row + 1].clone())[0]
        assert torch.equal(got[row], expected), row
    assert not torch.equal(got[1], logits[1])  # the penalty did something


def test_frequency_and_presence_penalties_count_generated_tokens_only() -> None:
    """vLLM's (and OpenAI's) formula: logits -= frequency * count + presence * (count > 0), counting the completion
    (positions from the prompt's end on), never the prompt."""
    logits, slots = _logits(2, 3), [1, 6]
    logs = [[4, 4, 9, 7, 7, 7, 4, 11], [9, 9, 9, 2, 3]]
    prompt_lens = [3, 5]  # row 0: the prompt is 4 4 9, the completion 7 7 7 4 11; row 1: nothing generated yet
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=-1.25, prompt_len=n) for n in prompt_lens]
    got = apply_penalties(logits, params, _history_of(logs, slots), slots, [len(log) for log in logs])
    expected = logits.clone()
    for row, (log, n) in enumerate(zip(logs, prompt_lens, strict=True)):
        for token, count in Counter(log[n:]).items():
            expected[row, token] -= 0.5 * count + -1.25 * (count > 0)
    assert torch.allclose(got, expected, atol=1e-6, rtol=0)
    assert got[0, 9] == logits[0, 9] and got[0, 7] != logits[0, 7]  # 9 is in the prompt only, 7 generated
    assert torch.equal(got[1], logits[1])


def test_penalties_computed_where_tokens_occur_equal_the_formulas_over_whole_rows_to_the_bit() -> None:
    """`apply_penalties` changes only the logits of tokens that occur, with the arithmetic the formulas have over whole
    rows of counts: every logit is the same, to the bit, including the rows without a penalty."""
    logits, logs, slots = _logits(4, 9), _histories(4, 5), [2, 0, 6, 4]
    history = _history_of(logs, slots)
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.7, prompt_len=3),
              SamplingParams(frequency_penalty=1.5, prompt_len=2), SamplingParams(),
              SamplingParams(repetition_penalty=0.8, presence_penalty=2.0, prompt_len=9)]  # fmt: skip
    positions = [len(log) for log in logs]
    got = apply_penalties(logits, params, history, slots, positions)
    seen = history.counts(slots, [0] * 4, positions, VOCAB) > 0
    r = torch.tensor([p.repetition_penalty for p in params])[:, None]
    x = torch.where(seen, torch.where(logits < 0, logits * r, logits / r), logits)
    generated = history.counts(slots, [p.prompt_len for p in params], positions, VOCAB)
    frequency = torch.tensor([p.frequency_penalty for p in params])[:, None]
    presence = torch.tensor([p.presence_penalty for p in params])[:, None]
    assert torch.equal(got, x - frequency * generated - presence * (generated > 0))
    assert torch.equal(got[2], logits[2]) and not torch.equal(got[3], logits[3])


def test_tallies_are_each_rows_tokens_with_their_counts_in_the_sequence_and_in_its_completion() -> None:
    """What a call of several steps starts its penalties from: a line per (row, token) before each row's end, with the
    counts `occurrences` gives over the whole sequence and over its completion; stale positions past the end and ids
    past the vocabulary are not counted."""
    logs, slots = _histories(3, 7), [4, 1, 6]
    history = _history_of(logs, slots)
    history.record([6], [2], [VOCAB + 3])  # an id past the vocabulary
    ends, prompt_lens = [len(log) - 1 for log in logs], [2, 0, 9]
    lines = history.tallies(slots, prompt_lens, ends, VOCAB)
    assert lines.dtype == torch.int64 and lines.shape[1] == 4
    expected = {}
    for row, (log, end, n) in enumerate(zip(logs, ends, prompt_lens, strict=True)):
        log = [VOCAB + 3 if (row, i) == (2, 2) else t for i, t in enumerate(log)]
        for token, count in Counter(t for t in log[:end] if t < VOCAB).items():
            expected[row, token] = (count, sum(1 for t in log[n:end] if t == token))
    assert {(r, t): (a, g) for r, t, a, g in lines.tolist()} == expected
    assert len(lines) == len(expected) and any(g == 0 < a for a, g in expected.values())
    rows, tokens, counts = history.occurrences(slots, prompt_lens, ends, VOCAB)
    completion = {(r, t): g for (r, t), (_, g) in expected.items() if g}
    assert dict(zip(zip(rows.tolist(), tokens.tolist(), strict=True), counts.tolist(), strict=True)) == completion


def test_a_position_written_again_counts_once_and_positions_past_the_draw_not_at_all() -> None:
    history = TokenHistory(num_slots=2, max_len=16)
    history.record([1] * 6, range(6), [3, 3, 5, 8, 8, 8])  # an earlier, longer sequence in the slot
    entry = StepEntry("r", 1, 0, 4, (3, 5, 5, 2), SamplingParams(presence_penalty=1.0))
    history.record_entries([entry])
    history.record_entries([entry])  # a replay writes the same positions again
    counts = history.counts([1], [0], [4], VOCAB)[0]
    assert counts.nonzero().flatten().tolist() == [2, 3, 5] and counts[[2, 3, 5]].tolist() == [1.0, 1.0, 2.0]
    assert history.counts([1], [1], [4], VOCAB)[0, 5] == 2 and history.counts([1], [2], [4], VOCAB)[0, 5] == 1


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"),
                         [(1.0, 0, 1.0, 0.05), (0.7, 0, 1.0, 0.2), (1.3, 0, 1.0, 0.5), (0.5, 0, 1.0, 1.0),
                          (1.0, 10, 1.0, 0.0), (0.8, 0, 0.9, 0.0), (1.2, 0, 0.3, 0.0), (0.7, 40, 0.95, 0.02),
                          (1.5, 30, 0.6, 0.1)])  # fmt: skip
def test_the_tokens_a_draw_keeps_are_transformers_warpers(temperature: float, top_k: int, top_p: float,
                                                          min_p: float) -> None:  # fmt: skip
    """Temperature, then top-k, top-p and min-p, as transformers' warpers apply them: the same tokens kept, with
    the same probabilities."""
    for row, logits in enumerate(_logits(4, 4)):
        p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=1)
        got = weights(logits[None], [p])[0]
        warped = TemperatureLogitsWarper(temperature)(None, logits[None].clone())
        for warper, on in ((TopKLogitsWarper(max(top_k, 1)), top_k), (TopPLogitsWarper(top_p), top_p < 1),
                           (MinPLogitsWarper(min_p), min_p)):  # fmt: skip
            warped = warper(None, warped) if on else warped
        kept = ~warped[0].isinf()
        assert torch.equal(got > 0, kept), row
        assert torch.allclose(got / got.sum(), warped[0].softmax(-1), atol=1e-6)
        assert 0 < int(kept.sum()) < VOCAB or min_p == 1.0


def test_greedy_with_a_penalty_takes_the_penalised_argmax_and_reports_the_model_logprob() -> None:
    logits = _logits(3, 5)
    top = int(logits[1].argmax())
    logs, slots = [[1], [top, top], [2]], [0, 1, 2]
    history = _history_of(logs, slots)
    penalised = SamplingParams(repetition_penalty=50.0, frequency_penalty=2.0)
    params = [SamplingParams(), penalised, SamplingParams()]
    drawn = sample(logits, params, [1, 2, 1], history, slots)
    expected = apply_penalties(logits[1:2], [penalised], history, [1], [2])[0]
    assert drawn.token_ids[1] == int(expected.argmax()) != top  # the penalty changed the choice
    assert drawn.token_ids[0] == int(logits[0].argmax()) and drawn.token_ids[2] == int(logits[2].argmax())
    raw = torch.log_softmax(logits, -1)
    assert drawn.logprobs == pytest.approx([float(raw[r, t]) for r, t in enumerate(drawn.token_ids)], abs=1e-6)


def test_a_sampled_row_draws_from_the_penalised_shaped_distribution_seeded_by_its_position() -> None:
    logits, logs, slots = _logits(1, 6), [[3, 3, 9, 9, 9, 14]], [4]
    history = _history_of(logs, slots)
    p = SamplingParams(temperature=0.8, top_k=20, min_p=0.05, seed=21, repetition_penalty=1.4,
                       frequency_penalty=0.3, presence_penalty=0.6, prompt_len=2)  # fmt: skip
    drawn = [sample(logits, [p], [6], history, slots).token_ids[0] for _ in range(3)]
    w = weights(apply_penalties(logits, [p], history, slots, [6]), [p])[0].double()
    target, run = uniform(21, 6) * float(w.sum()), 0.0
    expected = next(t for t in range(VOCAB) if w[t] > 0 and (run := run + float(w[t])) > target)
    assert drawn == [expected] * 3


def test_top_logprobs_are_the_raw_distributions_most_likely_tokens() -> None:
    logits, logs, slots = _logits(4, 7), [[1], [1], [1], [1]], [0, 1, 2, 3]
    params = [SamplingParams(top_logprobs=5), SamplingParams(),
              SamplingParams(top_logprobs=20, seed=2, temperature=1.0),
              SamplingParams(top_logprobs=1, repetition_penalty=3.0)]  # fmt: skip
    drawn = sample(logits, params, [1, 1, 1, 1], _history_of(logs, slots), slots)
    raw = torch.log_softmax(logits, -1)
    assert drawn.top_logprobs[1] == ()
    for row, n in ((0, 5), (2, 20), (3, 1)):  # penalties and temperature shape the draw, not these
        values, ids = torch.topk(raw[row], n)
        assert [t for t, _ in drawn.top_logprobs[row]] == ids.tolist()
        assert [lp for _, lp in drawn.top_logprobs[row]] == pytest.approx(values.tolist(), abs=1e-6)
    assert drawn.top_logprobs[0][0] == (drawn.token_ids[0], pytest.approx(drawn.logprobs[0], abs=1e-6))


def test_a_penalty_needs_the_history_and_the_token_ids() -> None:
    with pytest.raises(ValueError, match="needs the token history"):
        sample(_logits(1, 8), [SamplingParams(presence_penalty=0.5)], [3])
    with pytest.raises(ValueError, match="records them for the sampling's penalties"):
        StepEntry("r", 0, 0, 3, (), SamplingParams(repetition_penalty=1.1))
    StepEntry("r", 0, 0, 3, (), SamplingParams())  # no penalty: a stage past the first may go without them


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
     ({"frequency_penalty": 2.5}, r"frequency_penalty must be in \[-2, 2\]"),
     ({"presence_penalty": float("nan")}, r"presence_penalty must be in \[-2, 2\]"),
     ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"), ({"top_logprobs": 21}, r"top_logprobs must be in \[0, 20\]")],
)  # fmt: skip
def test_out_of_range_sampling_is_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
