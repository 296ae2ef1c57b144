"""Fixtures the engine tests share."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist


@pytest.fixture
def store(request: pytest.FixtureRequest) -> Iterator[dist.TCPStore]:
    """A rendezvous store served by this process, waiting as long as the test module's `TIMEOUT` (60 s without one):
    the sides of a group (threads here, or spawned processes) each connect a client of their own."""
    timeout = getattr(request.module, "TIMEOUT", timedelta(seconds=60))
    yield dist.TCPStore("127.0.0.1", 0, None, True, timeout=timeout, wait_for_workers=False)
