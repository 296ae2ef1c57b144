"""A mesh whose KV cache is paged (`ServingLimits.kv_block_size`): every stage runs each entry in the blocks its
block table names, a block table the mesh cannot hold is refused naming `entries[i].blocks`, a shared prefix's
blocks are read by the sequences sharing them, a replay reads the activation log by block, and a hand-over ships
each sequence's blocks to the same ids. On real stage cores over real Gloo links in this process; the gateway that
hands out the blocks is tested on its own (tests/unit/gateway/test_blocks.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardmesh.core.errors import InvalidArgument
from shardmesh.core.step import SamplingParams, StepEntry
from shardmesh.core.topology import ServingLimits, Topology
from shardmesh.engine.kv_cache import PagedActivationLog, PagedKVCache
from shardmesh.proto.v1 import worker_pb2
from shardworker.runtime import StageWorkerCore
from shardworker.servicer import entry_from_pb
from tests.checkpoints import reference_greedy
from tests.unit.shardworker.cores import apply_all, new_core, on_every_core, run_step
from tests.unit.shardworker.fakes import Events, mesh
from tests.unit.shardworker.test_kv_transfer import handed_over

BS = 4  # tokens per block: small, so a prompt of a few tokens spans blocks
PAGED = ServingLimits(kv_slots=4, max_context=64, max_batch_tokens=64, kv_block_size=BS, kv_blocks=24)
PROMPT = (1, 17, 5, 42, 9, 3)
TABLE = (7, 3, 12, 0, 21, 9)  # scattered on purpose: positions [0, 24), blocks in no particular order


def paged(topology: Topology, limits: ServingLimits = PAGED) -> Topology:
    return replace(topology, limits=limits)


def entry(start: int, tokens: tuple[int, ...], blocks: tuple[int, ...] = TABLE, request: str = "r", slot: int = 1,
          sample: bool = True, first: int = 0) -> StepEntry:  # fmt: skip
    return StepEntry(request, slot, start, len(tokens), tokens, SamplingParams(), not sample, first, 0, blocks)


def greedy(cores: list[StageWorkerCore], version: int, prompt: tuple[int, ...], n: int, *, start: int = 0,
           blocks: tuple[int, ...] = TABLE, request: str = "r", slot: int = 1) -> list[int]:  # fmt: skip
    """`prompt[start:]` through the mesh (positions before `start` already cached in `blocks`), then greedy
    decoding: the `n` tokens drawn."""
    fed = prompt[start:]
    out = [run_step(cores, version, [entry(start, fed, blocks, request, slot)])[-1].sampled[0].token_id]
    pos = len(prompt)
    while len(out) < n:
        step = run_step(cores, version, [entry(pos, (out[-1],), blocks, request, slot)])
        out.append(step[-1].sampled[0].token_id)
        pos += 1
    return out


def test_a_paged_mesh_decodes_as_the_reference(model: Path, store: dist.TCPStore) -> None:
    events = Events()
    cores = [StageWorkerCore("w0", torch.device("cpu"), events, 30.0), new_core("w1")]
    apply_all(cores, paged(mesh(model, 5, ("w0", "w1"), epoch=5, store_port=store.port)))
    kv, log = cores[0]._runtime.caches.kv, cores[0]._runtime.caches.log  # type: ignore[union-attr]
    assert isinstance(kv, PagedKVCache) and isinstance(log, PagedActivationLog)
    assert (kv.num_blocks, kv.block_size, log.num_blocks) == (24, BS, 24)
    assert cores[1]._runtime.caches.log is None  # type: ignore[union-attr]  # the last stage keeps none
    allocated = [f for level, event, f in events.lines if event == "kv_cache_allocated"]
    assert allocated == [{"kv_layout": "paged", "kv_blocks": 24, "kv_block_size": BS, "kv_cache_bytes": kv.nbytes,
                          "activation_log_bytes": log.nbytes, "attention_kernel": kv.attention_kernel}]  # fmt: skip
    info = cores[0].info()
    assert (info["kv_blocks"], info["kv_block_size"], info["kv_cache_bytes"]) == (24, BS, kv.nbytes)

    assert greedy(cores, 5, PROMPT, 8) == reference_greedy(model, list(PROMPT), 8)[0]
    # Only the table's blocks were written: positions [0, 13) lie in blocks 7, 3, 12 and 0 (one position there).
    written = kv.data.movedim(2, 0).flatten(1).abs().sum(1).nonzero().flatten().tolist()  # by block
    assert sorted(written) == [0, 3, 7, 12] and cores[0]._runtime.caches.blocks == {1: TABLE}  # type: ignore[union-attr]


def test_a_shared_prefix_is_read_from_the_blocks_another_sequence_wrote(model: Path, store: dist.TCPStore) -> None:
    cores = [new_core("w0"), new_core("w1")]
    apply_all(cores, paged(mesh(model, 5, ("w0", "w1"), epoch=5, store_port=store.port)))
    first = (1, 17, 5, 42, 9, 3, 8, 11, 30)  # its first two blocks (8 tokens) are full, so shareable
    greedy(cores, 5, first, 2, blocks=(7, 3, 12, 0), request="a", slot=0)
    second = (*first[:8], 60, 61, 62)
    # "b" starts at position 8: its first two blocks are "a"'s, read and not computed again; its own blocks follow.
    got = greedy(cores, 5, second, 4, start=8, blocks=(7, 3, 5, 6), request="b", slot=2)
    assert got == reference_greedy(model, list(second), 4)[0]


def test_a_replaced_last_stage_is_fed_from_the_paged_activation_log(model: Path, store: dist.TCPStore) -> None:
    w0, w1, w2 = new_core("w0"), new_core("w1"), new_core("w2")
    apply_all([w0, w1], paged(mesh(model, 5, ("w0", "w1"), epoch=5, store_port=store.port)))
    drawn = greedy([w0, w1], 5, PROMPT, 2)
    log = [*PROMPT, *drawn]
    apply_all([w0, w2], paged(mesh(model, 6, ("w0", "w2"), epoch=6, store_port=store.port)))  # w1 is gone
    run_step([w0, w2], 6, [entry(0, tuple(log[:-1]), sample=False, first=1)])  # stage 0 sends its log's rows
    rest = greedy([w0, w2], 6, tuple(log), 4, start=len(log) - 1)  # the last token drawn, fed on
    assert drawn + rest == reference_greedy(model, list(PROMPT), 6)[0]


def test_a_hand_over_ships_each_sequences_blocks_to_the_same_ids(model: Path, store: dist.TCPStore) -> None:
    w0, w1, spare = new_core("w0"), new_core("w1"), new_core("spare")
    apply_all([w0, w1], paged(mesh(model, 5, ("w0", "w1"), epoch=5, store_port=store.port)))
    a = greedy([w0, w1], 5, PROMPT, 3, blocks=TABLE, request="a", slot=1)
    sent = w0._runtime.caches  # type: ignore[union-attr]
    tables = dict(sent.blocks)
    moved = paged(handed_over(mesh(model, 6, ("spare", "w1"), epoch=6, store_port=store.port), 0, "w0"))
    on_every_core([w0, spare, w1], lambda core: core.hand_off(moved) if core is w0 else core.apply(moved))
    got = spare._runtime.caches  # type: ignore[union-attr]
    assert got.blocks == tables == {1: TABLE} and got.lengths == {1: len(PROMPT) + 2}
    assert got.log is not None and sent.log is not None
    held = TABLE[:2]  # the prompt and the two tokens fed back: positions [0, 8), blocks 7 and 3
    assert torch.equal(got.kv.data[:, :, held], sent.kv.data[:, :, held]) and got.kv.data[:, :, held].any()
    assert torch.equal(got.log.data[list(held)], sent.log.data[list(held)])
    assert not got.kv.data[:, :, TABLE[2]].any()  # a block the sequence had not reached: not sent
    assert spare.kv_moved["received"] == w0.kv_moved["sent"] > 0
    # Decoding goes on where it was, on the blocks that arrived: the same tokens as an undisturbed run.
    log = (*PROMPT, *a)
    rest = greedy([spare, w1], 6, log, 3, start=len(log) - 1)
    assert a + rest == reference_greedy(model, list(PROMPT), 6)[0]


def refused(core: StageWorkerCore, version: int, entries: list[StepEntry]) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as caught:
        core.step(version, entries)
    return caught.value


def test_block_tables_the_mesh_cannot_hold_are_refused_naming_the_entry(model: Path, store: dist.TCPStore) -> None:
    core = new_core("w0")
    apply_all([core], paged(mesh(model, 2, ("w0",), epoch=2, store_port=store.port)))
    ok = entry(0, (5, 6), blocks=(1,), request="ok", slot=0)
    cases = {
        "required: this mesh's KV cache is paged (kv_block_size 4), positions [0, 6) need a block table":
            entry(0, PROMPT, blocks=()),
        "positions [0, 6) need 2 blocks of 4 tokens, the block table has 1": entry(0, PROMPT, blocks=(2,)),
        "block id 24 is out of range: the KV cache has 24 blocks": entry(0, PROMPT, blocks=(2, 24)),
        "block 1 is written by entries[0] too in this step": entry(0, PROMPT, blocks=(2, 1)),
    }  # fmt: skip
    for message, bad in cases.items():
        e = refused(core, 2, [ok, bad])
        assert e.field_name == "entries[1].blocks" and message in str(e), str(e)
    # A block only read (a shared prefix, before start_pos) may be in several tables of one step.
    run_step([core], 2, [entry(0, (5, 6, 7, 8), blocks=(1,), request="a", slot=0)])
    shared = [entry(4, (9,), blocks=(1, 2), request="a", slot=0), entry(4, (10,), blocks=(1, 3), request="b", slot=2)]
    assert len(run_step([core], 2, shared)[-1].sampled) == 2


def test_a_slot_mesh_refuses_a_block_table(model: Path, store: dist.TCPStore) -> None:
    core = new_core("w0")
    apply_all([core], mesh(model, 2, ("w0",), epoch=2, store_port=store.port))
    e = refused(core, 2, [entry(0, PROMPT, blocks=(0, 1))])
    assert e.field_name == "entries[0].blocks" and "kv_block_size 0" in str(e)


def test_calibrating_a_paged_cache_renames_it_and_bounds_the_batch_by_blocks(model: Path, store: dist.TCPStore) -> None:
    few = ServingLimits(kv_slots=4, max_context=12, max_batch_tokens=12, kv_block_size=BS, kv_blocks=3)
    core = new_core("w0")
    apply_all([core], paged(mesh(model, 2, ("w0",), epoch=2, store_port=store.port), few))
    before = core.info()["kv_cache_id"]
    with pytest.raises(InvalidArgument, match=r"^decode_batch: must be in \[1, 3\], got 4$"):
        core.calibrate(2, decode_batch=4, prefill_tokens=8, iterations=1)  # a block each to write: 3 blocks
    assert core.info()["kv_cache_id"] == before  # a refused calibration writes nothing
    result = core.calibrate(2, decode_batch=3, prefill_tokens=8, iterations=1)
    assert result["timing"].decode.total_ms > 0 and core.info()["kv_cache_id"] not in ("", before)


def test_the_wire_carries_the_block_table() -> None:
    pb = worker_pb2.BatchEntry(request_id="r", slot=1, start_pos=4, num_tokens=1, token_ids=[5], blocks=[9, 2])
    assert entry_from_pb(pb).blocks == (9, 2)
    with pytest.raises(InvalidArgument, match=r"^entries\.blocks: .*block id 9 appears twice"):
        entry_from_pb(worker_pb2.BatchEntry(request_id="r", slot=1, num_tokens=1, token_ids=[5], blocks=[9, 9]))


def test_the_worker_reports_its_blocks_and_kv_bytes(model: Path, store: dist.TCPStore) -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from shardworker.metrics import WorkerMetrics

    def samples(core: StageWorkerCore) -> dict[tuple[str, str], float]:
        text = generate_latest(WorkerMetrics(core.info, lambda: core.worker_id, "cpu").registry).decode()
        return {(s.name, next(iter(s.labels.values()), "")): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip

    cores = [new_core("w0"), new_core("w1")]
    apply_all(cores, paged(mesh(model, 5, ("w0", "w1"), epoch=5, store_port=store.port)))
    first, last = samples(cores[0]), samples(cores[1])
    caches = cores[0]._runtime.caches  # type: ignore[union-attr]
    assert caches.log is not None
    assert first[("shardmesh_kv_blocks", "total")] == 24 and first[("shardmesh_kv_block_tokens", "")] == BS
    assert first[("shardmesh_kv_cache_bytes", "keys_values")] == caches.kv.nbytes
    assert first[("shardmesh_kv_cache_bytes", "activation_log")] == caches.log.nbytes > 0
    assert last[("shardmesh_kv_cache_bytes", "activation_log")] == 0  # the last stage keeps no log
    apply_all(cores, mesh(model, 6, ("w0", "w1"), epoch=6, store_port=store.port))  # slots: no blocks to report
    assert ("shardmesh_kv_blocks", "total") not in samples(cores[0])
