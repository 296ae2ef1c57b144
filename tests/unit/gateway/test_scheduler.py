"""The scheduler against a fake mesh of shards (which check slots and positions like real workers):
batching, slots, stop conditions, chunking, cancellation, the queue limit, worker failures, topology
changes and shutdown. Pipelining (pp steps in flight) over shards that keep the chain order is in
test_pipeline.py; the planner on its own in test_batching.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from gateway.observe import GatewayMetrics, GatewayObserver
from gateway.results import EndEvent, FinishReason, TokenEvent
from gateway.scheduler import Scheduler, SchedulerConfig
from gateway.watcher import ModelFiles
from shardmesh.core.errors import ResourceExhausted, Unavailable
from shardmesh.proto.v1 import worker_pb2
from tests.unit.gateway.fakes import FakeMesh, collect, eos_of, finish, ids_of, mesh_state, request, text, tokens
from tests.waiting import WAIT_S, wait_until

MODEL_NAME = "tiny-org/tiny-llama"  # the served name: the `model_name` label of the request metrics


def test_requests_are_batched_into_one_step(scheduler: Scheduler, model_files: ModelFiles) -> None:
    mesh = FakeMesh(pp=1, tp=2)  # one stage: one step in flight (pp=2 pipelines them: test_pipeline.py)
    mesh.gate = threading.Event()
    scheduler.update_mesh(mesh_state(mesh, model_files))
    first = scheduler.submit(request(model_files, "a", "hello", max_new=3))
    assert mesh.entered.wait(WAIT_S)  # step 1 (a's prompt) is in flight and held
    others = [scheduler.submit(request(model_files, rid, "yo", max_new=3)) for rid in ("b", "c")]
    mesh.gate.set()
    results = [collect(h) for h in (first, *others)]
    assert [len(tokens(r)) for r in results] == [3, 3, 3]
    assert all(finish(r) is FinishReason.LENGTH for r in results)
    steps = mesh.shards[0].steps
    # Step 2: a's first decode next to b's and c's whole prompts, each in its own slot.
    assert [(e.request_id, e.slot, e.start_pos, e.num_tokens) for e in steps[1].entries] == [
        ("a", 0, 5, 1), ("b", 1, 0, 2), ("c", 2, 0, 2),
    ]  # fmt: skip
    assert [e.request_id for e in steps[2].entries] == ["a", "b", "c"]  # then decodes only
    assert len(steps) == 4
    # Every shard got exactly the same steps, in the same order, and released all three.
    for shard in mesh.shards:
        assert shard.steps == steps
        wait_until(lambda shard=shard: sorted(shard.released_ids()) == ["a", "b", "c"])
        assert shard.slots == {}


def test_slots_are_reused_after_release(logger: Any, model_files: ModelFiles) -> None:
    scheduler = Scheduler(SchedulerConfig(max_queue=8, step_timeout=5.0), logger)
    scheduler.start()
    try:
        mesh = FakeMesh(pp=1, tp=2, kv_slots=2)
        mesh.gate = threading.Event()
        scheduler.update_mesh(mesh_state(mesh, model_files))
        handles = [scheduler.submit(request(model_files, "r0", max_new=2))]
        # r0's prompt step is held until every request is queued: on a busy machine r0 could otherwise finish and
        # free its slot before r1 arrives, and r1 would take slot 0 again.
        assert mesh.entered.wait(WAIT_S)
        handles += [scheduler.submit(request(model_files, f"r{i}", max_new=2 + i)) for i in range(1, 4)]
        mesh.gate.set()
        results = [collect(h) for h in handles]
        assert [len(tokens(r)) for r in results] == [2, 3, 4, 5]
        first_step, last_step = {}, {}
        for i, step in enumerate(mesh.shards[0].steps):
            for e in step.entries:
                first_step.setdefault(e.request_id, (i, e.slot))
                last_step[e.request_id] = i
        # Two slots: r0 and r1 take them, and r2 and r3 reuse them, each only after the slot's holder finished.
        # (Which of the two a later request gets depends on which release lands first: not asserted.)
        slot = {r: first_step[r][1] for r in first_step}
        assert {slot["r0"], slot["r1"]} == {slot["r2"], slot["r3"]} == {0, 1}
        for later in ("r2", "r3"):
            holder = next(r for r in ("r0", "r1") if slot[r] == slot[later])
            assert last_step[holder] < first_step[later][0], (holder, later, last_step, first_step)
        for shard in mesh.shards:  # the last release happens just after the last token is sent
            wait_until(lambda shard=shard: shard.released_ids() == ["r0", "r1", "r2", "r3"])
            assert shard.slots == {}
    finally:
        scheduler.shutdown(grace=0.0)


def test_eos_and_stop_strings_end_generation(scheduler: Scheduler, model_files: ModelFiles) -> None:
    mesh = FakeMesh(pp=1, tp=1)
    scheduler.update_mesh(mesh_state(mesh, model_files))
    eos = eos_of(model_files)
    mesh.script["eos"] = [*ids_of(model_files, "hi"), eos, *ids_of(model_files, "never")]
    mesh.script["stop"] = ids_of(model_files, "Hé, world!\nUser: more")
    eos_events = collect(scheduler.submit(request(model_files, "eos", max_new=10)))
    assert tokens(eos_events) == [*ids_of(model_files, "hi"), eos]  # the eos token is returned, its text is not
    assert text(eos_events) == "hi" and finish(eos_events) is FinishReason.EOS
    stop_events = collect(scheduler.submit(request(model_files, "stop", max_new=40, stop=("\nUser:", "zz"))))
    assert text(stop_events) == "Hé, world!" and finish(stop_events) is FinishReason.STOP_STRING
    assert tokens(stop_events) == ids_of(model_files, "Hé, world!\nUser:")  # up to the token completing it
    summary = stop_events[-1].summary
    assert summary is not None and summary.completion_tokens == len(tokens(stop_events))
    assert summary.prompt_tokens == 2
    assert [e.index for e in stop_events] == list(range(len(stop_events)))
    assert all(e.summary is None for e in stop_events[:-1])


def test_max_new_tokens_and_timings(scheduler: Scheduler, model_files: ModelFiles) -> None:
    mesh = FakeMesh(pp=2, tp=1)
    scheduler.update_mesh(mesh_state(mesh, model_files))
    events = collect(scheduler.submit(request(model_files, "len", max_new=5)))
    assert len(tokens(events)) == 5 and finish(events) is FinishReason.LENGTH
    assert [e.logprob for e in events] == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5])
    t = events[-1].summary.timings
    assert 0 <= t.queue_ms <= t.time_to_first_token_ms <= t.total_ms
    assert len(t.inter_token_ms) == 4 and t.mean_inter_token_ms == pytest.approx(sum(t.inter_token_ms) / 4)


def test_long_prompts_are_chunked_to_the_batch_budget(scheduler: Scheduler, model_files: ModelFiles) -> None:
    mesh = FakeMesh(pp=1, tp=1, max_batch_tokens=4)  # one step in flight, so both share every step
    scheduler.update_mesh(mesh_state(mesh, model_files))
    mesh.gate = threading.Event()
    short = scheduler.submit(request(model_files, "short", "ab", max_new=4))
    assert mesh.entered.wait(WAIT_S)
    long = scheduler.submit(request(model_files, "long", "0123456789", max_new=2))
    mesh.gate.set()
    assert len(tokens(collect(short))) == 4 and len(tokens(collect(long))) == 2
    plan = [[(e.request_id, e.start_pos, e.num_tokens, e.skip_sampling) for e in s.entries]
            for s in mesh.shards[-1].steps]  # fmt: skip
    assert plan[:5] == [
        [("short", 0, 2, False)],
        [("short", 2, 1, False), ("long", 0, 3, True)],  # decode first, the prompt gets what is left
        [("short", 3, 1, False), ("long", 3, 3, True)],
        [("short", 4, 1, False), ("long", 6, 3, True)],
        [("long", 9, 1, False)],  # the last chunk samples
    ]
    assert all(sum(e.num_tokens for e in s.entries) <= 4 for s in mesh.shards[-1].steps)


def test_cancellation_releases_on_every_shard(scheduler: Scheduler, model_files: ModelFiles) -> None:
    mesh = FakeMesh(pp=2, tp=2)
    scheduler.update_mesh(mesh_state(mesh, model_files))
    handle = scheduler.submit(request(model_files, "gone", max_new=50))
    first = handle.events.get(timeout=WAIT_S)
    assert isinstance(first, TokenEvent)
    handle.cancel()
    events = [first, *collect(handle)]
    assert isinstance(events[-1], EndEvent) and finish(events) is FinishReason.CANCELLED
    assert len(tokens(events)) < 50
    for shard in mesh.shards:
        wait_until(lambda shard=shard: shard.released_ids() == ["gone"])
        assert shard.slots == {}
    # A cancelled request that was still waiting never got a slot: nothing to release.
    mesh.gate = threading.Event()
    mesh.entered.clear()
    busy = [scheduler.submit(request(model_files, f"busy{i}", max_new=2)) for i in range(4)]
    assert mesh.entered.wait(WAIT_S)
    queued = scheduler.submit(request(model_files, "queued", max_new=2))
    queued.cancel()
    mesh.gate.set()
    assert finish(collect(queued)) is FinishReason.CANCELLED
    assert all(finish(collect(h)) is FinishReason.LENGTH for h in busy)
    wait_until(lambda: len(mesh.shards[0].released_ids()) == 5)
    assert "queued" not in mesh.shards[0].released_ids()


def test_queue_full_is_resource_exhausted(logger: Any, model_files: ModelFiles) -> None:
    scheduler = Scheduler(SchedulerConfig(max_queue=2, step_timeout=5.0), logger)
    scheduler.start()
    try:
        mesh = FakeMesh(pp=1, tp=1, kv_slots=2)
        mesh.gate = threading.Event()
        scheduler.update_mesh(mesh_state(mesh, model_files))
        running = scheduler.submit(request(model_files, "running", max_new=5))
        assert mesh.entered.wait(WAIT_S)  # its step is held: the others wait for the next step boundary
        # The second takes the free slot at that boundary, so it does not count as queued; two more fit.
        others = [scheduler.submit(request(model_files, f"w{i}", max_new=1)) for i in range(3)]
        with pytest.raises(ResourceExhausted, match=r"^queue full: 2 requests waiting for a KV slot"):
            scheduler.submit(request(model_files, "one-too-many"))
        # Cancelled requests leave at the next boundary (the step is still held): they no longer count.
        others[-1].cancel()
        others.append(scheduler.submit(request(model_files, "after-a-waiting-cancel", max_new=1)))
        running.cancel()  # its slot frees at the boundary too
        others.append(scheduler.submit(request(model_files, "after-a-running-cancel", max_new=1)))
        with pytest.raises(ResourceExhausted):
            scheduler.submit(request(model_files, "one-too-many-again"))
        mesh.gate.set()
        assert finish(collect(running)) is FinishReason.CANCELLED
        assert [finish(collect(h)) for h in others] == [FinishReason.LENGTH] * 2 + [FinishReason.CANCELLED] + [
            FinishReason.LENGTH
        ] * 2
    finally:
        scheduler.shutdown(grace=0.0)


def test_no_topology_is_unavailable(scheduler: Scheduler, model_files: ModelFiles) -> None:
    with pytest.raises(Unavailable, match=r"^no ready topology: waiting for the first topology"):
        scheduler.serving_context()
    mesh = FakeMesh()
    scheduler.update_mesh(mesh_state(mesh, model_files, complete=False))
    with pytest.raises(Unavailable, match=r"^no ready topology: topology v1 is not complete"):
        scheduler.submit(request(model_files, "x"))


@pytest.fixture
def observed(logger: Any) -> Iterator[tuple[Scheduler, GatewayMetrics]]:
    """A scheduler with its metrics on, the model served as `MODEL_NAME` (their `model_name` label)."""
    holder: list[Scheduler] = []
    metrics = GatewayMetrics(lambda: holder[0].load(), MODEL_NAME, lambda: holder[0].block_stats())
    s = Scheduler(SchedulerConfig(max_queue=8, step_timeout=5.0), logger, observer=GatewayObserver(None, metrics))
    holder.append(s)
    s.start()
    yield s, metrics
    s.shutdown(grace=0.0)


def test_a_worker_failure_resumes_running_requests_on_the_next_topology(
    observed: tuple[Scheduler, GatewayMetrics], model_files: ModelFiles
) -> None:
    scheduler, metrics = observed
    mesh = FakeMesh(pp=2, tp=2, kv_slots=1)
    mesh.default_script = list(range(30, 50))
    ready: list[bool] = []
    scheduler.add_ready_listener(ready.append)
    scheduler.update_mesh(mesh_state(mesh, model_files, seq=1))
    mesh.step_delay = 0.01
    running = scheduler.submit(request(model_files, "running", max_new=20))
    queued = scheduler.submit(request(model_files, "queued", max_new=2))  # no slot: waits through the failure
    sent = [running.events.get(timeout=WAIT_S) for _ in range(3)]
    mesh.failures[(1, 1)] = (grpc.StatusCode.UNAVAILABLE, "Connection refused")  # after 3 tokens or more
    wait_until(lambda: ready == [False, True, False])
    # A request that arrives meanwhile is not refused: it waits for the mesh, as the running ones do.
    waiting = scheduler.submit(request(model_files, "arrived", max_new=2))
    while not running.events.empty():
        sent.append(running.events.get())
    assert not any(isinstance(e, EndEvent) for e in sent)  # no error: it waits to resume
    # The coordinator publishes a newer complete topology (the worker is back): the running request replays
    # its log first (prompt and tokens so far, nothing drawn), then the queued one is served.
    scheduler.update_mesh(mesh_state(mesh, model_files, seq=2, version=2, placement="epoch-2"))
    events = sent + collect(running)
    assert finish(events) is FinishReason.LENGTH
    assert [e.token_id for e in events if isinstance(e, TokenEvent)] == list(range(30, 50))  # none lost or twice
    assert [e.index for e in events if isinstance(e, TokenEvent)] == list(range(20))
    assert finish(collect(queued)) is FinishReason.LENGTH
    assert finish(collect(waiting)) is FinishReason.LENGTH
    after = collect(scheduler.submit(request(model_files, "after", max_new=2)))
    assert finish(after) is FinishReason.LENGTH and ready[-1] is True
    assert mesh.shards[0].steps[-1].topology_version == 2
    replays = [e for s in mesh.shards[0].steps if s.topology_version == 2 for e in s.entries
               if e.request_id == "running" and e.start_pos == 0]  # fmt: skip
    prompt, before = len(ids_of(model_files, "hi")), len(sent)
    assert [(e.num_tokens, e.skip_sampling) for e in replays] == [(prompt + before - 1, True)]  # the log but its last
    assert list(replays[0].token_ids)[prompt:] == list(range(30, 30 + before - 1))  # the last one is fed next

    def value(name: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"model_name": MODEL_NAME})

    assert value("shardmesh_resumed_requests_total") == 1  # the one that arrived meanwhile did not resume
    assert value("shardmesh_replayed_tokens_total") == prompt + before - 1
    assert value("shardmesh_resume_gap_seconds_count") == 1  # one pause, measured at its first token after
    assert value("shardmesh_resume_gap_seconds_sum") > 0


def test_a_request_that_cannot_resume_in_time_fails_saying_why(model_files: ModelFiles, logger: Any) -> None:
    now = [0.0]
    scheduler = Scheduler(SchedulerConfig(max_queue=8, step_timeout=5.0, resume_timeout=30.0), logger,
                          clock=lambda: now[0])  # fmt: skip
    scheduler.start()
    try:
        mesh = FakeMesh(pp=1, tp=1, kv_slots=1)
        scheduler.update_mesh(mesh_state(mesh, model_files, seq=1))
        mesh.gate = threading.Event()
        handle = scheduler.submit(request(model_files, "r", max_new=20))
        assert mesh.entered.wait(WAIT_S)
        mesh.failures[(0, 0)] = (grpc.StatusCode.UNAVAILABLE, "Connection refused")
        mesh.gate.set()
        # Back in the queue to resume, its deadline 30 s on: nothing ended it (and nothing is released yet: the
        # workers that survive may keep its cache).
        wait_until(lambda: scheduler.load()[0] == 1)
        assert handle.events.empty() and mesh.shards[0].released_ids() == []
        now[0] = 30.0
        scheduler.update_mesh(mesh_state(mesh, model_files, seq=1))  # a wake-up, no new topology
        end = collect(handle)[-1]
        assert isinstance(end, EndEvent) and isinstance(end.error, Unavailable)
        assert str(end.error) == ("could not resume within 30 s (--resume-timeout): worker 127.0.0.1:7000 "
                                  "(stage 0, tp rank 0) lost: UNAVAILABLE: Connection refused")  # fmt: skip
        wait_until(lambda: mesh.shards[0].released_ids() == ["r"])  # its slot where it was lost, once it ended
    finally:
        scheduler.shutdown(grace=0.0)


def test_topology_versions_keep_running_requests_or_replay_them_elsewhere(
    scheduler: Scheduler, model_files: ModelFiles
) -> None:
    mesh = FakeMesh(pp=1, tp=2)
    scheduler.update_mesh(mesh_state(mesh, model_files, seq=1))
    mesh.gate = threading.Event()
    handle = scheduler.submit(request(model_files, "r", max_new=3))
    assert mesh.entered.wait(WAIT_S)
    # Same placement, newer version (e.g. a shard state refresh): the KV cache is still there.
    scheduler.update_mesh(mesh_state(mesh, model_files, seq=2, version=2))
    mesh.gate.set()
    assert finish(collect(handle)) is FinishReason.LENGTH
    assert [s.topology_version for s in mesh.shards[0].steps] == [1, 2, 2]
    # Another placement while a request runs (workers that do not say they kept their caches): it replays there.
    mesh.gate.clear()
    mesh.entered.clear()
    handle = scheduler.submit(request(model_files, "moved", max_new=30))
    assert mesh.entered.wait(WAIT_S)
    scheduler.update_mesh(mesh_state(mesh, model_files, seq=3, version=3, placement="epoch-3"))
    mesh.gate.set()
    assert finish(collect(handle)) is FinishReason.LENGTH
    moved = [e for s in mesh.shards[0].steps if s.topology_version == 3 for e in s.entries if e.request_id == "moved"]
    assert moved[0].start_pos == 0
    assert {s.topology_version for s in mesh.shards[0].steps if any(e.request_id == "moved" for e in s.entries)} \
        == {2, 3}  # fmt: skip


def test_duplicate_request_ids_get_distinct_worker_keys(scheduler: Scheduler, model_files: ModelFiles) -> None:
    mesh = FakeMesh(pp=1, tp=1)
    mesh.gate = threading.Event()
    scheduler.update_mesh(mesh_state(mesh, model_files))
    handles = [scheduler.submit(request(model_files, "same", max_new=2)) for _ in range(2)]
    mesh.gate.set()
    assert all(finish(collect(h)) is FinishReason.LENGTH for h in handles)
    wait_until(lambda: sorted(mesh.shards[0].released_ids()) == ["same", "same#2"])


def test_shutdown_lets_running_finish_then_cancels(logger: Any, model_files: ModelFiles) -> None:
    scheduler = Scheduler(SchedulerConfig(step_timeout=5.0), logger)
    scheduler.start()
    mesh = FakeMesh(pp=1, tp=2, kv_slots=1)
    scheduler.update_mesh(mesh_state(mesh, model_files))
    mesh.gate = threading.Event()
    short = scheduler.submit(request(model_files, "short", max_new=2))
    assert mesh.entered.wait(WAIT_S)
    waiting = scheduler.submit(request(model_files, "waiting", max_new=2))
    mesh.gate.set()
    scheduler.shutdown(grace=2.0)  # short finishes within the grace; waiting fails at once: it was not served
    assert finish(collect(short)) is FinishReason.LENGTH
    (end,) = collect(waiting)
    assert isinstance(end, EndEvent) and isinstance(end.error, Unavailable), end
    assert "not served" in str(end.error)
    assert not scheduler.alive
    with pytest.raises(Unavailable, match="shutting down"):
        scheduler.submit(request(model_files, "late"))

    scheduler = Scheduler(SchedulerConfig(step_timeout=5.0), logger)
    scheduler.start()
    scheduler.update_mesh(mesh_state(mesh, model_files))
    mesh.step_delay = 0.02  # 60 tokens take 1.2 s: longer than the grace
    endless = scheduler.submit(request(model_files, "endless", max_new=60))
    assert isinstance(endless.events.get(timeout=WAIT_S), TokenEvent)
    scheduler.shutdown(grace=0.2)  # the grace ends before the 60 tokens do: cancelled, part-way
    events = collect(endless)
    assert finish(events) is FinishReason.CANCELLED and events[-1].summary.completion_tokens < 60
    assert "endless" in mesh.shards[1].released_ids()


def test_requests_wait_for_a_changing_mesh_but_not_for_one_never_served(model_files: ModelFiles, logger: Any) -> None:
    now = [0.0]
    scheduler = Scheduler(SchedulerConfig(max_queue=8, resume_timeout=30.0), logger, clock=lambda: now[0])
    scheduler.start()
    try:
        mesh = FakeMesh(pp=1, tp=1)
        scheduler.update_mesh(mesh_state(mesh, model_files, seq=1, complete=False))
        with pytest.raises(Unavailable, match=r"^no ready topology: topology v1 is not complete"):
            scheduler.serving_context()  # never served: nothing to wait for
        scheduler.update_mesh(mesh_state(mesh, model_files, seq=2, version=2))
        assert finish(collect(scheduler.submit(request(model_files, "first", max_new=2)))) is FinishReason.LENGTH
        scheduler.update_mesh(mesh_state(mesh, model_files, seq=3, version=3, complete=False))  # a worker left
        assert scheduler.serving_context().vocab_size == mesh.view(2, "epoch-1").vocab_size  # the last one served
        late = scheduler.submit(request(model_files, "late", max_new=2))
        later = scheduler.submit(request(model_files, "later", max_new=2))
        now[0] = 31.0
        scheduler.update_mesh(mesh_state(mesh, model_files, seq=4, version=4, complete=False))  # a wake-up
        for handle in (late, later):
            end = collect(handle)[-1]
            assert isinstance(end, EndEvent) and isinstance(end.error, Unavailable)
            assert str(end.error).startswith("could not start within 30 s (--resume-timeout): no ready topology")
        waits = scheduler.submit(request(model_files, "waits", max_new=2))
        scheduler.update_mesh(mesh_state(mesh, model_files, seq=5, version=5, placement="epoch-5"))
        assert finish(collect(waits)) is FinishReason.LENGTH
    finally:
        scheduler.shutdown(grace=0.0)


def resumed_entries(scheduler: Scheduler, mesh: FakeMesh, model_files: ModelFiles,
                    cache_ids: list[str]) -> list[worker_pb2.BatchEntry]:  # fmt: skip
    """A request runs on a pp=2 mesh whose workers name their caches, until stage 1's worker fails a step; then
    the coordinator publishes a new epoch whose shards name `cache_ids`. The request finishes with every token
    once (none lost or twice); returns its entries in the new epoch."""
    mesh.default_script = list(range(30, 50))
    mesh.cache_ids = ["c0", "c1"]
    scheduler.update_mesh(mesh_state(mesh, model_files, seq=1))
    mesh.step_delay = 0.01
    handle = scheduler.submit(request(model_files, "running", max_new=20))
    sent = [handle.events.get(timeout=WAIT_S) for _ in range(3)]
    mesh.failures[(1, 0)] = (grpc.StatusCode.UNAVAILABLE, "Connection refused")
    wait_until(lambda: scheduler.load()[0] == 1)  # back in the queue, to resume
    mesh.failures.clear()
    mesh.cache_ids = cache_ids
    scheduler.update_mesh(mesh_state(mesh, model_files, seq=2, version=2, placement="epoch-2"))
    assert tokens(sent + collect(handle)) == list(range(30, 50))
    return [e for s in mesh.shards[0].steps if s.topology_version == 2 for e in s.entries
            if e.request_id == "running"]  # fmt: skip


def test_a_lost_last_stage_replays_there_only_in_the_same_slot(
    observed: tuple[Scheduler, GatewayMetrics], model_files: ModelFiles
) -> None:
    scheduler, metrics = observed
    mesh = FakeMesh(pp=2, tp=1, kv_slots=2)
    replay, after = resumed_entries(scheduler, mesh, model_files, ["c0", "c1-new"])[:2]
    before = [e for s in mesh.shards[0].steps if s.topology_version == 1 for e in s.entries]
    # Stage 0 kept its cache: the cached positions go through stage 1 only (stage 0 resends what it recorded).
    assert (replay.first_stage, replay.end_stage, replay.start_pos, replay.skip_sampling) == (1, 0, 0, True)
    assert replay.slot == before[0].slot
    assert (after.first_stage, after.end_stage, after.start_pos) == (0, 0, replay.num_tokens)
    replayed = metrics.registry.get_sample_value("shardmesh_replayed_tokens_total", {"model_name": MODEL_NAME})
    assert replayed == replay.num_tokens


def test_a_lost_first_stage_replays_there_only(scheduler: Scheduler, model_files: ModelFiles) -> None:
    replay = resumed_entries(scheduler, FakeMesh(pp=2, tp=1, kv_slots=2), model_files, ["c0-new", "c1"])[0]
    assert (replay.first_stage, replay.end_stage, replay.skip_sampling) == (0, 1, True)


def test_a_new_epoch_that_kept_every_cache_replays_nothing(scheduler: Scheduler, model_files: ModelFiles) -> None:
    first = resumed_entries(scheduler, FakeMesh(pp=2, tp=1, kv_slots=2), model_files, ["c0", "c1"])[0]
    assert first.num_tokens == 1 and first.start_pos > 0 and (first.first_stage, first.end_stage) == (0, 0)


def test_unknown_cache_ids_replay_on_every_stage(scheduler: Scheduler, model_files: ModelFiles) -> None:
    replay = resumed_entries(scheduler, FakeMesh(pp=2, tp=1, kv_slots=2), model_files, ["", ""])[0]
    assert (replay.first_stage, replay.end_stage, replay.start_pos) == (0, 0, 0)


# -- a paged mesh: block tables, prefix caching, admission by blocks ---------------------------------------------


def test_paged_entries_carry_block_tables_and_a_shared_prefix_is_prefilled_once(
    observed: tuple[Scheduler, GatewayMetrics], model_files: ModelFiles
) -> None:
    scheduler, metrics = observed
    mesh = FakeMesh(pp=2, tp=1, kv_slots=4, max_context=64, kv_block_size=4, kv_blocks=32)
    scheduler.update_mesh(mesh_state(mesh, model_files))
    system = "You are terse. "  # 15 tokens: 3 full blocks of 4, and 3 tokens
    first = collect(scheduler.submit(request(model_files, "first", system + "Hi", max_new=5)))
    second = collect(scheduler.submit(request(model_files, "second", system + "Yo!", max_new=5)))
    assert len(tokens(first)) == len(tokens(second)) == 5
    shard = mesh.shards[0]
    entries = {e.request_id: [] for e in shard.steps[0].entries}
    for step in shard.steps:
        for e in step.entries:
            entries.setdefault(e.request_id, []).append(e)
    # The second found the first's three full blocks of the system prompt: its prefill starts after them.
    prompt2 = ids_of(model_files, system + "Yo!")
    head = entries["second"][0]
    assert (head.start_pos, head.num_tokens) == (12, len(prompt2) - 12)
    assert list(head.blocks[:3]) == list(entries["first"][0].blocks[:3])
    assert shard.tokens_in(list(head.blocks), 12) == prompt2[:12]
    # Every entry's table covers its positions (the fake shards check it), and grows block by block.
    last = entries["second"][-1]
    assert len(last.blocks) == -(-(last.start_pos + 1) // 4)
    assert metrics.registry.get_sample_value("shardmesh_prefix_cache_tokens_saved_total") == 12


def test_paged_admission_waits_for_blocks_and_never_runs_out(logger: Any, model_files: ModelFiles) -> None:
    scheduler = Scheduler(SchedulerConfig(max_queue=8, step_timeout=5.0), logger)
    scheduler.start()
    try:
        # 6 blocks of 4: each request may need 3 (2 prompt tokens + up to 10 new), so two run at once.
        mesh = FakeMesh(pp=1, tp=1, kv_slots=4, max_context=24, kv_block_size=4, kv_blocks=6)
        mesh.gate = threading.Event()
        scheduler.update_mesh(mesh_state(mesh, model_files))
        handles = [scheduler.submit(request(model_files, "r0", max_new=10))]
        assert mesh.entered.wait(WAIT_S)  # r0's prompt step held until all four wait: none can finish alone first
        handles += [scheduler.submit(request(model_files, f"r{i}", max_new=10)) for i in range(1, 4)]
        mesh.gate.set()
        assert [len(tokens(collect(h))) for h in handles] == [10] * 4
        concurrent = max(len(step.entries) for step in mesh.shards[0].steps)
        assert concurrent == 2  # four slots, but blocks for two
        for step in mesh.shards[0].steps:
            held = [b for e in step.entries for b in e.blocks]
            assert len(held) == len(set(held))  # no block in two running sequences' tables
    finally:
        scheduler.shutdown(grace=0.0)


def test_paged_sequences_keep_their_blocks_through_a_failure_and_the_index_is_forgotten(
    scheduler: Scheduler, model_files: ModelFiles
) -> None:
    mesh = FakeMesh(pp=2, tp=1, kv_slots=2, max_context=64, kv_block_size=4, kv_blocks=32)
    mesh.default_script = list(range(30, 50))
    scheduler.update_mesh(mesh_state(mesh, model_files, seq=1))
    mesh.step_delay = 0.01
    prompt = "0123456789"
    done = collect(scheduler.submit(request(model_files, "done", prompt, max_new=2)))
    assert finish(done) is FinishReason.LENGTH
    running = scheduler.submit(request(model_files, "running", prompt + "ab", max_new=12))
    sent = [running.events.get(timeout=WAIT_S) for _ in range(3)]
    mesh.failures[(1, 0)] = (grpc.StatusCode.UNAVAILABLE, "Connection refused")
    wait_until(lambda: scheduler.snapshot()[1] is False)
    for shard in mesh.shards:  # the new workers hold nothing
        shard.blocks.clear()
    scheduler.update_mesh(mesh_state(mesh, model_files, seq=2, version=2, placement="epoch-2"))
    events = sent + collect(running)
    assert [e.token_id for e in events if isinstance(e, TokenEvent)] == list(range(30, 42))
    steps = mesh.shards[0].steps
    before = [e for s in steps if s.topology_version == 1 for e in s.entries if e.request_id == "running"]
    replay = next(e for s in steps if s.topology_version == 2 for e in s.entries if e.request_id == "running")
    assert before[0].start_pos == 8  # a prefix hit on the first mesh
    assert replay.start_pos == 0 and list(replay.blocks) == list(before[-1].blocks)[: len(replay.blocks)]
    # After the move, the index was forgotten: the same prompt finds nothing cached on the new workers.
    again = scheduler.submit(request(model_files, "again", prompt, max_new=2))
    assert finish(collect(again)) is FinishReason.LENGTH
    first = next(e for s in steps for e in s.entries if e.request_id == "again")
    assert first.start_pos == 0


def test_paged_prefix_caching_can_be_turned_off(logger: Any, model_files: ModelFiles) -> None:
    scheduler = Scheduler(SchedulerConfig(max_queue=8, step_timeout=5.0, prefix_caching=False), logger)
    scheduler.start()
    try:
        mesh = FakeMesh(pp=1, tp=1, kv_slots=2, max_context=64, kv_block_size=4, kv_blocks=32)
        scheduler.update_mesh(mesh_state(mesh, model_files))
        for rid in ("a", "b"):
            collect(scheduler.submit(request(model_files, rid, "the same prompt", max_new=2)))
        firsts = {}
        for step in mesh.shards[0].steps:
            for e in step.entries:
                firsts.setdefault(e.request_id, e)
        assert firsts["b"].start_pos == 0 and firsts["b"].num_tokens == len(ids_of(model_files, "the same prompt"))
        assert scheduler.block_stats().prefix.lookups == 0  # type: ignore[union-attr]
    finally:
        scheduler.shutdown(grace=0.0)


def test_paged_sequences_sharing_a_prefix_replay_into_blocks_of_their_own(
    scheduler: Scheduler, model_files: ModelFiles
) -> None:
    """Two running sequences share the blocks of a cached prefix; their workers are lost and the mesh moves. Both
    would replay from position 0 into the shared blocks in one step (two writers of one block), so they take private
    blocks instead and replay everything; their tokens are those of an undisturbed run."""
    mesh = FakeMesh(pp=2, tp=1, kv_slots=4, max_context=64, kv_block_size=4, kv_blocks=32)
    mesh.default_script = list(range(30, 50))
    scheduler.update_mesh(mesh_state(mesh, model_files, seq=1))
    system = "0123456789ab"  # 3 full blocks
    collect(scheduler.submit(request(model_files, "warm", system + "!", max_new=1)))
    mesh.step_delay = 0.01
    handles = [scheduler.submit(request(model_files, rid, system + rid, max_new=12)) for rid in ("x", "y")]
    sent = {id(h): [h.events.get(timeout=WAIT_S) for _ in range(2)] for h in handles}
    mesh.failures[(1, 0)] = (grpc.StatusCode.UNAVAILABLE, "Connection refused")
    wait_until(lambda: scheduler.snapshot()[1] is False)
    for shard in mesh.shards:
        shard.blocks.clear()
    scheduler.update_mesh(mesh_state(mesh, model_files, seq=2, version=2, placement="epoch-2"))
    for h in handles:
        events = sent[id(h)] + collect(h)
        assert [e.token_id for e in events if isinstance(e, TokenEvent)] == list(range(30, 42))
    replays = [e for s in mesh.shards[0].steps if s.topology_version == 2 for e in s.entries]
    tables = {e.request_id: set(e.blocks) for e in replays if e.start_pos == 0}
    assert set(tables) == {"x", "y"} and not tables["x"] & tables["y"]  # private blocks, each written once
