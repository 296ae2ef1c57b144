"""A GPU stage next to a host stage: links staged through host memory give the same model, end to end.

No GPU here. Host staging is forced (`staging="host"`, `--link-staging host`), which takes the same Gloo-and-copy
path a CUDA side of a mixed link takes, or one side is made to announce "cuda" (`groups.device_type`), which is all
the negotiation reads; its copies are then CPU clones through the same code. Three levels: a thread mesh against
`transformers`, stage-worker cores serving and handing a cache over, and offline `generate` over real processes.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from shardmesh.core.step import SamplingParams
from shardmesh.engine import groups
from shardmesh.engine.stage import StageEngine
from shardmesh_cli.offline import OfflineRequest, generate_local
from shardworker.runtime import StageWorkerCore
from tests.checkpoints import make_checkpoint, reference_greedy
from tests.equivalence.test_equivalence import DECODE_STEPS, PROMPT, _assert_matches, _teacher_forced
from tests.thread_mesh import run_mesh
from tests.unit.shardworker.cores import apply_all, new_store, on_every_core
from tests.unit.shardworker.fakes import Events, mesh
from tests.unit.shardworker.test_kv_retention import PROMPT as SERVED_PROMPT
from tests.unit.shardworker.test_kv_retention import decode, prefill
from tests.unit.shardworker.test_kv_transfer import handed_over

FAMILY = "llama-gqa-tied"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int], list[Tensor]]:
    model_dir = make_checkpoint(tmp_path_factory.mktemp(FAMILY), FAMILY)
    tokens, logits = reference_greedy(model_dir, PROMPT, DECODE_STEPS)
    return model_dir, tokens, logits


def with_links(body: Any) -> Any:
    """`body`'s results, and this rank's links as (backend, staged, staged_bytes) by direction."""

    def wrapped(engine: StageEngine, rank: int) -> tuple[Any, dict[str, tuple[str, bool, int]]]:
        out = body(engine, rank)
        links = {"prev": engine.groups.prev, "next": engine.groups.next}
        return out, {k: (v.backend, v.staged, v.staged_bytes) for k, v in links.items() if v is not None}

    return wrapped


@pytest.mark.parametrize("pp,tp", [(2, 1), (3, 1), (2, 2)])
def test_host_staged_links_match_transformers(reference, pp: int, tp: int) -> None:
    model_dir, ref_tokens, ref_logits = reference
    results = run_mesh(model_dir, pp, tp, with_links(_teacher_forced(ref_tokens[:DECODE_STEPS])), staging="host")
    _assert_matches([out for out, _ in results], ref_tokens, ref_logits, FAMILY, pp, tp)
    for rank, (_, links) in enumerate(results):
        stage = rank // tp
        assert set(links) == {name for name, has in (("prev", stage > 0), ("next", stage < pp - 1)) if has}
        for direction, (backend, staged, staged_bytes) in links.items():
            assert backend == "gloo" and staged, (rank, direction)
            assert staged_bytes > 0, f"rank {rank}'s {direction} link copied nothing through host memory"


def test_a_cuda_first_stage_feeds_a_cpu_stage(reference, monkeypatch: pytest.MonkeyPatch) -> None:
    """pp=2 where stage 0 announces "cuda" and stage 1 "cpu", negotiating on their own ("auto"): both agree on
    Gloo, only stage 0 stages, and the logits are the reference's."""
    model_dir, ref_tokens, ref_logits = reference
    monkeypatch.setattr(groups, "device_type",
                        lambda d: "cuda" if threading.current_thread().name == "rank0" else d.type)  # fmt: skip
    results = run_mesh(model_dir, 2, 1, with_links(_teacher_forced(ref_tokens[:DECODE_STEPS])))
    _assert_matches([out for out, _ in results], ref_tokens, ref_logits, FAMILY, 2, 1)
    (_, first), (_, second) = results
    assert first["next"][:2] == ("gloo", True) and first["next"][2] > 0
    assert second["prev"] == ("gloo", False, 0)


# ---- stage-worker cores: a mixed mesh serves, and a cache is handed over between a "cuda" and a cpu worker ----


def core(worker_id: str, device: torch.device, events: Events, staging: str = "auto") -> StageWorkerCore:
    return StageWorkerCore(worker_id, device, events, 30.0, link_staging=staging)


def test_worker_cores_of_mixed_devices_serve_and_hand_a_cache_over(
    reference, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    model_dir = reference[0]
    store = new_store()
    gpu = torch.device("cpu")  # this very object announces "cuda": the cores pass their device on unchanged
    monkeypatch.setattr(groups, "device_type", lambda d: "cuda" if d is gpu else d.type)
    events = {name: Events() for name in ("w0", "w1", "spare")}
    w0, w1 = core("w0", gpu, events["w0"]), core("w1", torch.device("cpu"), events["w1"])
    apply_all([w0, w1], mesh(model_dir, 5, ("w0", "w1"), epoch=5, store_port=store.port))
    ready = {name: next(f for _, e, f in events[name].lines if e == "ready") for name in ("w0", "w1")}
    assert ready["w0"]["next_link"] == "gloo host-staged (cuda <-> cpu)"
    assert ready["w1"]["prev_link"] == "gloo direct (cpu <-> cuda)"
    log = prefill([w0, w1], 5)
    link = w0._runtime.engine.groups.next  # type: ignore[union-attr]
    assert link is not None and link.staged_bytes > 0

    # The "cuda" first stage hands its slot and cache to a cpu spare: the pair agrees on Gloo the same way.
    spare = core("spare", torch.device("cpu"), events["spare"])
    moved = handed_over(mesh(model_dir, 6, ("spare", "w1"), epoch=6, store_port=store.port), 0, "w0")
    on_every_core([w0, spare, w1], lambda c: c.hand_off(moved) if c is w0 else c.apply(moved))
    pairs = {name: [f for _, e, f in events[name].lines if e == "kv_pair_formed"] for name in ("w0", "spare")}
    assert pairs["w0"] == [{"peer": "spare", "rank": 0, "link": "gloo host-staged (cuda <-> cpu)"}]
    assert pairs["spare"] == [{"peer": "w0", "rank": 0, "link": "gloo direct (cpu <-> cuda)"}]
    assert w0.kv_moved["sent"] == spare.kv_moved["received"] > 0
    reference_tokens = reference_greedy(model_dir, list(SERVED_PROMPT), 6)[0]
    assert log[len(SERVED_PROMPT) :] + decode([spare, w1], 6, log, 4) == reference_tokens


def test_a_worker_refuses_an_unknown_link_staging() -> None:
    with pytest.raises(ValueError, match="--link-staging: 'pinned' is not one of auto, host"):
        core("w", torch.device("cpu"), Events(), staging="pinned")


# ---- offline generate over real processes ----


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("gqa"), "llama-gqa-tied", num_layers=5, seed=3)


def test_offline_generate_with_host_staged_links_equals_one_stage(tiny: Path) -> None:
    request = OfflineRequest([1, 17, 5, 42, 33, 8], 10, SamplingParams(temperature=0.8, top_k=20, seed=11))
    whole = generate_local(tiny, request, pp=1, timeout_s=180)
    staged = generate_local(tiny, request, pp=2, link_staging="host", timeout_s=180)
    assert staged.token_ids == whole.token_ids and staged.finish_reason == whole.finish_reason
    assert max(abs(a - b) for a, b in zip(staged.logprobs, whole.logprobs, strict=True)) < 1e-5


def test_offline_ranks_refuse_an_unknown_link_staging(tiny: Path) -> None:
    request = OfflineRequest([1, 17, 5], 2)
    with pytest.raises(RuntimeError, match="--link-staging: invalid choice: 'gpu'"):
        generate_local(tiny, request, pp=2, link_staging="gpu", timeout_s=60)
