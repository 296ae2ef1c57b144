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
def _stop_on_signals() -> Iterator[threading.Event]:
    """An Event that SIGTERM or SIGINT sets; the previous handlers come back after.

    The handler only sets the event, so the main thread notices at its next wait and shuts the
    service down in order (NOT_SERVING, drain, stop) instead of dying inside whatever it was doing.
    """
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve_until_signal(service: Service, logger: Any, *, start_in_background: bool = False) -> bool:
    """Start `service`, serve until SIGTERM or SIGINT (logged as `signal_received`), then `service.stop()`,
    whatever happened before. Returns whether the service started.

    In the foreground (the default) an error from `start` is raised, after `stop`. `start_in_background`
    is for a service whose start waits on others (a worker registering with a coordinator that is not up
    yet): `start` runs on its own thread, so a signal meanwhile stops the service at once (its `stop`
    must end a `start` still running), and an error from it is logged as `start_failed` and ends serving.
    """
    with _stop_on_signals() as stop:
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
            if started:
                logger.info("signal_received")
        finally:
            service.stop()
    return started
