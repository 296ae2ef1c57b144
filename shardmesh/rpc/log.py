"""Structured JSON logs on stderr, one object per line, for every shardmesh process.

Each process states its identity once (`service`, and `worker_id` / `rank` where it has one) and
every line from every thread carries it (a processor adds it: context variables do not reach new
threads). Code inside a request binds `request_id` with `structlog.contextvars`, so every line can be
joined with the others from the same request, across services.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

_identity: dict[str, Any] = {}


def _add_identity(logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
    for key, value in _identity.items():
        event.setdefault(key, value)
    return event


def bind_identity(**fields: Any) -> None:
    """Add fields to every line this process logs from now on, e.g. `worker_id` once registered."""
    _identity.update(fields)


def configure(service: str, level: str | None = None, **identity: Any) -> structlog.stdlib.BoundLogger:
    level_name = (level or os.environ.get("SHARDMESH_LOG_LEVEL", "info")).upper()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _add_identity,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level_name, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    _identity.clear()
    _identity.update(service=service, pid=os.getpid(), **identity)
    return structlog.get_logger()


def get() -> structlog.stdlib.BoundLogger:
    return structlog.get_logger()
