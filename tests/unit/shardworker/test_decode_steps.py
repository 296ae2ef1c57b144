"""Several decode steps in one call (worker.proto `StepRequest.decode_steps`): a single-stage core feeds each
entry the token it drew, so one call draws what as many single steps would (greedy, and seeded sampling with
penalties, which count the tokens the core records itself), on a slot cache and a paged one; a pipeline's last
stage sends each drawn token back to the first over the loop link, with the same tokens; and a call the core
cannot run that way is refused naming the field. On real stage cores in this process."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from shardmesh.core.errors import InvalidArgument, MeshError, ResourceExhausted, Unavailable
from shardmesh.core.step import SamplingParams, StepEntry
from shardmesh.core.topology import ServingLimits, ShardState
from shardmesh.engine import shm_link
from shardmesh.engine.sampling import sample
from shardworker import runtime
from shardworker.metrics import WorkerMetrics
from shardworker.runtime import MAX_DECODE_STEPS, StageWorkerCore, _validate_decode_steps
from tests.checkpoints import make_checkpoint, reference_greedy
from tests.unit.engine.test_groups import GLOO_CLOSED
from tests.unit.shardworker.cores import apply_all, new_core, on_every_core, run_step
from tests.unit.shardworker.fakes import mesh

PROMPT = (1, 17, 5, 42, 9, 3)
PAGED = ServingLimits(kv_slots=4, max_context=64, max_batch_tokens=64, kv_block_size=4, kv_blocks=24)
TABLE = (7, 3, 12, 0, 21, 9)
GREEDY = SamplingParams()
SLOTS = ServingLimits(4, 64, 64)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, repetition_penalty=1.3, prompt_len=len(PROMPT))


def one_stage(model: Path, store: dist.TCPStore, limits: ServingLimits | None = None) -> StageWorkerCore:
    core = new_core("w0")
    topology = mesh(model, 5, ("w0",), epoch=5, store_port=store.port)
    apply_all([core], replace(topology, limits=limits) if limits is not None else topology)
    return core


def entry(start: int, tokens: tuple[int, ...], sampling: SamplingParams = GREEDY, request: str = "r",
          slot: int = 1, blocks: tuple[int, ...] = ()) -> StepEntry:  # fmt: skip
    return StepEntry(request, slot, start, len(tokens), tokens, sampling, blocks=blocks)


def decode(core: StageWorkerCore, sampling: SamplingParams, n: int, per_call: int,
           blocks: tuple[int, ...] = ()) -> list[int]:  # fmt: skip
    """The prompt, then `n` tokens in calls of at most `per_call` decode steps; the tokens drawn."""
    out = [core.step(5, [entry(0, PROMPT, sampling, blocks=blocks)]).sampled[0].token_id]
    while len(out) < n:
        k = min(per_call, n - len(out))
        result = core.step(5, [entry(len(PROMPT) + len(out) - 1, (out[-1],), sampling, blocks=blocks)], k)
        assert result.steps == k and len(result.sampled) == k
        out += [s.token_id for s in result.sampled]
    return out


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each `StageWorkerCore._drawn_steps` of the test drew its steps in one call of the engine (not None)."""
    calls: list[bool] = []
    original = runtime.StageWorkerCore._drawn_steps

    def spied(self: StageWorkerCore, *args: object) -> object:
        got = original(self, *args)  # type: ignore[arg-type]
        calls.append(got is not None)
        return got

    monkeypatch.setattr(runtime.StageWorkerCore, "_drawn_steps", spied)
    return calls


def test_one_call_of_several_steps_draws_what_single_steps_draw(model: Path, store: dist.TCPStore) -> None:
    core = one_stage(model, store)
    assert decode(core, GREEDY, 12, 5) == reference_greedy(model, list(PROMPT), 12)[0]
    core.release([("r", 1)])
    # Seeded sampling with a repetition penalty: the penalty counts the tokens the core fed itself.
    single = decode(core, SEEDED, 10, 1)
    core.release([("r", 1)])
    assert decode(core, SEEDED, 10, 9) == single


@pytest.mark.parametrize("sampling", [GREEDY, replace(SEEDED, repetition_penalty=1.0), SEEDED,
                                      replace(SEEDED, frequency_penalty=1.2, presence_penalty=-0.5),
                                      SamplingParams(repetition_penalty=1.5, frequency_penalty=0.4),
                                      replace(GREEDY, top_logprobs=4), replace(SEEDED, top_logprobs=2)],
                         ids=["greedy", "sampled", "repetition", "frequency-presence", "greedy-penalised",
                              "greedy-alternatives", "penalised-alternatives"])  # fmt: skip
def test_steps_in_one_call_give_the_tokens_and_log_probabilities_of_single_steps(
        model: Path, store: dist.TCPStore, calls: list[bool], sampling: SamplingParams) -> None:  # fmt: skip
    """A single stage's call of several steps, greedy or seeded, with penalties or without, asking for alternatives
    or not, draws them all in one call of its engine (`StageEngine.drawn_steps`); each token, its log-probability
    and its alternatives are those a call per step samples, to the bit. Calls of 4 steps: the second counts, for its
    penalties, the tokens the first drew."""
    core = one_stage(model, store)

    def drawn(per_call: int) -> list[tuple[int, float, tuple[tuple[int, float], ...]]]:
        first = core.step(5, [entry(0, PROMPT, sampling)]).sampled[0]
        out = [(first.token_id, first.logprob, first.top_logprobs)]
        while len(out) < 9:
            k = min(per_call, 9 - len(out))
            result = core.step(5, [entry(len(PROMPT) + len(out) - 1, (out[-1][0],), sampling)], k)
            out += [(s.token_id, s.logprob, s.top_logprobs) for s in result.sampled]
        core.release([("r", 1)])
        return out

    one_call = drawn(4)
    assert one_call == drawn(1)
    assert calls and all(calls)  # every call of several steps took the one call
    assert all(len(top) == sampling.top_logprobs for _, _, top in one_call)


def test_two_sequences_step_together_and_a_paged_cache_too(model: Path, store: dist.TCPStore) -> None:
    core = one_stage(model, store, PAGED)
    reference = reference_greedy(model, list(PROMPT), 9)[0]
    assert decode(core, GREEDY, 9, 4, blocks=TABLE) == reference
    other = (1, 17, 5, 42, 9, 3, 60)
    first = run_step([core], 5, [entry(0, PROMPT, slot=0, request="a", blocks=TABLE),
                                 entry(0, other, slot=2, request="b", blocks=(1, 2, 4, 5))])[0]  # fmt: skip
    a, b = (s.token_id for s in first.sampled)
    result = core.step(5, [entry(6, (a,), slot=0, request="a", blocks=TABLE),
                           entry(7, (b,), slot=2, request="b", blocks=(1, 2, 4, 5))], 4)  # fmt: skip
    drawn = [s.token_id for s in result.sampled]  # step-major: a, b, a, b...
    assert [a, *drawn[0::2]] == reference[:5]
    assert [b, *drawn[1::2]] == reference_greedy(model, list(other), 5)[0]


def test_a_penalised_call_the_compiled_path_cannot_take_samples_step_by_step_untallied(
        model: Path, store: dist.TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A paged cache whose head dims the compiled path cannot attend in place (this model's 12: `paged_rows`) takes
    the eager model, one step at a time: a penalised call there draws what calls of one step draw, without tallying
    its tokens for a compiled call that will not run."""
    core = one_stage(model, store, PAGED)
    tallied: list[int] = []
    original = runtime.StageWorkerCore._penalties

    def spied(*args: object) -> object:
        tallied.append(1)
        return original(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(runtime.StageWorkerCore, "_penalties", staticmethod(spied))
    single = decode(core, SEEDED, 9, 1, blocks=TABLE)
    core.release([("r", 1)])
    assert decode(core, SEEDED, 9, 4, blocks=TABLE) == single
    assert tallied == []


def pipelined(cores: list[StageWorkerCore], sampling: SamplingParams, n: int, per_call: int,
              version: int = 5) -> list[int]:  # fmt: skip
    """`decode` on every core of a pipeline at once; each call's results are checked against its steps: the last
    stage alone returns tokens, and each of them but the call's last went round the loop (last stage to first)."""
    first = run_step(cores, version, [entry(0, PROMPT, sampling)])
    out = [first[-1].sampled[0].token_id]
    while len(out) < n:
        k, step = min(per_call, n - len(out)), entry(len(PROMPT) + len(out) - 1, (out[-1],), sampling)
        before = [(core.stats.steps, core.stats.recv_wait_s) for core in cores]
        results = on_every_core(cores, lambda core, k=k, step=step: core.step(version, [step], k))
        assert [len(r.sampled) for r in results] == [0] * (len(cores) - 1) + [k]
        assert all(r.steps == k for r in results)
        # Each core counts every step of the call, and the waits the call reports (the loop's included).
        assert [core.stats.steps - s for core, (s, _) in zip(cores, before, strict=True)] == [k] * len(cores)
        waits = [core.stats.recv_wait_s - w for core, (_, w) in zip(cores, before, strict=True)]
        assert waits == pytest.approx([r.comm.recv_wait_s for r in results], abs=1e-9)
        assert (results[0].comm.recv_messages, results[-1].comm.send_messages) == (k - 1, k - 1)
        out += [s.token_id for s in results[-1].sampled]
        # The loop closes a ring: the first stage counts what it received as from the last, which sent to stage 0.
        ends = [WorkerMetrics(core.info, lambda: "w", "cpu") for core in (cores[0], cores[-1])]
        ends[0].observe(results[0], k)
        ends[1].observe(results[-1], k)
        last = str(len(cores) - 1)
        got = [m.registry.get_sample_value("shardmesh_link_messages_total", {"direction": d, "peer_stage": peer})
               for m, d, peer in ((ends[0], "received", last), (ends[1], "sent", "0"))]  # fmt: skip
        assert got == [k - 1, k - 1] if k > 1 else got == [None, None]
    for core in cores:
        core.release([("r", 1)])
    return out


@pytest.mark.parametrize("stages", [2, 3])
def test_a_pipeline_loops_its_drawn_tokens_back_to_the_first_stage(model: Path, store: dist.TCPStore,
                                                                   stages: int) -> None:  # fmt: skip
    ids = tuple(f"w{i}" for i in range(stages))
    cores = [new_core(w) for w in ids]
    apply_all(cores, mesh(model, 5, ids, epoch=5, store_port=store.port))
    groups = [core._runtime.engine.groups for core in cores]  # type: ignore[union-attr]
    assert [g.loop is not None for g in groups] == [True] + [False] * (stages - 2) + [True]
    assert pipelined(cores, GREEDY, 10, 4) == reference_greedy(model, list(PROMPT), 10)[0]  # calls of 4, 4, 1
    # Seeded sampling with a repetition penalty draws the same tokens in calls of one step and of several.
    assert pipelined(cores, SEEDED, 7, 6) == pipelined(cores, SEEDED, 7, 1)


# How a waiting peer learns its link closed: Gloo's connection, or the mark in a shared-memory ring.
CLOSED_LINK = {"gloo": GLOO_CLOSED, "shm": re.escape("closed the link (its epoch broke)")}


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("links", ["gloo", "shm"])
def test_a_stage_failing_part_way_through_a_call_fails_its_peers_at_once(model: Path, store: dist.TCPStore,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        stages: int, links: str) -> None:  # fmt: skip
    """The last stage raises something that is neither a refusal nor a lost peer in the second step of a call of
    4, after the first stage has begun waiting for that step's token: its epoch breaks and its groups close, so the
    first stage (and the stage between) fail on a closed link, not at the group timeout (30 s here: the message
    would say so), and every stage waits for a new epoch. Over Gloo links and over shared-memory ones. The later
    steps are sampled one at a time in Python (`_drawn_steps` declines them): over shared-memory links the last stage
    would otherwise draw them inside the layers' call, where no Python `sample` runs."""
    monkeypatch.setenv(shm_link.TRANSPORT_ENV, links)
    ids = tuple(f"w{i}" for i in range(stages))
    cores = [new_core(w) for w in ids]
    apply_all(cores, mesh(model, 5, ids, epoch=5, store_port=store.port))
    first = run_step(cores, 5, [entry(0, PROMPT)])[-1].sampled[0].token_id
    calls = []

    def failing_sample(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("a bug in sampling")
        return sample(*args, **kwargs)

    monkeypatch.setattr(runtime, "sample", failing_sample)
    monkeypatch.setattr(runtime.StageWorkerCore, "_drawn_steps", lambda *args: None)
    step = entry(len(PROMPT), (first,), SEEDED)
    results = on_every_core(cores, lambda core: core.step(5, [step], 4), raising=False)
    assert len(calls) == 2
    assert all(isinstance(r, MeshError) for r in results), results
    assert str(results[-1]).startswith(f"stage {stages - 1} tp rank 0 failed part-way through a step (ValueError: a "
                                       "bug in sampling); its epoch is broken")  # fmt: skip
    for r in results[:-1]:  # a peer lost: the link closed, not the group timeout
        assert isinstance(r, Unavailable) and re.search(CLOSED_LINK[links], str(r)), r
    assert all(core.state is ShardState.PENDING for core in cores)
    assert all(core.detail.startswith(("a step failed part-way", "process group broken")) for core in cores)
    # The broken epoch is not joined again, whatever the version; a new epoch forms new groups, and serves.
    on_every_core(cores, lambda core: core.apply(mesh(model, 6, ids, epoch=5, store_port=store.port)))
    assert all(core.state is ShardState.PENDING for core in cores)
    monkeypatch.setattr(runtime, "sample", sample)
    apply_all(cores, mesh(model, 7, ids, epoch=7, store_port=store.port))
    for core in cores:
        core.release([("r", 1)])
    assert pipelined(cores, GREEDY, 6, 3, version=7) == reference_greedy(model, list(PROMPT), 6)[0]


def _rt(stages: int = 1, tp: int = 1, limits: ServingLimits = SLOTS) -> SimpleNamespace:
    placement = SimpleNamespace(num_stages=stages, spec=SimpleNamespace(tp_size=tp), limits=limits)
    return SimpleNamespace(placement=placement)


@pytest.mark.parametrize(("rt", "entries", "n", "error", "field"), [
    (_rt(), [entry(6, (5,))], MAX_DECODE_STEPS + 1, InvalidArgument, "decode_steps"),
    (_rt(stages=2), [entry(6, (5,))], 2, None, ""),
    (_rt(stages=2), [replace(entry(6, (5,)), first_stage=0, end_stage=2)], 2, None, ""),
    (_rt(stages=3), [replace(entry(6, (5,)), first_stage=0, end_stage=2)], 2, InvalidArgument,
     "entries[0].first_stage"),
    (_rt(stages=2), [replace(entry(6, (5,)), first_stage=1)], 2, InvalidArgument, "entries[0].first_stage"),
    (_rt(), [entry(0, PROMPT)], 2, InvalidArgument, "entries[0].num_tokens"),
    (_rt(), [entry(6, (5,)), replace(entry(6, (5,), slot=2), skip_sampling=True)], 2, InvalidArgument,
     "entries[1].skip_sampling"),
    (_rt(), [replace(entry(6, (5,)), first_stage=0, end_stage=1)], 2, None, ""),
    (_rt(tp=2), [entry(6, (5,), SamplingParams(temperature=0.7))], 2, InvalidArgument, "entries[0].sampling.seed"),
    (_rt(tp=2), [entry(6, (5,), SamplingParams(temperature=0.7, seed=3))], 2, None, ""),
    (_rt(), [entry(60, (5,))], 5, ResourceExhausted, "entries[0].start_pos"),
    (_rt(limits=PAGED), [entry(6, (5,), blocks=(7, 3))], 3, InvalidArgument, "entries[0].blocks"),
    (_rt(limits=PAGED), [entry(6, (5,), blocks=(7, 3, 12))], 3, None, ""),
])  # fmt: skip
def test_what_several_steps_per_call_need_is_checked_naming_the_field(
    rt: SimpleNamespace, entries: list[StepEntry], n: int, error: type[MeshError] | None, field: str,
) -> None:  # fmt: skip
    if error is None:
        _validate_decode_steps(rt, entries, n)  # type: ignore[arg-type]
        return
    with pytest.raises(error) as info:
        _validate_decode_steps(rt, entries, n)  # type: ignore[arg-type]
    assert str(info.value).startswith(f"{field}: "), str(info.value)


@pytest.fixture(scope="module")
def whole_vector_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`model` with head dims of whole vectors (16), whose paged steps take the compiled path (`paged_rows`)."""
    return make_checkpoint(tmp_path_factory.mktemp("decode16"), "llama-gqa-tied", num_layers=4, seed=5,
                           eos_token_id=95, head_dim=16)  # fmt: skip


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "penalised"])
def test_a_paged_cache_draws_its_calls_of_steps_in_one_compiled_call(
        whole_vector_heads: Path, store: dist.TCPStore, calls: list[bool],
        sampling: SamplingParams) -> None:  # fmt: skip
    """On a paged cache the compiled path takes: every call of several steps is one call of the engine, the prompt
    included in the compiled layers, and draws what calls of one step draw (greedy: `transformers`' tokens)."""
    core = one_stage(whole_vector_heads, store, PAGED)
    single = decode(core, sampling, 10, 1, blocks=TABLE)
    core.release([("r", 1)])
    assert decode(core, sampling, 10, 4, blocks=TABLE) == single
    assert calls and all(calls)
    if sampling is GREEDY:
        assert single == reference_greedy(whole_vector_heads, list(PROMPT), 10)[0]
