"""Model configuration: the subset of a Hugging Face ``config.json`` the Llama family needs.

Parsed once, validated once, then passed down as a frozen dataclass. Anything we do not implement
is refused here with an error that names the field, rather than silently producing wrong numbers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Architectures that share the Llama block: pre-norm RMSNorm, rotary attention, SwiGLU MLP.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


class ConfigError(ValueError):
    """A config.json we cannot serve; the message names the offending field."""

    def __init__(self, field_name: str, message: str, source: str = "config.json") -> None:
        super().__init__(f"{source}: field '{field_name}': {message}")
        self.field_name = field_name


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style frequency scaling (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q, k, v projections
    o_proj_bias: bool  # Llama's `attention_bias` also covers o_proj; Qwen2's bias does not
    mlp_bias: bool
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def max_context(self) -> int:
        return self.max_position_embeddings

    def check_fits(self, prompt_tokens: int, max_new_tokens: int, name: str = "max_new_tokens") -> None:
        """Raises ValueError led by `name` (the field or flag the caller took `max_new_tokens` from) when a prompt and
        its longest answer exceed `max_context`."""
        if prompt_tokens + max_new_tokens > self.max_context:
            raise ValueError(f"{name}: prompt ({prompt_tokens}) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"the model context of {self.max_context} tokens")  # fmt: skip

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no config.json in model directory {model_dir}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a JSON object at the top level")
        return cls.from_hf(raw, source=str(path))

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        return _parse(raw, source)

    def to_hf(self) -> dict[str, Any]:
        """A minimal HF config dict, used by tests and by `shardmesh plan` on configs alone."""
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": SUPPORTED_ARCHITECTURES[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        return out


def _get(raw: dict[str, Any], name: str, kind: type, source: str, default: Any = ...) -> Any:
    if name not in raw or raw[name] is None:
        if default is ...:
            raise ConfigError(name, "is required", source)
        return default
    value = raw[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
        raise ConfigError(name, f"expected {kind.__name__}, got {type(value).__name__} {value!r}", source)
    return value


def _positive(raw: dict[str, Any], name: str, source: str, default: Any = ...) -> int:
    value = _get(raw, name, int, source, default)
    if value <= 0:
        raise ConfigError(name, f"must be a positive integer, got {value}", source)
    return value


def _architecture(raw: dict[str, Any], source: str) -> str:
    archs = raw.get("architectures")
    if archs is None:
        model_type = raw.get("model_type")
        by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
        if model_type in by_type:
            return by_type[model_type]
        raise ConfigError("architectures", "missing, and 'model_type' does not name a supported family", source)
    if not isinstance(archs, list) or len(archs) != 1:
        raise ConfigError("architectures", f"expected a list with one entry, got {archs!r}", source)
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            "architectures",
            f"{archs[0]!r} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}",
            source,
        )
    return archs[0]


def _rope(raw: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """Rope parameters live in `rope_scaling` + `rope_theta` (HF <5) or `rope_parameters` (HF 5)."""
    params = raw.get("rope_parameters")
    key = "rope_parameters"
    if params is None:
        params = raw.get("rope_scaling")
        key = "rope_scaling"
    theta = raw.get("rope_theta")
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        theta = params["rope_theta"]
    if theta is None:
        theta = 10000.0
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ConfigError("rope_theta", f"must be a positive number, got {theta!r}", source)
    if params is None:
        return float(theta), None
    if not isinstance(params, dict):
        raise ConfigError(key, f"expected an object, got {params!r}", source)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ConfigError(f"{key}.rope_type", f"{rope_type!r} is not supported; supported: default, llama3", source)
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ConfigError(f"{key}.{e.args[0]}", "is required for rope_type llama3", source) from None
    except (TypeError, ValueError) as e:
        raise ConfigError(key, f"llama3 parameters must be numbers: {e}", source) from None
    return float(theta), scaling


def _eos_ids(raw: dict[str, Any], source: str) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    if isinstance(eos, int) and not isinstance(eos, bool):
        return (eos,)
    if isinstance(eos, list) and all(isinstance(e, int) for e in eos):
        return tuple(eos)
    raise ConfigError("eos_token_id", f"expected an int or a list of ints, got {eos!r}", source)


def _parse(raw: dict[str, Any], source: str) -> ModelConfig:
    arch = _architecture(raw, source)
    family = SUPPORTED_ARCHITECTURES[arch]
    hidden = _positive(raw, "hidden_size", source)
    heads = _positive(raw, "num_attention_heads", source)
    kv_heads = _positive(raw, "num_key_value_heads", source, default=heads)
    if heads % kv_heads:
        raise ConfigError("num_key_value_heads", f"{kv_heads} does not divide num_attention_heads={heads}", source)
    head_dim = raw.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ConfigError("hidden_size", f"{hidden} is not divisible by num_attention_heads={heads}", source)
        head_dim = hidden // heads
    head_dim = _positive({"head_dim": head_dim}, "head_dim", source)
    if head_dim % 2:
        raise ConfigError("head_dim", f"rotary embeddings need an even head_dim, got {head_dim}", source)

    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError("hidden_act", f"{act!r} is not supported; the Llama family uses 'silu'", source)
    if raw.get("pretraining_tp", 1) not in (1, None):
        raise ConfigError("pretraining_tp", "only 1 is supported (it changes the numerics of linear layers)", source)
    if family == "qwen2" and raw.get("use_sliding_window"):
        raise ConfigError("use_sliding_window", "sliding-window attention is not supported", source)

    max_pos = _positive(raw, "max_position_embeddings", source, default=2048)
    if family == "mistral" and raw.get("sliding_window") is not None:
        # Mistral's window only matters past its length; serving a context no longer than the
        # window keeps full attention exact, so we cap the context instead of masking.
        window = _positive(raw, "sliding_window", source)
        max_pos = min(max_pos, window)

    theta, scaling = _rope(raw, source)
    eps = _get(raw, "rms_norm_eps", float, source, default=1e-6)
    if not (0 < eps < 1) or math.isnan(eps):
        raise ConfigError("rms_norm_eps", f"must be in (0, 1), got {eps}", source)

    if family == "qwen2":
        qkv_bias, o_bias = True, False  # Qwen2 always has q/k/v bias and never an o_proj bias
    else:
        qkv_bias = bool(_get(raw, "attention_bias", bool, source, default=False))
        o_bias = qkv_bias
    bos = raw.get("bos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=_positive(raw, "vocab_size", source),
        hidden_size=hidden,
        intermediate_size=_positive(raw, "intermediate_size", source),
        num_layers=_positive(raw, "num_hidden_layers", source),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=eps,
        rope_theta=theta,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(_get(raw, "tie_word_embeddings", bool, source, default=False)),
        attention_bias=qkv_bias,
        o_proj_bias=o_bias,
        mlp_bias=bool(_get(raw, "mlp_bias", bool, source, default=False)),
        rope_scaling=scaling,
        bos_token_id=bos if isinstance(bos, int) else None,
        eos_token_ids=_eos_ids(raw, source),
    )
