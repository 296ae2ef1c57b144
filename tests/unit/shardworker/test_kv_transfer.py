"""A slot handed over from a serving worker takes that worker's KV cache with it (ShardAssignment.kv_from): the
new holder receives the cache, the activation log and their id over a two-rank group, so nothing is replayed.
On real stage cores over real Gloo groups in this process; over real processes in tests/e2e/test_elastic.py."""

from __future__ import annotations

import threading
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardmesh.core.errors import FailedPrecondition
from shardmesh.core.step import SamplingParams, StepEntry
from shardmesh.core.topology import MeshWorker, ShardState, Topology, WorkerState
from shardmesh.engine import kv_transfer
from shardmesh.engine.groups import Backend
from shardworker import runtime
from shardworker.runtime import StageWorkerCore
from tests.checkpoints import reference_greedy
from tests.unit.shardworker.cores import apply_all, new_core, on_every_core, run_step
from tests.unit.shardworker.fakes import mesh
from tests.unit.shardworker.test_kv_retention import PROMPT, count_forwards, decode, entry, prefill

OTHER = (7, 8, 9, 10)


def handed_over(topology: Topology, rank: int, kv_from: str) -> Topology:
    stages = list(topology.stages)
    stage = stages[rank]
    stages[rank] = replace(stage, shards=(replace(stage.shards[0], kv_from=kv_from),))
    return replace(topology, stages=tuple(stages))


def preparing(topology: Topology, spare: str, rank: int) -> Topology:
    """`topology` with `spare` listed as a spare asked to prepare `rank`."""
    spare_entry = MeshWorker(spare, "127.0.0.1:1", 0, WorkerState.SPARE, None, "", rank)
    return replace(topology, workers=(*topology.workers, spare_entry))


def two_sequences(cores: list[StageWorkerCore], version: int) -> tuple[list[int], int]:
    """Sequence "r" in slot 1 (prompt + two tokens) and sequence "s" in slot 2 (its prompt): their logs."""
    log = prefill(cores, version)
    other = run_step(cores, version, [StepEntry("s", 2, 0, len(OTHER), OTHER, SamplingParams())])
    return log, other[-1].sampled[0].token_id


def test_a_drained_first_stage_hands_its_cache_to_a_prepared_spare(model: Path, store: dist.TCPStore) -> None:
    w0, w1, spare = new_core("w0"), new_core("w1"), new_core("spare")
    apply_all([w0, w1], mesh(model, 5, ("w0", "w1"), epoch=5, store_port=store.port))
    log, s_first = two_sequences([w0, w1], 5)
    sent_id = w0.info()["kv_cache_id"]

    spare.prepare(preparing(mesh(model, 5, ("w0", "w1"), epoch=5, store_port=store.port), "spare", 0))
    assert spare.prepared_rank == 0 and spare._kept is not None  # weights loaded and the cache allocated ahead
    allocated = spare._kept

    moved = handed_over(mesh(model, 6, ("spare", "w1"), epoch=6, store_port=store.port), 0, "w0")
    on_every_core([w0, spare, w1], lambda core: core.hand_off(moved) if core is w0 else core.apply(moved))
    assert spare.state is ShardState.READY and w1.state is ShardState.READY
    assert spare._runtime is not None and spare._runtime.caches is allocated  # no allocation at the join
    assert spare.info()["kv_cache_id"] == sent_id  # the gateway finds stage 0's cache kept: no replay
    assert w0.kv_moved["sent"] == spare.kv_moved["received"] > 0
    assert w0.state is ShardState.PENDING and "handed over to spare" in w0.detail
    with pytest.raises(FailedPrecondition, match="pending"):
        w0.step(6, [entry(len(log) - 1, (log[-1],))])  # a late step of the old epoch would miss the new holder

    forwards = count_forwards(spare)
    reference = reference_greedy(model, list(PROMPT), 6)[0]
    assert log[len(PROMPT) :] + decode([spare, w1], 6, log, 4) == reference
    assert forwards() == 4  # the decode steps: nothing was replayed
    s_next = run_step([spare, w1], 6, [StepEntry("s", 2, len(OTHER), 1, (s_first,), SamplingParams())])
    assert [s_first, s_next[-1].sampled[0].token_id] == reference_greedy(model, list(OTHER), 2)[0]

    # The activation log came too: a replaced last stage is fed from the new first stage's log.
    w3 = new_core("w3")
    apply_all([spare, w3], mesh(model, 7, ("spare", "w3"), epoch=7, store_port=store.port))
    replay = entry(0, tuple(log[:-1]), sample=False, first=1)
    run_step([spare, w3], 7, [replay])
    assert log[len(PROMPT) :] + decode([spare, w3], 7, log, 4) == reference


def test_a_drained_last_stage_hands_over_to_a_spare_that_did_not_prepare(model: Path, store: dist.TCPStore) -> None:
    w0, w1, spare = new_core("w0"), new_core("w1"), new_core("spare")
    apply_all([w0, w1], mesh(model, 5, ("w0", "w1"), epoch=5, store_port=store.port))
    log = prefill([w0, w1], 5)
    sent_id = w1.info()["kv_cache_id"]
    history = w1._runtime.caches.tokens  # type: ignore[union-attr]  # the last stage's, for the penalties
    assert history is not None
    history.data[1, : len(log) - 1] = torch.tensor(log[:-1], dtype=history.data.dtype)
    moved = handed_over(mesh(model, 6, ("w0", "spare"), epoch=6, store_port=store.port), 1, "w1")
    on_every_core([w0, w1, spare], lambda core: core.hand_off(moved) if core is w1 else core.apply(moved))
    assert spare.info()["kv_cache_id"] == sent_id and w0.info()["kv_cache_id"] != sent_id
    received = spare._runtime.caches.tokens  # type: ignore[union-attr]
    assert received is not None and received.data[1, : len(log) - 1].tolist() == log[:-1]
    assert log[len(PROMPT) :] + decode([w0, spare], 6, log, 4) == reference_greedy(model, list(PROMPT), 6)[0]


def test_a_receiver_whose_sender_never_comes_keeps_an_empty_cache_under_a_new_id(
    model: Path, store: dist.TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    monkeypatch.setattr(runtime, "KV_TRANSFER_TIMEOUT_S", 1.0)
    w0, w1, spare = new_core("w0"), new_core("w1"), new_core("spare")
    apply_all([w0, w1], mesh(model, 5, ("w0", "w1"), epoch=5, store_port=store.port))
    sent_id = w1.info()["kv_cache_id"]
    moved = handed_over(mesh(model, 6, ("w0", "spare"), epoch=6, store_port=store.port), 1, "w1")  # w1 died
    apply_all([w0, spare], moved)
    assert spare.info()["kv_cache_id"] not in ("", sent_id) and spare.kv_moved["received"] == 0


def pair(store: dist.TCPStore, name: str) -> list[dist.ProcessGroup]:
    backend = Backend("gloo", timedelta(seconds=10))
    groups: list[dist.ProcessGroup] = [None, None]  # type: ignore[list-item]

    def join(rank: int) -> None:  # a store client per side, as each worker has its own
        client = dist.TCPStore("127.0.0.1", store.port, None, False, timeout=timedelta(seconds=10))
        groups[rank] = backend.group(client, name, rank, 2)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return groups


def test_the_receiver_refuses_a_cache_sized_for_another_shard(store: dist.TCPStore) -> None:
    send_pg, recv_pg = pair(store, "kv/a/b/rank0")
    src, dst = torch.arange(12.0).view(3, 4), torch.zeros(3, 4)
    header = kv_transfer.Header(kv_transfer.key_digest(("shard", 1)), "abc", ((1, "r", 4),), {})
    sent: list[int] = []
    t = threading.Thread(target=lambda: sent.append(kv_transfer.send(send_pg, header, lambda s, n, _: [src[s, :n]],
                                                                       torch.device("cpu"))))  # fmt: skip
    t.start()
    with pytest.raises(ValueError, match="sized for another shard"):
        kv_transfer.receive(recv_pg, kv_transfer.key_digest(("shard", 2)), lambda s, n, _: [dst[s, :n]],
                            torch.device("cpu"))  # fmt: skip
    t.join(30)
    assert sent == [0] and not dst.any()


def test_rows_arrive_where_they_came_from(store: dist.TCPStore) -> None:
    send_pg, recv_pg = pair(store, "kv/a/b/rank1")
    key = kv_transfer.key_digest(("shard", 1))
    src_kv, src_ids = torch.randn(4, 8, 2), torch.randint(0, 100, (4, 8))
    dst_kv, dst_ids = torch.zeros(4, 8, 2), torch.zeros(4, 8, dtype=torch.int64)
    header = kv_transfer.Header(key, "abc", ((0, "r", 3), (2, "s", 8), (3, "t", 0)), {"s": 11})
    rows = lambda s, n, _: [src_kv[s, :n], src_ids[s, :n]]  # noqa: E731
    t = threading.Thread(target=kv_transfer.send, args=(send_pg, header, rows, torch.device("cpu")))
    t.start()
    got, received = kv_transfer.receive(recv_pg, key, lambda s, n, _: [dst_kv[s, :n], dst_ids[s, :n]],
                                        torch.device("cpu"))  # fmt: skip
    t.join(30)
    assert got == header and received == (3 + 8) * (2 * 4 + 8)
    assert torch.equal(dst_kv[0, :3], src_kv[0, :3]) and torch.equal(dst_kv[2], src_kv[2])
    assert torch.equal(dst_ids[2], src_ids[2]) and not dst_kv[0, 3:].any() and not dst_kv[1].any()
