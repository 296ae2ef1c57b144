"""A service's main loop: start, serve until SIGTERM or SIGINT, stop in order.

The three services share it; each one's `stop()` keeps its own order of shutdown steps (health NOT_SERVING
first, so load balancers and peers look elsewhere, then `server.stop(grace)` to drain), because what else
has to end in between (watch streams, the scheduler, leaving the mesh) differs per service.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any, Protocol

POLL_S = 0.5  # how long the main thread sleeps between looks at the stop event


class Service(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...


@contextlib.contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[list[int]]:
    """SIGTERM or SIGINT set `stop`; yields the signals received. The previous handlers come back after.

    The handler only sets the event, so the main thread notices at its next wait and shuts the
    service down in order (NOT_SERVING, drain, stop) instead of dying inside whatever it was doing.
    """
    received: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        received.append(signum)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve_until_signal(
    service: Service, logger: Any, *, start_in_background: bool = False, stop: threading.Event | None = None
) -> bool:
    """Start `service`, serve until SIGTERM or SIGINT (logged as `signal_received`), then `service.stop()`,
    whatever happened before. Returns whether the service started.

    `stop` is an event the service may set to end serving itself (a drained worker): it is stopped as on a
    signal, without `signal_received`, and this returns True as well, so the process exits 0.

    In the foreground (the default) an error from `start` is raised, after `stop`. `start_in_background`
    is for a service whose start waits on others (a worker registering with a coordinator that is not up
    yet): `start` runs on its own thread, so a signal meanwhile stops the service at once (its `stop`
    must end a `start` still running), and an error from it is logged as `start_failed` and ends serving.
    """
    stop = stop if stop is not None else threading.Event()
    with _stop_on_signals(stop) as signals:
        started = True
        try:
            if start_in_background:

                def start() -> None:
                    nonlocal started
                    try:
                        service.start()
                    except Exception as e:
                        logger.error("start_failed", error=str(e))
                        started = False
                        stop.set()

                threading.Thread(target=start, name="start", daemon=True).start()
            else:
                service.start()
            while not stop.wait(POLL_S):
                pass
            if started and signals:
                logger.info("signal_received")
        finally:
            service.stop()
    return started
