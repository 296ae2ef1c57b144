"""The worker messages built from scheduling state: entries carry the log from the cached position."""

from __future__ import annotations

from gateway import wire
from gateway.batching import Planned
from gateway.requests import PreparedRequest, Sampling
from gateway.results import RequestHandle
from gateway.sequence import Sequence
from shardmesh.proto.v1 import worker_pb2


def running(key: str, prompt: tuple[int, ...], slot: int) -> Sequence:
    sampling = Sampling(temperature=0.5, top_p=0.9, top_k=4, seed=7)
    req = PreparedRequest(key, prompt, 8, sampling, (), frozenset(), None, 0.0)
    s = Sequence(req, RequestHandle(key, lambda: None), key)
    s.slot, s.sampling = slot, wire.token_sampling(sampling, len(prompt))
    return s


def test_a_step_request_carries_prompt_chunks_and_decode_rows() -> None:
    a, b = running("a", (1, 2, 3, 4, 5), slot=1), running("b", (9, 8), slot=0)
    b.cached = 2
    b.tokens.append(40)
    request = wire.step_request(7, 3, 6, [Planned(a, 3, False), Planned(b, 1, True)], 2)
    assert (request.step_id, request.topology_version, request.after_step_id) == (7, 3, 6)
    first, second = request.entries
    assert (first.request_id, first.slot, first.start_pos, first.num_tokens, list(first.token_ids)) == (
        "a", 1, 0, 3, [1, 2, 3]
    )  # fmt: skip
    assert first.skip_sampling and not second.skip_sampling
    assert (first.first_stage, first.end_stage, second.first_stage, second.end_stage) == (0, 0, 0, 0)
    assert (second.request_id, second.slot, second.start_pos, list(second.token_ids)) == ("b", 0, 2, [40])
    assert second.sampling == worker_pb2.TokenSampling(temperature=0.5, top_p=0.9, top_k=4, seed=7,
                                                       repetition_penalty=1, prompt_tokens=2)  # fmt: skip
    released = wire.released_slot("a", 1)
    assert (released.request_id, released.slot) == ("a", 1)


def test_a_sampled_request_without_a_seed_gets_one_and_a_greedy_one_none() -> None:
    """The gateway picks the seed, so a replay on other workers draws the same tokens (engine/sampling.py)."""
    sampled = wire.token_sampling(Sampling(temperature=0.7), 3)
    assert sampled.HasField("seed")
    assert wire.token_sampling(Sampling(temperature=0.7), 3).seed != sampled.seed  # one per request
    assert not wire.token_sampling(Sampling(), 3).HasField("seed")
    assert wire.token_sampling(Sampling(temperature=0.7, seed=5), 3).seed == 5


def test_penalties_min_p_top_logprobs_and_the_prompt_length_go_to_the_last_stage() -> None:
    sampling = Sampling(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=-1.0, min_p=0.25,
                        top_logprobs=4)  # fmt: skip
    pb = wire.token_sampling(sampling, 6)
    assert (pb.repetition_penalty, pb.frequency_penalty, pb.presence_penalty, pb.min_p) == (1.5, 0.5, -1.0, 0.25)
    assert (pb.top_logprobs, pb.prompt_tokens, pb.HasField("seed")) == (4, 6, False)
