"""Waiting for a condition in tests: poll it until it holds, with a generous bound that only a bug reaches.

Tests never sleep for a fixed time to let something happen; they wait for the observable result.
"""

from __future__ import annotations

import time
from collections.abc import Callable

WAIT_S = 10.0  # upper bound for anything a test waits on; normally milliseconds


def wait_until(predicate: Callable[[], bool], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)
