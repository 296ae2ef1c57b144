"""Tests for the F32 GGUF that bench/llamacpp.py gives llama.cpp (no llama-cpp-python needed).

The llama.cpp baseline must run the float32 weights the mesh serves. So every tensor of the F32 file must
equal, bit for bit, gguf's dequantization of the source tensor, under the same name and shape. llama.cpp
must also find every metadata value it reads from the source (architecture, hyper-parameters, tokenizer,
chat template), byte for byte. Writing the real 538 MB file takes close to a minute on a busy machine, so
tensors are tested on a small GGUF built here with real Q4_1/Q8_0/F16 encodings, and the real model's
metadata (49152-token vocabulary, merges, chat template) is copied on its own.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, LlamaFileType
from gguf.quants import dequantize, quantize

from bench import llamacpp
from bench.llamacpp import copy_metadata, f32_gguf, write_f32_gguf
from shardmesh.models.cache import locate_gguf
from shardmesh.models.registry import DEFAULT_MODEL, REGISTRY

# name -> (numpy shape, stored type). Rows of Q4_1/Q8_0 are multiples of their 32-value block.
TENSORS = {
    "token_embd.weight": ((48, 64), Q.Q8_0),
    "blk.0.attn_norm.weight": ((64,), Q.F32),
    "blk.0.attn_q.weight": ((64, 64), Q.Q4_1),
    "blk.0.ffn_up.weight": ((96, 64), Q.F16),
    "blk.0.odd.weight": ((2, 3, 32), Q.F32),  # 3-D: ggml lists dimensions in the reverse order
}


def _build_source(path: Path, alignment: int | None) -> dict[str, np.ndarray]:
    """A small llama-architecture GGUF with quantized tensors and metadata of every kind; returns the
    float32 values the tensors were made from."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch="llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_name("tiny ünïcode model")
    writer.add_uint32("llama.block_count", 1)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float64("test.f64", 1 / 3)
    writer.add_int8("test.i8", -5)
    writer.add_uint64("test.u64", 2**40 + 3)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_key_value("tokenizer.ggml.tokens", ["<|im_start|>", "Ġthe", "é", "日本"], GGUFValueType.ARRAY,
                         sub_type=GGUFValueType.STRING)  # fmt: skip
    writer.add_key_value("tokenizer.ggml.token_type", [3, 1, 1, 1], GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
    writer.add_key_value("tokenizer.ggml.scores", [0.0, -1.5, -2.25, -1e-7], GGUFValueType.ARRAY,
                         sub_type=GGUFValueType.FLOAT32)  # fmt: skip
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}")
    writer.add_file_type(LlamaFileType.MOSTLY_Q4_1)
    originals = {}
    for name, (shape, qtype) in TENSORS.items():
        values = rng.standard_normal(shape).astype(np.float32)
        originals[name] = values
        if qtype == Q.F32:
            writer.add_tensor(name, values)
        elif qtype == Q.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return originals


def _user_fields(reader: GGUFReader) -> dict[str, tuple[list[GGUFValueType], list[bytes]]]:
    """key -> (value types, raw bytes of each value part), leaving out the reader's GGUF.* header view."""
    return {
        name: (list(field.types), [field.parts[i].tobytes() for i in field.data])
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.")
    }


def _assert_same_metadata(source: GGUFReader, written: GGUFReader) -> None:
    """Same keys in the same order, same types, same bytes; only general.file_type changes, to ALL_F32."""
    src, out = _user_fields(source), _user_fields(written)
    assert list(out) == list(src)
    for name in src:
        if name == "general.file_type":
            assert out[name][0] == src[name][0] == [GGUFValueType.UINT32]
            assert written.fields[name].contents() == LlamaFileType.ALL_F32
            assert source.fields[name].contents() != LlamaFileType.ALL_F32
        else:
            assert out[name] == src[name], name


@pytest.fixture(params=[None, 64], ids=["default-alignment", "alignment-64"])
def source(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path / "source.gguf"
    return path, _build_source(path, request.param)


def test_written_file_has_the_source_metadata(source: tuple[Path, dict], tmp_path: Path) -> None:
    path, _ = source
    write_f32_gguf(path, tmp_path / "out.gguf")
    src, out = GGUFReader(str(path)), GGUFReader(str(tmp_path / "out.gguf"))
    _assert_same_metadata(src, out)
    assert out.alignment == src.alignment
    assert out.fields["tokenizer.ggml.tokens"].contents() == ["<|im_start|>", "Ġthe", "é", "日本"]


def test_every_tensor_is_the_dequantized_source(source: tuple[Path, dict], tmp_path: Path) -> None:
    path, originals = source
    write_f32_gguf(path, tmp_path / "out.gguf")
    src, out = GGUFReader(str(path)), GGUFReader(str(tmp_path / "out.gguf"))
    assert [t.name for t in out.tensors] == list(TENSORS)
    assert [t.tensor_type for t in src.tensors] == [qtype for _, qtype in TENSORS.values()]
    for s, o in zip(src.tensors, out.tensors, strict=True):
        shape, qtype = TENSORS[s.name]
        assert o.tensor_type == Q.F32
        assert o.shape.tolist() == s.shape.tolist() == list(reversed(shape))  # ggml order, as the source says
        assert o.data_offset % out.alignment == 0
        values = np.asarray(o.data)
        assert values.dtype == np.float32 and values.shape == shape
        expected = dequantize(s.data, s.tensor_type)
        assert np.array_equal(values.view(np.uint32), expected.view(np.uint32)), s.name  # bit for bit
        # And those are the weights the source was made from, to quantization error (Q4_1 is coarsest).
        tol = {Q.F32: 0.0, Q.F16: 2e-3, Q.Q8_0: 0.03, Q.Q4_1: 0.5}[qtype]
        assert np.abs(values - originals[s.name]).max() <= tol, s.name


def test_f32_gguf_reuses_an_existing_file(source: tuple[Path, dict], tmp_path: Path) -> None:
    path, _ = source
    out = tmp_path / "cache" / "model-f32.gguf"
    assert f32_gguf(out, source=path) == out
    stamp = out.stat().st_mtime_ns
    # A second call must not read the source at all: a missing one proves it.
    assert f32_gguf(out, source=tmp_path / "missing.gguf") == out
    assert out.stat().st_mtime_ns == stamp
    assert [p.name for p in out.parent.iterdir()] == ["model-f32.gguf"]  # no temporary file left


def test_f32_gguf_leaves_no_partial_file(source: tuple[Path, dict], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    path, _ = source
    calls = []

    def failing(data: np.ndarray, qtype: Q) -> np.ndarray:
        calls.append(qtype)
        if len(calls) == 3:  # fail mid-file, after some tensor data is written
            raise RuntimeError("disk full")
        return dequantize(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", failing)
    out = tmp_path / "cache" / "model-f32.gguf"
    with pytest.raises(RuntimeError, match="disk full"):
        f32_gguf(out, source=path)
    assert list(out.parent.iterdir()) == []  # neither the file nor its temporary name


def test_real_model_metadata_copies_exactly(tmp_path: Path) -> None:
    """SmolLM2's own metadata: 49152 tokens and types, 48900 merges, chat template, special ids."""
    reader = GGUFReader(str(locate_gguf(REGISTRY[DEFAULT_MODEL], install=True, progress=False)))
    assert reader.fields["general.file_type"].contents() == LlamaFileType.MOSTLY_Q4_1
    writer = gguf.GGUFWriter(str(tmp_path / "meta.gguf"), arch=reader.fields["general.architecture"].contents())
    copy_metadata(reader, writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()  # no tensors: metadata only
    writer.close()
    written = GGUFReader(str(tmp_path / "meta.gguf"))
    _assert_same_metadata(reader, written)
    assert len(written.fields["tokenizer.ggml.tokens"].data) == 49152


def test_available_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` fail as if not installed
    assert llamacpp.available() == "llama-cpp-python is not installed: pip install '.[bench]'"
