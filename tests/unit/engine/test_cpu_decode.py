"""The compiled CPU decode path: the blocked product (`cpu_kernels.pack` / `linear`) and the layer halves the decode
runner calls (`cpu_decode.CpuDecode`). Each must give what the eager model gives, for float32 and bfloat16, with
biases, grouped or full heads, any slots, positions and order, and write the same keys and values."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from shardmesh.core.dtypes import Quantization
from shardmesh.core.layout import ShardSpec
from shardmesh.core.step import SamplingParams, Segment
from shardmesh.engine import cpu_decode as cpu_decode_module
from shardmesh.engine import cpu_kernels, sampling, shm_link
from shardmesh.engine.batch import BatchLayout
from shardmesh.engine.cpu_decode import CpuDecode, cpu_decode
from shardmesh.engine.cpu_features import cpu_flags
from shardmesh.engine.groups import ShardGroups, SingleRank, StageLink
from shardmesh.engine.kv_cache import ActivationLog
from shardmesh.engine.linear import KERNEL_ENV, BlockedCpuKernel, BlockedInt8Kernel, dequantize, quantize_groups
from shardmesh.engine.loader import build_shard
from shardmesh.engine.model import Transformer
from shardmesh.engine.penalties import TokenHistory
from shardmesh.engine.shm_collective import ShmCollective
from shardmesh.engine.stage import StageEngine
from tests.checkpoints import make_checkpoint
from tests.thread_mesh import run_mesh
from tests.unit.engine.test_model import PROMPTS, prefilled
from tests.waiting import WAIT_S

# Every test here runs on each build of the kernels this CPU can run (the `isa` fixture).
pytestmark = [pytest.mark.skipif(not cpu_kernels.available(), reason=f"no C++ build: {cpu_kernels.build_error()}"),
              pytest.mark.usefixtures("isa")]  # fmt: skip


# rows, N, K. On a CPU with AMX, bfloat16 products whose K is a multiple of 32 go through its tiles, 16 rows at a time
# (37: two tiles of rows and one of 5); the others through AVX512-BF16. With AVX2, products of 8 rows or more walk each
# block in tiles of 128 inputs (K 300: two and a part; 257 and 5 odd, a bfloat16 tile's last pair half padding; 130:
# one and 2 at 12 rows), each tile's weights widened once in bfloat16, in panels of 96 rows (101: one and 5 rows), six
# rows at a time and the rest (9: 3 left, 13: 1, 16: 4, 32: 2, 34: 4, 37: 1, 101: 5), asking for the next tile ahead
# (past the last block's end too). On AVX-512, widened bfloat16 products of 9 to 32 rows take each block 32 pairs at a
# time by every group of rows (12 rows by 130 inputs: two chunks of 32 pairs and one of 1).
SHAPES = [(1, 64, 96), (3, 70, 33), (4, 576, 64), (9, 17, 5), (5, 32, 1), (13, 40, 24), (16, 33, 8), (37, 70, 64),
          (16, 40, 32), (32, 40, 300), (34, 33, 257), (101, 40, 130), (12, 70, 130)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_blocked_product_equals_a_dense_one(dtype: torch.dtype, shape: tuple[int, int, int]) -> None:
    """Any rows (groups of eight, four and the rest; AMX's tiles of 16), any width (a last block padded), odd K
    (bfloat16 pairs padded)."""
    rows, n, k = shape
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    packed = cpu_kernels.pack(w)
    assert packed.shape == (n, k)
    assert torch.equal(cpu_kernels.unpack(packed), w)  # the layout round-trips exactly
    got = cpu_kernels.linear(x, packed, bias)
    want = (x.double() @ w.double().T + bias.double()).to(dtype)
    assert got.dtype == dtype and got.shape == (rows, n)
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bfloat16: one rounding of the output
    assert ((got.double() - want.double()).abs() / (want.double().abs() + 1)).max() < tol


@pytest.fixture
def bf16_ways(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The ways this build multiplies bfloat16 weights by several rows, AMX's aside (it takes every product whose
    pairs fill its tiles, whichever way is set); the way set and chosen are put back after the test."""
    ext = cpu_kernels.module()
    monkeypatch.setattr(cpu_kernels, "_BF16_ROWS", {})
    before = ext.bf16_rows()  # type: ignore[attr-defined]
    yield [w for w in ext.bf16_rows_ways() if w != "amx"]  # type: ignore[attr-defined]
    ext.set_bf16_rows(before)  # type: ignore[attr-defined]


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[0] >= 2])
def test_bf16_rows_ways_give_the_same_numbers(isa: str, bf16_ways: list[str], shape: tuple[int, int, int]) -> None:
    """vdpbf16ps and the weights widened for FMAs (AVX512-BF16 builds have both) sum the same exact products in the
    same order, so they agree to the bit; a build without AVX512-BF16 has only the second, and refuses the first.
    float32 rows, so float32 results: both round the rows to bfloat16, and a bfloat16 result would hide a sum's last
    bits (adding input k before k + 1, not after, left bfloat16 results equal and changed 4-4691 float32 ones)."""
    rows, n, k = shape
    g = torch.Generator().manual_seed(rows + n * k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x, bias = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    packed = cpu_kernels.pack(w)
    got = {}
    for way in bf16_ways:
        cpu_kernels.use_bf16_rows(way)
        assert cpu_kernels.module().bf16_rows() == way  # type: ignore[attr-defined]
        assert cpu_kernels.choose_bf16_rows().way == way
        got[way] = cpu_kernels.linear(x, packed, bias)
    first = got[bf16_ways[0]]
    assert first.dtype == torch.float32 and all(torch.equal(first, y) for y in got.values())
    # vdpbf16ps multiplies the rows as bfloat16, and widened does too in its builds; the others take them as they are
    # (a bfloat16 shard's rows are bfloat16 values either way)
    xs = x.bfloat16().double() if "vdpbf16ps" in bf16_ways else x.double()
    products = xs[:, None, :] * w.double()[None]
    want = products.sum(-1) + bias.double()
    assert ((first.double() - want).abs() / (products.abs().sum(-1) + 1)).max() < 1e-6
    if "vdpbf16ps" in bf16_ways:
        assert bf16_ways == ["vdpbf16ps", "widened"]
        return
    assert bf16_ways == ["widened"] and (isa in ("avx2", "avx512") or "avx512_bf16" not in cpu_flags())
    with pytest.raises(RuntimeError, match="this build has no vdpbf16ps"):
        cpu_kernels.use_bf16_rows("vdpbf16ps")


def test_bf16_rows_chosen_once_from_the_environment_or_a_probe(bf16_ways: list[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """`$SHARDMESH_CPU_BF16_ROWS` names the way; unset, a probe times both and takes widened only where it is clearly
    faster; a value naming no way is refused with the variable's name. A choice holds for the process (the build)."""
    monkeypatch.setenv(cpu_kernels.BF16_ROWS_ENV, "fastest")
    with pytest.raises(ValueError, match="SHARDMESH_CPU_BF16_ROWS='fastest': expected auto, vdpbf16ps or widened"):
        cpu_kernels.choose_bf16_rows()
    amx = "amx" in cpu_kernels.module().bf16_rows_ways()  # type: ignore[attr-defined]
    for asked in bf16_ways:
        monkeypatch.setenv(cpu_kernels.BF16_ROWS_ENV, asked)
        monkeypatch.setattr(cpu_kernels, "_BF16_ROWS", {})
        chosen = cpu_kernels.choose_bf16_rows()
        assert chosen.way == ("amx" if amx else asked)
        if not amx:
            assert cpu_kernels.module().bf16_rows() == asked  # type: ignore[attr-defined]
    monkeypatch.delenv(cpu_kernels.BF16_ROWS_ENV)
    monkeypatch.setattr(cpu_kernels, "_BF16_ROWS", {})
    chosen = cpu_kernels.choose_bf16_rows()
    if amx:
        assert chosen.way == "amx"
    elif bf16_ways == ["widened"]:
        assert chosen == cpu_kernels.Bf16Rows("widened", "no AVX512-BF16 in this build")
    else:
        assert chosen.vdpbf16ps_ns and chosen.widened_ns  # the probe ran, and its verdict is the one set
        assert chosen.way == ("widened" if chosen.widened_ns < cpu_kernels.WIDEN_BELOW * chosen.vdpbf16ps_ns
                              else "vdpbf16ps")  # fmt: skip
        assert cpu_kernels.module().bf16_rows() == chosen.way  # type: ignore[attr-defined]
    monkeypatch.setenv(cpu_kernels.BF16_ROWS_ENV, "fastest")
    assert cpu_kernels.choose_bf16_rows() is chosen  # once per process: the environment is read the first time


@pytest.mark.parametrize("shape", SHAPES)
def test_blocked_int8_product_equals_the_dequantized_one(shape: tuple[int, int, int]) -> None:
    rows, n, k = shape
    g = torch.Generator().manual_seed(n + k)
    w, x, bias = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    q, scale = quantize_groups(w + 0.1)
    packed, groups = cpu_kernels.pack(q), cpu_kernels.pack_groups(scale)
    assert torch.equal(cpu_kernels.unpack(packed), q) and torch.equal(cpu_kernels.unpack_groups(groups), scale)
    got = cpu_kernels.linear(x, packed, bias, groups)
    want = x.double() @ dequantize(q, scale).double().T + bias.double()
    assert ((got.double() - want).abs() / (want.abs() + 1)).max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("rows", [1, 5, 16, 40])
def test_threads_sharing_a_product_compute_every_block_once(dtype: torch.dtype, rows: int) -> None:
    """Each thread takes its own range of blocks, then the others' unclaimed ones (`each_block`: `over_blocks`, and
    `over_chunks` for bfloat16 at 9-32 rows on AVX-512). With more threads than this host has cores a thread is often
    off its core mid-product while the others take its blocks: every product must still equal one thread's, to the
    bit (each block is computed whole by whoever claims it). float32 at 40 rows on AVX2 takes the tiled path instead
    (fixed panels per thread), which the same check holds."""
    g = torch.Generator().manual_seed(rows)
    n, k = 32 * 40 + 7, 96  # 41 blocks, the last one short: ranges of 13 and 14 over 3 threads
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    if dtype == torch.int8:
        q, scale = quantize_groups(w)
        args: tuple = (cpu_kernels.pack(q), None, cpu_kernels.pack_groups(scale))
    else:
        w, x = w.to(dtype), x.to(dtype)
        args = (cpu_kernels.pack(w),)
    want = cpu_kernels.linear(x, *args)  # on one thread, the suite's setting
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for _ in range(200):
            assert torch.equal(cpu_kernels.linear(x, *args), want)
    finally:
        torch.set_num_threads(before)


def test_pack_refuses_other_dtypes() -> None:
    with pytest.raises(ValueError, match="bfloat16 or int8, not torch"):
        cpu_kernels.pack(torch.zeros(4, 4, dtype=torch.float16))


@pytest.mark.parametrize("family", ["llama-gqa-tied", "llama-mha-untied", "qwen2-bias-tied", "llama31-rope-scaling"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_steps_equal_eager(tmp_path: pytest.TempPathFactory, family: str, dtype: torch.dtype) -> None:
    d = make_checkpoint(tmp_path, family, num_layers=2, seed=3)
    model = build_shard(d, ShardSpec(0, 2, 2), dtype=dtype, progress=False, max_len=64)
    assert model.linear_kernels == [BlockedCpuKernel.name]
    slots, order = [3, 0, 7, 1], [2, 0, 3, 1]
    eager_cache, native_cache = prefilled(model, slots, dtype), prefilled(model, slots, dtype)
    runner = cpu_decode(model, native_cache, torch.device("cpu"))
    assert isinstance(runner, CpuDecode)
    positions = {i: len(PROMPTS[i]) for i in order}
    for step in range(3):
        segments = [Segment(slots[i], positions[i], 1) for i in order[: 4 - step]]  # fewer rows each step
        ids = torch.tensor([7 + 3 * i + step for i in order[: 4 - step]])
        batch = BatchLayout.build(segments)
        assert runner.accepts(batch, all_logits=False)
        with torch.inference_mode():
            eager = model(ids, batch, eager_cache)
            native = runner.run(batch, ids)
        assert native.dtype == torch.float32 and native.shape == eager.shape
        assert runner._head is not None  # the head in one call (`head_block`), not the eager modules
        assert runner._all is not None  # and every layer in one (`decode_layers`)
        scale = eager.abs().max()
        # float32: the order of sums only; bfloat16: the same roundings, a bfloat16 ulp apart at most here and there
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        assert (native - eager).abs().max() / scale < tol
        assert torch.equal(native.argmax(-1), eager.argmax(-1))
        for i in order[: 4 - step]:
            positions[i] += 1
    cache_tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (native_cache.data.float() - eager_cache.data.float()).abs().max() < cache_tol


@pytest.mark.parametrize("paged", [False, True], ids=["slots", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_prompts_equal_eager(tmp_path: pytest.TempPathFactory, dtype: torch.dtype, paged: bool) -> None:
    """Prompts through the layer halves: every row's key and value is written before any row attends, so each row
    sees its own segment's earlier rows. Whole prompts, a prompt's second chunk beside decode rows, the logits of each
    sequence's last token and the cache as eager leaves them; in slots, or (`paged`) in shuffled blocks of 4
    (`attend_paged`)."""
    d = make_checkpoint(tmp_path, "qwen2-bias-tied", num_layers=2, seed=11, hidden_size=64, intermediate_size=80)
    model = build_shard(d, ShardSpec(0, 2, 2), dtype=dtype, progress=False, max_len=64)
    if paged:
        eager_cache, native_cache = (model.make_paged_cache(24, 4, dtype, "cpu") for _ in range(2))
    else:
        eager_cache, native_cache = model.make_cache(4, dtype, "cpu"), model.make_cache(4, dtype, "cpu")
    runner = cpu_decode(model, native_cache, torch.device("cpu"))
    assert isinstance(runner, CpuDecode)
    tables = {2: (13, 2, 7, 11, 20), 0: (5, 9, 0, 3, 21), 3: (22, 17, 1, 8, 6, 14)}  # each slot's blocks, when paged

    def layout(segments: list[tuple[int, int, int]]) -> BatchLayout:  # (slot, start, length) each
        if paged:
            return BatchLayout.build([Segment(0, start, n, tables[slot]) for slot, start, n in segments], block_size=4)
        return BatchLayout.build([Segment(slot, start, n) for slot, start, n in segments])

    g = torch.Generator().manual_seed(2)
    steps = [
        [(2, 0, 9), (0, 0, 1), (3, 0, 17)],  # three prompts, one of a single token
        [(2, 9, 1), (0, 1, 6), (3, 17, 1)],  # decode rows beside a prompt's second chunk
        [(2, 10, 1), (0, 7, 1), (3, 18, 1)],
    ]
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for segments in steps:
        batch = layout(segments)
        ids = torch.randint(0, 96, (batch.num_tokens,), generator=g)
        assert runner.accepts(batch, all_logits=False)
        with torch.inference_mode():
            eager, native = model(ids, batch, eager_cache), runner.run(batch, ids)
        assert native.shape == eager.shape == (len(segments), 96)
        assert (native - eager).abs().max() / eager.abs().max() < tol
        assert torch.equal(native.argmax(-1), eager.argmax(-1))
    cache_tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (native_cache.data.float() - eager_cache.data.float()).abs().max() < cache_tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_steps_equal_eager_at_widths_off_the_vectors(tmp_path: pytest.TempPathFactory,
                                                            dtype: torch.dtype) -> None:  # fmt: skip
    """Widths that are not multiples of 16, so each 16-lane loop of the layer halves ends on its scalar tail: hidden
    72 (the norms and residuals: 64 + 8), head dim 18 (the cache writes: 16 + 2; RoPE's half of 9, scalar alone),
    qkv 144 outputs (a last block of 16 of 32, masked), intermediate 52 (SwiGLU: 48 + 4)."""
    d = make_checkpoint(tmp_path, "llama-mha-untied", num_layers=2, seed=5, hidden_size=72, intermediate_size=52)
    model = build_shard(d, ShardSpec(0, 2, 2), dtype=dtype, progress=False, max_len=64)
    slots = [2, 0, 1]
    eager_cache, native_cache = prefilled(model, slots, dtype), prefilled(model, slots, dtype)
    runner = cpu_decode(model, native_cache, torch.device("cpu"))
    assert isinstance(runner, CpuDecode)
    batch = BatchLayout.build([Segment(s, len(PROMPTS[i]), 1) for i, s in enumerate(slots)])
    ids = torch.tensor([5, 17, 30])
    with torch.inference_mode():
        eager, native = model(ids, batch, eager_cache).float(), runner.run(batch, ids)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert (native - eager).abs().max() / eager.abs().max() < tol
    assert torch.equal(native.argmax(-1), eager.argmax(-1))
    cache_tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (native_cache.data.float() - eager_cache.data.float()).abs().max() < cache_tol


def test_native_bf16_steps_are_the_same_whichever_way_rows_are_multiplied(tmp_path: pytest.TempPathFactory,
                                                                         bf16_ways: list[str]) -> None:  # fmt: skip
    """A bfloat16 decode step of several sequences (the layer halves and the head) gives the same logits and writes the
    same keys and values with each way this build has (test_native_steps_equal_eager holds either to eager)."""
    d = make_checkpoint(tmp_path, "qwen2-bias-tied", num_layers=2, seed=8)
    model = build_shard(d, ShardSpec(0, 2, 2), dtype=torch.bfloat16, progress=False, max_len=64)
    slots = [3, 0, 7, 1]
    batch = BatchLayout.build([Segment(s, len(PROMPTS[i]), 1) for i, s in enumerate(slots)])
    ids = torch.tensor([9, 4, 11, 2])
    logits, caches = {}, {}
    for way in bf16_ways:
        cpu_kernels.use_bf16_rows(way)
        caches[way] = prefilled(model, slots, torch.bfloat16)
        runner = cpu_decode(model, caches[way], torch.device("cpu"))
        assert isinstance(runner, CpuDecode) and runner.accepts(batch, all_logits=False)
        with torch.inference_mode():
            logits[way] = runner.run(batch, ids)
    first = bf16_ways[0]
    assert all(torch.equal(logits[first], y) for y in logits.values())
    assert all(torch.equal(caches[first].data, c.data) for c in caches.values())


# Prompts of 5 tokens in slots 3, 0 and 7, then three decode steps of them, the second with a prompt of 3 beside them.
ONE_CALL_STEPS = [[Segment(s, 0, 5) for s in (3, 0, 7)]] + [
    [Segment(s, 5 + k, 1) for s in (3, 0, 7)] + ([Segment(9, 0, 3)] if k == 1 else []) for k in range(3)
]


@pytest.mark.parametrize("stage", ["whole", "middle"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_layers_in_one_call_equal_a_call_per_half(tmp_path: pytest.TempPathFactory, dtype: torch.dtype,
                                                      stage: str) -> None:  # fmt: skip
    """A shard of whole layers runs them all in one call (`decode_layers`): the same output and the same keys and
    values, to the bit, as a call per half, over decode steps of several rows and a short prompt beside them; a
    middle stage's too (activations in and out, no embeddings, no head)."""
    d = make_checkpoint(tmp_path, "qwen2-bias-tied", num_layers=4, seed=11)
    spec = ShardSpec(0, 4, 4) if stage == "whole" else ShardSpec(1, 3, 4)
    model = build_shard(d, spec, dtype=dtype, progress=False, max_len=64)
    runners = {one: CpuDecode(model, model.make_cache(12, dtype, "cpu"), one_call=one) for one in (True, False)}
    hidden = model.cfg.hidden_size
    generator = torch.Generator().manual_seed(2)
    for segments in ONE_CALL_STEPS:
        batch = BatchLayout.build(segments)
        rows = batch.num_tokens
        x = (torch.randint(0, model.cfg.vocab_size, (rows,), generator=generator) if stage == "whole"
             else torch.randn(rows, hidden, generator=generator).to(dtype))  # fmt: skip
        with torch.inference_mode():
            out = {one: runner.run(batch, x) for one, runner in runners.items()}
        assert torch.equal(out[True], out[False])
        assert torch.equal(runners[True].cache.data, runners[False].cache.data)
    assert runners[True]._all is not None and runners[False]._all is None  # each took the way it was asked to


def _tp_steps(runners: dict[bool, CpuDecode], vocab: int) -> list[tuple[Tensor, Tensor]]:
    """Prompts, then decode steps of several rows with a short prompt beside one, through both runners in turn
    (the same on every rank of the group): each step's (one call's, a call per half's) logits."""
    generator = torch.Generator().manual_seed(4)
    out = []
    for segments in ONE_CALL_STEPS:
        batch = BatchLayout.build(segments)
        ids = torch.randint(0, vocab, (batch.num_tokens,), generator=generator)
        with torch.inference_mode():
            out.append((runners[True].run(batch, ids), runners[False].run(batch, ids)))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tensor_parallel_ranks_layers_in_one_call_equal_a_call_per_half(tmp_path: pytest.TempPathFactory,
                                                                          dtype: torch.dtype) -> None:  # fmt: skip
    """A tensor-parallel rank whose group reduces through shared memory runs its layers and their all-reduces in one
    call (`decode_layers_reduced`): on every rank of tp=3 at uneven shares (as `up` gives two cores), the same logits
    and the same keys and values, to the bit, as a call per half; the group's counters move as they would."""
    d = make_checkpoint(tmp_path, "llama-mha-untied", num_layers=3, seed=6, num_attention_heads=6,
                        num_key_value_heads=3, intermediate_size=96)  # fmt: skip

    def body(engine: StageEngine, rank: int) -> tuple[list[tuple[Tensor, Tensor]], bool, bool, list[int]]:
        model, group = engine.model, engine.groups.tp
        runners = {one: CpuDecode(model, model.make_cache(12, dtype, "cpu"), one_call=one) for one in (True, False)}
        before = group.calls
        out = _tp_steps(runners, model.cfg.vocab_size)
        same_cache = torch.equal(runners[True].cache.data, runners[False].cache.data)
        stacks = [int(r._all is not None and r._all.reduced) for r in runners.values()]
        return out, isinstance(group, ShmCollective), same_cache, [group.calls - before, *stacks]

    results = run_mesh(d, 1, 3, body, dtype=dtype, tp_split=(2, 1, 1))
    layers = 3
    for out, shm, same_cache, (calls, one, per_half) in results:
        assert shm and same_cache and (one, per_half) == (1, 0)
        assert all(torch.equal(a, b) for a, b in out)
        # per step and runner: the embedding's all-reduce, two a layer, the head's all-gather
        assert calls == 2 * len(out) * (1 + 2 * layers + 1)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(results[0][0], results[1][0], strict=True))


def test_a_rank_whose_peer_closed_the_group_fails_its_one_call_naming_it(tmp_path: pytest.TempPathFactory) -> None:
    """Rank 1 closes the group (its epoch broke) instead of stepping: ranks 0 and 2, waiting inside the one call,
    raise naming rank 1, as a collective called from Python would; rank 1's own next step raises too."""
    d = make_checkpoint(tmp_path, "llama-mha-untied", num_layers=2, seed=6, num_attention_heads=6,
                        num_key_value_heads=3, intermediate_size=96)  # fmt: skip

    stepped = threading.Barrier(3)  # the ranks are threads (`run_mesh`)

    def body(engine: StageEngine, rank: int) -> str:
        model, group = engine.model, engine.groups.tp
        runner = CpuDecode(model, model.make_cache(2, torch.float32, "cpu"))
        batch = BatchLayout.build([Segment(0, 0, 1)])
        with torch.inference_mode():
            runner.run(batch, torch.tensor([5]))  # one step together
            # Every rank out of that step before rank 1 closes: a rank leaves the step's last collective as soon as
            # its own share is read, and on a busy machine rank 1 could close while another still read its part.
            stepped.wait(WAIT_S)
            if rank == 1:
                group.close("a test broke it")
            try:
                runner.run(BatchLayout.build([Segment(0, 1, 1)]), torch.tensor([6]))
            except RuntimeError as e:
                return str(e)
        return "no error"

    messages = run_mesh(d, 1, 3, body)
    for rank in (0, 2):
        assert "rank 1" in messages[rank] and "closed the group (its epoch broke)" in messages[rank]
    assert "the group broke earlier (rank 1 closed the group: a test broke it)" in messages[1]


@pytest.fixture
def shm_pipeline(tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A small checkpoint for a pp=2 thread mesh whose links go through shared memory (the default on one host)."""
    monkeypatch.delenv(shm_link.TRANSPORT_ENV, raising=False)
    return make_checkpoint(tmp_path, "llama-gqa-tied", num_layers=4, seed=3)


def _loop(engine: StageEngine) -> StageLink:
    loop = engine.groups.loop
    assert loop is not None
    return loop


def _pipelined(engine: StageEngine, rank: int, steps: int) -> tuple[list[Tensor], list[tuple[bool, bool]]]:
    """A prompt, then `steps` greedy decode steps through a pp=2 mesh, the last stage sending each drawn token back
    to the first over the loop link, which the first receives in its step (`tokens_from`), and the first stage keeping
    an activation log: the last stage's logits of every step, or the first stage's log of the sequence's rows; and per
    step on each stage, whether its input was received inside the layers' call and its output sent on from there."""
    native = engine.native
    assert native is not None
    taken: list[tuple[bool, bool]] = []
    received = native.run_received

    def counted(batch: BatchLayout, *args: Any) -> tuple[Tensor, bool] | None:
        out = received(batch, *args)
        taken.append((out is not None, out is not None and out[1]))
        return out

    native.run_received = counted  # type: ignore[method-assign]
    prompt, hidden = PROMPTS[0], engine.model.cfg.hidden_size
    if rank == 0:
        engine.log = ActivationLog(2, 128, hidden, engine.dtype)
    logits = [engine.step(BatchLayout.build([Segment(0, 0, len(prompt))]), torch.tensor(prompt) if rank == 0 else None)]
    loop = _loop(engine)
    for k in range(steps):
        batch = BatchLayout.build([Segment(0, len(prompt) + k, 1)])
        if rank == 1:
            loop.send(logits[-1].argmax(-1))  # type: ignore[union-attr]
            logits.append(engine.step(batch))
        else:
            engine.step(batch, tokens_from=loop)
    if rank == 0:
        assert engine.log is not None
        return [engine.log.data[0, : len(prompt) + steps].clone()], taken
    return [x for x in logits if x is not None], taken


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stages_that_receive_and_send_inside_the_layers_call_compute_what_python_links_give(
        shm_pipeline: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:  # fmt: skip
    """Over shared-memory links a stage waits for its input inside the layers' call (`decode_layers_received`):
    the first stage for the drawn token, which it embeds there, the next for the activations; and the first stage
    sends its output on and writes its activation log from the same call. Every step of a pp=2 mesh takes that way,
    and the logits and the log are those of the same mesh receiving and sending from Python, to the bit."""
    inside = run_mesh(shm_pipeline, 2, 1, lambda engine, rank: _pipelined(engine, rank, 5), dtype=dtype)
    monkeypatch.setattr(CpuDecode, "run_received", lambda self, *args: None)
    outside = run_mesh(shm_pipeline, 2, 1, lambda engine, rank: _pipelined(engine, rank, 5), dtype=dtype)
    # The first stage receives every decode step's token and sends its rows inside; the last stage receives its
    # prompt's rows and every step's inside, and sends nothing on.
    assert inside[0][1] == [(True, True)] * 5 and inside[1][1] == [(True, False)] * 6
    assert outside[0][1] == [(False, False)] * 5 and outside[1][1] == [(False, False)] * 6
    assert len(inside[1][0]) == 6 and all(torch.equal(a, b) for a, b in zip(inside[1][0], outside[1][0], strict=True))
    assert torch.equal(inside[0][0][0], outside[0][0][0])


# Three rows: greedy, sampled with top-p, sampled with top-k and min-p (draws from the sampled rows of a tiny random
# model at these temperatures change from step to step: a step's uniform taken at the wrong position shows).
SAMPLED = [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.9, seed=3),
           SamplingParams(temperature=1.3, top_k=20, min_p=0.01, seed=2**64 - 5)]  # fmt: skip


# (llama-gqa-tied's random weights draw the token they are fed: a step fed the wrong token would go unseen there.)
@pytest.mark.parametrize("family", ["qwen2-bias-tied", "llama-mha-untied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_single_stages_steps_in_one_call_draw_what_steps_one_at_a_time_draw(
        tmp_path: pytest.TempPathFactory, family: str, dtype: torch.dtype, sampled: bool) -> None:  # fmt: skip
    """Five decode steps of three sequences in one call (`decode_steps_drawn`), each step embedding what the one
    before drew: the same tokens, log-probabilities and KV cache, to the bit, as five steps one call each, each drawn
    by `sampling.sample` from that step's logits: greedy rows, or (`sampled`) a greedy row beside two seeded ones."""
    d = make_checkpoint(tmp_path, family, num_layers=2, seed=5)
    model = build_shard(d, ShardSpec(0, 2, 2), dtype=dtype, progress=False, max_len=64)
    slots, counts = [3, 0, 7], [3, 0, 5]  # the alternatives each row asks for
    params = [replace(p, top_logprobs=n) for p, n in zip(SAMPLED if sampled else [SamplingParams()] * 3, counts,
                                                          strict=True)]  # fmt: skip
    caches = {way: prefilled(model, slots, dtype) for way in ("each", "one call")}
    runners = {way: cpu_decode(model, cache, torch.device("cpu")) for way, cache in caches.items()}
    first = torch.tensor([11, 5, 42])
    layouts = [BatchLayout.build([Segment(s, len(PROMPTS[i]) + k, 1) for i, s in enumerate(slots)]) for k in range(5)]
    each_ids, each_lp, each_top = [], [], []
    fed = first
    for k, batch in enumerate(layouts):
        runner = runners["each"]
        assert runner is not None
        d = sampling.sample(runner.run(batch, fed), params, [len(PROMPTS[i]) + k + 1 for i in range(3)])
        each_ids.append(d.token_ids)
        each_lp.append(d.logprobs)
        each_top.append(d.top_logprobs)
        fed = torch.tensor(d.token_ids)
    runner = runners["one call"]
    assert runner is not None
    drawn = runner.run_drawn_steps(layouts, first, (sampling.draw_table(params), sampling.seed_bits(params))
                                   if sampled else None, None, torch.tensor(counts))  # fmt: skip
    assert drawn is not None
    assert drawn.ids.tolist() == each_ids and drawn.logprobs() == each_lp
    assert drawn.top_logprobs(counts) == each_top
    assert all([len(top) for top in step] == counts for step in each_top)
    assert torch.equal(caches["one call"].data, caches["each"].data)
    assert each_ids[0] != first.tolist()  # the later steps are fed other tokens than the first: what each drew
    assert torch.equal(drawn.picked[:, 0], drawn.top[:, 0])  # the greedy row took its most likely token each step
    if sampled:  # the sampled rows did not, every time, and drew more than one token
        assert bool((drawn.picked[:, 1:] < drawn.top[:, 1:]).any())
        assert all(len({ids[i] for ids in each_ids}) > 1 for i in (1, 2))


def test_tied_alternatives_go_lower_id_first_in_a_call_of_steps_and_step_by_step(tmp_path: Path) -> None:
    """A checkpoint whose LM head rows come in identical pairs (token 2j + 1's row is token 2j's), so that every logit
    has a twin: each step's alternatives list each tied pair lower id first, with the same log-probability, in a call
    of several steps (`StepTops`) and step by step (`sampling.top_tokens`) alike. torch.topk alone leaves ties in
    whatever order its selection does."""
    from safetensors.torch import load_file, save_file

    d = make_checkpoint(tmp_path, "llama-mha-untied", num_layers=2, seed=5)
    tensors = load_file(d / "model.safetensors")
    head = tensors["lm_head.weight"]
    head[1::2] = head[0::2]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    model = build_shard(d, ShardSpec(0, 2, 2), progress=False, max_len=64)
    slots, counts = [3, 0], [6, 4]
    params = [SamplingParams(top_logprobs=6), replace(SAMPLED[1], top_logprobs=4)]
    caches = {way: prefilled(model, slots) for way in ("each", "one call")}
    runners = {way: cpu_decode(model, cache, torch.device("cpu")) for way, cache in caches.items()}
    first = torch.tensor([11, 5])
    layouts = [BatchLayout.build([Segment(s, len(PROMPTS[i]) + k, 1) for i, s in enumerate(slots)]) for k in range(4)]
    each_top, fed = [], first
    for k, batch in enumerate(layouts):
        runner = runners["each"]
        assert runner is not None
        d_k = sampling.sample(runner.run(batch, fed), params, [len(PROMPTS[i]) + k + 1 for i in range(2)])
        each_top.append(d_k.top_logprobs)
        fed = torch.tensor(d_k.token_ids)
    runner = runners["one call"]
    assert runner is not None
    drawn = runner.run_drawn_steps(layouts, first, (sampling.draw_table(params), sampling.seed_bits(params)), None,
                                   torch.tensor(counts))  # fmt: skip
    assert drawn is not None
    assert drawn.top_logprobs(counts) == each_top
    for step in each_top:
        for row, n in zip(step, counts, strict=True):
            ids, lps = [t for t, _ in row], [lp for _, lp in row]
            assert len(ids) == n and all(i % 2 == 0 for i in ids[0::2]) and ids[1::2] == [i + 1 for i in ids[0::2]]
            assert lps[0::2] == lps[1::2]


# A greedy row with a repetition penalty, two sampled rows with penalties of each kind, and one without any.
PENALISED = [SamplingParams(repetition_penalty=1.6), SamplingParams(temperature=0.9, top_p=0.9, seed=3,
                                                                    frequency_penalty=1.5, presence_penalty=0.75),
             SamplingParams(temperature=1.3, top_k=20, seed=2**64 - 5, repetition_penalty=0.7, frequency_penalty=2.0,
                            presence_penalty=-0.25),
             SamplingParams(temperature=1.0, seed=9)]  # fmt: skip


@pytest.mark.parametrize("family", ["llama-gqa-tied", "llama-mha-untied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_penalised_steps_in_one_call_draw_what_steps_one_at_a_time_draw(tmp_path: pytest.TempPathFactory, family: str,
                                                                        dtype: torch.dtype) -> None:  # fmt: skip
    """Eight decode steps of four sequences in one call with penalties (`penalties`: the rows' settings and their
    tokens' tallies before the first draw), the call counting its own draws: the same tokens, log-probabilities (the
    model's) and KV cache, to the bit, as eight steps one call each, each recording the token it is fed and drawing
    by `sampling.sample` with the token history. The penalties change what is drawn (llama-gqa-tied's random weights
    otherwise draw the token they are fed, again and again)."""
    d = make_checkpoint(tmp_path, family, num_layers=2, seed=5)
    model = build_shard(d, ShardSpec(0, 2, 2), dtype=dtype, progress=False, max_len=64)
    slots, steps, counts = [3, 0, 7, 5], 8, [0, 4, 0, 2]
    lens = [len(PROMPTS[i]) for i in range(4)]
    params = [replace(p, prompt_len=n, top_logprobs=c) for p, n, c in zip(PENALISED, lens, counts, strict=True)]
    histories = {way: TokenHistory(12, 64) for way in ("each", "one call")}
    for history in histories.values():
        for slot, prompt in zip(slots, PROMPTS, strict=False):
            history.record([slot] * len(prompt), range(len(prompt)), prompt)
    caches = {way: prefilled(model, slots, dtype) for way in ("each", "one call", "unpenalised")}
    runners = {way: cpu_decode(model, cache, torch.device("cpu")) for way, cache in caches.items()}
    first = torch.tensor([11, 5, 42, 11])
    layouts = [BatchLayout.build([Segment(s, lens[i] + k, 1) for i, s in enumerate(slots)]) for k in range(steps)]
    each_ids, each_lp, each_top, fed = [], [], [], first
    history = histories["each"]
    for k, batch in enumerate(layouts):
        runner = runners["each"]
        assert runner is not None
        history.record(slots, [n + k for n in lens], fed.tolist())
        d = sampling.sample(runner.run(batch, fed), params, [n + k + 1 for n in lens], history, slots)
        each_ids.append(d.token_ids)
        each_lp.append(d.logprobs)
        each_top.append(d.top_logprobs)
        fed = torch.tensor(d.token_ids)
    history = histories["one call"]
    history.record(slots, lens, first.tolist())
    # The tallies of the penalised rows, the first three.
    vocab = model.cfg.vocab_size
    tallies = history.tallies(slots[:3], [p.prompt_len for p in params[:3]], [n + 1 for n in lens[:3]], vocab)
    penalties = (sampling.penalty_table(params), tallies)
    draws = (sampling.draw_table(params), sampling.seed_bits(params))
    runner = runners["one call"]
    assert runner is not None
    drawn = runner.run_drawn_steps(layouts, first, draws, penalties, torch.tensor(counts))
    assert drawn is not None
    assert drawn.ids.tolist() == each_ids and drawn.logprobs() == each_lp
    assert drawn.top_logprobs(counts) == each_top  # the model's alternatives, not the penalised logits'
    assert torch.equal(caches["one call"].data, caches["each"].data)
    unpenalised = [replace(p, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0) for p in params]
    runner = runners["unpenalised"]
    assert runner is not None
    plain = runner.run_drawn_steps(layouts, first, (sampling.draw_table(unpenalised), sampling.seed_bits(unpenalised)))
    assert plain is not None
    differ = [i for i in range(4) if plain.ids[:, i].tolist() != drawn.ids[:, i].tolist()]
    assert differ[:3] == [0, 1, 2] and 3 not in differ  # the penalties shaped the draws of the rows that have them
    assert torch.equal(drawn.picked[:, 3], plain.picked[:, 3])


def test_penalties_in_a_call_of_steps_are_checked_and_need_a_sampling_table(small: Transformer) -> None:
    """Malformed penalties, or alternatives' counts, are refused, naming what is wrong, before anything runs."""
    runner = cpu_decode(small, small.make_cache(2, torch.float32, "cpu"), torch.device("cpu"))
    assert runner is not None
    layouts = [BatchLayout.build([Segment(0, k, 1)]) for k in range(2)]
    p = [SamplingParams(temperature=1.0, seed=4, repetition_penalty=1.2)]
    draws = (sampling.draw_table(p), sampling.seed_bits(p))
    tallies = torch.tensor([[0, 7, 1, 1]])
    with pytest.raises(RuntimeError, match="penalties need the rows' sampling table"):
        runner.run_drawn_steps(layouts, torch.tensor([7]), None, (sampling.penalty_table(p), tallies))
    with pytest.raises(RuntimeError, match=r"the penalties must be a contiguous \(1, 4\) float64 tensor"):
        runner.run_drawn_steps(layouts, torch.tensor([7]), draws, (sampling.penalty_table(p * 2), tallies))
    with pytest.raises(RuntimeError, match=r"tally 1 repeats token 7 of row 0"):
        runner.run_drawn_steps(layouts, torch.tensor([7]), draws, (sampling.penalty_table(p), tallies.repeat(2, 1)))
    with pytest.raises(RuntimeError, match=r"tally 0 \(row 1, token 7\) is not of a penalised row's tokens"):
        runner.run_drawn_steps(layouts, torch.tensor([7]), draws, (sampling.penalty_table(p), tallies + tallies.eq(0)))
    with pytest.raises(RuntimeError, match=r"top-logprob counts must be \(1,\) int64, not \[2\]"):
        runner.run_drawn_steps(layouts, torch.tensor([7]), None, None, torch.tensor([3, 3]))
    with pytest.raises(RuntimeError, match=r"row 0 asks for -1 top logprobs"):
        runner.run_drawn_steps(layouts, torch.tensor([7]), None, None, torch.tensor([-1]))


def _drawn_pipeline(engine: StageEngine, rank: int, together: bool,
                    p: SamplingParams) -> list[tuple[list[int], list[float], list]]:  # fmt: skip
    """A prompt, then 5 decode steps of one sequence drawing as `p` says through a pp=2 mesh: the first stage receives
    each step's tokens over the loop link; the last stage draws them one step a call (`sampling.sample`, then a send)
    or, `together`, all in one call (`StageEngine.drawn_steps`). The last stage's draws, their log-probabilities and
    their alternatives (`p.top_logprobs`), each step's."""
    prompt, loop = PROMPTS[0], _loop(engine)
    batches = [BatchLayout.build([Segment(0, len(prompt) + k, 1)]) for k in range(5)]
    logits = engine.step(BatchLayout.build([Segment(0, 0, len(prompt))]), torch.tensor(prompt) if rank == 0 else None)
    if rank == 0:
        for batch in batches:
            engine.step(batch, tokens_from=loop)
        return []
    assert logits is not None
    history = TokenHistory(1, 64)  # what a penalised draw counts: the prompt, then each token fed
    history.record([0] * len(prompt), range(len(prompt)), prompt)
    first = sampling.sample(logits, [p], [len(prompt)], history, [0]).token_ids
    loop.send(torch.tensor(first))
    if together:
        draws = None if p.greedy and not p.penalized else (sampling.draw_table([p]), sampling.seed_bits([p]))
        penalties = None
        if p.penalized:
            history.record([0], [len(prompt)], first)
            penalties = (sampling.penalty_table([p]), history.tallies([0], [p.prompt_len], [len(prompt) + 1],
                                                                      engine.model.cfg.vocab_size))  # fmt: skip
        counts = torch.tensor([p.top_logprobs]) if p.top_logprobs else None
        drawn = engine.drawn_steps(batches, torch.tensor(first), loop, draws, penalties, counts)
        assert drawn is not None
        return list(zip(drawn.ids.tolist(), drawn.logprobs(), drawn.top_logprobs([p.top_logprobs]), strict=True))
    out, fed = [], first
    for k, batch in enumerate(batches):
        step_logits = engine.step(batch)
        assert step_logits is not None
        history.record([0], [len(prompt) + k], fed)
        d = sampling.sample(step_logits, [p], [len(prompt) + k + 1], history, [0])
        fed = d.token_ids
        out.append((d.token_ids, d.logprobs, d.top_logprobs))
        if k < len(batches) - 1:
            loop.send(torch.tensor(d.token_ids))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [SamplingParams(), SAMPLED[1], replace(PENALISED[2], prompt_len=len(PROMPTS[0])),
                               replace(SAMPLED[1], top_logprobs=4)],
                         ids=["greedy", "sampled", "penalised", "alternatives"])  # fmt: skip
def test_a_pipelines_last_stage_draws_its_steps_in_one_call_as_one_at_a_time(
        tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
        p: SamplingParams) -> None:  # fmt: skip
    """The last stage of a pp=2 mesh runs five steps in one call (`decode_steps_drawn_received`): each receives its
    activations, draws (greedy, seeded at the token's position, that with penalties, or with alternatives), and sends
    the tokens back to the first stage, which feeds them to its next step. The draws, their log-probabilities and
    alternatives are those of the last stage drawing one step a call, to the bit. (An untied model: the tied one of
    `shm_pipeline` draws the token it is fed, so a wrong token sent would go unseen.)"""
    monkeypatch.delenv(shm_link.TRANSPORT_ENV, raising=False)
    d = make_checkpoint(tmp_path, "llama-mha-untied", num_layers=4, seed=3)
    one_call = run_mesh(d, 2, 1, lambda engine, rank: _drawn_pipeline(engine, rank, True, p), dtype=dtype)
    each = run_mesh(d, 2, 1, lambda engine, rank: _drawn_pipeline(engine, rank, False, p), dtype=dtype)
    assert len(one_call[1]) == 5 and one_call[1] == each[1]
    assert len({tuple(ids) for ids, _, _ in each[1]}) > 1  # the tokens fed back change from step to step
    assert all(len(top[0]) == p.top_logprobs for _, _, top in one_call[1])


def test_a_last_stage_drawing_in_one_call_fails_naming_the_stage_that_closed_its_link(shm_pipeline: Path) -> None:
    """The first stage computes two of five greedy steps, then closes its link to the last stage (its epoch broke):
    the last stage's call of five steps fails at the third step's receive, naming the side that closed the link, as
    a receive from Python would; the two steps before it were counted."""

    def body(engine: StageEngine, rank: int) -> str:
        prompt, loop = PROMPTS[0], _loop(engine)
        batches = [BatchLayout.build([Segment(0, len(prompt) + k, 1)]) for k in range(5)]
        logits = engine.step(BatchLayout.build([Segment(0, 0, len(prompt))]),
                             torch.tensor(prompt) if rank == 0 else None)  # fmt: skip
        if rank == 0:
            for batch in batches[:2]:
                engine.step(batch, tokens_from=loop)
            assert engine.groups.next is not None
            engine.groups.next.close("a test broke it")
            return ""
        assert logits is not None
        first = logits.argmax(-1)
        loop.send(first)
        try:
            engine.drawn_steps(batches, first, loop)
        except RuntimeError as e:
            assert engine.groups.prev is not None and engine.groups.prev.messages_received == 3  # prompt + 2
            return str(e)
        return "no error"

    message = run_mesh(shm_pipeline, 2, 1, body)[1]
    assert "side 0 (pid " in message and "closed the link (its epoch broke)" in message, message


def test_a_sampled_row_without_finite_logits_is_the_value_error_python_draws_raise(tmp_path: Path) -> None:
    """A model whose final norm holds a NaN: a call of several sampled steps refuses its logits with the ValueError
    `sampling.draw` raises from Python (the model's output, not a failed peer), while greedy steps take the first NaN
    as `argmax` does."""
    d = make_checkpoint(tmp_path, "llama-mha-untied", num_layers=2, seed=5)
    model = build_shard(d, ShardSpec(0, 2, 2), progress=False, max_len=64)
    with torch.no_grad():
        model.model.norm.weight[3] = float("nan")
    runner = cpu_decode(model, prefilled(model, [0]), torch.device("cpu"))
    assert runner is not None
    layouts = [BatchLayout.build([Segment(0, len(PROMPTS[0]) + k, 1)]) for k in range(3)]
    p = [SamplingParams(temperature=1.0, seed=4)]
    with pytest.raises(ValueError, match="a sampled row's logits hold a NaN or no finite value"):
        runner.run_drawn_steps(layouts, torch.tensor([7]), (sampling.draw_table(p), sampling.seed_bits(p)))
    with pytest.raises(ValueError, match="a sampled row's logits hold a NaN or no finite value"):
        sampling.draw(runner.run(layouts[0], torch.tensor([7])), p, [0.5])
    greedy = runner.run_drawn_steps(layouts, torch.tensor([7]))
    assert greedy is not None and greedy.top.isnan().all()


def test_a_single_stages_drawn_steps_name_a_token_past_the_embedding(small: Transformer) -> None:
    cache = small.make_cache(2, torch.float32, "cpu")
    runner = cpu_decode(small, cache, torch.device("cpu"))
    assert runner is not None
    layouts = [BatchLayout.build([Segment(0, k, 1)]) for k in range(2)]
    vocab = small.cfg.vocab_size
    with pytest.raises(RuntimeError, match=f"token id {vocab} is out of the embedding's {vocab} rows"):
        runner.run_drawn_steps(layouts, torch.tensor([vocab]))


def test_a_stage_receiving_inside_the_layers_call_names_a_message_of_the_wrong_size(shm_pipeline: Path) -> None:
    """The first stage sends two rows of activations where the next stage's step expects one: the next stage's call
    refuses them before computing, naming both sizes, as a receive from Python would, and the link is broken."""

    def body(engine: StageEngine, rank: int) -> str:
        hidden = engine.model.cfg.hidden_size
        if rank == 0:
            assert engine.groups.next is not None
            engine.groups.next.send(torch.zeros(2, hidden))
            return ""
        try:
            engine.step(BatchLayout.build([Segment(0, 0, 1)]))
        except RuntimeError as e:
            assert engine.groups.prev is not None
            with pytest.raises(RuntimeError, match="the link broke earlier"):
                engine.groups.prev.recv((1, hidden), torch.float32, "cpu")
            return str(e)
        return "no error"

    message = run_mesh(shm_pipeline, 2, 1, body)[1]
    assert f"sent {2 * 4 * 48} bytes where side 1 expected a message of {4 * 48}" in message, message


def test_a_token_id_past_the_embedding_fails_the_call_naming_it_and_breaks_its_link(shm_pipeline: Path) -> None:
    """The first stage receives a token id past its embedding's rows inside its call: the call fails naming it, and
    the link it came over is closed (its messages' count is not known any more), so that neither side can go on on
    it out of step: the next receive raises, and the sender learns at once that the link was closed."""

    def body(engine: StageEngine, rank: int) -> str:
        loop = _loop(engine)
        if rank == 1:
            loop.send(torch.tensor([96]))  # the checkpoint's vocabulary is 96 tokens
            with pytest.raises(RuntimeError, match="closed the link"):
                for _ in range(shm_link.SLOTS + 1):  # until the ring is full and the close is read
                    loop.send(torch.tensor([5]))
            return ""
        try:
            engine.step(BatchLayout.build([Segment(0, 0, 1)]), tokens_from=loop)
        except RuntimeError as e:
            with pytest.raises(RuntimeError, match="the link broke earlier"):
                loop.recv((1,), torch.int64, "cpu")
            return str(e)
        return "no error"

    message = run_mesh(shm_pipeline, 2, 1, body)[0]
    assert "token id 96 is out of the embedding's 96 rows" in message, message


def test_a_stage_sending_from_the_layers_call_to_a_closed_link_names_the_side_that_closed_it(
    shm_pipeline: Path,
) -> None:
    """The last stage sends the first a token, then closes the link between them (its epoch broke): the first
    stage receives the token and computes inside its call, whose send is refused, and raises naming the side that
    closed the link, as a send from Python would; its activation log is not written."""

    def body(engine: StageEngine, rank: int) -> str:
        loop = _loop(engine)
        if rank == 1:
            assert engine.groups.prev is not None
            engine.groups.prev.close("a test broke it")
            loop.send(torch.tensor([7]))
            return ""
        log = engine.log = ActivationLog(2, 16, engine.model.cfg.hidden_size, engine.dtype)
        log.data.fill_(3.0)
        try:
            engine.step(BatchLayout.build([Segment(0, 0, 1)]), tokens_from=loop)
        except RuntimeError as e:
            assert bool((log.data == 3.0).all())
            return str(e)
        return "no error"

    message = run_mesh(shm_pipeline, 2, 1, body)[0]
    assert "side 1 (pid " in message and "closed the link (its epoch broke)" in message, message


def test_a_stack_of_layers_refuses_short_lists_and_is_gone_once_dropped(small: Transformer) -> None:
    runner = CpuDecode(small, small.make_cache(2, torch.float32, "cpu"))
    ext, layers = runner.ext, runner._calls()
    stack = runner._all
    assert stack is not None
    attention = [list(args) for args in zip(*(c.attention for c in layers), strict=True)]
    mlp = [list(args) for args in zip(*(c.mlp for c in layers), strict=True)][:8]
    n_heads, n_kv = layers[0].heads[:2]
    with pytest.raises(RuntimeError, match=r"one entry per layer \(1\), one holds 2"):
        ext.stack_layers(attention[0][:1], *attention[1:], n_heads, n_kv, *mlp)  # the first layer's norm only
    batch = BatchLayout.build([Segment(0, 0, 1)])
    x = torch.zeros(1, small.cfg.hidden_size)
    step = (*batch.kv_index, small.rope_cos, small.rope_sin)
    assert ext.decode_layers(stack.id, x, *step).shape == x.shape
    runner.cache = small.make_cache(2, torch.float32, "cpu")  # another cache: the stack is made again
    runner._calls()
    assert runner._all is not None and runner._all.id != stack.id
    with pytest.raises(RuntimeError, match=f"no stack of layers numbered {stack.id}"):
        ext.decode_layers(stack.id, x, *step)


@pytest.mark.parametrize("head_dim", [16, 32, 48, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_attention_over_longer_contexts_equals_eager(tmp_path: pytest.TempPathFactory, dtype: torch.dtype,
                                                            head_dim: int) -> None:  # fmt: skip
    """Head dims that are multiples of the vector (16 lanes on AVX-512, 8 on AVX2): 2, 4 or 8 vectors take the
    attention a vector's positions at a time (AVX-512: 32, 64, 128; AVX2: 16, 32, 64), the others one position at a
    time. Contexts of 2 to 35 positions: whole blocks of positions, a partial one, and both."""
    d = make_checkpoint(tmp_path, "llama-gqa-tied", num_layers=2, seed=6, hidden_size=4 * head_dim,
                        intermediate_size=96)  # fmt: skip
    model = build_shard(d, ShardSpec(0, 2, 2), dtype=dtype, progress=False, max_len=64)
    prompts = [[1], [1, *range(3, 17)], [1, *range(3, 18)], [1, *range(40, 72)]]  # 1, 15, 16 and 33 tokens
    eager_cache, native_cache = model.make_cache(4, dtype, "cpu"), model.make_cache(4, dtype, "cpu")
    with torch.inference_mode():
        for cache in (eager_cache, native_cache):
            for slot, prompt in enumerate(prompts):
                model(torch.tensor(prompt), BatchLayout.build([Segment(slot, 0, len(prompt))]), cache)
    runner = cpu_decode(model, native_cache, torch.device("cpu"))
    assert isinstance(runner, CpuDecode)
    decided = 0
    for step in range(3):
        batch = BatchLayout.build([Segment(slot, len(p) + step, 1) for slot, p in enumerate(prompts)])
        ids = torch.tensor([5 + slot + step for slot in range(len(prompts))])
        with torch.inference_mode():
            eager, native = model(ids, batch, eager_cache).float(), runner.run(batch, ids).float()
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        assert (native - eager).abs().max() / eager.abs().max() < tol
        # The same token wherever the eager one leads by more than twice the row's difference (bfloat16 has
        # near-ties here, logits one ulp apart, which any other order of sums may swap), and that is most rows.
        top, err = eager.topk(2, dim=-1).values, (native - eager).abs().amax(-1)
        clear = (top[:, 0] - top[:, 1]) > 2 * err
        assert torch.equal(native.argmax(-1)[clear], eager.argmax(-1)[clear])
        decided += int(clear.sum())
    assert decided >= 3 * len(prompts) * 2 // 3, decided


def test_native_int8_steps_equal_eager(tmp_path: pytest.TempPathFactory) -> None:
    """An int8 shard (float32 activations, int8 decoder products and head) decodes natively, as eager does."""
    d = make_checkpoint(tmp_path, "qwen2-bias-tied", num_layers=2, seed=4)
    model = build_shard(d, ShardSpec(0, 2, 2), progress=False, max_len=64, quantization=Quantization.INT8)
    assert model.linear_kernels == [BlockedInt8Kernel.name]
    slots = [2, 0, 5]
    eager_cache, native_cache = prefilled(model, slots, torch.float32), prefilled(model, slots, torch.float32)
    runner = cpu_decode(model, native_cache, torch.device("cpu"))
    assert runner is not None
    batch = BatchLayout.build([Segment(s, len(PROMPTS[i]), 1) for i, s in enumerate(slots)])
    ids = torch.tensor([3, 8, 5])
    with torch.inference_mode():
        eager, native = model(ids, batch, eager_cache), runner.run(batch, ids)
    assert (native - eager).abs().max() / eager.abs().max() < 1e-4
    assert (native_cache.data - eager_cache.data).abs().max() < 1e-5


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Transformer:
    d = make_checkpoint(tmp_path_factory.mktemp("gqa"), "llama-gqa-tied", num_layers=2, seed=5)
    return build_shard(d, ShardSpec(0, 2, 2), progress=False, max_len=64)


def test_declines_what_it_cannot_compute(small: Transformer) -> None:
    runner = cpu_decode(small, small.make_cache(2, torch.float32, "cpu"), torch.device("cpu"))
    assert runner is not None
    assert runner.accepts(BatchLayout.build([Segment(0, 4, 1), Segment(1, 0, 2)]), all_logits=False)  # a prompt
    long = Segment(1, 0, cpu_decode_module.ROW_CHUNK + 1)  # taken in chunks of rows
    assert runner.accepts(BatchLayout.build([Segment(0, 4, 1), long]), all_logits=False)
    assert not runner.accepts(BatchLayout.build([Segment(0, 4, 1)]), all_logits=True)
    assert runner.accepts(BatchLayout.build([Segment(0, 4, 1)]), all_logits=False)
    # another device: eager
    assert cpu_decode(small, small.make_cache(2, torch.float32, "cpu"), torch.device("cuda")) is None
    # a paged cache: decode rows only, of head dims in whole vectors (this model's are 12)
    paged = cpu_decode(small, small.make_paged_cache(8, 4, torch.float32, "cpu"), torch.device("cpu"))
    assert paged is not None
    assert not paged.accepts(BatchLayout.build([Segment(0, 4, 1, (0, 1))], block_size=4), all_logits=False)


def _paged_prefilled(model: Transformer, tables: list[tuple[int, ...]], dtype: torch.dtype, block: int) -> Any:
    """A paged cache in `dtype` holding PROMPTS[i] in the blocks of tables[i], each written alone."""
    cache = model.make_paged_cache(24, block, dtype, "cpu")
    with torch.inference_mode():
        for table, prompt in zip(tables, PROMPTS, strict=False):
            model(torch.tensor(prompt), BatchLayout.build([Segment(0, 0, len(prompt), table)], block_size=block),
                  cache)  # fmt: skip
    return cache


# Each sequence's blocks, shuffled and scattered over the pool.
PAGED_TABLES = {4: [(13, 2, 7, 11), (5, 9, 0, 3), (21, 17, 1, 8), (6, 14, 19, 4)], 16: [(3, 1), (0, 5), (7, 2), (4, 6)]}


@pytest.mark.parametrize("family", ["llama-gqa-tied", "llama-mha-untied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [4, 16])
def test_paged_decode_rows_equal_eager(tmp_path: pytest.TempPathFactory, family: str, dtype: torch.dtype,
                                       block: int) -> None:  # fmt: skip
    """Decode rows over a paged cache through the layer halves (`attend_paged`): the logits and the blocks' keys and
    values the eager model (`paged_attention`) gives, rows in any order over shuffled blocks, across a block's end
    (blocks of 4: the last vector of positions part-filled; of 16: whole vectors on AVX-512, two on AVX2)."""
    d = make_checkpoint(tmp_path, family, num_layers=2, seed=3, head_dim=16)
    model = build_shard(d, ShardSpec(0, 2, 2), dtype=dtype, progress=False, max_len=64)
    tables = PAGED_TABLES[block]
    eager_cache, native_cache = (_paged_prefilled(model, tables, dtype, block) for _ in range(2))
    runner = cpu_decode(model, native_cache, torch.device("cpu"))
    assert isinstance(runner, CpuDecode)
    order = [2, 0, 3, 1]
    positions = {i: len(PROMPTS[i]) for i in order}
    for step in range(6 if block == 4 else 12):
        rows = order[: 4 - step % 3]  # fewer rows, then all again
        segments = [Segment(0, positions[i], 1, tables[i]) for i in rows]
        ids = torch.tensor([7 + 3 * i + step for i in rows])
        batch = BatchLayout.build(segments, block_size=block)
        assert runner.accepts(batch, all_logits=False)
        with torch.inference_mode():
            eager = model(ids, batch, eager_cache)
            native = runner.run(batch, ids)
        assert runner._all is not None  # every layer in one call
        scale = eager.abs().max()
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        assert (native - eager).abs().max() / scale < tol
        assert torch.equal(native.argmax(-1), eager.argmax(-1))
        for i in rows:
            positions[i] += 1
    assert max(positions.values()) > block  # some sequence went on into its next block
    cache_tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (native_cache.data.float() - eager_cache.data.float()).abs().max() < cache_tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_steps_in_one_call_draw_what_steps_one_at_a_time_draw(tmp_path: pytest.TempPathFactory,
                                                                    dtype: torch.dtype) -> None:  # fmt: skip
    """Five decode steps of three sequences over a paged cache in one call (`decode_steps_drawn`, the block tables
    (steps, rows, blocks)), a sequence crossing into its next block part-way: the same tokens, log-probabilities and
    cache, to the bit, as five steps one call each."""
    d = make_checkpoint(tmp_path, "llama-mha-untied", num_layers=2, seed=5, head_dim=16)
    model = build_shard(d, ShardSpec(0, 2, 2), dtype=dtype, progress=False, max_len=64)
    tables = PAGED_TABLES[4][:3]
    params = SAMPLED
    caches = {way: _paged_prefilled(model, tables, dtype, 4) for way in ("each", "one call")}
    runners = {way: cpu_decode(model, cache, torch.device("cpu")) for way, cache in caches.items()}
    first = torch.tensor([11, 5, 42])
    layouts = [BatchLayout.build([Segment(0, len(PROMPTS[i]) + k, 1, t) for i, t in enumerate(tables)], block_size=4)
               for k in range(5)]  # fmt: skip
    each_ids, each_lp, fed = [], [], first
    for k, batch in enumerate(layouts):
        runner = runners["each"]
        assert runner is not None
        d = sampling.sample(runner.run(batch, fed), params, [len(PROMPTS[i]) + k + 1 for i in range(3)])
        each_ids.append(d.token_ids)
        each_lp.append(d.logprobs)
        fed = torch.tensor(d.token_ids)
    runner = runners["one call"]
    assert runner is not None
    drawn = runner.run_drawn_steps(layouts, first, (sampling.draw_table(params), sampling.seed_bits(params)))
    assert drawn is not None
    assert drawn.ids.tolist() == each_ids and drawn.logprobs() == each_lp
    assert torch.equal(caches["one call"].data, caches["each"].data)


def test_other_kernels_stay_eager(tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights the layer halves cannot read (another kernel chosen) leave every step to the eager model."""
    monkeypatch.setenv(KERNEL_ENV, "dense")
    d = make_checkpoint(tmp_path, "llama-gqa-tied", num_layers=2, seed=5)
    model = build_shard(d, ShardSpec(0, 2, 2), progress=False, max_len=64)
    groups = ShardGroups(ShardSpec(0, 2, 2), 0, 1, SingleRank(), None, None)
    engine = StageEngine(model, groups, model.make_cache(2, torch.float32, "cpu"), torch.device("cpu"))
    assert engine.decode_runner == "eager"


def test_stage_engine_runs_decode_and_prompts_natively(small: Transformer) -> None:
    groups = ShardGroups(ShardSpec(0, 2, 2), 0, 1, SingleRank(), None, None)
    engine = StageEngine(small, groups, small.make_cache(2, torch.float32, "cpu"), torch.device("cpu"))
    assert engine.decode_runner == "cpu-native"
    calls = []
    run = engine.native.run  # type: ignore[union-attr]
    engine.native.run = lambda batch, x: calls.append(batch) or run(batch, x)  # type: ignore[union-attr,method-assign]
    engine.step(BatchLayout.build([Segment(1, 0, 40)]), torch.arange(1, 41))  # a long prompt
    engine.step(BatchLayout.build([Segment(0, 0, 3)]), torch.tensor([1, 2, 3]))  # a short one
    out = engine.step(BatchLayout.build([Segment(0, 3, 1)]), torch.tensor([4]))
    assert len(calls) == 3 and out is not None and out.shape == (1, small.cfg.vocab_size)


@pytest.mark.parametrize(("stage", "hidden", "paged"), [("whole", 128, False), ("first", 128, False),
                                                       ("whole", 48, False), ("whole", 128, True),
                                                       ("first", 128, True)])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_steps_in_chunks_of_rows_equal_one_chunk_and_eager(
        tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, stage: str, hidden: int,
        paged: bool) -> None:  # fmt: skip
    """A step of more than `ROW_CHUNK` rows goes through the layers a chunk of rows at a time, each chunk's prompt rows
    attending over keys the chunks before wrote: the same logits (or a first stage's activations) and cache to the bit
    as one chunk, and eager's within the order of sums. Chunks of 7 rows cut a 40-token prompt, a 9-token one, and
    decode rows beside them. The prompts' rows attend over 1 to 40 positions, so their attention tasks differ in length
    as a long prompt's do, and the threads take them longest first: by key-value head (head dim 32, a multiple of the
    vector) or by query head (12). `paged`: the same in blocks of 4 (`attend_paged`)."""
    d = make_checkpoint(tmp_path, "llama-gqa-tied", num_layers=2, seed=9, hidden_size=hidden, intermediate_size=96)
    spec = ShardSpec(0, 2, 2) if stage == "whole" else ShardSpec(0, 1, 2)
    model = build_shard(d, spec, dtype=dtype, progress=False, max_len=64)
    slots = [1, 3]
    tables = {1: (13, 2, 7), 3: (5, 9, 0), 0: tuple(range(14, 24)), 2: (3, 1, 10, 11)}  # each slot's, when paged
    ways = ("eager", "one", "chunks")
    if paged:
        caches = {way: _paged_prefilled(model, [tables[s] for s in slots], dtype, 4) for way in ways}
    else:
        caches = {way: prefilled(model, slots, dtype) for way in ways}
    runners = {way: cpu_decode(model, caches[way], torch.device("cpu")) for way in ("one", "chunks")}
    places = [(0, 0, 40), (slots[0], len(PROMPTS[0]), 1), (2, 0, 9), (slots[1], len(PROMPTS[1]), 1)]
    if paged:
        batch = BatchLayout.build([Segment(0, start, n, tables[s]) for s, start, n in places], block_size=4)
    else:
        batch = BatchLayout.build([Segment(s, start, n) for s, start, n in places])
    segments = batch.segments
    ids = torch.randint(1, 96, (batch.num_tokens,), generator=torch.Generator().manual_seed(4))
    out = {}
    with torch.inference_mode():
        out["eager"] = model(ids, batch, caches["eager"]).float()
        for way, chunk in (("one", 64), ("chunks", 7)):
            monkeypatch.setattr(cpu_decode_module, "ROW_CHUNK", chunk)
            runner = runners[way]
            assert runner is not None and runner.accepts(batch, all_logits=False)
            out[way] = runner.run(batch, ids).float()
    rows = len(segments) if stage == "whole" else batch.num_tokens
    assert out["one"].shape == out["eager"].shape and out["one"].shape[0] == rows
    assert torch.equal(out["chunks"], out["one"]) and torch.equal(caches["chunks"].data, caches["one"].data)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert (out["one"] - out["eager"]).abs().max() / out["eager"].abs().max() < tol
    native_kv, eager_kv = caches["one"].data.float(), caches["eager"].data.float()
    cache_tol = 1e-5 if dtype == torch.float32 else 1e-2  # relative: bfloat16 keys near 4 are 1/64 apart
    assert (native_kv - eager_kv).abs().max() / eager_kv.abs().max() < cache_tol


@pytest.fixture(params=[None, 16], ids=["one-segment", "segments-of-16"])
def attend_segment(request: pytest.FixtureRequest) -> Iterator[int | None]:
    """The positions per attention segment: the default (512: every sequence in these tests within one), or 16, so
    that short test sequences span several and take the softmax a segment at a time."""
    if request.param is None:
        yield None
        return
    ext = cpu_kernels.module()
    before = ext.set_attend_segment(request.param)  # type: ignore[attr-defined]
    yield request.param
    ext.set_attend_segment(before)  # type: ignore[attr-defined]


@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_in_one_step_equals_it_token_by_token(tmp_path: pytest.TempPathFactory, dtype: torch.dtype,
                                                       head_dim: int, attend_segment: int | None) -> None:  # fmt: skip
    """A prompt's rows attend by runs of consecutive rows (`attend_rows`: each block of keys read once for the run), a
    decode row on its own (the same kernel, one row); row for row they must do the same work whatever the run's length,
    and the products, norms and RoPE are each row's own. So a 37-token prompt in one step (runs of 8, 8, 8, 8 and 5
    rows, rows whose positions end inside a block of the vector's width and on its edge) leaves the same cache, and its
    last token the same logits, to the bit, as the same tokens one step each. Beside it, in the same steps, another
    slot's prompt of 3 tokens. With segments of 16 positions, the prompt's runs take their segments in order within a
    task, and a decode row (too few tasks for the threads) a task per segment, merged after: the same merges in the same
    order."""
    d = make_checkpoint(tmp_path, "llama-gqa-tied", num_layers=2, seed=12, hidden_size=4 * head_dim,
                        intermediate_size=96)  # fmt: skip
    model = build_shard(d, ShardSpec(0, 2, 2), dtype=dtype, progress=False, max_len=64)
    ids = torch.randint(1, 96, (40,), generator=torch.Generator().manual_seed(7))
    whole, stepped = model.make_cache(2, dtype, "cpu"), model.make_cache(2, dtype, "cpu")
    at_once_runner, stepped_runner = (cpu_decode(model, c, torch.device("cpu")) for c in (whole, stepped))
    assert at_once_runner is not None and stepped_runner is not None
    with torch.inference_mode():
        at_once = at_once_runner.run(BatchLayout.build([Segment(0, 0, 37), Segment(1, 0, 3)]), ids)
        for p in range(37):
            segments = [Segment(0, p, 1)] + ([Segment(1, p, 1)] if p < 3 else [])
            tokens = torch.stack([ids[p], ids[37 + p]]) if p < 3 else ids[p : p + 1]
            one = stepped_runner.run(BatchLayout.build(segments), tokens)
            if p == 2:
                assert torch.equal(one[1], at_once[1])
    assert torch.equal(one[0], at_once[0])
    assert torch.equal(whole.data, stepped.data)


@pytest.mark.parametrize("block", [4, 16])
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_paged_prompt_in_one_step_equals_it_token_by_token(tmp_path: pytest.TempPathFactory, dtype: torch.dtype,
                                                             head_dim: int, block: int) -> None:  # fmt: skip
    """Over a paged cache too, a prompt's rows attend by runs of up to 8 consecutive rows (`attend_paged`: each block's
    tiles read once for the run), and row for row do what a decode row does alone. Blocks shuffled; of 16 positions,
    a block's last few scores are a vector like the others (`tile_scores`), of 4 they are dot products one by one.
    Sequence 0's prompt (36 or 32 tokens), then sequence 1, which shares those blocks (a cached prefix), writes 3
    positions of its own block; then one step holds sequence 0's next 3 rows followed by sequence 1's: consecutive
    positions, but tables that differ past the prefix, so not one run. Taken so, and taken one token a step, the steps
    leave the same cache and last logits to the bit, and match eager's."""
    d = make_checkpoint(tmp_path, "llama-gqa-tied", num_layers=2, seed=12, hidden_size=4 * head_dim,
                        intermediate_size=96)  # fmt: skip
    model = build_shard(d, ShardSpec(0, 2, 2), dtype=dtype, progress=False, max_len=64)
    prefix = 36 if block == 4 else 32  # whole blocks
    shared = prefix // block
    pool = torch.randperm(shared + 6, generator=torch.Generator().manual_seed(4)).tolist()
    tables = [tuple(pool[: shared + 3]), tuple(pool[:shared] + pool[shared + 3 :])]  # the prefix's, then each its own
    steps = [[(0, 0, prefix)], [(1, prefix, 3)], [(0, prefix, 3), (1, prefix + 3, 3)]]  # (sequence, start, length)
    ids = torch.randint(1, 96, (prefix + 9,), generator=torch.Generator().manual_seed(7))
    caches = {way: model.make_paged_cache(shared + 6, block, dtype, "cpu") for way in ("eager", "at once", "stepped")}
    runners = {way: cpu_decode(model, caches[way], torch.device("cpu")) for way in ("at once", "stepped")}
    at_once, stepped = runners["at once"], runners["stepped"]
    assert at_once is not None and stepped is not None

    def layout(pieces: list[tuple[int, int, int]]) -> BatchLayout:
        return BatchLayout.build([Segment(0, start, n, tables[s]) for s, start, n in pieces], block_size=block)

    with torch.inference_mode():
        start = 0
        for pieces in steps:
            batch, tokens = layout(pieces), ids[start : start + sum(n for _, _, n in pieces)]
            assert at_once.accepts(batch, all_logits=False)
            whole, want = at_once.run(batch, tokens), model(tokens, batch, caches["eager"]).float()
            ends = []  # each piece's last logits, its tokens one step each
            for (s, first, n), chunk in zip(pieces, tokens.split([n for _, _, n in pieces]), strict=True):
                for i in range(n):
                    last = stepped.run(layout([(s, first + i, 1)]), chunk[i : i + 1])
                ends.append(last)
            start += len(tokens)
            assert torch.equal(whole, torch.cat(ends)), pieces
            tol = 1e-4 if dtype == torch.float32 else 5e-2
            assert (whole - want).abs().max() / want.abs().max() < tol, pieces
    assert torch.equal(caches["at once"].data, caches["stepped"].data)
    eager = caches["eager"].data.float()
    cache_tol = 1e-5 if dtype == torch.float32 else 2e-2  # relative: bfloat16 keys of ~4 are 2^-6 apart
    assert (caches["at once"].data.float() - eager).abs().max() / eager.abs().max() < cache_tol


@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_by_segments_equals_eager_however_cut(tmp_path: pytest.TempPathFactory, dtype: torch.dtype,
                                                        head_dim: int) -> None:  # fmt: skip
    """Rows attending over more positions than a segment (16 here) take the softmax a segment at a time, normalized
    by its own sum, and merge the segments in order, however the tasks are cut. On 3 threads: prompts of 20 to 59
    tokens (2 to 4 segments; runs of 8 rows in tasks that do their segments in turn) and a 5-token chunk after the
    59 (one run: 2 tasks, so a task per segment, merged after) match eager's logits. Then one decode step of the 4
    sequences (8 tasks: each does its row's segments in turn) and the same rows one step each (2 tasks: a task per
    segment) give the same logits and cache to the bit, and match eager's step."""
    ext = cpu_kernels.module()
    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # tasks are cut by how evenly the threads would share them
    before = ext.set_attend_segment(16)  # type: ignore[attr-defined]
    try:
        d = make_checkpoint(tmp_path, "llama-gqa-tied", num_layers=2, seed=13, hidden_size=4 * head_dim,
                            intermediate_size=96)  # fmt: skip
        model = build_shard(d, ShardSpec(0, 2, 2), dtype=dtype, progress=False, max_len=96)
        pieces = [Segment(0, 0, 50), Segment(1, 0, 37), Segment(2, 0, 59), Segment(2, 59, 5), Segment(3, 0, 20)]
        ids = torch.randint(1, 96, (sum(p.length for p in pieces) + 4,), generator=torch.Generator().manual_seed(8))
        caches = {way: model.make_cache(4, dtype, "cpu") for way in ("eager", "together", "alone")}
        runners = {way: cpu_decode(model, caches[way], torch.device("cpu")) for way in ("together", "alone")}
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        with torch.inference_mode():
            start = 0
            for piece in pieces:
                prompt, tokens = BatchLayout.build([piece]), ids[start : start + piece.length]
                want = model(tokens, prompt, caches["eager"]).float()
                for way, runner in runners.items():
                    assert runner is not None
                    got = runner.run(prompt, tokens).float()
                    assert (got - want).abs().max() / want.abs().max() < tol, (way, piece)
                start += piece.length
            lengths = [50, 37, 64, 20]
            step = BatchLayout.build([Segment(slot, n, 1) for slot, n in enumerate(lengths)])
            tokens = ids[start:]
            one_step, one_each = runners["together"], runners["alone"]
            assert one_step is not None and one_each is not None
            together = one_step.run(step, tokens)
            alone = torch.cat([one_each.run(BatchLayout.build([Segment(slot, n, 1)]), tokens[slot : slot + 1])
                               for slot, n in enumerate(lengths)])  # fmt: skip
            eager = model(tokens, step, caches["eager"]).float()
    finally:
        ext.set_attend_segment(before)  # type: ignore[attr-defined]
        torch.set_num_threads(threads)
    assert torch.equal(together, alone) and torch.equal(caches["together"].data, caches["alone"].data)
    assert (together.float() - eager).abs().max() / eager.abs().max() < tol


@pytest.mark.parametrize("rows,n,k", [(1, 17, 40), (3, 64, 576), (2, 9, 5), (8, 33, 1536)])
def test_rows_linear_multiplies_row_major_weights_and_column_slices(rows: int, n: int, k: int) -> None:
    """The streamed products' kernel: weights as the checkpoint lays them out (rows of a few, K not a multiple of 16 or
    32), and a column slice of longer rows (a row-parallel rank's share of a mapped tensor)."""
    g = torch.Generator().manual_seed(n * k)
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k + 7, generator=g), torch.randn(n, generator=g)
    for weight in (w[:, :k].contiguous(), w[:, 7:]):
        want = x.double() @ weight.double().T + b.double()
        # float32 sums of k products: the error scales with the sum of the products' magnitudes, not with the result
        # (a sum of 1536 terms that cancels to near 0 carried 1.5e-5 of rounding on an AVX-512 host's AVX2 build)
        scale = x.double().abs() @ weight.double().abs().T + b.double().abs() + 1
        got = cpu_kernels.rows_linear(x, weight, b)
        assert got.shape == (rows, n) and ((got.double() - want).abs() / scale).max() < 1e-6


def _rows_with_ties_nans_and_infinities() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    rows = [torch.randn(n, generator=g) for n in (1, 5, 16, 37, 49152)]
    tied = torch.randn(37, generator=g)
    tied[[3, 20, 36]] = 9.0  # the first of equal largest values
    late_tie = torch.randn(40, generator=g)
    late_tie[[35, 39]] = 9.0  # both in the tail past the last full 16
    nan_late = torch.randn(50, generator=g)
    nan_late[[7, 44]] = float("nan")  # the first NaN, as torch.argmax has it
    nan_tail = torch.randn(35, generator=g)
    nan_tail[33] = float("nan")
    infinite = torch.randn(33, generator=g)
    infinite[[2, 30]] = float("inf")
    return [*rows, tied, late_tie, nan_late, nan_tail, infinite, torch.full((20,), float("-inf"))]


@pytest.mark.parametrize("row", _rows_with_ties_nans_and_infinities(), ids=lambda r: f"n{r.numel()}")
def test_greedy_rows_pick_what_torch_picks_with_its_log_probabilities(row: torch.Tensor) -> None:
    x = torch.stack([row, row.flip(0), torch.zeros_like(row), 30 * row - 7])
    ids, top, logsum = cpu_kernels.greedy_rows(x)
    assert ids.tolist() == x.argmax(-1).tolist()
    assert torch.equal(top, x.gather(1, ids[:, None])[:, 0]) or top.isnan().any()
    want = torch.log_softmax(x.double(), -1).float()  # every entry's, from the two numbers per row
    got = (x - top[:, None]) - logsum[:, None]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=2e-6, equal_nan=True)
    chosen = torch.tensor(sampling.greedy(x)[1])  # the argmax's, as sampling reports it from these numbers
    torch.testing.assert_close(chosen, want.gather(1, ids[:, None])[:, 0], rtol=1e-6, atol=2e-6, equal_nan=True)


def test_sampling_takes_the_compiled_greedy_rows_once_the_kernels_are_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu_kernels.module()
    calls, compiled = [], cpu_kernels.greedy_rows
    monkeypatch.setattr(cpu_kernels, "greedy_rows", lambda x: calls.append(x.dtype) or compiled(x))
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(6)) * 5
    ids, logprobs, norm = sampling.greedy(logits)
    assert calls == [torch.float32]
    assert ids == logits.argmax(-1).tolist()
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None])[:, 0]
    assert logprobs == pytest.approx(want.tolist(), abs=1e-5)
    monkeypatch.setattr(cpu_kernels, "loaded", lambda: False)  # a process without them: torch's ops, same answers
    fallback = sampling.greedy(logits)
    assert fallback[0] == ids and fallback[1] == pytest.approx(logprobs, abs=1e-5)
    every = norm.log_probs(logits, [0, 1, 2])
    assert torch.allclose(fallback[2].log_probs(logits, [0, 1, 2]), every, atol=1e-5)
    assert torch.allclose(every, torch.log_softmax(logits, -1), atol=1e-5)
    assert calls == [torch.float32]


def test_the_isa_builds_are_named_by_their_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """SHARDMESH_CPU_ISA=avx2 compiles without AVX-512 and AMX, =avx512 without AVX512-BF16 and AMX, each under a name
    of its own (so the builds are cached side by side); a value that names no build is refused by `isa_kernel` and
    ignored, with a warning, from the environment."""
    native, avx512, avx2 = (cpu_kernels.isa_kernel(isa) for isa in ("native", "avx512", "avx2"))
    assert "-mno-avx512f" in avx2.cflags and "-mno-amx-tile" in avx2.cflags and "-mno-avx512f" not in native.cflags
    assert "-mno-avx512bf16" in avx512.cflags and "-mno-amx-bf16" in avx512.cflags
    assert "-mno-avx512f" not in avx512.cflags and "-mno-avx512bf16" not in native.cflags
    assert len({native.name, avx512.name, avx2.name}) == 3 and cpu_kernels.isa_kernel("avx2") is avx2
    with pytest.raises(ValueError, match="SHARDMESH_CPU_ISA='avx9': expected one of native, avx512, avx2"):
        cpu_kernels.isa_kernel("avx9")
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx9")
    assert cpu_kernels._isa_from_env() == "native"
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx2")
    assert cpu_kernels._isa_from_env() == "avx2"
