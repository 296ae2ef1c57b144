"""What bench/seam_trace.py reads from a scheduler trace: the stages' compute threads and partners, each turn's
hand-over and partner latency, and the CPU each class of thread took in the turn, with a vCPU whose switches from
idle are not traced."""

from __future__ import annotations

import pytest

from bench.seam_trace import (
    Mesh,
    against_markdown,
    compute_threads,
    parse,
    partners,
    per_round,
    running,
    summary,
    turns,
)

NAMES = {0: "<idle>", 101: "python", 102: "python", 103: "python", 201: "python", 202: "python", 301: "event_engine"}


def switch(ts: float, cpu: int, prev: int, nxt: int, state: str = "S") -> str:
    return (f"  {NAMES[prev]}-{prev}  [{cpu:03d}] d..2. {ts:.6f}: sched_switch: prev_comm={NAMES[prev]} "
            f"prev_pid={prev} prev_prio=120 prev_state={state} ==> next_comm={NAMES[nxt]} next_pid={nxt} "
            "next_prio=120")  # fmt: skip


def waking(ts: float, cpu: int, waker: int, woken: int, target: int, kind: str = "sched_waking") -> str:
    return (f"  {NAMES[waker]}-{waker}  [{cpu:03d}] d..2. {ts:.6f}: {kind}: comm={NAMES[woken]} pid={woken} prio=120 "
            f"target_cpu={target:03d}")  # fmt: skip


# Stage 0 (pid 100: compute thread 101, OpenMP partner 102, an idle thread 103) hands over to stage 1 (pid 200:
# 201 and 202) at 10 ms and back at 20 ms; the gateway (301) preempts stage 1's partner for 1 ms. vCPU 1 does not
# trace its switches from idle: 201 is taken to run from the wake-up the idle vCPU emits for it.
TRACE = [
    "# tracer: nop",
    switch(0.000, 0, 0, 101, "R"),
    switch(0.000, 1, 0, 102, "R"),
    switch(0.008, 1, 102, 0),  # stage 0's partner sleeps: vCPU 1 idle
    waking(0.010, 0, 101, 201, 1),  # the hand-over: stage 1's turn
    waking(0.0102, 1, 0, 201, 1, "sched_wakeup"),  # vCPU 1 takes 201 (no switch traced)
    switch(0.0105, 0, 101, 0),  # stage 0's compute thread waits for the token
    waking(0.0110, 1, 201, 202, 0),  # the first parallel region wakes the partner
    switch(0.0111, 0, 0, 202, "R"),
    switch(0.0150, 0, 202, 301, "R"),
    switch(0.0160, 0, 301, 202),
    waking(0.0200, 1, 201, 101, 0),  # the token back: stage 0's turn
    switch(0.0201, 0, 202, 101),
    switch(0.0210, 1, 201, 0),
    waking(0.0300, 0, 101, 201, 1),
]
MESH = Mesh({101: 100, 102: 100, 103: 100, 201: 200, 202: 200, 301: 300},
            {100: "stage 0", 200: "stage 1", 300: "gateway"})  # fmt: skip


def test_the_idle_vcpu_s_untraced_switch_starts_the_task_at_its_wakeup() -> None:
    spans = running(parse(TRACE))
    assert (0.0102, 0.021, 1, 201) in [(round(s, 6), round(e, 6), c, t) for s, e, c, t in spans]
    assert (0.008, 0.0102, 1, 0) in [(round(s, 6), round(e, 6), c, t) for s, e, c, t in spans]


def test_the_compute_threads_are_the_pair_that_wakes_each_other_and_the_partner_the_next_busiest() -> None:
    events = parse(TRACE)
    main = compute_threads(events, MESH)
    assert main == {100: 101, 200: 201}
    assert partners(running(events), MESH, main) == {100: 102, 200: 202}  # not 103, which never ran


def test_a_turn_s_cpu_adds_up_to_both_vcpus_and_is_charged_by_class() -> None:
    found = turns(parse(TRACE), MESH)
    assert [(t.stage, round(t.start, 4), round(t.end, 4)) for t in found] == [(200, 0.01, 0.02), (100, 0.02, 0.03)]
    t = found[0]
    assert t.handover_s == pytest.approx(0.0002)  # woken at 10.0 ms, running at 10.2
    assert t.partner_s == pytest.approx(0.0009)  # its partner running at 11.1
    assert t.cpu["compute thread"] == pytest.approx(0.0098)
    assert t.cpu["partner"] == pytest.approx(0.0039 + 0.0040)  # less the gateway's millisecond
    assert t.cpu["gateway"] == pytest.approx(0.001)
    assert t.cpu["the other stage"] == pytest.approx(0.0005)  # stage 0's compute thread until it waits
    assert t.cpu["idle"] == pytest.approx(0.0002 + 0.0006)
    assert sum(t.cpu.values()) == pytest.approx(0.020)  # two vCPUs for 10 ms
    rows = summary(found, MESH)
    assert set(rows) == {"stage 0", "stage 1"} and rows["stage 1"]["turns"] == 1
    assert rows["stage 1"]["cpu_ms"]["partner"][1] == pytest.approx(7.9)


def test_no_wake_ups_between_the_stages_is_a_clear_error() -> None:
    with pytest.raises(SystemExit, match="no wake-ups between the two stages"):
        compute_threads(parse(TRACE[:4]), MESH)


def test_a_run_s_headline_and_the_difference_between_trees_is_taken_within_each_round() -> None:
    row = per_round(turns(parse(TRACE), MESH), MESH, {"ms_per_token": 20.0})
    assert row["ms_per_token"] == 20.0
    assert row["stage 1 partner_ms"] == pytest.approx(0.9)  # the one turn of stage 1 (pid 200)
    assert row["stage 1 idle_ms"] == pytest.approx(0.8)
    rounds = [
        {"a": {"ms_per_token": 20.0, "x": 1.0}, "b": {"ms_per_token": 30.0, "x": 0.5}},
        {"a": {"ms_per_token": 40.0, "x": 2.0}, "b": {"ms_per_token": 39.0, "x": 1.9}},
        {"a": {"ms_per_token": 25.0, "x": 1.0}, "b": {"ms_per_token": 24.0, "x": 0.8}},
    ]
    text = against_markdown(rounds, ["a", "b"])
    assert "- ms_per_token: **+1.000** (-10.000 to +1.000)" in text  # the median of -10, +1, +1: not of the medians
    assert "- x: **+0.200** (+0.100 to +0.500)" in text
    assert "| 2 | b | 39.00 | 1.900 |" in text
