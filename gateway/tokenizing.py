"""Where prompts are tokenized: away from the threads that serve requests, a bounded amount at a time.

Tokenizing costs about a microsecond per byte of prompt here, and it used to run on the request's own thread
holding the interpreter lock: a 20 MiB prompt took 23 s and stalled every stream in the gateway for seconds.
Three things now keep a prompt from doing that (the first two in `gateway/requests.py` and
`shardmesh.models.tokenizer`):

- a prompt whose bytes could not fit the context is refused before it is tokenized, so the work a request can
  cause is bounded by the context (`max_context × Tokenizer.max_bytes_per_token` bytes: 663 KB for SmolLM2);
- encoding releases the interpreter lock (the `tokenizers` batch form), so the scheduler's thread and the other
  requests run while a prompt is tokenized;
- a prompt larger than `SMALL_PROMPT_BYTES` is tokenized (and its chat template rendered) on this pool: a few
  threads at a lowered CPU priority, so that a flood of long prompts takes at most `workers` cores, and those
  after the workers and the streams. At most `max_waiting` such prompts wait or run at once; more is
  RESOURCE_EXHAUSTED, so waiting prompts cannot pile up in memory either. Smaller prompts cost less than the
  hand-over and are tokenized where they arrive.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from shardmesh.core.errors import ResourceExhausted

T = TypeVar("T")

SMALL_PROMPT_BYTES = 64 * 1024  # tokenized on the request's thread: ~50 ms at most here, with the lock released
WORKERS = 1  # large prompts tokenized at once: the cores the workers share are for the streams
MAX_WAITING = 16  # large prompts waiting or being tokenized; more are refused
NICE = 10  # the pool's threads run after the request threads and the stage workers (Linux: nice is per thread)


class TokenizerPool:
    """`run(fn, size)`: `fn()` (tokenize, render a template) on the pool when `size` (the prompt's bytes) exceeds
    `small`, else on the calling thread; the caller waits either way and gets what `fn` returns or raises."""

    def __init__(self, workers: int = WORKERS, max_waiting: int = MAX_WAITING, small: int = SMALL_PROMPT_BYTES,
                 nice: int = NICE) -> None:  # fmt: skip
        self.max_waiting = max_waiting
        self.small = small
        self._nice = nice
        self._lock = threading.Lock()
        self._pending = 0  # large prompts submitted and not done
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenizer",
                                            initializer=self._lower_priority)  # fmt: skip

    def run(self, fn: Callable[[], T], size: int) -> T:
        if size <= self.small:
            return fn()
        with self._lock:
            if self._pending >= self.max_waiting:
                raise ResourceExhausted(f"tokenizer busy: {self._pending} long prompts are being tokenized or wait "
                                        "for it; retry later")  # fmt: skip
            self._pending += 1
        try:
            return self._executor.submit(fn).result()
        finally:
            with self._lock:
                self._pending -= 1

    @property
    def pending(self) -> int:
        """Large prompts submitted and not done."""
        with self._lock:
            return self._pending

    def _lower_priority(self) -> None:
        # On Linux a thread id is a process id for setpriority, so only this thread is lowered; elsewhere this
        # lowers the whole process, which no caller wants: there the pool runs at the normal priority.
        if self._nice and sys.platform.startswith("linux"):
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)


_shared: TokenizerPool | None = None
_shared_lock = threading.Lock()


def shared_pool() -> TokenizerPool:
    """The process's pool, which both front doors (gRPC and HTTP) share; created on first use."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = TokenizerPool()
        return _shared
