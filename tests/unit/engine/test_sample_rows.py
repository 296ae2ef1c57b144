"""The compiled draws (`cpu_kernels.sample_rows`, through `sampling.draw`) against their definition in torch
(`sampling.weights` and a running sum): the same tokens kept, each token drawn where its share of the running sum
says, and the same draws for the same (seed, position), on every build this CPU runs (the `isa` fixture)."""

from __future__ import annotations

import pytest
import torch

from shardmesh.core.step import SamplingParams
from shardmesh.engine import cpu_kernels
from shardmesh.engine.sampling import _top_tokens_torch, draw, draw_table, sample, uniform, weights
from tests.unit.engine.test_sampling import TIED, by_hand

pytestmark = [pytest.mark.skipif(not cpu_kernels.available(), reason=f"no C++ build: {cpu_kernels.build_error()}"),
              pytest.mark.usefixtures("isa")]  # fmt: skip

VOCAB = 49152  # SmolLM2's: 768 blocks of 64 tokens
PARAMS = [
    SamplingParams(temperature=0.7, seed=1),
    SamplingParams(temperature=1.0, top_k=50, seed=1),  # k within the blocks' maxima
    SamplingParams(temperature=1.0, top_k=2000, seed=1),  # k past them: the buckets' way
    SamplingParams(temperature=0.7, top_p=0.9, seed=1),  # a floor holds the cut
    SamplingParams(temperature=3.0, top_p=0.999, seed=1),  # flat: no floor reaches it, the buckets' way
    SamplingParams(temperature=1.0, min_p=0.05, seed=1),
    SamplingParams(temperature=1.3, top_k=200, top_p=0.5, min_p=0.01, seed=1),
]


def _row(seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _midpoints(w: torch.Tensor, most: int = 300) -> tuple[list[int], list[float]]:
    """Up to `most` kept tokens, spread over the kept ones (the first and last among them), of at least 1e-5 of the
    whole (so that an ulp or two in a weight cannot move them), and for each the uniform at the middle of its share of
    the running sum: where the draw must take that token."""
    w = w.double()
    cum, total = w.cumsum(0), float(w.sum())
    tokens = (w >= 1e-5 * total).nonzero().flatten()
    tokens = tokens[torch.linspace(0, len(tokens) - 1, min(most, len(tokens))).round().long().unique()].tolist()
    return tokens, [(float(cum[t]) - float(w[t]) / 2) / total for t in tokens]


@pytest.mark.parametrize("p", PARAMS, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_each_kept_token_is_drawn_at_the_middle_of_its_share(p: SamplingParams) -> None:
    """Where torch's weights put a kept token's share of the running sum, both ways draw it: the same tokens kept
    and cut, in the same order. A dropped token kept, or a kept one dropped, moves the shares after it."""
    row = _row(3)
    w = weights(row[None], [p])[0]
    tokens, us = _midpoints(w)
    assert len(tokens) > 1 and all(w[t] > 0 for t in tokens)
    rows = row.expand(len(us), VOCAB)
    assert draw(rows, [p] * len(us), us, compiled=True) == tokens
    assert draw(rows, [p] * len(us), us, compiled=False) == tokens


def test_ties_at_the_cut_keep_the_lower_ids() -> None:
    """Top-k keeps every token equal to the k-th largest; top-p ranks equal logits by id, so a cut inside them keeps
    the lower ids; both ways agree."""
    row = torch.full((4096,), -5.0)
    row[[7, 100, 2049, 3000, 4000]] = 2.0  # five equal leaders, tied
    row[[1, 50]] = 1.0
    tied = [7, 100, 2049, 3000, 4000]
    for p, kept in ((SamplingParams(temperature=1.0, top_k=3, seed=1), tied),
                    # Each leader weighs 1 of ~9.47: two lie below 0.3 of the whole, so a third is kept.
                    (SamplingParams(temperature=1.0, top_p=0.3, seed=1), tied[:3]),
                    # Top-k keeps the leaders and both 1.0s (~5.74): one leader lies below 0.3 of that.
                    (SamplingParams(temperature=1.0, top_p=0.3, top_k=6, seed=1), tied[:2])):  # fmt: skip
        w = weights(row[None], [p])[0]
        assert (w > 0).nonzero().flatten().tolist() == kept
        tokens, us = _midpoints(w)
        assert tokens == kept
        assert draw(row.expand(len(us), 4096), [p] * len(us), us, compiled=True) == kept


@pytest.mark.parametrize("p", PARAMS, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_seeded_draws_are_torchs(p: SamplingParams) -> None:
    """What a replay relies on whichever worker draws: the same (seed, position), the same token, compiled or not."""
    rows = torch.stack([_row(10 + i) for i in range(4)]).repeat_interleave(8, 0)
    us = [uniform(seed, position) for seed in (5, 6) for position in range(16)]
    compiled = draw(rows, [p] * 32, us, compiled=True)
    assert compiled == draw(rows, [p] * 32, us, compiled=False)
    assert len(set(compiled)) > 4  # the draws move with the position


def test_rows_of_different_settings_in_one_call_draw_as_each_would_alone() -> None:
    """One call of rows each with its own settings (with and without top-k, top-p or min-p beside each other): each
    row draws what it draws alone, compiled and in torch, whose top-k and top-p for all rows at once must leave the
    rows without them whole."""
    rows = torch.stack([_row(20 + i) for i in range(len(PARAMS))])
    us = [uniform(9, 40 + i) for i in range(len(PARAMS))]
    alone = [draw(rows[i : i + 1], [p], [us[i]], compiled=False)[0] for i, p in enumerate(PARAMS)]
    assert draw(rows, PARAMS, us, compiled=False) == alone
    assert draw(rows, PARAMS, us, compiled=True) == alone


@pytest.mark.parametrize("compiled", [True, False])
def test_draws_follow_the_weights(compiled: bool) -> None:
    """Over many positions each token comes up as often as its weight says (top-k and min-p drop the rest): the
    uniforms are uniform and the positions independent. 12000 draws; a share's standard error is <= 0.0046."""
    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0, -9.0])
    p = SamplingParams(temperature=0.9, top_k=6, min_p=0.05, seed=77)
    w = weights(row[None], [p])[0].double()
    n = 12000
    drawn = draw(row.expand(n, 8), [p] * n, [uniform(77, pos) for pos in range(n)], compiled=compiled)
    share = torch.bincount(torch.tensor(drawn), minlength=8).double() / n
    assert torch.equal(share > 0, w > 0) and int((w > 0).sum()) == 5  # min-p dropped the 6th, top-k the last two
    assert torch.allclose(share, w / w.sum(), atol=0.02)


@pytest.mark.parametrize("compiled", [True, False])
def test_a_row_without_a_finite_logit_is_named(compiled: bool) -> None:
    p = SamplingParams(temperature=1.0, seed=1)
    for bad in (torch.tensor([0.0, float("nan"), 1.0]), torch.full((3,), float("-inf")),
                torch.tensor([0.0, float("inf"), 1.0])):  # fmt: skip
        with pytest.raises(ValueError, match="NaN or no finite value"):
            draw(torch.stack([torch.zeros(3), bad]), [p, p], [0.5, 0.5], compiled=compiled)


def test_sample_takes_the_compiled_draws_once_the_kernels_are_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    calls, compiled = [], cpu_kernels.sample_rows
    monkeypatch.setattr(cpu_kernels, "sample_rows", lambda *a: calls.append(a[0].shape) or compiled(*a))
    logits = torch.stack([_row(1), _row(2), _row(3)])
    params = [SamplingParams(temperature=0.8, seed=4), SamplingParams(), SamplingParams(temperature=1.0, seed=5)]
    got = sample(logits, params, [3, 3, 9]).token_ids
    assert calls == [torch.Size([2, VOCAB])]  # the two sampled rows in one call; the greedy row by its argmax
    assert got[1] == int(logits[1].argmax())
    assert [got[0], got[2]] == draw(logits[[0, 2]], [params[0], params[2]], [uniform(4, 3), uniform(5, 9)],
                                    compiled=False)  # fmt: skip


def test_bad_arguments_are_named() -> None:
    x, u = torch.zeros(2, 5), torch.zeros(2, dtype=torch.double)
    table = draw_table([SamplingParams(temperature=1.0, seed=1)] * 2)
    with pytest.raises(RuntimeError, match=r"sampling table must be a contiguous \(2, 4\) float64 tensor"):
        cpu_kernels.sample_rows(x, table.float(), u)
    with pytest.raises(RuntimeError, match=r"u must be \(2,\) float64"):
        cpu_kernels.sample_rows(x, table, u.float())
    with pytest.raises(RuntimeError, match="row 1's temperature must be above 0"):
        cpu_kernels.sample_rows(x, draw_table([SamplingParams(temperature=1.0, seed=1), SamplingParams()]), u)


@pytest.mark.parametrize("k", [1, 3, 4, 7, 12])
def test_the_compiled_top_rows_order_as_top_tokens_in_torch(k: int) -> None:
    """`cpu_kernels.top_rows` (what `top_tokens` takes on a CPU with the kernels, and what a call of several steps
    keeps) orders as the torch version: ties across the k-th place, NaNs, -inf; and SmolLM2-wide bfloat16 rows, full of
    ties, equal to the torch version's ids and values."""
    values, ids = cpu_kernels.top_rows(TIED, k)
    assert ids.tolist() == by_hand(TIED, k)
    torch.testing.assert_close(values, TIED.gather(1, ids), rtol=0, atol=0, equal_nan=True)
    x = (torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(k)) * 3).to(torch.bfloat16).float()
    got, want = cpu_kernels.top_rows(x, k), _top_tokens_torch(x, k)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
