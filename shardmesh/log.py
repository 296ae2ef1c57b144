"""Structured JSON logs on stderr, one object per line, for every shardmesh process.

Each process binds its identity once (`service`, and `worker_id` / `rank` where it has one); code
inside a request binds `request_id` with `structlog.contextvars`, so every line can be joined with
the others from the same request, across services.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog


def configure(service: str, level: str | None = None, **identity: Any) -> structlog.stdlib.BoundLogger:
    level_name = (level or os.environ.get("SHARDMESH_LOG_LEVEL", "info")).upper()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level_name, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service, pid=os.getpid(), **identity)
    return structlog.get_logger()


def get() -> structlog.stdlib.BoundLogger:
    return structlog.get_logger()
