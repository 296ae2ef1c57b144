"""Choosing tokens on the last stage: greedy rows, draws fixed by (seed, position), the model log-probability."""

from __future__ import annotations

import pytest
import torch

from shardmesh.core.step import SamplingParams
from shardmesh.engine import cpu_kernels
from shardmesh.engine.sampling import Draws, draw_seed, sample, top_tokens

GREEDY = SamplingParams()


def _ids_lps(drawn: Draws) -> tuple[list[int], list[float]]:
    return drawn.token_ids, drawn.logprobs


def test_greedy_rows_take_the_argmax_and_report_its_model_logprob() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1)) * 3
    drawn = sample(logits, [GREEDY] * 5, [9] * 5)
    ids, lps = drawn.token_ids, drawn.logprobs
    assert ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1)[torch.arange(5), torch.tensor(ids)]
    assert lps == pytest.approx(expected.tolist(), abs=1e-6)


def test_a_seeded_row_draws_the_same_token_whatever_rows_share_its_step() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    seeded = SamplingParams(temperature=1.0, seed=7)
    alone = _ids_lps(sample(logits[2:3], [seeded], [12]))
    params = [GREEDY, SamplingParams(temperature=0.8, top_k=5, seed=3), seeded, GREEDY]
    together = _ids_lps(sample(logits, params, [3, 40, 12, 5]))
    assert together[0][2] == alone[0][0] and together[1][2] == pytest.approx(alone[1][0])
    assert together[0][0] == int(logits[0].argmax()) and together[0][3] == int(logits[3].argmax())
    top5 = torch.topk(logits[1], 5).indices.tolist()
    assert together[0][1] in top5
    # The reported log-probability is the model's, not the shaped distribution's.
    assert together[1][1] == pytest.approx(float(torch.log_softmax(logits[1], -1)[together[0][1]]), abs=1e-6)


def test_rows_and_params_must_agree() -> None:
    with pytest.raises(ValueError, match="3 rows of logits, 2 params"):
        sample(torch.zeros(3, 8), [GREEDY] * 2, [0] * 2)


def test_a_draw_depends_on_the_seed_and_the_position_only() -> None:
    """What makes a replay after a worker's loss exact: no state carried from one step to the next."""
    flat = torch.zeros(1, 1000)  # every token equally likely: the draw is the generator's alone
    hot = SamplingParams(temperature=1.0, seed=11)
    draws = [sample(flat, [hot], [pos]).token_ids[0] for pos in range(6)]
    again = [sample(flat, [hot], [pos]).token_ids[0] for pos in reversed(range(6))][::-1]
    assert draws == again  # the same (seed, position), in any order, the same token
    assert len(set(draws)) > 1  # but not one token for every position
    other = [sample(flat, [SamplingParams(temperature=1.0, seed=12)], [pos]).token_ids[0] for pos in range(6)]
    assert other != draws
    assert draw_seed(11, 0) != draw_seed(11, 1) != draw_seed(12, 0)


def test_a_sampled_row_without_a_seed_is_refused() -> None:
    with pytest.raises(ValueError, match="needs a seed"):
        sample(torch.zeros(1, 8), [SamplingParams(temperature=1.0)], [0])


NAN, INF = float("nan"), float("inf")
# Rows with ties across the k-th place, several NaNs, and -inf.
TIED = torch.tensor([
    [0.5, 2.0, 2.0, -1.0, 2.0, 0.5, 0.5, 3.0, -INF, 0.5, 2.0, 0.0],
    [1.0, NAN, 1.0, NAN, -INF, 1.0, 7.0, 1.0, -INF, 1.0, 0.0, 1.0],
    [-INF] * 6 + [0.0] + [-INF] * 5,
])  # fmt: skip


def by_hand(x: torch.Tensor, k: int) -> list[list[int]]:
    """Each row's k first indices sorted NaN first, then by value descending, then by index."""

    def rank(row: list[float], i: int) -> tuple[bool, float, int]:
        return (row[i] == row[i], -row[i] if row[i] == row[i] else 0.0, i)

    return [sorted(range(len(row)), key=lambda i, row=row: rank(row, i))[:k] for row in x.tolist()]


@pytest.mark.parametrize("k", [1, 3, 4, 7, 12])
def test_top_tokens_order_ties_by_id_and_nan_above_every_number(monkeypatch: pytest.MonkeyPatch, k: int) -> None:
    """`top_tokens` in torch (where the compiled kernels are not loaded: other devices, or a CPU without a build)
    takes each row's k largest, largest first, a tie going to the lower index and NaN above every number (as
    torch.topk ranks it): the order a compiled call of several steps keeps too."""
    monkeypatch.setattr(cpu_kernels, "loaded", lambda: False)
    values, ids = top_tokens(TIED, k)
    assert ids.tolist() == by_hand(TIED, k)
    torch.testing.assert_close(values, TIED.gather(1, ids), rtol=0, atol=0, equal_nan=True)
