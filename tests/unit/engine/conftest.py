"""Fixtures the engine tests share."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from shardmesh.engine import cpu_kernels
from shardmesh.engine.cpu_features import cpu_flags

# The kernels come in versions for AVX-512 with its bfloat16 instructions (and AMX), AVX-512 without them, AVX2 (and
# plain loops), and a host compiles only the widest it has: a test taking `isa` runs on every narrower build this CPU
# can run as well (SHARDMESH_CPU_ISA=avx512, avx2), so none goes untested.
_FLAGS = cpu_flags()
ISAS = ["native", *(["avx512"] if {"avx512_bf16", "amx_bf16"} & _FLAGS else []),
        *(["avx2"] if "avx512f" in _FLAGS else [])]  # fmt: skip


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The compiled kernels of one build, as this process's (`cpu_kernels._KERNEL`), for the test's duration."""
    kernel = cpu_kernels.isa_kernel(request.param)
    assert kernel.module() is not None, kernel.build_error
    monkeypatch.setattr(cpu_kernels, "_KERNEL", kernel)
    return request.param


@pytest.fixture
def store(request: pytest.FixtureRequest) -> Iterator[dist.TCPStore]:
    """A rendezvous store served by this process, waiting as long as the test module's `TIMEOUT` (60 s without one):
    the sides of a group (threads here, or spawned processes) each connect a client of their own."""
    timeout = getattr(request.module, "TIMEOUT", timedelta(seconds=60))
    yield dist.TCPStore("127.0.0.1", 0, None, True, timeout=timeout, wait_for_workers=False)
