"""C++ kernels compiled at first use, for the CPU they run on (`cpu_kernels`, `int8_cpu`, `paged_attention`,
`shm_collective`, `shm_link`).

Each is built with `torch.utils.cpp_extension.load_inline` under a name that carries a digest of its source, its
compiler flags, this CPU's flags, torch's version and where torch's headers are, so a machine with other flags or
another torch (or the same torch in another virtual environment) builds its own, and cached under
~/.cache/torch_extensions (or $TORCH_EXTENSIONS_DIR): 10-35 s per kernel on 2 cores the first time (compiled
against HEADERS, not <torch/extension.h>: see there), a fraction of a second after. A kernel that cannot be built
(no compiler, no ninja, a failed build) is None with the reason in `build_error`, and its module falls back to a
torch path.

Every function is bound so that it releases the GIL while it runs (`torch::wrap_pybind_function_no_gil`), as torch's
own operators do. A worker's compute thread spends nearly all of a step inside these calls. Holding the GIL there, the
process's other Python threads (gRPC's, the topology watch, the heartbeat) could not run for as long as a call took,
a long prompt's product included, and one that woke forced the compute thread to hand the GIL over between two calls.
Decode speed through meshes did not change measurably (docs/performance.md, "Inside the meshes").

A build holds a `lock` file in its directory, and torch waits for that file to go, without a timeout. A process
killed while building (SIGKILL, a container stopped during the first start) leaves the file behind, and every
later start would wait forever, silently. A lock older than any build takes is therefore removed, with a warning.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import time
from pathlib import Path
from typing import Any

import structlog
import torch

from shardmesh.engine.cpu_features import cpu_flags

# Every kernel is compiled and linked with OpenMP: `at::parallel_for` is a header template whose parallel region is
# compiled into the extension itself, and without -fopenmp it silently runs on one thread (all SmolLM2 products, one
# row, 2 cores: 25 ms instead of 16.5 ms). With it, the extension shares PyTorch's OpenMP runtime and threads.
# A tuple, and copied into every call: `load_inline` appends torch's own link flags to the lists it is given, so a
# shared list would grow with every kernel a process loads, and with it the next kernels' names (their digests), so
# each process would look for (and build) kernels under names that depend on what it happened to load first.
OPENMP = ("-fopenmp",)
log = structlog.get_logger()
# What every kernel is compiled against, in place of the <torch/extension.h> that `load_inline` would put first. That
# header brings torch's whole C++ frontend (modules, optimizers, data loaders, autograd's factories): ~400,000 lines
# after the preprocessor, and parsing them was most of every build (a one-line kernel took 35 s on 2 cores with it,
# 10 s with these). The kernels use tensors, their dtypes and dispatch, `at::parallel_for`, `empty(_like)` and pybind's
# casters.
HEADERS = r"""#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/Exceptions.h>
namespace torch { using namespace at; }  // torch::Tensor, torch::empty, torch::kFloat, as <torch/types.h> has them
"""
STALE_LOCK_S = 15 * 60  # a build takes under a minute on 2 cores; a lock this old was left by a dead process


class InlineKernel:
    """One C++ source with the functions it exports, built at first use (`module`)."""

    def __init__(self, prefix: str, source: str, functions: list[str], cflags: list[str]) -> None:
        self.prefix, self.source, self.functions, self.cflags = prefix, source, functions, cflags
        self.build_error = ""  # why it could not be built ("" when it was, or was not tried)
        self.ext: Any | None = None  # the extension, once `module` has built and loaded it

    @property
    def bound_source(self) -> str:
        """The source after HEADERS, with its Python bindings: each function releases the GIL while it runs (module
        docstring)."""
        defs = "".join(f'  m.def("{f}", torch::wrap_pybind_function_no_gil({f}), "{f}");\n' for f in self.functions)
        return f"{HEADERS}\n{self.source}\n\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{\n{defs}}}\n"

    @property
    def name(self) -> str:
        from torch.utils.cpp_extension import include_paths

        flags = " ".join(sorted(cpu_flags()))
        compiler = " ".join([*self.cflags, *OPENMP])
        # torch's headers where this environment has them: the build file names them, so a kernel built from another
        # virtual environment's torch is rebuilt, in place and without a word, by every process of this one (a fresh
        # clone's first `make run` spent two minutes so, and two environments on one machine rebuilt each other's).
        where = " ".join(include_paths())
        digest = hashlib.sha256((self.bound_source + compiler + flags + torch.__version__ + where).encode())
        return f"{self.prefix}_{digest.hexdigest()[:16]}"

    @functools.cache  # noqa: B019  (one instance per kernel module, alive as long as the process)
    def module(self) -> Any | None:
        """The built extension (building it now if it is not cached), or None."""
        try:
            from torch.utils import cpp_extension

            name = self.name
            build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
            _remove_stale_lock(build_dir / "lock")
            # A first build takes up to half a minute on 2 cores, inside a worker's load: say so, or it looks hung.
            building = not (build_dir / f"{name}.so").exists()
            if building:
                log.info("kernel_build_started", kernel=self.prefix, dir=str(build_dir),
                         note="once per CPU, torch and environment; 10-35 s on 2 cores")  # fmt: skip
            t0 = time.perf_counter()
            ext = cpp_extension.load_inline(name, cpp_sources=self.bound_source, extra_cflags=[*self.cflags, *OPENMP],
                                            extra_ldflags=list(OPENMP),
                                            **_lean_headers(cpp_extension.load_inline))  # fmt: skip
            if building:
                log.info("kernel_built", kernel=self.prefix, seconds=round(time.perf_counter() - t0, 1))
            self.ext = ext
            return ext
        except Exception as e:  # no compiler, no ninja, a failed build: the caller falls back
            message = str(e).strip()
            self.build_error = f"{type(e).__name__}: {message.splitlines()[-1] if message else ''}"
            log.warning("kernel_unavailable", kernel=self.prefix, error=self.build_error,
                        fallback="the torch path this kernel stands in for")  # fmt: skip
            return None


def _lean_headers(load_inline: Any) -> dict[str, bool]:
    """Keeps `load_inline` from putting <torch/extension.h> before HEADERS where it can (torch 2.6 on); an older torch
    compiles both, slower but alike."""
    return {"no_implicit_headers": True} if "no_implicit_headers" in inspect.signature(load_inline).parameters else {}


def _remove_stale_lock(lock: Path, now: float | None = None) -> bool:
    """Remove `lock` when it is older than STALE_LOCK_S (see the module docstring); whether it did."""
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_S:
        return False
    log.warning("stale_build_lock_removed", path=str(lock), age_s=round(age),
                reason="older than any build: the process that was building is gone")  # fmt: skip
    lock.unlink(missing_ok=True)
    return True
