"""The micro-batch planner on its own: sequence states in, planned entries out."""

from __future__ import annotations

from dataclasses import dataclass, replace

from gateway.batching import Planned, pipeline_depth, plan_micro_batch


@dataclass(frozen=True)
class Seq:
    name: str
    prefill_len: int
    cached: int = 0
    ready_at: int = 0
    in_flight: bool = False
    samples_after_prefill: bool = True  # False: a replay after a lost worker, its next token known
    replay_until: int = 0  # a replay on some stages only ends its chunks here

    @property
    def chunk_end(self) -> int:
        return self.replay_until if self.cached < self.replay_until else self.prefill_len


def prefill(name: str, prompt_len: int, cached: int = 0, ready_at: int = 0) -> Seq:
    return Seq(name, prompt_len, cached, ready_at)


def decode(name: str, ready_at: int = 0) -> Seq:
    return Seq(name, prefill_len=3, cached=5, ready_at=ready_at)  # prompt cached, two tokens decoded


def rows(plan: list[Planned[Seq]]) -> list[tuple[str, int, bool]]:
    return [(p.seq.name, p.num_tokens, p.sample) for p in plan]


def test_decode_rows_go_first_one_token_each_then_whole_prompts() -> None:
    running = [prefill("p", 10, ready_at=1), decode("d1", ready_at=2), decode("d2", ready_at=3)]
    plan = plan_micro_batch(running, depth=1, max_batch_tokens=64)
    assert rows(plan) == [("d1", 1, True), ("d2", 1, True), ("p", 10, True)]  # p waited longest, decodes first
    assert all(p.seq is s for p, s in zip(plan, [running[1], running[2], running[0]], strict=True))


def test_prompts_are_chunked_to_what_the_budget_leaves_and_only_the_last_chunk_samples() -> None:
    # As the scheduler runs "short" (2 prompt tokens) and "long" (10) at max_batch_tokens=4.
    short, long = decode("short", ready_at=1), prefill("long", 10, ready_at=2)
    assert rows(plan_micro_batch([short, long], 1, 4)) == [("short", 1, True), ("long", 3, False)]
    long = replace(long, cached=6)
    assert rows(plan_micro_batch([short, long], 1, 4)) == [("short", 1, True), ("long", 3, False)]
    long = replace(long, cached=9)
    assert rows(plan_micro_batch([long], 1, 4)) == [("long", 1, True)]  # the last chunk samples
    long = replace(long, cached=6)
    assert rows(plan_micro_batch([long], 1, 4)) == [("long", 4, True)]  # exactly the rest: last chunk too
    # Two prompts share the budget in waiting order; the second gets what is left.
    a, b = prefill("a", 5, ready_at=1), prefill("b", 5, ready_at=2)
    assert rows(plan_micro_batch([b, a], 1, 8)) == [("a", 5, True), ("b", 3, False)]


def test_the_budget_bounds_decode_rows_and_leaves_prompts_nothing() -> None:
    running = [decode("d1", 1), decode("d2", 2), decode("d3", 3), prefill("p", 4, ready_at=0)]
    assert rows(plan_micro_batch(running, 1, 2)) == [("d1", 1, True), ("d2", 1, True)]
    plan = plan_micro_batch(running, 1, 3)
    assert rows(plan) == [("d1", 1, True), ("d2", 1, True), ("d3", 1, True)]
    assert sum(p.num_tokens for p in plan) <= 3


def test_pipeline_depth_splits_the_running_set_into_micro_batches() -> None:
    assert pipeline_depth(0, 3) == 3  # default: one step in flight per stage
    assert pipeline_depth(1, 2) == 1  # the stages take turns
    # Three running at depth 2: at most ceil(3 / 2) = 2 per micro-batch.
    a, b, c = decode("a", 1), prefill("b", 2, ready_at=2), prefill("c", 2, ready_at=3)
    first = plan_micro_batch([a, b, c], 2, 64)
    assert rows(first) == [("a", 1, True), ("b", 2, True)]
    # Those two in flight: the next micro-batch is what is left, still counting them for the cap.
    a, b = replace(a, in_flight=True), replace(b, in_flight=True)
    assert rows(plan_micro_batch([a, b, c], 2, 64)) == [("c", 2, True)]
    five = [decode(f"s{i}", i) for i in range(5)]
    assert len(plan_micro_batch(five, 2, 64)) == 3 and len(plan_micro_batch(five, 5, 64)) == 1


def test_longest_waiting_first_and_sequences_in_flight_are_skipped() -> None:
    running = [decode("late", 9), decode("busy", 1), decode("early", 2), decode("tie-a", 5), decode("tie-b", 5)]
    running[1] = replace(running[1], in_flight=True)
    plan = plan_micro_batch(running, 1, 64)
    assert rows(plan) == [("early", 1, True), ("tie-a", 1, True), ("tie-b", 1, True), ("late", 1, True)]
    assert rows(plan_micro_batch(running, 1, 2)) == [("early", 1, True), ("tie-a", 1, True)]


def test_nothing_to_plan() -> None:
    assert plan_micro_batch([], 2, 64) == []
    assert plan_micro_batch([replace(decode("a"), in_flight=True)], 1, 64) == []


def test_a_replay_is_prefilled_like_a_prompt_and_its_last_chunk_samples_nothing() -> None:
    """A sequence resuming after a lost worker: 7 log tokens to cache again, its next token already known."""
    replay = Seq("r", prefill_len=7, ready_at=1, samples_after_prefill=False)
    first = plan_micro_batch([replay], depth=1, max_batch_tokens=4)
    assert rows(first) == [("r", 4, False)]
    last = plan_micro_batch([replace(replay, cached=4)], depth=1, max_batch_tokens=4)
    assert rows(last) == [("r", 3, False)]  # the whole log is cached now, and nothing was drawn
    after = plan_micro_batch([replace(replay, cached=7)], depth=1, max_batch_tokens=4)
    assert rows(after) == [("r", 1, True)]  # then it decodes its last token, which draws the next


def test_a_replay_on_some_stages_ends_its_chunk_where_the_replay_ends() -> None:
    """The entries past a partial replay go to every stage: they never share a chunk with it."""
    s = Seq("r", prefill_len=10, samples_after_prefill=False, replay_until=6)
    assert rows(plan_micro_batch([s], 1, 64)) == [("r", 6, False)]
    after = Seq("r", prefill_len=10, cached=6, samples_after_prefill=False, replay_until=6)
    assert rows(plan_micro_batch([after], 1, 64)) == [("r", 4, False)]
    within = Seq("r", prefill_len=10, cached=2, samples_after_prefill=False, replay_until=6)
    assert rows(plan_micro_batch([within], 1, 3)) == [("r", 3, False)]  # the budget still bounds it
