"""Penalties after a fail-over: a last stage that replaces a lost one rebuilds each sequence's token history from the
replay the gateway sends it, so it draws the same penalised tokens as the stage it replaces would have. On real
stage cores over real Gloo links in this process (the gateway's half: tests/unit/gateway/test_scheduler.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch.distributed as dist

from shardmesh.core.step import SamplingParams, StepEntry
from shardworker.runtime import StageWorkerCore
from tests.unit.shardworker.cores import apply_all, new_core, run_step
from tests.unit.shardworker.fakes import mesh

PROMPT = (1, 17, 5, 42, 9, 3)
PENALTIES = {"repetition_penalty": 1.8, "frequency_penalty": 0.8, "presence_penalty": 0.5, "prompt_len": len(PROMPT)}
BEFORE, AFTER = 3, 6  # tokens decoded before the last stage is lost, and after


def generate(cores: list[StageWorkerCore], version: int, key: str, slot: int, sampling: SamplingParams,
             log: list[int], n: int) -> list[int]:  # fmt: skip
    """`n` tokens on from `log` (the prompt alone, or prompt + tokens whose last one is not fed yet)."""
    out: list[int] = []
    for _ in range(n):
        start = 0 if len(log) == len(PROMPT) and not out else len(log) - 1
        step = StepEntry(key, slot, start, len(log) - start, tuple(log[start:]), sampling)
        token = run_step(cores, version, [step])[-1].sampled[0].token_id
        out.append(token)
        log = [*log, token]
    return out


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(**PENALTIES), SamplingParams(temperature=0.3, seed=11, min_p=0.05, **PENALTIES)],
    ids=["greedy", "seeded"],
)
def test_a_replaced_last_stage_draws_the_same_penalised_tokens(model: Path, store: dist.TCPStore,
                                                               sampling: SamplingParams) -> None:  # fmt: skip
    w0, w1, w2 = new_core("w0"), new_core("w1"), new_core("w2")
    apply_all([w0, w1], mesh(model, 5, ("w0", "w1"), epoch=5, store_port=store.port))
    # The undisturbed answer, in slot 0; and without penalties, to show they matter here.
    reference = generate([w0, w1], 5, "ref", 0, sampling, list(PROMPT), BEFORE + AFTER)
    plain = generate([w0, w1], 5, "plain", 2, replace(sampling, repetition_penalty=1.0, frequency_penalty=0.0,
                                                      presence_penalty=0.0), list(PROMPT), BEFORE + AFTER)  # fmt: skip
    assert plain != reference
    # The same request in slot 1, and one that will replay without its ids recorded (no penalty then) in slot 3.
    log = [*PROMPT, *generate([w0, w1], 5, "r", 1, sampling, list(PROMPT), BEFORE)]
    control = [*PROMPT, *generate([w0, w1], 5, "c", 3, sampling, list(PROMPT), BEFORE)]
    assert log == control and log[len(PROMPT) :] == reference[:BEFORE]

    apply_all([w0, w2], mesh(model, 6, ("w0", "w2"), epoch=6, store_port=store.port))  # w1 is gone: w2 replaces it
    # The gateway replays the cached positions on stage 1 only (stage 0 sends what it recorded), sampling nothing.
    replay = StepEntry("r", 1, 0, len(log) - 1, tuple(log[:-1]), sampling, True, 1)
    unrecorded = StepEntry("c", 3, 0, len(control) - 1, tuple(control[:-1]), SamplingParams(), True, 1)
    assert not run_step([w0, w2], 6, [replay, unrecorded])[-1].sampled
    assert log[len(PROMPT) :] + generate([w0, w2], 6, "r", 1, sampling, log, AFTER) == reference
    # A stage that did not get the ids draws from other counts: the check above can fail.
    assert control[len(PROMPT) :] + generate([w0, w2], 6, "c", 3, sampling, control, AFTER) != reference
