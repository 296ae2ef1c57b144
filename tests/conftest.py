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


@pytest.fixture
def stack(tmp_path: Path) -> Iterator["Stack"]:  # noqa: F821  (imported below, after sys.path is set)
    """Services started one by one, as compose would (tests/stack.py); whatever still runs is stopped after."""
    from tests.stack import Stack

    s = Stack(tmp_path)
    try:
        yield s
    finally:
        s.close()
