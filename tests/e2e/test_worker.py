"""Stage workers as real processes under a real coordinator, driven step by step as the gateway does."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from shardmesh.proto.v1 import worker_pb2
from tests.checkpoints import make_checkpoint, reference_greedy
from tests.stack import Stack, worker_stubs

PROMPT = [1, 17, 5, 42, 33, 8]
GREEDY = worker_pb2.TokenSampling(temperature=0.0, top_p=1.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("w"), "llama-gqa-tied", num_layers=4, seed=5)


def run_step(stubs, version: int, step_id: int, entries: list[worker_pb2.BatchEntry]) -> worker_pb2.StepResponse:
    """The same StepRequest to every shard at once; the last shard's answer carries the tokens."""
    req = worker_pb2.StepRequest(step_id=step_id, topology_version=version, entries=entries)
    futures = [s.Step.future(req, timeout=30) for s in stubs]
    return [f.result() for f in futures][-1]


def greedy_decode(stubs, version: int, prompt: list[int], n: int, slot: int = 0, rid: str = "r") -> list:
    out, pos, inputs = [], 0, prompt
    for i in range(n):
        e = worker_pb2.BatchEntry(request_id=rid, slot=slot, start_pos=pos, num_tokens=len(inputs),
                                  token_ids=inputs, sampling=GREEDY)  # fmt: skip
        tok = run_step(stubs, version, i, [e]).tokens[0]
        out.append((tok.token_id, tok.logprob))
        pos += len(inputs)
        inputs = [tok.token_id]
    return out


@pytest.mark.parametrize("pp,tp", [(2, 1), (1, 2), (2, 2)])
def test_steps_match_transformers(model: Path, stack: Stack, pp: int, tp: int) -> None:
    import torch

    stack.start_coordinator(model, pp, tp)
    for r in range(pp * tp):
        stack.start_worker(f"w{r}")
    topo = stack.wait_complete()
    ref_tokens, ref_logits = reference_greedy(model, PROMPT, 8)
    ref_logprobs = [torch.log_softmax(ref_logits[0][-1], -1)[ref_tokens[0]].item()] + [
        torch.log_softmax(ref_logits[i], -1)[ref_tokens[i]].item() for i in range(1, 8)
    ]
    got = greedy_decode(worker_stubs(topo), topo.version, PROMPT, 8)
    assert [t for t, _ in got] == ref_tokens
    assert max(abs(lp - r) for (_, lp), r in zip(got, ref_logprobs, strict=True)) < 1e-4


def test_release_frees_the_slot_on_every_stage_and_refusals_name_fields(model: Path, stack: Stack) -> None:
    stack.start_coordinator(model, 2, 1, "--kv-slots", "4", "--max-context", "64")
    stack.start_worker("a")
    stack.start_worker("b")
    topo = stack.wait_complete()
    stubs = worker_stubs(topo)
    greedy_decode(stubs, topo.version, PROMPT, 2, slot=3, rid="x")
    infos = [s.GetShardInfo(worker_pb2.GetShardInfoRequest()) for s in stubs]
    assert [(i.free_slots, i.total_slots) for i in infos] == [(3, 4), (3, 4)]
    assert [(i.layer_start, i.layer_end) for i in infos] == [(0, 2), (2, 4)]
    for s in stubs:
        s.Release(worker_pb2.ReleaseRequest(sequences=[worker_pb2.ReleasedSequence(request_id="x", slot=3)]))
    assert [s.GetShardInfo(worker_pb2.GetShardInfoRequest()).free_slots for s in stubs] == [4, 4]

    def refused(entry: worker_pb2.BatchEntry, version: int = topo.version) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as e:
            stubs[0].Step(worker_pb2.StepRequest(step_id=9, topology_version=version, entries=[entry]), timeout=10)
        return e.value

    e = refused(worker_pb2.BatchEntry(request_id="y", slot=4, num_tokens=1, token_ids=[1], sampling=GREEDY))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "entries[0].slot: 4 outside [0, 4)" in e.details()
    e = refused(worker_pb2.BatchEntry(request_id="y", slot=0, num_tokens=1, token_ids=[500], sampling=GREEDY))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "entries[0].token_ids: [500] outside" in e.details()
    e = refused(worker_pb2.BatchEntry(request_id="y", slot=0, start_pos=63, num_tokens=2, token_ids=[1, 2],
                                      sampling=GREEDY))  # fmt: skip
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "exceeds max_context=64" in e.details()
    bad_p = worker_pb2.TokenSampling(temperature=1.0, top_p=1.5)
    e = refused(worker_pb2.BatchEntry(request_id="y", slot=0, num_tokens=1, token_ids=[1], sampling=bad_p))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in e.details()
    e = refused(worker_pb2.BatchEntry(request_id="y", slot=0, num_tokens=1, token_ids=[1], sampling=GREEDY), 1)
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "predates" in e.details()


def test_lost_worker_fails_the_step_then_the_mesh_recovers(model: Path, stack: Stack) -> None:
    stack.start_coordinator(model, 2, 1)
    stack.start_worker("a")
    stack.start_worker("b")
    topo = stack.wait_complete()
    expected = greedy_decode(worker_stubs(topo), topo.version, PROMPT, 3)

    stack.kill("b")  # the last stage dies; stage 0 is alone with its link
    entry = worker_pb2.BatchEntry(request_id="z", slot=1, num_tokens=len(PROMPT), token_ids=PROMPT, sampling=GREEDY)
    req = worker_pb2.StepRequest(step_id=100, topology_version=topo.version, entries=[entry])
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        worker_stubs(topo)[0].Step(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert time.monotonic() - t0 < 25, "a lost peer must fail the step, not hang it"

    stack.start_worker("b")  # back with the same id: takes its slot back, everyone re-forms groups
    topo2 = stack.wait_complete(after_version=topo.version)
    assert topo2.rendezvous is not None and topo.rendezvous is not None
    assert topo2.rendezvous.epoch > topo.rendezvous.epoch
    assert greedy_decode(worker_stubs(topo2), topo2.version, PROMPT, 3) == expected
