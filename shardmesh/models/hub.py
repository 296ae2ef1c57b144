"""Models named by their Hugging Face id, `ORG/NAME` or `ORG/NAME@REVISION`, fetched through `huggingface_hub`.

The files stay in the hub's own cache, shared with `transformers` and every other tool, and the directory a name
resolves to is the cached snapshot itself (`<cache>/models--ORG--NAME/snapshots/<commit>/`), so nothing is
copied. Only what the mesh reads is fetched: `config.json`, `generation_config.json`, the tokenizer files and
the safetensors weights the checkpoint names (`model.safetensors`, or the files `model.safetensors.index.json`
lists). Never pickles (`*.bin`, `*.pt`), nor a second copy of the weights under another name (Mistral's repos
also hold a `consolidated.safetensors`).

With a network the revision is looked up on the Hub and whatever is missing is downloaded; without one, or
with `HF_HUB_OFFLINE=1`, the cache alone answers. The settings are the hub's own variables (`HF_HUB_CACHE`,
`HF_HOME`, `HF_HUB_OFFLINE`, `HF_ENDPOINT`, `HF_TOKEN`), read when a model is resolved rather than when
`huggingface_hub` is imported, and `huggingface_hub` itself is imported only then.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DEFAULT_REVISION = "main"
REPO_FOLDER_PREFIX = "models--"  # the hub cache's folder of a model repo: models--ORG--NAME
# What the mesh reads besides the weights (the checkpoint's index is among them, so the weights can follow it).
METADATA_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")  # fmt: skip
SINGLE_WEIGHTS = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# The weights as `save_pretrained` names them: one file, or shards its index lists (rarely named otherwise: those
# are fetched by name once the index is read).
WEIGHT_PATTERNS = (SINGLE_WEIGHTS, "model-*-of-*.safetensors")
# One part of a repo id, as the Hub validates it: word characters, '-' and '.', starting and ending with a word
# character, at most 96; '--' and '..' are refused (the cache's folder names use '--' as the separator).
_PART = re.compile(r"\w(?:[\w.-]{0,94}\w)?")
_TRUE = ("1", "ON", "YES", "TRUE")
# What every command's `--model` and `--revision` (and a manifest's `model.path` and `model.revision`) take: the
# one wording of `registry.resolve`, kept here because building a command's parser must stay cheap.
MODEL_HELP = ("a built-in model name (smollm2-135m-instruct), a model directory, or a Hugging Face id "
              "ORG/NAME[@REV] (read from the hub cache, fetched first when a network is there)")  # fmt: skip
REVISION_HELP = ("the revision of a Hugging Face --model: a branch, tag or commit (default main); the same as "
                 "ORG/NAME@REV")  # fmt: skip


class HubError(ValueError):
    """A Hugging Face id that cannot be served: not cached and no network, no such repo or revision, gated, or
    not a safetensors model. The message names the id, the revision and the cache directory."""


def is_repo_id(name: str) -> bool:
    """`ORG/NAME` as the Hub spells a model id (a name alone, like `gpt2`, is not taken: it would shadow typos of
    known names and relative paths)."""
    parts = name.split("/")
    return (len(parts) == 2 and all(_PART.fullmatch(p) for p in parts) and "--" not in name and ".." not in name
            and not name.endswith(".git"))  # fmt: skip


def split_revision(name: str) -> tuple[str, str | None]:
    """`ORG/NAME@REVISION` -> (`ORG/NAME`, `REVISION`); no `@`: (`name`, None). A repo id cannot contain `@`,
    while a revision may contain `/` (`refs/pr/1`), so the first `@` splits."""
    repo_id, at, revision = name.partition("@")
    return (repo_id, revision) if at else (name, None)


@dataclass(frozen=True)
class HubSettings:
    """Where the hub cache is and whether the network may be used: the hub's variables, read now."""

    cache_dir: Path
    offline: bool
    endpoint: str | None = None  # None: huggingface.co

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> HubSettings:
        """`HF_HUB_CACHE`, else `HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub` (`~/.cache/...`), as
        `huggingface_hub` computes it; offline when `HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) is true."""
        if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
            cache = env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]
        else:
            xdg = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
            cache = os.path.join(env.get("HF_HOME") or os.path.join(xdg, "huggingface"), "hub")
        offline = (env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or "").strip().upper() in _TRUE
        return cls(Path(os.path.expandvars(cache)).expanduser(), offline, env.get("HF_ENDPOINT") or None)


def model_name(path: str | Path) -> str:
    """The name a user would give for a resolved model directory: `ORG/NAME` for a snapshot in a hub cache,
    else the directory's own name (a known model's cache directory is named after it)."""
    p = Path(path)
    repo = p.parent.parent.name
    if p.parent.name == "snapshots" and repo.startswith(REPO_FOLDER_PREFIX):
        return repo[len(REPO_FOLDER_PREFIX) :].replace("--", "/")
    return p.name


def fetch(repo_id: str, revision: str | None = None, settings: HubSettings | None = None) -> Path:
    """The snapshot directory of model `repo_id` at `revision` (default `main`) in the hub cache, with the files
    the mesh reads; downloaded first when the network may be used, else read from the cache alone."""
    s = settings if settings is not None else HubSettings.from_env()
    revision = revision or DEFAULT_REVISION
    what = f"Hugging Face model {repo_id!r} (revision {revision!r})"
    snapshot = _snapshot(repo_id, revision, [*METADATA_FILES, *WEIGHT_PATTERNS], s, what)
    if not (snapshot / "config.json").is_file():
        raise HubError(f"{what}: no config.json in {snapshot}: not a transformers model, or only partly cached")
    weights = _weight_files(snapshot, what)
    missing = [f for f in weights if not (snapshot / f).is_file()]
    if missing and not s.offline:  # an index naming files outside the usual pattern: fetch exactly those
        _snapshot(repo_id, snapshot.name, missing, s, what)  # by commit: the snapshot found above
        missing = [f for f in weights if not (snapshot / f).is_file()]
    if missing:
        listed = ", ".join(missing[:3]) + (" ..." if len(missing) > 3 else "")
        raise HubError(f"{what}: {listed} missing from {snapshot} (the copy in the cache {s.cache_dir} is "
                       f"incomplete; run once with network access)")  # fmt: skip
    return snapshot


def _weight_files(snapshot: Path, what: str) -> list[str]:
    """The safetensors files the checkpoint reads: those its index maps, else `model.safetensors`."""
    import json

    index = snapshot / INDEX_FILE
    if not index.is_file():
        return [SINGLE_WEIGHTS]
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise HubError(f"{what}: {index} is not a safetensors index ({type(e).__name__}: {e})") from None
    bad = [f for f in files if not isinstance(f, str) or not f.endswith(".safetensors") or ".." in f.split("/")]
    if bad:
        raise HubError(f"{what}: {index} maps tensors to {bad[:3]}: only safetensors files are read")
    return files


def _snapshot(repo_id: str, revision: str, files: list[str], s: HubSettings, what: str) -> Path:
    """`snapshot_download` limited to `files`, its failures turned into one line that says what to do."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"the cache {s.cache_dir}"
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=s.cache_dir, local_files_only=s.offline,
                                      allow_patterns=files, endpoint=s.endpoint))  # fmt: skip
    except IncompleteSnapshotError as e:
        raise HubError(f"{what}: the copy in {where} is incomplete and cannot be completed now ({e})") from None
    except LocalEntryNotFoundError as e:
        why = ("HF_HUB_OFFLINE is set" if s.offline else
               f"the Hub could not be reached ({_cause(e)})")  # fmt: skip
        raise HubError(f"{what} is not in {where}, and {why}: run once with network access to fetch it, or point "
                       f"HF_HOME (or HF_HUB_CACHE) at a cache that holds it") from None  # fmt: skip
    except GatedRepoError:
        raise HubError(f"{what} is gated: accept its terms at https://huggingface.co/{repo_id}, then set HF_TOKEN "
                       f"(or run `hf auth login`); it is not in {where} either") from None  # fmt: skip
    except RepositoryNotFoundError:
        raise HubError(f"{what} was not found on the Hub (a private model needs HF_TOKEN), nor in {where}") from None
    except RevisionNotFoundError:
        raise HubError(f"{what}: the Hub has no revision {revision!r} of {repo_id!r} (a branch, tag or commit); "
                       f"nor has {where}") from None  # fmt: skip
    except HfHubHTTPError as e:
        raise HubError(f"{what}: the Hub refused ({_cause(e)}), and the model is not in {where}") from None
    except HFValidationError as e:
        raise HubError(f"{what}: {e}") from None


def _cause(e: BaseException) -> str:
    """The first line of the underlying error, for a one-line message."""
    cause = e.__cause__ or e
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0]}" if text else type(cause).__name__
