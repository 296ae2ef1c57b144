import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Tests share 2 cores with the processes they start; one intra-op thread keeps timings sane.
torch.set_num_threads(1)
os.environ.setdefault("SHARDMESH_LOG_LEVEL", "warning")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@pytest.fixture(scope="session", autouse=True)
def native_kernels() -> None:
    """Build the C++ kernels (blocked products and decode layers, int8 products, paged decode attention, the
    shared-memory collectives and links) once, before the first test: a worker builds
    them at first use (tens of seconds each on 2 cores, then cached under ~/.cache/torch_extensions), which on a
    fresh machine would otherwise fall inside some test's wait for a worker to load. Where they cannot be built the
    engine falls back to its torch paths, as it would in service. Parallel test workers (pytest-xdist) take them in
    opposite orders: on a fresh machine the two build different kernels at once until they meet in the middle, where
    one waits for the other's build (torch's lock in the build directory) and then finds the rest built."""
    from shardmesh.engine import cpu_kernels, int8_cpu, paged_attention, shm_collective, shm_link

    kernels = [cpu_kernels, int8_cpu, paged_attention, shm_collective, shm_link]
    if int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")) % 2:
        kernels.reverse()
    for kernel in kernels:
        kernel.available()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator["Stack"]:  # noqa: F821  (imported below, after sys.path is set)
    """Services started one by one, as compose would (tests/stack.py); whatever still runs is stopped after."""
    from tests.stack import Stack

    s = Stack(tmp_path)
    try:
        yield s
    finally:
        s.close()
