"""A server-streaming call followed on its own thread and re-opened with backoff: the gateway's watches.

The gateway follows two kinds of stream for as long as it runs: the coordinator's topologies
(`gateway/watcher.py`) and each worker's health (`gateway/links.py`). Both must survive the other end
going away and coming back, and both must end promptly on shutdown, including when shutdown comes while
a call is being opened.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc


class ReopeningStream:
    """Calls `open_call()` and hands each message to `on_message` until the stream ends or fails; then
    reports why to `on_lost(problem, retry_s)`, waits, and opens it again, the wait doubling from
    `backoff[0]` to `backoff[1]` and starting over after a message arrives. Until `stop()`.

    `on_message` raises ValueError for a message it cannot use: the stream is re-opened and the error's text
    is the problem reported. A stream that ends without an error is reported as `ended`, or not at all when
    `ended` is None.
    """

    def __init__(self, name: str, open_call: Callable[[], Any], on_message: Callable[[Any], None],
                 on_lost: Callable[[str, float], None], backoff: tuple[float, float],
                 ended: str | None = "stream ended") -> None:  # fmt: skip
        self._open, self._on_message, self._on_lost = open_call, on_message, on_lost
        self._backoff, self._ended = backoff, ended
        self._stopping = threading.Event()
        self._call: Any = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stopping.set()
        call = self._call
        if call is not None:
            call.cancel()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)

    def _run(self) -> None:
        delay = self._backoff[0]
        while not self._stopping.is_set():
            call = self._call = self._open()
            if self._stopping.is_set():  # stop() ran before the call existed: end it here
                call.cancel()
            problem: str | None
            try:
                for message in call:
                    delay = self._backoff[0]
                    self._on_message(message)
                problem = self._ended
            except grpc.RpcError as e:
                problem = f"{e.code().name}: {e.details()}"
            except ValueError as e:
                problem = str(e)
            if self._stopping.is_set():
                break
            if problem is not None:
                self._on_lost(problem, delay)
            self._stopping.wait(delay)
            delay = min(delay * 2, self._backoff[1])
