"""The worker's side of TokenSampling and SampledToken: proto to `SamplingParams` (defaults as worker.proto documents
them, refusals naming the field) and the sampled token, alternatives included, back to proto."""

from __future__ import annotations

import pytest

from shardmesh.core.errors import InvalidArgument
from shardmesh.core.step import Sampled, SamplingParams
from shardmesh.proto.v1 import worker_pb2
from shardworker.servicer import entry_from_pb, sampled_pb


def _entry(token_ids: list[int], **sampling: float) -> worker_pb2.BatchEntry:
    return worker_pb2.BatchEntry(request_id="r", slot=1, start_pos=4, num_tokens=2, token_ids=token_ids,
                                 sampling=worker_pb2.TokenSampling(**sampling))  # fmt: skip


def test_token_sampling_becomes_sampling_params() -> None:
    pb = _entry([5, 6], temperature=0.5, top_p=0.75, seed=3, repetition_penalty=1.5, frequency_penalty=0.25,
                presence_penalty=-0.5, min_p=0.125, top_logprobs=7, prompt_tokens=4)  # fmt: skip
    assert entry_from_pb(pb).sampling == SamplingParams(0.5, 0.75, 0, 3, repetition_penalty=1.5, frequency_penalty=0.25,
                                                        presence_penalty=-0.5, min_p=0.125, top_logprobs=7,
                                                        prompt_len=4)  # fmt: skip
    # Unset: proto3's zeros mean no nucleus and no repetition penalty (1.0), as worker.proto documents.
    plain = entry_from_pb(_entry([])).sampling
    assert plain == SamplingParams() and not plain.penalized


@pytest.mark.parametrize(
    ("entry", "field", "message"),
    [(_entry([5, 6], frequency_penalty=3.0), "entries.sampling", "frequency_penalty must be in [-2, 2]"),
     (_entry([5, 6], top_logprobs=21), "entries.sampling", "top_logprobs must be in [0, 20]"),
     (_entry([], presence_penalty=0.5), "entries.token_ids", "0 token_ids for num_tokens=2")],
)  # fmt: skip
def test_bad_sampling_is_refused_naming_the_field(entry: worker_pb2.BatchEntry, field: str, message: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        entry_from_pb(entry)
    assert e.value.field_name == field and message in str(e.value)


def test_a_sampled_token_carries_its_alternatives() -> None:
    pb = sampled_pb(Sampled("r", 7, -0.5, ((7, -0.5), (9, -1.25))))
    assert (pb.request_id, pb.token_id, pb.logprob) == ("r", 7, -0.5)
    assert [(a.token_id, a.logprob) for a in pb.top_logprobs] == [(7, -0.5), (9, -1.25)]
    assert not sampled_pb(Sampled("r", 7, -0.5)).top_logprobs
