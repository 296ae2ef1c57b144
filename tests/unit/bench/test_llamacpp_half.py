"""Tests for the BF16/F16 GGUF that bench/llamacpp.py gives llama.cpp for the mesh's bfloat16/float16 runs.

The like-for-like baseline must hold the weights the mesh serves with `--dtype bfloat16`: the float32 checkpoint
rounded by torch's `.to(torch.bfloat16)` (round to nearest, ties to even). So every 2-D tensor of the file must
be BF16 with exactly torch's bits, the 1-D norms float32 as stored (what llama.cpp's own converter writes), and
the metadata the F32 file's, except `general.file_type`. Tested on a tiny llama GGUF whose values include exact
ties, where truncating or rounding ties away from zero would give other bits.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, LlamaFileType
from gguf.quants import quantize
from safetensors.numpy import save_file

from bench.llamacpp import check_weights, half_gguf, write_f32_gguf, write_half_gguf
from shardmesh.models.gguf_weights import hf_tensor_name, unpermute_rope_rows

HEADS, KV_HEADS = 4, 2
# name -> numpy shape: llama's own names, so check_weights can map them to the converted model's.
SHAPES = {
    "token_embd.weight": (48, 64),
    "blk.0.attn_norm.weight": (64,),
    "blk.0.attn_q.weight": (64, 64),
    "blk.0.attn_k.weight": (32, 64),
}
# float32 bit patterns halfway between two bfloat16 values (low 16 bits 0x8000), with an even and an odd upper
# half, and just either side of halfway: ties go to the even neighbour, the rest to the nearer one.
TIES = np.array([0x3F808000, 0x3F818000, 0xBF818000, 0x3F807FFF, 0x3F808001, 0x7F7F8000, 0x00018000, 0x4049_0FDB],
                dtype=np.uint32).view(np.float32)  # fmt: skip


def _values() -> dict[str, np.ndarray]:
    """Random float32 weights, the q projection's first row holding `TIES`."""
    rng = np.random.default_rng(1)
    values = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}
    values["blk.0.attn_q.weight"][0, : len(TIES)] = TIES
    return values


def _build_f32(path: Path, values: dict[str, np.ndarray]) -> None:
    """A tiny F32 llama GGUF (what `f32_gguf` writes) holding ``values``."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_uint32("llama.attention.head_count", HEADS)
    writer.add_uint32("llama.attention.head_count_kv", KV_HEADS)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    writer.add_file_type(LlamaFileType.ALL_F32)
    for name, v in values.items():
        writer.add_tensor(name, v)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _torch_bits(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    return torch.from_numpy(values).to(dtype).view(torch.int16).numpy().view(np.uint16)


@pytest.fixture
def f32_file(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    values = _values()
    path = tmp_path / "model-f32.gguf"
    _build_f32(path, values)
    return path, values


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # float16 of 3.4e38: inf
@pytest.mark.parametrize(("dtype", "ggml", "file_type", "torch_dtype"), [
    ("bfloat16", Q.BF16, LlamaFileType.MOSTLY_BF16, torch.bfloat16),
    ("float16", Q.F16, LlamaFileType.MOSTLY_F16, torch.float16),
])  # fmt: skip
def test_2d_tensors_are_torch_rounded_and_norms_stay_f32(f32_file: tuple[Path, dict], tmp_path: Path, dtype: str,
                                                         ggml: Q, file_type: LlamaFileType,
                                                         torch_dtype: torch.dtype) -> None:  # fmt: skip
    path, values = f32_file
    write_half_gguf(path, tmp_path / "out.gguf", dtype)
    out = GGUFReader(str(tmp_path / "out.gguf"))
    assert out.fields["general.file_type"].contents() == file_type
    assert [t.name for t in out.tensors] == list(SHAPES)
    for t in out.tensors:
        want = values[t.name]
        assert t.shape.tolist() == list(reversed(want.shape))  # ggml order
        assert t.data_offset % out.alignment == 0
        bits = np.ascontiguousarray(t.data)
        if want.ndim == 1:
            assert t.tensor_type == Q.F32
            assert np.array_equal(bits.view(np.uint32), want.view(np.uint32)), t.name
        else:
            assert t.tensor_type == ggml
            assert np.array_equal(bits.view(np.uint16), _torch_bits(want, torch_dtype)), t.name


def test_ties_round_to_even_as_torch_does(f32_file: tuple[Path, dict], tmp_path: Path) -> None:
    path, _ = f32_file
    write_half_gguf(path, tmp_path / "out.gguf", "bfloat16")
    q = next(t for t in GGUFReader(str(tmp_path / "out.gguf")).tensors if t.name == "blk.0.attn_q.weight")
    first = np.ascontiguousarray(q.data).view(np.uint16)[0, : len(TIES)]
    # 0x3F80|8000 -> 0x3F80 (even, down); 0x3F81|8000 -> 0x3F82 (odd, up); below/above halfway -> nearer.
    assert first.tolist()[:6] == [0x3F80, 0x3F82, 0xBF82, 0x3F80, 0x3F81, 0x7F80]


def test_metadata_is_the_f32_files_but_the_file_type(f32_file: tuple[Path, dict], tmp_path: Path) -> None:
    path, _ = f32_file
    write_half_gguf(path, tmp_path / "out.gguf", "bfloat16")
    src, out = GGUFReader(str(path)), GGUFReader(str(tmp_path / "out.gguf"))
    keys = [k for k in src.fields if not k.startswith("GGUF.")]
    assert [k for k in out.fields if not k.startswith("GGUF.")] == keys
    for k in keys:
        if k != "general.file_type":
            assert [out.fields[k].parts[i].tobytes() for i in out.fields[k].data] == \
                   [src.fields[k].parts[i].tobytes() for i in src.fields[k].data], k  # fmt: skip


def test_float32_is_refused_by_name(f32_file: tuple[Path, dict], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="write_f32_gguf"):
        write_half_gguf(f32_file[0], tmp_path / "out.gguf", "float32")
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16, got 'int8'"):
        write_half_gguf(f32_file[0], tmp_path / "out.gguf", "int8")


def test_half_gguf_is_written_once_beside_its_source(f32_file: tuple[Path, dict], tmp_path: Path) -> None:
    path, _ = f32_file
    out = tmp_path / "cache" / "model-bf16.gguf"
    assert half_gguf("bfloat16", out, source=path) == out
    stamp = out.stat().st_mtime_ns
    assert half_gguf("bfloat16", out, source=tmp_path / "missing.gguf") == out  # reused: the source is not read
    assert out.stat().st_mtime_ns == stamp
    assert [p.name for p in out.parent.iterdir()] == ["model-bf16.gguf"]


def _converted_model(tmp_path: Path, values: dict[str, np.ndarray]) -> Path:
    """The converted safetensors those GGUF tensors stand for: HF names, q/k rows in transformers' order."""
    heads = {"attn_q": HEADS, "attn_k": KV_HEADS}
    tensors = {}
    for name, v in values.items():
        kind = name.split(".")[-2]
        tensors[hf_tensor_name(name)] = np.ascontiguousarray(unpermute_rope_rows(v, heads[kind]) if kind in heads
                                                             else v)  # fmt: skip
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    save_file(tensors, str(model_dir / "model.safetensors"))
    return model_dir


def test_check_weights_accepts_torch_rounding_only(f32_file: tuple[Path, dict], tmp_path: Path) -> None:
    path, values = f32_file
    model_dir = _converted_model(tmp_path, values)
    write_half_gguf(path, tmp_path / "bf16.gguf", "bfloat16")
    parameters = sum(v.size for v in values.values())
    assert check_weights(tmp_path / "bf16.gguf", model_dir, "bfloat16") == {"tensors": 4, "parameters": parameters}
    assert check_weights(path, model_dir) == {"tensors": 4, "parameters": parameters}

    # A file whose 2-D tensors were truncated to bfloat16 (not rounded) holds other bits at the ties.
    truncated = {k: v if v.ndim == 1 else (v.view(np.uint32) & 0xFFFF0000).view(np.float32) for k, v in values.items()}
    _build_f32(tmp_path / "trunc-f32.gguf", truncated)
    write_half_gguf(tmp_path / "trunc-f32.gguf", tmp_path / "trunc.gguf", "bfloat16")
    with pytest.raises(AssertionError, match=re.escape("model.layers.0.self_attn.q_proj.weight")):
        check_weights(tmp_path / "trunc.gguf", model_dir, "bfloat16")

    # An F32 file is not a bfloat16 one, whatever its values.
    with pytest.raises(ValueError, match=re.escape("token_embd.weight is F32, not BF16 (a bfloat16 file)")):
        check_weights(path, model_dir, "bfloat16")


def test_bf16_of_a_q8_0_source_equals_bf16_of_its_f32(tmp_path: Path) -> None:
    """The file is the same whether written from the F32 GGUF or straight from a quantized source."""
    values = _values()
    values["blk.0.attn_q.weight"][0, : len(TIES)] = 0.5  # Q8_0 cannot scale a row holding 3.4e38
    writer = gguf.GGUFWriter(str(tmp_path / "q8.gguf"), arch="llama")
    for name, v in values.items():
        writer.add_tensor(name, quantize(v, Q.Q8_0), raw_dtype=Q.Q8_0) if v.ndim == 2 else writer.add_tensor(name, v)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    write_f32_gguf(tmp_path / "q8.gguf", tmp_path / "f32.gguf")
    write_half_gguf(tmp_path / "f32.gguf", tmp_path / "a.gguf")
    write_half_gguf(tmp_path / "q8.gguf", tmp_path / "b.gguf")
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
