"""Choosing tokens on the last stage: greedy rows, seeded draws, and the model log-probability reported."""

from __future__ import annotations

import pytest
import torch

from shardmesh.core.step import SamplingParams
from shardmesh.engine.sampling import generator, sample

GREEDY = SamplingParams()


def test_greedy_rows_take_the_argmax_and_report_its_model_logprob() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1)) * 3
    ids, lps = sample(logits, [GREEDY] * 5, [None] * 5)
    assert ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1)[torch.arange(5), torch.tensor(ids)]
    assert lps == pytest.approx(expected.tolist(), abs=1e-6)


def test_a_seeded_row_draws_the_same_token_whatever_rows_share_its_step() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    seeded = SamplingParams(temperature=1.0, seed=7)
    alone = sample(logits[2:3], [seeded], [generator(seeded)])
    params = [GREEDY, SamplingParams(temperature=0.8, top_k=5, seed=3), seeded, GREEDY]
    together = sample(logits, params, [generator(p) for p in params])
    assert together[0][2] == alone[0][0] and together[1][2] == pytest.approx(alone[1][0])
    assert together[0][0] == int(logits[0].argmax()) and together[0][3] == int(logits[3].argmax())
    top5 = torch.topk(logits[1], 5).indices.tolist()
    assert together[0][1] in top5
    # The reported log-probability is the model's, not the shaped distribution's.
    assert together[1][1] == pytest.approx(float(torch.log_softmax(logits[1], -1)[together[0][1]]), abs=1e-6)


def test_rows_and_params_must_agree() -> None:
    with pytest.raises(ValueError, match="3 rows of logits, 2 params"):
        sample(torch.zeros(3, 8), [GREEDY] * 2, [None] * 2)
