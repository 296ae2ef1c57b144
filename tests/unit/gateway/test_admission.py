"""Admission: the queue limit counts what the next step boundary leaves waiting; keys are unique in flight."""

from __future__ import annotations

import pytest

from gateway.admission import Admission, context_refusal
from gateway.fanout import MeshView
from gateway.requests import PreparedRequest, Sampling
from gateway.results import RequestHandle
from gateway.slots import SlotPool
from shardmesh.core.errors import InvalidArgument, ResourceExhausted


def req(request_id: str, prompt_len: int = 2, max_new: int = 4) -> PreparedRequest:
    return PreparedRequest(request_id, (1,) * prompt_len, max_new, Sampling(), (), frozenset(), None, 0.0)


def enqueue(admission: Admission, request_id: str, free_slots: int = 0) -> RequestHandle:
    handle = RequestHandle(request_id, lambda: None)
    admission.enqueue(req(request_id), handle, free_slots, None, "")
    return handle


def test_the_queue_limit_counts_requests_left_without_a_slot() -> None:
    admission = Admission(max_queue=2)
    enqueue(admission, "a", free_slots=0)
    enqueue(admission, "b", free_slots=0)
    with pytest.raises(ResourceExhausted, match=r"^queue full: 2 requests waiting for a KV slot \(--max-queue\)$"):
        enqueue(admission, "c", free_slots=0)
    third = enqueue(admission, "c", free_slots=1)  # one of them takes a free slot at the boundary
    third.cancel()  # a cancelled one leaves at the boundary: it does not count
    assert admission.queued(free_slots=1) == 1 and len(admission) == 3
    assert [s.req.request_id for s in admission.drop(everything=False)] == ["c"] and len(admission) == 2
    assert [s.req.request_id for s in admission.drop(everything=True)] == ["a", "b"] and len(admission) == 0


def test_keys_are_unique_among_requests_in_flight_and_free_again_once_forgotten() -> None:
    admission = Admission(max_queue=8)
    for _ in range(3):
        enqueue(admission, "same")
    keys = [s.key for s in admission.drain()]
    assert keys == ["same", "same#2", "same#3"]
    admission.forget("same")
    enqueue(admission, "same")
    assert [s.key for s in admission.drain()] == ["same"]


def test_admission_pairs_the_oldest_request_with_the_lowest_slot() -> None:
    admission, slots = Admission(max_queue=8), SlotPool()
    mesh = MeshView(1, ("p",), 1, 1, 2, 64, 64, 259, ())
    for rid in ("a", "b", "c"):
        enqueue(admission, rid)
    assert admission.next_admitted(slots) is None  # no pool yet
    slots.adopt(mesh)
    admitted = [admission.next_admitted(slots) for _ in range(3)]
    assert [(s.req.request_id, slot) for s, slot in admitted[:2]] == [("a", 0), ("b", 1)] and admitted[2] is None
    assert len(admission) == 1


def test_a_request_that_no_longer_fits_the_context_is_refused_naming_the_field() -> None:
    mesh = MeshView(1, ("p",), 1, 1, 2, 8, 8, 259, ())
    assert context_refusal(req("fits", prompt_len=4, max_new=4), mesh) is None
    refusal = context_refusal(req("long", prompt_len=4, max_new=5), mesh)
    assert isinstance(refusal, InvalidArgument) and refusal.field_name == "params.max_new_tokens"
    assert str(refusal) == "params.max_new_tokens: prompt + max_new_tokens (9) exceeds the context of 8"
