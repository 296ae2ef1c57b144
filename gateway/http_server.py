"""An ASGI app served by uvicorn on its own thread and event loop, inside the gateway process.

The gateway's main thread owns signals and the shutdown order (`gateway.process`), so uvicorn gets neither:
its socket is bound here, before the thread starts (a port in use fails `start()` at once, and port 0 is known
at once), and `begin_stop()` / `join()` are called from `GatewayServer.stop`. uvicorn then stops accepting
connections, closes idle keep-alive ones, lets running requests finish for `shutdown_timeout` seconds and
cancels what is left; the thread ends with its loop.

uvicorn logs through the standard library; its warnings and errors are passed on to the gateway's JSON log.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import threading
from typing import Any

UVICORN_LOGGERS = ("uvicorn", "uvicorn.error")


class _ToStructlog(logging.Handler):
    """uvicorn's log records as lines of the gateway's own log."""

    def __init__(self, logger: Any) -> None:
        super().__init__(logging.WARNING)
        self._log = logger

    def emit(self, record: logging.LogRecord) -> None:
        method = self._log.error if record.levelno >= logging.ERROR else self._log.warning
        method("http_server", message=record.getMessage())


def bind(listen: str) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one; `[::1]:8000` for IPv6)."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, int(port)), family=family, backlog=2048)


class HttpServer:
    """`start()` serves `app` on `listen` from a thread of its own; `begin_stop()`, then `join()`."""

    def __init__(self, app: Any, listen: str, logger: Any, shutdown_timeout: float = 5.0, tls: Any = None) -> None:
        """`tls` (`shardmesh.rpc.tls.TlsFiles`): serve HTTPS with its certificate and key, re-read when they change
        (`shardmesh.rpc.tls.https_context`); clients need no certificate (they present an API key)."""
        import uvicorn

        self._listen = listen
        self._log = logger
        self._handler = _ToStructlog(logger)
        config = uvicorn.Config(
            app, http="h11", ws="none", lifespan="off", loop="asyncio", log_config=None, access_log=False,
            timeout_graceful_shutdown=math.ceil(shutdown_timeout), server_header=False,
            **({"ssl_certfile": str(tls.cert), "ssl_keyfile": str(tls.key)} if tls is not None else {}),
        )  # fmt: skip
        if tls is not None:  # uvicorn's own context, loaded once, replaced by one that follows the files
            from shardmesh.rpc.tls import https_context

            config.load()
            config.ssl = https_context(tls, logger)
        self._server = uvicorn.Server(config)
        self._socket: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    def start(self) -> int:
        """Bind and serve; returns the port."""
        self._socket = bind(self._listen)
        self.port = self._socket.getsockname()[1]
        for name in UVICORN_LOGGERS:
            logger = logging.getLogger(name)
            logger.addHandler(self._handler)
            logger.propagate = False  # not also printed as plain text by the root logger's last resort
        self._thread = threading.Thread(target=self._run, name="http-server", daemon=True)
        self._thread.start()
        return self.port

    def _run(self) -> None:
        try:
            asyncio.run(self._server.serve(sockets=[self._socket]))
        except BaseException:  # a dead HTTP server must show in the log; gRPC goes on serving
            self._log.exception("http_server_failed")

    def begin_stop(self) -> None:
        """Stop accepting connections (within uvicorn's 0.1 s tick); running requests go on until `join`."""
        self._server.should_exit = True

    def join(self, timeout: float) -> bool:
        """Wait for the thread (running requests end meanwhile, or are cancelled after the shutdown timeout);
        False if it is still running after `timeout`."""
        self.begin_stop()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self._server.force_exit = True
                self._thread.join(1.0)
        for name in UVICORN_LOGGERS:
            logging.getLogger(name).removeHandler(self._handler)
        return self._thread is None or not self._thread.is_alive()
