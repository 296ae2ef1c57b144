"""A worker with peers builds its transports' kernels beside its shard's load (on a fresh machine each first build
is one compiler process: two at a time, not one after another), and never leaves that build behind its load."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import structlog
import torch

from shardworker import runtime
from shardworker.runtime import StageWorkerCore

WAIT_S = 60.0  # only bounds a failure: each side waits for the other to have started


def _placement() -> SimpleNamespace:
    return SimpleNamespace(spec="spec", model_path="m", dtype="float32", limits=SimpleNamespace(max_context=64),
                           quantization="none")  # fmt: skip


@pytest.fixture
def core() -> Iterator[StageWorkerCore]:
    c = StageWorkerCore("w", torch.device("cpu"), structlog.wrap_logger(structlog.ReturnLogger()))
    yield c
    c.close()


def test_the_transports_kernels_build_while_the_shard_loads(core: StageWorkerCore, monkeypatch) -> None:
    building, loading, built = threading.Event(), threading.Event(), threading.Event()
    seen: list[str] = []

    def build(device: torch.device) -> None:
        building.set()
        seen.append("build saw the load" if loading.wait(WAIT_S) else "build ran alone")
        built.set()

    def load_shard(*args: object) -> str:
        loading.set()
        seen.append("load saw the build" if building.wait(WAIT_S) else "load ran alone")
        return "model"

    monkeypatch.setattr(runtime, "_has_peers", lambda p: True)
    monkeypatch.setattr(runtime, "build_transport_kernels", build)
    monkeypatch.setattr(core, "_load_shard", load_shard)
    assert core._load(_placement()) == "model"
    assert built.is_set()  # joined before the load returned: the negotiation never waits on a build
    assert sorted(seen) == ["build saw the load", "load saw the build"]


def test_a_failed_load_still_waits_for_the_build_and_raises(core: StageWorkerCore, monkeypatch) -> None:
    release, built = threading.Event(), threading.Event()

    def build(device: torch.device) -> None:
        release.wait(WAIT_S)
        built.set()

    def load_shard(*args: object) -> str:
        release.set()
        raise ValueError("truncated checkpoint")

    monkeypatch.setattr(runtime, "_has_peers", lambda p: True)
    monkeypatch.setattr(runtime, "build_transport_kernels", build)
    monkeypatch.setattr(core, "_load_shard", load_shard)
    with pytest.raises(ValueError, match="truncated checkpoint"):
        core._load(_placement())
    assert built.is_set()


def test_a_shard_without_peers_builds_no_transport_kernel(core: StageWorkerCore, monkeypatch) -> None:
    built: list[torch.device] = []
    monkeypatch.setattr(runtime, "_has_peers", lambda p: False)
    monkeypatch.setattr(runtime, "build_transport_kernels", built.append)
    monkeypatch.setattr(core, "_load_shard", lambda *args: "model")
    assert core._load(_placement()) == "model" and built == []
