"""Fixtures shared by the gateway's unit tests (the fakes themselves are in fakes.py)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import pytest
import structlog

from gateway.scheduler import Scheduler, SchedulerConfig
from gateway.watcher import ModelFiles
from tests.unit.gateway.fakes import started, write_tokenizer


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> ModelFiles:
    files = ModelFiles.load(str(write_tokenizer(tmp_path_factory.mktemp("tok") / "model")))
    assert files.tokenizer is not None and not files.problem
    return files


@pytest.fixture
def logger() -> Any:
    return structlog.wrap_logger(structlog.PrintLogger(io.StringIO()), processors=[structlog.processors.JSONRenderer()])


@pytest.fixture
def scheduler(logger: Any) -> Iterator[Scheduler]:
    with started(SchedulerConfig(max_queue=8, default_max_new_tokens=16, step_timeout=5.0), logger) as s:
        yield s
