"""The gateway's channels to the stage workers, each with a grpc.health.v1 watch held open on it.

The watch does two jobs. It reports, in the gateway's log, every change of a worker's health as the
worker itself sees it (SERVING only while its shard is loaded and in a complete mesh), so a worker that
stops serving shows up here before the coordinator's topology says so.

And it keeps one call open on the channel at all times, which is a measured speed-up. gRPC Python
serves a channel's non-blocking calls (`.future()`, streams) from a polling thread that it starts when
the channel's first such call begins and that exits when its last one ends. With one stream decoding,
every step's `Step.future()` found no call open, so every step started a thread; that cost the gateway
~5 ms of CPU per step, taken from the worker computing it on a 2-core machine (SmolLM2, pp=1: 22.8 ->
20.0 ms per token, the step itself 20.2 -> 16.9 ms).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.stream import ReopeningStream
from shardmesh.proto.v1 import worker_pb2
from shardmesh.rpc import server as rpc
from shardmesh.rpc import tls
from shardmesh.rpc.tls import Dial

WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["StageWorker"].full_name


class _HealthWatch:
    """`Health.Watch` on one worker's channel, re-opened with backoff while the worker is unreachable."""

    def __init__(self, address: str, channel: grpc.Channel, logger: Any, backoff: tuple[float, float],
                 on_lost: Callable[[str, str], None] | None = None) -> None:  # fmt: skip
        self.address = address
        self.status = "UNKNOWN"  # the worker's last reported status, or UNREACHABLE
        self._log = logger
        self._on_lost = on_lost
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service=WORKER_SERVICE)
        self._stream = ReopeningStream(
            f"health-watch {address}", lambda: stub.Watch(request),
            lambda r: self._report(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status), ""),
            lambda problem, _retry_s: self._report("UNREACHABLE", problem), backoff, ended=None,
        )  # fmt: skip
        self._stream.start()

    def stop(self) -> None:
        self._stream.stop()

    def _report(self, status: str, error: str) -> None:
        if status == self.status:
            return
        was, self.status = self.status, status
        fields = {"error": error} if error else {}
        self._log.info("worker_health", address=self.address, status=status, **fields)
        if status == "UNREACHABLE" and was != "UNKNOWN" and self._on_lost is not None:
            self._on_lost(self.address, error)  # it answered before: gone now, maybe while no step ran


class WorkerLinks:
    """One channel per worker address, kept for the gateway's life: a worker that comes back at the same
    address reuses its channel, and a view the scheduler still steps on is never closed under it."""

    def __init__(self, logger: Any, max_message_bytes: int, backoff: tuple[float, float] = (0.1, 2.0),
                 on_lost: Callable[[str, str], None] | None = None, dial: Dial | None = None) -> None:  # fmt: skip
        """`on_lost(address, error)`: a worker that had answered its health watch became unreachable. `dial`: TLS and
        the join token the channels carry (default: plaintext, no token)."""
        self._log = logger
        self._on_lost = on_lost
        self._options = rpc.message_options(max_message_bytes)
        self._dial = dial if dial is not None else Dial()
        self._backoff = backoff
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._watches: dict[str, _HealthWatch] = {}
        self._closed = False

    def channel(self, address: str) -> grpc.Channel:
        with self._lock:
            if self._closed:
                raise RuntimeError("the gateway's worker links are closed")
            if address not in self._channels:
                channel = tls.channel(address, self._dial.tls, self._options, self._dial.token)
                self._channels[address] = channel
                self._watches[address] = _HealthWatch(address, channel, self._log, self._backoff, self._on_lost)
            return self._channels[address]

    def health(self) -> dict[str, str]:
        """address -> the worker's last reported health (SERVING, NOT_SERVING, UNREACHABLE, UNKNOWN)."""
        with self._lock:
            return {address: w.status for address, w in self._watches.items()}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            watches, channels = list(self._watches.values()), list(self._channels.values())
        for watch in watches:
            watch.stop()
        for channel in channels:
            channel.close()
