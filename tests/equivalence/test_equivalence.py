"""Sharded outputs equal the unsharded `transformers` model: every family × every (pp, tp) that fits.

Tolerance: 1e-4 max-abs on float32 logits. The shards compute the same products as the reference;
what differs is summation order (row-parallel partial sums are added by an all-reduce, matmul
blocking differs with shapes), which moves float32 results by ~1e-6 relative on these sizes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from shardmesh.core.step import Segment
from shardmesh.engine.batch import BatchLayout
from tests import thread_mesh
from tests.checkpoints import FAMILIES, make_checkpoint, reference_greedy
from tests.thread_mesh import run_mesh

TOL = 1e-4
DECODE_STEPS = 16
PROMPT = [1, 17, 5, 42, 33, 8, 61, 12, 3]
LAYOUTS = [(pp, tp) for pp in (1, 2, 3) for tp in (1, 2)]
OVERRIDES = {"mistral-gqa": {"vocab_size": 97}}  # a vocabulary that tp=2 cannot split evenly


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[int], list[torch.Tensor]]]:
    out = {}
    for family in FAMILIES:
        d = make_checkpoint(tmp_path_factory.mktemp(family), family, **OVERRIDES.get(family, {}))
        tokens, logits = reference_greedy(d, PROMPT, DECODE_STEPS)
        out[family] = (d, tokens, logits)
    return out


def _teacher_forced(tokens: list[int]):
    """Prefill the prompt, then feed the reference's greedy tokens one at a time; collect logits."""

    def body(engine, rank):
        ids = torch.tensor(PROMPT)
        outs = [engine.step(BatchLayout.build([Segment(0, 0, len(PROMPT))]), ids, all_logits=True)]
        pos = len(PROMPT)
        for t in tokens:
            logits = engine.step(BatchLayout.build([Segment(0, pos, 1)]), torch.tensor([t]))
            outs.append(None if logits is None else logits[0])
            pos += 1
        return outs

    return body


@pytest.mark.parametrize("pp,tp", LAYOUTS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(checkpoints, family: str, pp: int, tp: int) -> None:
    model_dir, ref_tokens, ref_logits = checkpoints[family]
    results = run_mesh(model_dir, pp, tp, _teacher_forced(ref_tokens[:DECODE_STEPS]))
    _assert_matches(results, ref_tokens, ref_logits, family, pp, tp)


@pytest.mark.parametrize("pp,split", [(1, (3, 1)), (2, (1, 3))])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_uneven_tp_split_logits_match_transformers(checkpoints, family: str, pp: int, split: tuple[int, ...]) -> None:
    """tp=2 with the MLP columns and the vocabulary split 3:1 (`--tp-split`): the ranks' partial sums and their
    logits' chunks are of unequal sizes (mistral-gqa's 97 tokens: 75 and 22), the heads even; the same numbers."""
    model_dir, ref_tokens, ref_logits = checkpoints[family]
    results = run_mesh(model_dir, pp, 2, _teacher_forced(ref_tokens[:DECODE_STEPS]), tp_split=split)
    _assert_matches(results, ref_tokens, ref_logits, family, pp, 2)


BLOCK = 4
TABLE = (13, 2, 7, 11, 0, 5, 9)  # 28 positions in shuffled, non-contiguous blocks of a pool of 16


def _teacher_forced_paged(tokens: list[int]):
    """`_teacher_forced` on a paged KV cache: the prompt in two chunks, then one token at a time, each step's
    segment carrying the block table up to its last position."""

    def seg(start: int, length: int) -> BatchLayout:
        end = start + length
        return BatchLayout.build([Segment(0, start, length, TABLE[: -(-end // BLOCK)])], block_size=BLOCK)

    def body(engine, rank):
        outs = [engine.step(seg(0, 5), torch.tensor(PROMPT[:5]), all_logits=True)]
        outs.append(engine.step(seg(5, len(PROMPT) - 5), torch.tensor(PROMPT[5:]), all_logits=True))
        pos = len(PROMPT)
        for t in tokens:
            logits = engine.step(seg(pos, 1), torch.tensor([t]))
            outs.append(None if logits is None else logits[0])
            pos += 1
        if outs[0] is not None:  # the two prompt chunks' logits, as one prefill's
            outs[:2] = [torch.cat(outs[:2])]
        else:
            outs[:2] = [None]
        return outs

    return body


@pytest.mark.parametrize("pp,tp", LAYOUTS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_paged_cache_logits_match_transformers(checkpoints, family: str, pp: int, tp: int) -> None:
    """The same comparison through a paged KV cache (`PagedKVCache`, the C++ decode kernel where it builds)."""
    model_dir, ref_tokens, ref_logits = checkpoints[family]
    results = run_mesh(model_dir, pp, tp, _teacher_forced_paged(ref_tokens[:DECODE_STEPS]), paged=(16, BLOCK))
    _assert_matches(results, ref_tokens, ref_logits, family, pp, tp)


@pytest.fixture(scope="module")
def whole_vector_heads(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int], list[torch.Tensor]]:
    """A checkpoint whose head dims are whole vectors (16), which the compiled decode path attends over paged blocks
    in place (`cpu_decode.CpuDecode.paged_rows`); the families above have 12."""
    d = make_checkpoint(tmp_path_factory.mktemp("hd16"), "llama-gqa-tied", head_dim=16)
    tokens, logits = reference_greedy(d, PROMPT, DECODE_STEPS)
    return d, tokens, logits


@pytest.mark.parametrize("block,table", [(BLOCK, TABLE), (16, (3, 1))])
@pytest.mark.parametrize("pp,tp", [(1, 1), (2, 1), (1, 2)])
def test_paged_decode_through_the_compiled_path_matches_transformers(whole_vector_heads, pp: int, tp: int, block: int,
                                                                     table: tuple[int, ...]) -> None:  # fmt: skip
    """Paged decode steps through the compiled layer halves (every decode step of every stage checked to be one the
    runner takes), blocks of 4 and 16, crossing from block to block: `transformers`' logits and greedy tokens."""
    model_dir, ref_tokens, ref_logits = whole_vector_heads

    def seg(start: int, length: int) -> BatchLayout:
        return BatchLayout.build([Segment(0, start, length, table[: -(-(start + length) // block)])], block_size=block)

    def body(engine, rank):
        outs = [engine.step(seg(0, len(PROMPT)), torch.tensor(PROMPT), all_logits=True)]
        for k, t in enumerate(ref_tokens[:DECODE_STEPS]):
            step = seg(len(PROMPT) + k, 1)
            assert engine.native is not None and engine.native.accepts(step, False)
            logits = engine.step(step, torch.tensor([t]))
            outs.append(None if logits is None else logits[0])
        return outs

    results = run_mesh(model_dir, pp, tp, body, paged=(16, block))
    _assert_matches(results, ref_tokens, ref_logits, "llama-gqa-tied head_dim=16", pp, tp)


def _assert_matches(results, ref_tokens: list[int], ref_logits: list[torch.Tensor], family: str, pp: int,
                    tp: int) -> None:  # fmt: skip
    for rank in range((pp - 1) * tp, pp * tp):  # every tensor rank of the last stage holds the logits
        ours = results[rank]
        assert len(ours) == 1 + DECODE_STEPS
        for step, (a, b) in enumerate(zip(ours, ref_logits, strict=True)):
            err = (a - b).abs().max().item()
            assert err < TOL, f"{family} pp={pp} tp={tp} rank={rank} step={step}: max-abs {err:.2e}"
        greedy = [int(ours[0][-1].argmax())] + [int(x.argmax()) for x in ours[1:DECODE_STEPS]]
        assert greedy == ref_tokens[:DECODE_STEPS]
    for rank in range((pp - 1) * tp):
        assert all(x is None for x in results[rank]), "only the last stage may return logits"


def test_a_planted_bug_fails_the_comparison(checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison can fail: k and v swapped in one layer's stacked qkv (what a wrong block order or
    offset in loading would do) must move the logits past TOL."""
    model_dir, ref_tokens, ref_logits = checkpoints["llama-gqa-tied"]
    build = thread_mesh.build_shard

    def swap_k_v(*args, **kwargs):
        model = build(*args, **kwargs)
        attn = model.model.layers["1"].self_attn
        qkv = attn.qkv_proj
        kv = attn.n_kv_heads * attn.head_dim
        q, k, v = qkv.kernel.dense(qkv.weight).split((attn.n_heads * attn.head_dim, kv, kv))
        qkv.weight = nn.Parameter(qkv.kernel.prepare(torch.cat([q, v, k])), requires_grad=False)
        return model

    monkeypatch.setattr(thread_mesh, "build_shard", swap_k_v)
    results = run_mesh(model_dir, 1, 1, _teacher_forced(ref_tokens[:DECODE_STEPS]))
    with pytest.raises(AssertionError, match="max-abs"):
        _assert_matches(results, ref_tokens, ref_logits, "llama-gqa-tied", 1, 1)


def test_uneven_split_is_exercised() -> None:
    from shardmesh.core.layout import split_layers

    assert split_layers(5, 3) == [(0, 2), (2, 4), (4, 5)]


@pytest.mark.parametrize("pp,tp", [(1, 1), (2, 2)])
def test_batched_steps_equal_each_sequence_alone(checkpoints, pp: int, tp: int) -> None:
    """Two sequences packed into one step (different slots and positions) give their solo logits."""
    model_dir, _, _ = checkpoints["llama-gqa-tied"]
    a, b = PROMPT, [1, 70, 71, 72, 4]

    def solo(prompt):
        def body(engine, rank):
            out = [engine.step(BatchLayout.build([Segment(0, 0, len(prompt))]), torch.tensor(prompt))]
            out.append(engine.step(BatchLayout.build([Segment(0, len(prompt), 1)]), torch.tensor([9])))
            return out

        return run_mesh(model_dir, pp, tp, body)[-1]

    def together(engine, rank):
        prefill = BatchLayout.build([Segment(0, 0, len(a)), Segment(1, 0, len(b))])
        out = [engine.step(prefill, torch.tensor(a + b))]
        # Then a decode step for both, plus a chunked-prefill style step: 2 tokens onto sequence b.
        decode = BatchLayout.build([Segment(0, len(a), 1), Segment(1, len(b), 1)])
        out.append(engine.step(decode, torch.tensor([9, 9])))
        return out

    alone_a, alone_b = solo(a), solo(b)
    both = run_mesh(model_dir, pp, tp, together)[-1]
    for step in range(2):
        assert (both[step][0] - alone_a[step][0]).abs().max() < 1e-5
        assert (both[step][1] - alone_b[step][0]).abs().max() < 1e-5


def test_chunked_prefill_equals_whole_prefill(checkpoints) -> None:
    model_dir, _ref_tokens, ref_logits = checkpoints["qwen2-bias-tied"]

    def body(engine, rank):
        first = engine.step(BatchLayout.build([Segment(0, 0, 4)]), torch.tensor(PROMPT[:4]), all_logits=True)
        rest = engine.step(
            BatchLayout.build([Segment(0, 4, len(PROMPT) - 4)]), torch.tensor(PROMPT[4:]), all_logits=True
        )
        return None if first is None else torch.cat([first, rest])

    ours = run_mesh(model_dir, 2, 1, body)[-1]
    assert (ours - ref_logits[0]).abs().max() < TOL


# -- int8 weights at every layout -------------------------------------------------------------------------------------

# Head dim 32 and an FFN of 128: every row-parallel slice at tp=2 holds whole int8 groups of 32 inputs, so every layout
# holds the unsharded shard's int8 numbers (`shardmesh.engine.loader._edge_groups`).
INT8_DIMS = {"hidden_size": 128, "intermediate_size": 128, "head_dim": 32}
INT8_FAMILIES = ("llama-gqa-tied", "qwen2-bias-tied", "smollm-like-kv1")


def _int8_run(model_dir: Path, pp: int, tp: int, tokens: list[int]) -> list:
    from shardmesh.core.dtypes import Quantization

    return run_mesh(model_dir, pp, tp, _teacher_forced(tokens[:DECODE_STEPS]), quantization=Quantization.INT8)


@pytest.fixture(scope="module")
def int8_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[int], list]]:
    """Per family: the checkpoint, the float model's greedy tokens, and int8 pp=1 tp=1's logits along them."""
    out = {}
    for family in INT8_FAMILIES:
        d = make_checkpoint(tmp_path_factory.mktemp(f"int8-{family}"), family, **INT8_DIMS)
        tokens, _ = reference_greedy(d, PROMPT, DECODE_STEPS)
        out[family] = (d, tokens, _int8_run(d, 1, 1, tokens)[0])
    return out


@pytest.mark.parametrize("pp,tp", LAYOUTS[1:])
@pytest.mark.parametrize("family", INT8_FAMILIES)
def test_int8_logits_are_the_same_at_every_layout(int8_checkpoints, family: str, pp: int, tp: int) -> None:
    """int8 shards at every (pp, tp) give the unsharded int8 shard's logits, within the float suite's TOL: the same
    int8 values and scales, float32 activations, only the order of sums differs."""
    model_dir, tokens, whole = int8_checkpoints[family]
    results = _int8_run(model_dir, pp, tp, tokens)
    for rank in range((pp - 1) * tp, pp * tp):
        for step, (a, b) in enumerate(zip(results[rank], whole, strict=True)):
            err = (a - b).abs().max().item()
            assert err < TOL, f"int8 {family} pp={pp} tp={tp} rank={rank} step={step}: max-abs {err:.2e}"


def test_int8_slices_of_split_groups_stay_within_int8s_own_error(checkpoints) -> None:
    """Head dim 24: at tp=2 each rank's attention output holds 24 inputs, so its groups start at its slice, not at
    the unsharded product's multiples of 32, and its numbers differ from tp=1's by int8 rounding. The tolerance is
    int8's own: tp=2 stays as close to tp=1 as tp=1 is to float32 (`transformers`) at every step."""
    model_dir, tokens, ref_logits = checkpoints["smollm-like-kv1"]
    whole, split = _int8_run(model_dir, 1, 1, tokens)[0], _int8_run(model_dir, 1, 2, tokens)
    for step, (a, b, f) in enumerate(zip(split[0], whole, ref_logits, strict=True)):
        int8_error = (b - f).abs().max().item()
        assert 0 < (a - b).abs().max().item() <= int8_error, f"step {step}"
