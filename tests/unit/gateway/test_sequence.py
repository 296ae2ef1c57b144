"""One sequence on its own: its next inputs from the token log, the stop conditions, its summary."""

from __future__ import annotations

import pytest

from gateway.requests import PreparedRequest, Sampling
from gateway.results import FinishReason, RequestHandle
from gateway.sequence import Sequence
from gateway.watcher import ModelFiles
from tests.unit.gateway.fakes import ids_of


def sequence(prompt: tuple[int, ...] = (5, 6, 7), max_new: int = 3, files: ModelFiles | None = None,
             stop: tuple[str, ...] = (), arrival: float = 10.0, stop_token_ids: frozenset[int] = frozenset(),
             eos: frozenset[int] = frozenset({2})) -> Sequence:  # fmt: skip
    """A request with eos id 2 (unless `eos` says otherwise); with `files`, their tokenizer."""
    tokenizer = files.tokenizer if files is not None else None
    req = PreparedRequest("r", prompt, max_new, Sampling(), stop, eos, tokenizer, arrival, stop_token_ids)
    return Sequence(req, RequestHandle("r", lambda: None), "r")


def test_inputs_are_prompt_chunks_then_the_last_sampled_token() -> None:
    s = sequence(prompt=(5, 6, 7, 8, 9))
    assert s.prefilling and s.inputs(3) == (5, 6, 7)
    s.cached = 3
    assert s.inputs(2) == (8, 9)
    s.cached = 5
    s.add_token(40, -0.1, 11.0)
    assert not s.prefilling and s.inputs(1) == (40,)
    s.cached = 6
    s.add_token(41, -0.2, 12.0)
    assert s.inputs(1) == (41,)


def test_stop_conditions_eos_and_max_new_tokens() -> None:
    s = sequence(max_new=3)
    assert s.add_token(30, -0.1, 11.0) == ("", None)  # no tokenizer: no text
    assert s.add_token(2, -0.2, 12.0) == ("", FinishReason.EOS)
    s = sequence(max_new=2)
    assert [s.add_token(t, -0.1, 11.0)[1] for t in (30, 31)] == [None, FinishReason.LENGTH]
    assert s.tokens == [30, 31] and s.logprobs == pytest.approx([-0.1, -0.1])


def test_a_stop_string_ends_with_the_token_completing_it_and_flushes_the_text(model_files: ModelFiles) -> None:
    s = sequence(max_new=40, files=model_files, stop=("END",))
    results = [s.add_token(t, 0.0, 11.0) for t in ids_of(model_files, "ab ENDx")[:6]]
    assert [r[1] for r in results] == [None] * 5 + [FinishReason.STOP_STRING]
    assert "".join(r[0] for r in results) == "ab " and s.text.text == "ab "
    s = sequence(max_new=4, files=model_files, stop=("ENDING",))
    results = [s.add_token(t, 0.0, 11.0) for t in ids_of(model_files, "a EN")]
    assert results[-1] == ("EN", FinishReason.LENGTH)  # held back as a possible stop string, flushed at the end


def test_a_stop_token_ends_without_its_text_and_flushes_what_was_held_back(model_files: ModelFiles) -> None:
    ids = ids_of(model_files, "ab;c")
    s = sequence(max_new=40, files=model_files, stop=("b;x",), stop_token_ids=frozenset({ids[2]}))
    results = [s.add_token(t, 0.0, 11.0) for t in ids[:3]]
    assert [r[1] for r in results] == [None, None, FinishReason.STOP_TOKEN]
    # "b" was held back as the start of a stop string; the stop token's own text (";") is not part of the answer
    assert [r[0] for r in results] == ["a", "", "b"] and s.text.text == "ab" and s.tokens == ids[:3]


def test_eos_comes_before_a_stop_token_and_ignore_eos_goes_on_past_it() -> None:
    s = sequence(max_new=5, stop_token_ids=frozenset({2, 9}))
    assert s.add_token(2, 0.0, 11.0)[1] is FinishReason.EOS  # the same id in both: the model's own ending wins
    ignoring = sequence(max_new=5, stop_token_ids=frozenset({9}), eos=frozenset())  # as `prepare` makes ignore_eos
    assert [ignoring.add_token(t, 0.0, 11.0)[1] for t in (2, 2, 9)] == [None, None, FinishReason.STOP_TOKEN]
    ignoring = sequence(max_new=2, eos=frozenset())
    assert [ignoring.add_token(t, 0.0, 11.0)[1] for t in (2, 2)] == [None, FinishReason.LENGTH]


def test_summary_timings_from_the_arrival() -> None:
    s = sequence(max_new=3, arrival=10.0)
    s.first_step_at = 10.5
    for t, now in ((30, 11.0), (31, 11.25), (32, 12.0)):
        s.add_token(t, 0.0, now)
    summary = s.summary(FinishReason.LENGTH, now=99.0)
    assert (summary.finish_reason, summary.prompt_tokens, summary.completion_tokens) == (FinishReason.LENGTH, 3, 3)
    t = summary.timings
    assert (t.queue_ms, t.time_to_first_token_ms, t.total_ms) == pytest.approx((500.0, 1000.0, 2000.0))
    assert t.inter_token_ms == pytest.approx((250.0, 750.0))
    # Cancelled in the queue: no step, no token; `now` stands in for both.
    t = sequence(arrival=10.0).summary(FinishReason.CANCELLED, now=10.2).timings
    assert (t.queue_ms, t.time_to_first_token_ms, t.total_ms) == pytest.approx((200.0, 0.0, 200.0))
    assert t.inter_token_ms == ()
