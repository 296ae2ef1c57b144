"""The arithmetic bench/paged_kv.py reports from: peak concurrency, KV positions held at a moment, throughput,
the prompts it sends and the ratios it pairs per round."""

from __future__ import annotations

import pytest

from bench.paged_kv import (
    Stream,
    aggregate_tok_s,
    distinct_prompts,
    paired,
    peak_concurrency,
    summarize_prefix,
    system_prompt,
    tokens_held,
)


def test_distinct_prompts_never_share_a_first_block() -> None:
    prompts = distinct_prompts(64, 448, 49152, seed=3)
    assert len(prompts) == 64 and all(len(p) == 448 for p in prompts)
    assert len({tuple(p[:16]) for p in prompts}) == 64
    assert all(1000 <= t < 49152 for p in prompts for t in p)
    assert distinct_prompts(4, 8, 49152, seed=3) == distinct_prompts(4, 8, 49152, seed=3)


def test_distinct_prompts_refuse_what_they_cannot_make() -> None:
    with pytest.raises(ValueError, match="length=0"):
        distinct_prompts(2, 0, 49152)
    with pytest.raises(ValueError, match="vocab=1002"):
        distinct_prompts(4, 8, 1002)


def test_peak_concurrency_counts_overlaps_not_touching_ends() -> None:
    assert peak_concurrency([]) == 0
    assert peak_concurrency([(0, 1), (1, 2), (2, 3)]) == 1  # one ends as the next starts
    assert peak_concurrency([(0, 10), (1, 2), (1.5, 3), (2.5, 4)]) == 3
    assert peak_concurrency([(0, 5)] * 4 + [(6, 7)]) == 4


def test_tokens_held_counts_prompt_and_streamed_tokens_of_unfinished_streams() -> None:
    a = Stream(10, sent=0.0, stamps=[1.0, 2.0, 3.0, 4.0])
    b = Stream(10, sent=0.0, stamps=[2.5, 3.5, 5.0])
    done = Stream(10, sent=0.0, stamps=[0.1, 0.2])
    waiting = Stream(10, sent=0.0, stamps=[6.0, 7.0])  # not streaming yet at 3.0: it holds nothing known
    # At 3.0: a has streamed 3 tokens (the third one's KV is being written), b 1; `done` has finished.
    assert tokens_held([a, b, done, waiting], 3.0) == ((10 + 3) + (10 + 1), 2)
    assert tokens_held([a, b, done, waiting], 4.0) == ((10 + 2), 1)  # a's last token: a has ended
    assert tokens_held([], 3.0) == (0, 0)


def test_aggregate_tok_s_is_every_token_over_first_send_to_last_token() -> None:
    streams = [Stream(5, sent=1.0, stamps=[2.0, 3.0]), Stream(5, sent=1.5, stamps=[2.5, 3.5, 5.0])]
    assert aggregate_tok_s(streams) == pytest.approx(5 / 4.0)


def test_prefix_rounds_pair_by_round_and_take_medians() -> None:
    runs = [
        {"round": 0, "mesh": "paged+prefix", "ttft_median_s": 0.2, "tok_s": 100.0},
        {"round": 0, "mesh": "slots", "ttft_median_s": 2.0, "tok_s": 50.0},
        {"round": 1, "mesh": "slots", "ttft_median_s": 4.0, "tok_s": 40.0},
        {"round": 1, "mesh": "paged+prefix", "ttft_median_s": 0.5, "tok_s": 60.0},
        {"round": 2, "mesh": "paged+prefix", "ttft_median_s": 0.3, "tok_s": 90.0},
        {"round": 2, "mesh": "slots", "ttft_median_s": 3.0, "tok_s": 30.0},
    ]
    assert paired(runs, "slots", "paged+prefix", "ttft_median_s") == pytest.approx([10.0, 8.0, 10.0])
    assert paired(runs, "paged+prefix", "slots", "tok_s") == pytest.approx([2.0, 1.5, 3.0])
    s = summarize_prefix(runs)
    assert s["paged+prefix"] == {"ttft_median_s": 0.3, "tok_s": 90.0}
    assert s["slots"] == {"ttft_median_s": 3.0, "tok_s": 40.0}


class _Words:
    """A tokenizer with one token per word."""

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return [len(w) for w in text.split()]


def test_system_prompt_has_exactly_the_tokens_asked() -> None:
    assert len(system_prompt(_Words(), 1000)) == 1000
    assert len(system_prompt(_Words(), 7)) == 7
