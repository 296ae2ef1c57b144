"""The worker messages the gateway sends, built from its scheduling state in this one place."""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from typing import TYPE_CHECKING

from shardmesh.core.step import blocks_for
from shardmesh.proto.v1 import worker_pb2

if TYPE_CHECKING:
    from gateway.batching import Planned
    from gateway.requests import Sampling
    from gateway.sequence import Sequence


def token_sampling(sampling: Sampling, prompt_tokens: int) -> worker_pb2.TokenSampling:
    """Built once per request. A sampled request without a seed gets one here: the gateway owns its token
    log, and with the seed a replay after a worker's loss draws the same tokens (`engine.sampling`). The
    prompt's length tells the last stage which positions the frequency and presence penalties skip."""
    seed = sampling.seed
    if seed is None and sampling.temperature > 0:
        seed = secrets.randbits(62)
    s = sampling
    return worker_pb2.TokenSampling(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=seed, repetition_penalty=s.repetition_penalty,
        frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty, min_p=s.min_p,
        top_logprobs=s.top_logprobs, prompt_tokens=prompt_tokens,
    )  # fmt: skip


def batch_entry(p: Planned[Sequence], pp: int, blocks: Iterable[int] = ()) -> worker_pb2.BatchEntry:
    """`p.num_tokens` of the sequence's log from its cached position, in its slot, on the stages that need it
    (a replay where some kept its cache: `Sequence.entry_stages`); on a paged mesh with its block table `blocks`,
    covering positions [0, cached + num_tokens) (worker.proto `BatchEntry.blocks`)."""
    s = p.seq
    first, end = s.entry_stages(pp)
    return worker_pb2.BatchEntry(request_id=s.key, slot=s.slot, start_pos=s.cached, num_tokens=p.num_tokens,
                                 token_ids=s.inputs(p.num_tokens), sampling=s.sampling,
                                 skip_sampling=not p.sample, first_stage=first, end_stage=end,
                                 blocks=blocks)  # fmt: skip


def step_request(step_id: int, topology_version: int, after_step_id: int, planned: list[Planned[Sequence]],
                 pp: int, decode_steps: int = 1) -> worker_pb2.StepRequest:  # fmt: skip
    """`decode_steps` > 1: that many decode steps in the call (worker.proto `StepRequest.decode_steps`)."""
    entries = [batch_entry(p, pp, _blocks(p, decode_steps)) for p in planned]
    return worker_pb2.StepRequest(step_id=step_id, topology_version=topology_version, after_step_id=after_step_id,
                                  entries=entries, decode_steps=decode_steps if decode_steps > 1 else 0)  # fmt: skip


def _blocks(p: Planned[Sequence], decode_steps: int) -> list[int]:
    """The leading blocks of the sequence's table that hold the positions up to the last this entry writes, over
    all of the call's decode steps (a paged mesh)."""
    s = p.seq
    if s.blocks is None or s.block_pool is None:
        return []
    return s.blocks.blocks[: blocks_for(s.cached + p.num_tokens + decode_steps - 1, s.block_pool.block_size)]


def released_slot(key: str, slot: int) -> worker_pb2.ReleasedSequence:
    return worker_pb2.ReleasedSequence(request_id=key, slot=slot)
