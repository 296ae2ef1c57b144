"""`StepOrder`, the worker's half of pipelining: steps take their turns in the order the gateway chained
them (`after_step_id`), whatever order their RPCs arrive in, and nothing waits forever: a missing
predecessor times out naming the field, one that gave up fails its successor at once, closing the
order (a new epoch) frees every waiter. The whole path over real Gloo links is in
tests/unit/shardworker/test_pipeline.py, over real processes in tests/e2e/test_pipeline.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from shardworker.ordering import OrderError, StepOrder
from tests.waiting import WAIT_S, wait_until


def _take_turn(order: StepOrder, step_id: int, after: int, ran: list[int], errors: list[str]) -> None:
    try:
        with order.turn(step_id, after):
            ran.append(step_id)
    except OrderError as e:
        errors.append(str(e))


def test_turns_follow_the_chain_whatever_the_arrival_order() -> None:
    order, ran, errors = StepOrder(arrival_timeout_s=WAIT_S), [], []
    threads = []
    for arrived, (step_id, after) in enumerate([(3, 2), (2, 1), (1, 0)], start=1):  # newest first
        t = threading.Thread(target=_take_turn, args=(order, step_id, after, ran, errors))
        t.start()
        threads.append(t)
        if after:  # the first step of the chain does not wait
            wait_until(lambda n=arrived: order.waiting() == n)
    for t in threads:
        t.join(WAIT_S)
    assert errors == [] and ran == [1, 2, 3]


def test_a_missing_predecessor_times_out_and_its_successor_fails_at_once() -> None:
    order, ran, errors = StepOrder(arrival_timeout_s=0.3), [], []
    successor = threading.Thread(target=_take_turn, args=(order, 6, 5, ran, errors))
    successor.start()  # waits for step 5, which has arrived and waits for step 4, which never comes
    wait_until(lambda: order.waiting() == 1)
    started = time.monotonic()
    _take_turn(order, 5, 4, ran, errors)
    successor.join(WAIT_S)
    assert ran == [] and errors[0] == "after_step_id: step 4 did not arrive within 0.3 s (last step run here: none)"
    assert errors[1] == "after_step_id: step 5 gave up its turn here without running"
    assert time.monotonic() - started < WAIT_S  # both ended; nothing waits forever
    _take_turn(order, 7, 0, ran, errors)  # a new chain runs at once
    _take_turn(order, 8, 7, ran, errors)
    assert ran == [7, 8]


def test_an_arrived_predecessor_is_waited_for_past_the_arrival_timeout() -> None:
    order, ran, errors = StepOrder(arrival_timeout_s=0.1), [], []
    running, finish_it = threading.Event(), threading.Event()

    def long_step() -> None:
        with order.turn(1, 0):
            running.set()
            finish_it.wait(WAIT_S)
            ran.append(1)

    first = threading.Thread(target=long_step)
    first.start()
    assert running.wait(WAIT_S)
    second = threading.Thread(target=_take_turn, args=(order, 2, 1, ran, errors))
    second.start()
    second.join(0.5)  # five arrival timeouts: step 1 arrived, so step 2 keeps waiting for it
    assert second.is_alive() and errors == []
    finish_it.set()
    first.join(WAIT_S)
    second.join(WAIT_S)
    assert ran == [1, 2] and errors == []


def test_closing_fails_the_waiting_steps_with_the_reason() -> None:
    order, ran, errors = StepOrder(arrival_timeout_s=WAIT_S), [], []
    waiter = threading.Thread(target=_take_turn, args=(order, 3, 2, ran, errors))
    waiter.start()
    wait_until(lambda: order.waiting() == 1)
    order.close("this worker left epoch 1")
    waiter.join(WAIT_S)
    assert errors == ["after_step_id: step 2 will not run here: this worker left epoch 1"] and ran == []
    cancelled = StepOrder(arrival_timeout_s=WAIT_S)
    with (pytest.raises(OrderError, match=r"^after_step_id: cancelled while waiting for step 2$"),
          cancelled.turn(3, 2, cancelled=lambda: True)):  # fmt: skip
        pass
