"""A worker killed with SIGKILL while requests stream: every request finishes, with the tokens it would have had.

Over real processes: `shardmesh up` (which restarts a dead worker under the same id), 8 concurrent streams,
half greedy and half sampled with a seed, `kill -9` of one worker once every stream has tokens. The gateway
keeps each sequence's token log; on the next complete topology each one replays its log and decodes on.
The streams are compared token for token with an undisturbed run of the same requests on the same mesh.
Kept in the normal suite on purpose: a fail-over path that no test exercises rots.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardmesh.proto.v1 import gateway_pb2
from tests.checkpoints import make_checkpoint
from tests.meshes import Mesh, Progress, stream_all


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # eos 95 is rare under this seed, so the streams run to NEW_TOKENS and compare many tokens each.
    return make_checkpoint(tmp_path_factory.mktemp("failover"), "llama-gqa-tied", num_layers=4, seed=11,
                           eos_token_id=95)  # fmt: skip


# The paged mesh: sequences keep their block tables through the loss and replay into them (gateway/blocks.py).
@pytest.fixture(scope="module", params=[(2, 1, ()), (1, 2, ()), (2, 1, ("--kv-block-size", "4"))],
                ids=lambda p: f"pp{p[0]}-tp{p[1]}{'-paged' if p[2] else ''}")  # fmt: skip
def mesh(request, model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    pp, tp, extra = request.param
    m = Mesh(model, pp, tp, tmp_path_factory.mktemp(f"failover{pp}{tp}"), *extra)
    yield m
    m.close()


def killed_mid_stream(mesh: Mesh, stage: int, tp_rank: int, streaming: int) -> dict[str, list[int]]:
    """Every request at once, and SIGKILL of the worker at (stage, tp_rank) once `streaming` streams have
    3 tokens, sent from the stream thread that saw it (the pid looked up before); their tokens by request id."""
    progress = Progress()
    killed: list[int] = []
    pid = mesh.worker_pid(stage, tp_rank)

    def kill() -> None:
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    progress.at_n(streaming, kill)
    tokens = stream_all(mesh.stub, progress=progress)
    assert killed, "the worker was not killed"
    return tokens


def test_requests_survive_a_killed_worker_with_the_tokens_of_an_undisturbed_run(mesh: Mesh) -> None:
    reference = stream_all(mesh.stub)
    long = [k for k, tokens in reference.items() if len(tokens) >= 20]
    assert len(long) >= 4  # the greedy ones run to NEW_TOKENS; a sampled one may draw eos early
    info = mesh.stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=10)
    # pp=2: the first stage, then the last (the sampler); tp=2: the rank that is not the sampler.
    victims = [(0, 0), (1, 0)] if info.pp > 1 else [(0, 1)]
    for round_, (stage, tp_rank) in enumerate(victims, start=1):
        disturbed = killed_mid_stream(mesh, stage, tp_rank, len(long))
        assert disturbed == reference, (stage, tp_rank)  # every request, every token: none lost, repeated or changed
        resumed = (mesh.log_dir / "gateway.log").read_text().count('"event": "requests_resuming"')
        assert resumed >= round_  # the kill did land mid-stream: requests replayed their logs
