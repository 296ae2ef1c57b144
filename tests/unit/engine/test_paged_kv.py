"""The paged KV cache gives what the slot cache gives: the same logits, step by step, whatever the block ids
(shuffled, reused after another sequence freed them, shared as a common prefix), with either decode kernel
(`paged-cpu` compiled, `paged-gather` in torch); and bad block tables are refused with the numbers named.

Tolerance 1e-5 in float32: both caches hold the same keys and values; they differ only in the order the
attention sums run (the kernel's online softmax block by block, SDPA's flash kernel tile by tile), a few ulps
on logits of magnitude ~10. In bfloat16 the two read the same bfloat16 keys but round their outputs at different
points, so the bound there is bfloat16's: ~2^-8 relative.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from shardmesh.core.layout import ShardSpec
from shardmesh.core.step import SamplingParams, Segment, StepEntry
from shardmesh.engine import paged_attention
from shardmesh.engine.batch import BatchLayout
from shardmesh.engine.groups import ShardGroups, SingleRank
from shardmesh.engine.kv_cache import ActivationLog, KVCache, PagedActivationLog, PagedKVCache
from shardmesh.engine.loader import build_shard
from shardmesh.engine.model import Transformer
from shardmesh.engine.paged_attention import CpuDecode, DecodeKernel, GatherDecode
from shardmesh.engine.stage import StageEngine
from tests.checkpoints import make_checkpoint

BS = 4  # small blocks, so short sequences span many of them
NUM_BLOCKS = 40
KERNELS = [CpuDecode(), GatherDecode()]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Transformer:
    d = make_checkpoint(tmp_path_factory.mktemp("gqa"), "llama-gqa-tied", num_layers=2, seed=5)
    return build_shard(d, ShardSpec(0, 2, 2), progress=False, max_len=64)


@pytest.fixture(scope="module")
def model_bf16(tmp_path_factory: pytest.TempPathFactory) -> Transformer:
    d = make_checkpoint(tmp_path_factory.mktemp("gqa-bf16"), "llama-gqa-tied", num_layers=2, seed=5)
    return build_shard(d, ShardSpec(0, 2, 2), progress=False, max_len=64, dtype=torch.bfloat16)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 96) for _ in range(n - 1)]


class Pair:
    """The same sequences run on a slot cache (sequence i in slot i) and a paged cache (block tables given)."""

    def __init__(self, model: Transformer, kernel: DecodeKernel, dtype: torch.dtype = torch.float32) -> None:
        self.model = model
        self.slot = model.make_cache(8, dtype, "cpu")
        self.paged = PagedKVCache(2, NUM_BLOCKS, model.cfg.num_kv_heads, BS, model.cfg.head_dim, dtype, kernel=kernel)

    def step(self, parts: list[tuple[int, int, list[int], tuple[int, ...]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of (slot, start, new tokens, block table) parts: (slot logits, paged logits), every token's."""
        ids = torch.tensor([t for _, _, new, _ in parts for t in new])
        slots = [Segment(slot, start, len(new)) for slot, start, new, _ in parts]
        paged = [Segment(slot, start, len(new), blocks) for slot, start, new, blocks in parts]
        with torch.inference_mode():
            a = self.model(ids, BatchLayout.build(slots), self.slot, all_logits=True)
            b = self.model(ids, BatchLayout.build(paged, block_size=BS), self.paged, all_logits=True)
        return a, b


def assert_same(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    assert (a - b).abs().max() <= tol * max(1.0, a.abs().max().item()), (a - b).abs().max()
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def shuffled_tables(lengths: list[int], seed: int) -> list[tuple[int, ...]]:
    """Disjoint block tables for sequences of up to `lengths` positions, from a shuffled pool of block ids."""
    ids = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(ids)
    out = []
    for n in lengths:
        need = -(-n // BS)
        out.append(tuple(ids[:need]))
        ids = ids[need:]
    return out


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_sequences_over_shuffled_blocks_decode_together(model: Transformer, kernel: DecodeKernel) -> None:
    prompts = [tokens(13, 1), tokens(22, 2), tokens(6, 3)]
    steps = 7
    tables = shuffled_tables([len(p) + steps for p in prompts], seed=0)
    pair = Pair(model, kernel)
    # The second prompt in two chunks: the second chunk reads the first's blocks (start > 0).
    assert_same(*pair.step([(0, 0, prompts[0], tables[0]), (1, 0, prompts[1][:9], tables[1])]))
    assert_same(*pair.step([(1, 9, prompts[1][9:], tables[1]), (2, 0, prompts[2], tables[2])]))
    for i in range(steps):  # different lengths, one token each, all in one decode call per layer
        a, b = pair.step([(s, len(p) + i, [7 + s + i], tables[s]) for s, p in enumerate(prompts)])
        assert_same(a, b)
    assert_same(*pair.step([(1, len(prompts[1]) + steps, [9], tables[1])]))  # one decoding alone


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_a_freed_block_reused_by_another_sequence(model: Transformer, kernel: DecodeKernel) -> None:
    pair = Pair(model, kernel)
    first = tokens(11, 4)  # blocks 5, 2, 7: block 7 holds 3 positions
    for a, b in [pair.step([(0, 0, first, (5, 2, 7))]), pair.step([(0, 11, [8], (5, 2, 7))])]:
        assert_same(a, b)
    # The first sequence is gone; the second gets its blocks back in another order. Its positions past its
    # own length in block 2 still hold the first sequence's keys, which it must not see.
    second = tokens(6, 5)
    assert_same(*pair.step([(1, 0, second, (7, 2))]))
    for i in range(4):
        assert_same(*pair.step([(1, 6 + i, [10 + i], (7, 2, 5))]))


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_a_shared_prefix_is_read_not_recomputed(model: Transformer, kernel: DecodeKernel) -> None:
    prefix = tokens(8, 6)  # two full blocks
    a_rest, b_rest = tokens(5, 7)[1:], tokens(7, 8)[1:]
    a_blocks, b_blocks = (3, 9, 1, 12), (3, 9, 20, 15, 17)  # b shares a's first two blocks
    pair = Pair(model, kernel)
    pair.step([(0, 0, prefix + a_rest, a_blocks)])
    # b prefills only what follows the prefix, reading a's blocks; the slot cache computes b whole.
    ids = prefix + b_rest
    with torch.inference_mode():
        whole = model(torch.tensor(ids), BatchLayout.build([Segment(1, 0, len(ids))]), pair.slot, all_logits=True)
        rest = model(torch.tensor(b_rest), BatchLayout.build([Segment(1, 8, len(b_rest), b_blocks)], block_size=BS),
                     pair.paged, all_logits=True)  # fmt: skip
    assert_same(whole[8:], rest)
    # Both decode on, together, over the shared blocks.
    a_len, b_len = len(prefix + a_rest), len(ids)
    for i in range(3):
        parts = [(0, a_len + i, [20 + i], a_blocks), (1, b_len + i, [30 + i], b_blocks)]
        assert_same(*pair.step(parts))


def test_bfloat16_paged_matches_the_slot_cache(model_bf16: Transformer) -> None:
    prompts = [tokens(9, 10), tokens(15, 11), tokens(4, 12)]
    tables = shuffled_tables([len(p) + 4 for p in prompts], seed=3)
    pair = Pair(model_bf16, CpuDecode(), torch.bfloat16)
    assert_same(*pair.step([(s, 0, p, tables[s]) for s, p in enumerate(prompts)]), tol=2e-2)
    for i in range(4):
        assert_same(*pair.step([(s, len(p) + i, [5 + i], tables[s]) for s, p in enumerate(prompts)]), tol=2e-2)


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
              lengths: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Each sequence on its own, in float64, position by position: key p is column p % bs of block
    tables[p // bs]'s (hd, bs) key tile, value p row p % bs of its (bs, hd) value tile; softmax, sum."""
    D, h, hd = q.shape
    kvh, bs = values.shape[1], values.shape[2]
    out = torch.empty(D, h, hd, dtype=torch.float64)
    for d in range(D):
        cells = [(int(tables[d, p // bs]), p % bs) for p in range(int(lengths[d]))]
        k = torch.stack([keys[b, :, :, o] for b, o in cells], 1).double()  # (kvh, n, hd)
        v = torch.stack([values[b, :, o] for b, o in cells], 1).double()
        k, v = k.repeat_interleave(h // kvh, 0), v.repeat_interleave(h // kvh, 0)  # (h, n, hd)
        w = torch.softmax((q[d].double()[:, None, :] @ k.transpose(1, 2)) / math.sqrt(hd), -1)
        out[d] = (w @ v)[:, 0]
    return out


# (query heads, kv heads, head_dim, block size). SmolLM2's in blocks of 16: the kernel's vector paths; a head_dim and
# a block size that are not multiples of its 16 lanes (a chunk and a tail of each); five query heads per kv head
# (the kernel takes up to four per pass: two passes).
SHAPES = {"smollm2": (9, 3, 64, 16), "tails": (4, 2, 24, 20), "two-passes": (10, 2, 32, 16)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_the_kernel_against_the_gather_and_a_reference(dtype: torch.dtype, shape: tuple[int, int, int, int]) -> None:
    """Lengths from 1 to several blocks, not multiples of the block size, block ids shuffled, the tables padded;
    scores spread wide (q x 4) so the softmax is peaked and the online rescaling matters."""
    h, kvh, hd, bs = shape
    g = torch.Generator().manual_seed(0)
    num_blocks = 64
    keys = torch.randn(num_blocks, kvh, hd, bs, generator=g).to(dtype)  # the cache's layouts: keys transposed
    values = torch.randn(num_blocks, kvh, bs, hd, generator=g).to(dtype)
    lengths = torch.tensor([1, bs, bs + 1, 100, 250, 33], dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lengths), 16, dtype=torch.int32)
    used = 0
    for d, n in enumerate(lengths.tolist()):
        need = -(-n // bs)
        tables[d, :need] = perm[used : used + need]
        used += need
    q = (4 * torch.randn(len(lengths), h, hd, generator=g)).to(dtype)
    want = reference(q, keys, values, tables, lengths)
    got, gathered = CpuDecode()(q, keys, values, tables, lengths), GatherDecode()(q, keys, values, tables, lengths)
    assert got.dtype == gathered.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: the output rounded to 8 bits of mantissa
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(gathered.double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(got, gathered, rtol=tol, atol=tol)


def test_the_kernel_is_chosen_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    assert paged_attention.available(), paged_attention.build_error()
    assert PagedKVCache(1, 2, 1, 4, 8, torch.float32).attention_kernel == "paged-cpu"
    assert type(paged_attention.choose("meta")) is GatherDecode  # another device: the torch fallback
    monkeypatch.setattr(paged_attention, "available", lambda: False)  # no compiler
    assert PagedKVCache(1, 2, 1, 4, 8, torch.float32).attention_kernel == "paged-gather"


def test_a_stage_engine_runs_on_either_cache(model: Transformer) -> None:
    groups = ShardGroups(ShardSpec(0, 2, 2), 0, 1, SingleRank(), None, None)
    cpu = torch.device("cpu")
    slot = StageEngine(model, groups, model.make_cache(2, torch.float32, cpu), cpu)
    paged = StageEngine(model, groups, model.make_paged_cache(16, BS, torch.float32, cpu), cpu)
    ids = tokens(10, 13)
    a = slot.step(BatchLayout.build([Segment(0, 0, 10)]), torch.tensor(ids))
    b = paged.step(BatchLayout.build([Segment(0, 0, 10, (4, 11, 2))], block_size=BS), torch.tensor(ids))
    assert_same(a, b)
    a = slot.step(BatchLayout.build([Segment(0, 10, 1)]), torch.tensor([5]))
    assert_same(a, paged.step(BatchLayout.build([Segment(0, 10, 1, (4, 11, 2))], block_size=BS), torch.tensor([5])))
    with pytest.raises(ValueError, match="needs a PagedActivationLog"):
        StageEngine(model, groups, model.make_paged_cache(16, BS, torch.float32, cpu), cpu,
                    ActivationLog(2, 64, model.cfg.hidden_size, torch.float32))  # fmt: skip


def test_the_paged_activation_log_is_read_through_block_tables() -> None:
    log = PagedActivationLog(10, BS, 3, torch.float32)
    first, second = Segment(0, 0, 6, (8, 1)), Segment(1, 0, 9, (2, 6, 5))
    batch = BatchLayout.build([first, second], block_size=BS)
    rows = torch.randn(15, 3)
    log.record(batch, rows)
    assert torch.equal(log.rows(Segment(1, 2, 5, (2, 6, 5))), rows[6 + 2 : 6 + 7])
    shared = Segment(2, 4, 2, (8, 1))  # another sequence's positions 4..5, in the first's block 1
    assert torch.equal(log.rows(shared), rows[4:6])
    with pytest.raises(ValueError, match="block_size=0, this activation log 4"):
        log.record(BatchLayout.build([Segment(0, 0, 15)]), rows)


# ---- bad block tables --------------------------------------------------------------------------------


def test_a_block_table_must_cover_the_positions() -> None:
    with pytest.raises(ValueError, match=r"slot 3, positions \[8, 13\)\): positions \[0, 13\) need 4 blocks of 4 "
                                         r"tokens, the block table has 3"):  # fmt: skip
        BatchLayout.build([Segment(3, 8, 5, (0, 1, 2))], block_size=BS)
    entry = StepEntry("req-7", 0, 8, 5, (), SamplingParams(), blocks=(0, 1, 2))
    with pytest.raises(ValueError, match=r"request 'req-7': positions \[0, 13\) need 4 blocks of 4 tokens"):
        entry.check_blocks(BS)
    StepEntry("req-8", 0, 8, 5, (), SamplingParams(), blocks=(0, 1, 2, 3)).check_blocks(BS, 4)


def test_a_block_id_out_of_range(model: Transformer) -> None:
    cache = model.make_paged_cache(8, BS, torch.float32, "cpu")
    batch = BatchLayout.build([Segment(0, 0, 3, (2,)), Segment(1, 0, 6, (1, 8))], block_size=BS)
    with pytest.raises(ValueError, match=r"slot 1, positions \[0, 6\)\): block id 8 is out of range: the KV cache "
                                         r"has 8 blocks"):  # fmt: skip
        model(torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9]), batch, cache)
    entry = StepEntry("req-9", 0, 0, 5, (), SamplingParams(), blocks=(0, 11))
    with pytest.raises(ValueError, match="request 'req-9': block id 11 is out of range: the KV cache has 8 blocks"):
        entry.check_blocks(BS, 8)


def test_block_ids_negative_or_twice() -> None:
    with pytest.raises(ValueError, match=r"slot 0, positions \[0, 2\)\): block ids must be >= 0, got -1"):
        Segment(0, 0, 2, (-1,))
    with pytest.raises(ValueError, match="request 'r': block id 3 appears twice in the block table"):
        StepEntry("r", 0, 0, 2, (), SamplingParams(), blocks=(3, 1, 3))


def test_two_segments_may_not_write_one_block() -> None:
    a, b = Segment(0, 0, 6, (0, 1)), Segment(1, 4, 3, (0, 1))  # b would write positions 4..6: block 1, a's
    with pytest.raises(ValueError, match=r"slot 1, positions \[4, 7\)\) and segment \(slot 0, .* both write block 1"):
        BatchLayout.build([a, b], block_size=BS)
    BatchLayout.build([Segment(0, 8, 1, (0, 1, 2)), Segment(1, 8, 2, (0, 1, 3))], block_size=BS)  # shared prefix


def test_a_layout_for_the_other_cache_is_refused(model: Transformer) -> None:
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="this KV cache has slots: build it without block_size"):
        model(
            ids, BatchLayout.build([Segment(0, 0, 3, (0,))], block_size=BS), model.make_cache(1, torch.float32, "cpu")
        )
    paged = model.make_paged_cache(4, BS, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"block_size=0, this paged KV cache 4: build it with .*block_size=4\)"):
        model(ids, BatchLayout.build([Segment(0, 0, 3)]), paged)
    assert isinstance(model.make_cache(1, torch.float32, "cpu"), KVCache)
