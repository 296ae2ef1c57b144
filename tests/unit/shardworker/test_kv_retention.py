"""A worker keeps its KV cache (and its id) across rendezvous epochs while its shard is unchanged, and a replay
runs on the stages that lost a sequence's cache only: on real stage cores over real Gloo links in this process.

The gateway's half (which stages to replay, from the cache ids in the topology) is in
tests/unit/gateway/test_retained_replay.py; the whole path over real processes in tests/e2e/test_elastic.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardmesh.core.errors import InvalidArgument
from shardmesh.core.step import SamplingParams, Segment, StepEntry
from shardworker.runtime import StageWorkerCore
from tests.checkpoints import reference_greedy
from tests.unit.shardworker.cores import apply_all, new_core, on_every_core, run_step
from tests.unit.shardworker.fakes import mesh

PROMPT = (1, 17, 5, 42, 9, 3)


def entry(start: int, tokens: tuple[int, ...], sample: bool = True, first: int = 0, end: int = 0) -> StepEntry:
    return StepEntry("r", 1, start, len(tokens), tokens, SamplingParams(), not sample, first, end)


def count_forwards(core: StageWorkerCore) -> Callable[[], int]:
    """How many times `core`'s shard runs its layers from now on: eagerly, or through the compiled decode path."""
    engine = core._runtime.engine  # type: ignore[union-attr]
    calls = [0]

    def counting(run: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return run(*args, **kwargs)

        return counted

    engine.model.forward = counting(engine.model.forward)  # type: ignore[method-assign]
    if engine.native is not None:
        engine.native.run = counting(engine.native.run)  # type: ignore[method-assign]
    return lambda: calls[0]


def decode(cores: list[StageWorkerCore], version: int, log: list[int], n: int) -> list[int]:
    """Greedy decoding of `n` tokens on from `log` (prompt + tokens, the last one not yet fed)."""
    out = []
    for _ in range(n):
        token = run_step(cores, version, [entry(len(log) - 1, (log[-1],))])[-1].sampled[0].token_id
        out.append(token)
        log = [*log, token]
    return out


def prefill(cores: list[StageWorkerCore], version: int) -> list[int]:
    """The prompt and two decoded tokens through the mesh: the log, its last token not fed yet."""
    first = run_step(cores, version, [entry(0, PROMPT)])[-1].sampled[0].token_id
    log = [*PROMPT, first]
    return [*log, *decode(cores, version, log, 1)]


def test_an_unchanged_mesh_keeps_every_cache_across_an_epoch(model: Path, store: dist.TCPStore) -> None:
    cores = [new_core("w0"), new_core("w1")]
    apply_all(cores, mesh(model, 5, ("w0", "w1"), epoch=5, store_port=store.port))
    ids = [core.info()["kv_cache_id"] for core in cores]
    assert all(ids) and ids[0] != ids[1]
    log = prefill(cores, 5)
    apply_all(cores, mesh(model, 6, ("w0", "w1"), epoch=6, store_port=store.port))
    assert [core.info()["kv_cache_id"] for core in cores] == ids
    # No replay: decoding goes on from the cached positions, and equals an undisturbed run.
    reference = reference_greedy(model, list(PROMPT), 6)[0]
    assert log[len(PROMPT) :] + decode(cores, 6, log, 4) == reference


def test_a_replaced_last_stage_is_fed_from_the_first_stages_activation_log(model: Path, store: dist.TCPStore) -> None:
    w0, w1, w2 = new_core("w0"), new_core("w1"), new_core("w2")
    apply_all([w0, w1], mesh(model, 5, ("w0", "w1"), epoch=5, store_port=store.port))
    kept = w0.info()["kv_cache_id"]
    log = prefill([w0, w1], 5)
    apply_all([w0, w2], mesh(model, 6, ("w0", "w2"), epoch=6, store_port=store.port))  # w1 is gone
    assert w0.info()["kv_cache_id"] == kept and w2.info()["kv_cache_id"] not in ("", kept)
    forwards = count_forwards(w0)
    # Replay the cached positions on stage 1 only: stage 0 sends what it recorded, and computes nothing.
    replay = entry(0, tuple(log[:-1]), sample=False, first=1)
    results = run_step([w0, w2], 6, [replay])
    assert forwards() == 0 and results[0].comm.send_messages == 1 and not results[-1].sampled
    reference = reference_greedy(model, list(PROMPT), 6)[0]
    assert log[len(PROMPT) :] + decode([w0, w2], 6, log, 4) == reference
    assert forwards() == 4  # the decode steps


def test_a_call_of_several_decode_steps_logs_what_single_steps_log_and_a_replay_feeds_it(
    model: Path, store: dist.TCPStore
) -> None:
    """What the first stage logs of a decode call's steps (each step's activations, sent on and recorded) equals
    what it logs of the same tokens fed one step per call (in another slot), and a replay after the call feeds
    those rows to the replacement of the last stage, decoding on as if nothing had happened."""
    w0, w1, w2 = new_core("w0"), new_core("w1"), new_core("w2")
    apply_all([w0, w1], mesh(model, 5, ("w0", "w1"), epoch=5, store_port=store.port))
    first = run_step([w0, w1], 5, [entry(0, PROMPT)])[-1].sampled[0].token_id
    call = on_every_core([w0, w1], lambda core: core.step(5, [entry(len(PROMPT), (first,))], 4))
    log = [*PROMPT, first, *(s.token_id for s in call[-1].sampled)]  # positions 6-9 fed by the call
    fed = log[:-1]
    alone = [replace(entry(0, PROMPT), request_id="s", slot=2)]
    alone += [replace(entry(pos, (token,)), request_id="s", slot=2) for pos, token in enumerate(fed) if pos >= 6]
    for step in alone:
        run_step([w0, w1], 5, [step])
    recorded = w0._runtime.engine.log  # type: ignore[union-attr]
    assert recorded is not None
    rows = recorded.rows(Segment(1, 0, len(fed)))
    assert (rows.abs().sum(-1) > 0).all()  # every position written (the log starts as unwritten memory)
    assert torch.equal(rows, recorded.rows(Segment(2, 0, len(fed))))
    apply_all([w0, w2], mesh(model, 6, ("w0", "w2"), epoch=6, store_port=store.port))  # w1 is gone
    forwards = count_forwards(w0)
    run_step([w0, w2], 6, [entry(0, tuple(fed), sample=False, first=1)])
    assert forwards() == 0
    reference = reference_greedy(model, list(PROMPT), 8)[0]
    assert log[len(PROMPT) :] + decode([w0, w2], 6, log, 3) == reference


def test_a_replaced_first_stage_replays_alone_and_the_last_stage_keeps_its_cache(
    model: Path, store: dist.TCPStore
) -> None:
    w0, w1, w2 = new_core("w0"), new_core("w1"), new_core("w2")
    apply_all([w0, w1], mesh(model, 5, ("w0", "w1"), epoch=5, store_port=store.port))
    log = prefill([w0, w1], 5)
    apply_all([w2, w1], mesh(model, 6, ("w2", "w1"), epoch=6, store_port=store.port))  # w0 drained
    forwards = count_forwards(w1)
    replay = entry(0, tuple(log[:-1]), sample=False, first=0, end=1)  # stage 0 only: it embeds the tokens
    results = run_step([w2, w1], 6, [replay])
    assert forwards() == 0 and results[0].comm.send_messages == 0
    reference = reference_greedy(model, list(PROMPT), 6)[0]
    assert log[len(PROMPT) :] + decode([w2, w1], 6, log, 4) == reference


def test_a_replay_step_mixes_with_other_sequences_decoding(model: Path, store: dist.TCPStore) -> None:
    """A relay puts computed rows and recorded rows in the next stage's entry order."""
    w0, w1, w2 = new_core("w0"), new_core("w1"), new_core("w2")
    apply_all([w0, w1], mesh(model, 5, ("w0", "w1"), epoch=5, store_port=store.port))
    log = prefill([w0, w1], 5)
    apply_all([w0, w2], mesh(model, 6, ("w0", "w2"), epoch=6, store_port=store.port))
    other = StepEntry("s", 2, 0, 3, (7, 8, 9), SamplingParams())  # a new request, on every stage
    replay = entry(0, tuple(log[:-1]), sample=False, first=1)
    last = run_step([w0, w2], 6, [other, replay])[-1]
    assert [s.request_id for s in last.sampled] == ["s"]
    assert last.sampled[0].token_id == reference_greedy(model, [7, 8, 9], 1)[0][0]
    assert log[len(PROMPT) :] + decode([w0, w2], 6, log, 4) == reference_greedy(model, list(PROMPT), 6)[0]


def test_a_changed_shard_gets_a_new_cache(model: Path, store: dist.TCPStore) -> None:
    w0, w1 = new_core("w0"), new_core("w1")
    apply_all([w0, w1], mesh(model, 5, ("w0", "w1"), epoch=5, store_port=store.port))
    first = w0.info()["kv_cache_id"]
    apply_all([w1, w0], mesh(model, 6, ("w1", "w0"), epoch=6, store_port=store.port))  # the stages swap holders
    assert w0.info()["kv_cache_id"] not in ("", first)


def test_calibrating_over_kept_slots_renames_the_cache_and_reports_it(model: Path, store: dist.TCPStore) -> None:
    core = new_core("w0")
    apply_all([core], mesh(model, 2, ("w0",), epoch=2, store_port=store.port))
    run_step([core], 2, [entry(0, PROMPT)])
    apply_all([core], mesh(model, 3, ("w0",), epoch=3, store_port=store.port))
    kept = core.info()["kv_cache_id"]
    reported: list[str] = []
    core.on_cache_reset = lambda: reported.append(core.info()["kv_cache_id"])
    core.calibrate(3, decode_batch=2, prefill_tokens=4, iterations=1)  # its passes overwrite the kept slots
    assert reported and reported[0] not in ("", kept) and core.info()["active_sequences"] == 0


@pytest.mark.parametrize(
    ("first", "end", "sample", "field"),
    [(2, 0, False, "first_stage"), (1, 1, False, "first_stage"), (0, 1, True, "skip_sampling")],
)
def test_a_replay_range_outside_the_stages_is_refused_naming_the_field(
    model: Path, store: dist.TCPStore, first: int, end: int, sample: bool, field: str
) -> None:
    cores = [new_core("w0"), new_core("w1")]
    apply_all(cores, mesh(model, 5, ("w0", "w1"), epoch=5, store_port=store.port))
    with pytest.raises(InvalidArgument) as e:
        cores[0].step(5, [entry(0, PROMPT, sample=sample, first=first, end=end)])
    assert e.value.field_name == f"entries[0].{field}"
