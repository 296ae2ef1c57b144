"""Child processes that never outlive their parent.

Every process shardmesh starts for a local mesh asks the kernel to SIGTERM it when its parent dies
(Linux `PR_SET_PDEATHSIG`), and the parent stops all of them on exit, SIGINT or SIGTERM: whatever
happens to the launcher, no worker is left running.

The child makes that request itself, first thing at start-up (`die_with_parent_if_asked`), rather
than in a `preexec_fn`: a preexec hook forces a plain fork of a parent that may hold live gRPC
channels, and gRPC's fork handlers can then crash the child before it ever execs.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

from shardmesh.core.device_map import cores

_PR_SET_PDEATHSIG = 1


_PARENT_ENV = "SHARDMESH_DIE_WITH_PARENT"


def die_with_parent_if_asked() -> None:
    """In a child `spawn` started: be SIGTERMed when the parent dies; exit now if it already has."""
    parent = os.environ.pop(_PARENT_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):  # the parent died before we asked: nobody will stop us
        sys.exit(0)


def spawn(
    args: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    stdout: int | IO | None = None,
    stderr: int | IO | None = None,
) -> subprocess.Popen:
    """Start `python -m ...`-style children with the current interpreter, tied to this process.

    The child must call `die_with_parent_if_asked()` at start-up (shardmesh's entry points do).
    """
    env = {**(os.environ if env is None else env), _PARENT_ENV: str(os.getpid())}
    return subprocess.Popen([sys.executable, *args], env=env, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL)


def stop_all(procs: Sequence[subprocess.Popen], grace: float = 5.0) -> None:
    """SIGTERM everyone, wait up to `grace` seconds, then SIGKILL whoever is left."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait()


@contextlib.contextmanager
def terminate_on_signals() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt for the duration, so `finally:` blocks clean up children."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def threads_per_process(processes: int) -> int:
    """Split the machine's cores between processes that share it, so they do not oversubscribe."""
    return max(1, cores() // max(1, processes))
