"""Fixtures the stage-core tests share: a rendezvous store per test, and the tiny checkpoint the KV-cache tests
(retention, hand-over, penalised replay) decode from; a module that needs another checkpoint defines its own
`model`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from tests.checkpoints import make_checkpoint
from tests.unit.shardworker.cores import new_store


@pytest.fixture
def store() -> dist.TCPStore:
    """The rendezvous store, as a coordinator serves it."""
    return new_store()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tied random model whose greedy answer runs long (eos 95 is rare under this seed) and repeats tokens
    (penalties change it)."""
    return make_checkpoint(tmp_path_factory.mktemp("decode"), "llama-gqa-tied", num_layers=4, seed=5, eos_token_id=95)
