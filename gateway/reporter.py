"""Telling the coordinator at once that workers failed, so that a hot spare takes a lost worker's slot
without waiting for its heartbeats to time out.

When a step breaks, the gateway knows before anyone else that the mesh is gone; the coordinator would
only notice a killed worker when its heartbeats stop (heartbeat_timeout, seconds). `Coordinator.ReportFailure`
asks it to probe the named workers' health now and treat the ones that do not answer as lost. The
gateway reports every worker of the failed step's mesh: the shard whose call failed may be a survivor
that only saw its peer vanish, and the coordinator's probe tells them apart.

The call is made on a thread of its own, never on the scheduler's, with a short deadline. It is a
hint, not a duty: a report that fails is logged and dropped (heartbeats still catch the loss). The
steps in flight on a broken mesh all fail, one after the other, so the same workers are reported once
while a report about them is outstanding and for a short while after it.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from shardmesh.proto.v1 import coordinator_pb2, coordinator_pb2_grpc
from shardmesh.rpc import server as rpc
from shardmesh.rpc import tls
from shardmesh.rpc.tls import Dial

REPORT_TIMEOUT_S = 3.0  # deadline of one ReportFailure call: the coordinator probes, it does not wait
QUIET_S = 5.0  # after a report about a set of workers ended, the same set is not reported again for this long


class FailureReporter:
    """Sends `ReportFailure` for `report(worker_ids, reason)` from a daemon thread: `start(reporter)`,
    then `report` from any thread (it never blocks), then `stop()`."""

    def __init__(self, coordinator: str, logger: Any, *, max_message_bytes: int = 64 * 1024 * 1024,
                 timeout: float = REPORT_TIMEOUT_S, quiet: float = QUIET_S,
                 clock: Callable[[], float] = time.monotonic, dial: Dial | None = None) -> None:  # fmt: skip
        self.coordinator = coordinator
        self._log = logger
        self._options = rpc.message_options(max_message_bytes)
        self._dial = dial if dial is not None else Dial()  # TLS and the join token (default: plaintext, none)
        self._timeout, self._quiet, self._clock = timeout, quiet, clock
        self._reporter = ""
        self._lock = threading.Lock()
        # Worker set -> when its last report ended (inf while it is queued or outstanding); guarded by _lock.
        self._recent: dict[frozenset[str], float] = {}
        self._stopping = False
        self._queue: queue.SimpleQueue[tuple[list[str], str] | None] = queue.SimpleQueue()
        self._channel: grpc.Channel | None = None
        self._thread: threading.Thread | None = None

    def start(self, reporter: str) -> None:
        """`reporter`: who this is, for the coordinator's log, e.g. "gateway 127.0.0.1:50050"."""
        self._reporter = reporter
        self._channel = tls.channel(self.coordinator, self._dial.tls, self._options, self._dial.token)
        stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._thread = threading.Thread(target=self._run, args=(stub,), name="failure-reporter", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def report(self, worker_ids: list[str], reason: str) -> None:
        """Queue a report about these workers, unless the same set was reported a moment ago or is being
        reported now. Returns at once; never raises for the coordinator's sake."""
        ids = list(dict.fromkeys(w for w in worker_ids if w))
        key = frozenset(ids)
        if not key:
            return
        now = self._clock()
        with self._lock:
            if self._stopping:
                return
            ended = self._recent.get(key)
            if ended is not None and now < ended + self._quiet:
                return  # the coordinator is probing these workers already, or just did
            self._recent = {k: t for k, t in self._recent.items() if now < t + self._quiet}  # forget old sets
            self._recent[key] = math.inf
        self._queue.put((ids, reason))

    def stop(self, timeout: float = 2.0) -> None:
        """Drop what is queued, cancel the call in progress and wait (bounded) for the thread to end."""
        with self._lock:
            self._stopping = True
        self._queue.put(None)
        if self._channel is not None:
            self._channel.close()  # ends an outstanding call at once (CANCELLED)
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=timeout)

    # -- the reporting thread ---------------------------------------------------------------------

    def _run(self, stub: coordinator_pb2_grpc.CoordinatorStub) -> None:
        while True:
            item = self._queue.get()
            with self._lock:
                if item is None or self._stopping:
                    return
            worker_ids, reason = item
            try:
                self._send(stub, worker_ids, reason)
            finally:
                with self._lock:
                    self._recent[frozenset(worker_ids)] = self._clock()

    def _send(self, stub: coordinator_pb2_grpc.CoordinatorStub, worker_ids: list[str], reason: str) -> None:
        request = coordinator_pb2.ReportFailureRequest(worker_ids=worker_ids, reason=reason, reporter=self._reporter)
        try:
            response = stub.ReportFailure(request, timeout=self._timeout)
        except grpc.RpcError as e:
            self._failed(worker_ids, reason, e.code().name, e.details() or "")
        except Exception as e:  # e.g. the channel closed under a call by stop(): never kill the thread
            self._failed(worker_ids, reason, type(e).__name__, str(e))
        else:
            self._log.info("failure_reported", reason=reason, worker_ids=worker_ids, lost=list(response.lost),
                           topology_version=response.topology_version)  # fmt: skip

    def _failed(self, worker_ids: list[str], reason: str, code: str, error: str) -> None:
        with self._lock:
            if self._stopping:
                return  # cancelled by stop(): nothing went wrong
        self._log.warning("failure_report_failed", code=code, error=error, reason=reason, worker_ids=worker_ids,
                          coordinator=self.coordinator)  # fmt: skip
