"""The scheduler's policy alone: admission order, per-session order, batch cap, step plans,
wait or Busy when memory is short."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from llava.sched.scheduler import Scheduler


@dataclass(eq=False)
class Req:
    order_key: str | None
    pending: int = 1
    prefilling: bool = True
    deadline: float = 10.0


def test_a_sessions_second_request_waits_for_its_first_and_overtakes_nothing():
    scheduler = Scheduler(max_batch=8)
    a1, b1, a2, b2 = Req("a"), Req("b"), Req("a"), Req("b")
    for request in (a1, b1, a2, b2):
        scheduler.add(request)
    assert scheduler.admissible() == [a1, b1]
    scheduler.start(a1)
    assert scheduler.admissible() == [b1]  # a2 waits while a1 runs
    scheduler.remove(a1)
    assert scheduler.admissible() == [b1, a2]


def test_a_request_left_waiting_keeps_its_sessions_later_requests_behind_it():
    scheduler = Scheduler(max_batch=8)
    a1, a2, opening = Req("a"), Req("a"), Req(None)
    for request in (a1, a2, opening):
        scheduler.add(request)
    assert scheduler.admissible() == [a1, opening]  # a1 not started (say, Busy): a2 still waits


def test_a_request_short_of_memory_waits_only_while_others_run_and_its_time_lasts():
    scheduler = Scheduler(max_batch=8)
    short, running = Req("a", deadline=10.0), Req("b")
    scheduler.add(short)
    assert not scheduler.waits_for_memory(short, now=0.0)  # nothing runs: nothing will free
    scheduler.add(running)
    scheduler.start(running)
    assert scheduler.waits_for_memory(short, now=9.9)  # its session turns idle (movable) soon
    assert not scheduler.waits_for_memory(short, now=10.0)  # out of time: Busy


def test_a_request_short_of_memory_waits_for_running_turns_before_anyone_is_dropped():
    scheduler = Scheduler(max_batch=8, wait_for_room_s=0.25)
    short, running = Req("a"), Req("b")
    scheduler.add(short)
    assert scheduler.may_drop(short, now=0.0)  # nothing runs: waiting would free nothing
    scheduler.add(running)
    scheduler.start(running)
    assert not scheduler.may_drop(short, now=1.0)  # not yet short: first it waits
    assert scheduler.waits_for_memory(short, now=1.0)  # found short at 1.0
    assert not scheduler.may_drop(short, now=1.2)
    assert scheduler.may_drop(short, now=1.25)  # waited its bound: idle sessions may move
    scheduler.start(short)
    scheduler.remove(short)
    scheduler.add(short)  # a new wait starts from scratch
    assert not scheduler.may_drop(short, now=5.0)


def test_no_more_than_max_batch_run_at_once():
    scheduler = Scheduler(max_batch=2)
    requests = [Req(str(i)) for i in range(4)]
    for request in requests:
        scheduler.add(request)
    assert scheduler.admissible() == requests[:2]
    scheduler.start(requests[0])
    assert scheduler.admissible() == requests[1:2]


def test_a_mixed_step_feeds_every_decode_and_prefill_chunks_within_the_budget():
    scheduler = Scheduler(max_batch=8, prefill_chunk_tokens=100)
    long, short = Req("p1", pending=300), Req("p2", pending=30)
    decodes = [Req(f"d{i}", pending=1, prefilling=False) for i in range(3)]
    for request in (long, short, *decodes):
        scheduler.add(request)
        scheduler.start(request)
    assert scheduler.plan() == [(long, 100), *((d, 1) for d in decodes)]
    long.pending = 20
    assert scheduler.plan() == [(long, 20), (short, 30), *((d, 1) for d in decodes)]


def test_alternating_steps_take_turns_between_prefill_and_decode():
    scheduler = Scheduler(max_batch=8, prefill_chunk_tokens=100, mixed=False)
    prefill, decode = Req("p", pending=250), Req("d", pending=1, prefilling=False)
    for request in (prefill, decode):
        scheduler.add(request)
        scheduler.start(request)
    plans = [scheduler.plan() for _ in range(4)]
    assert plans == [[(prefill, 100)], [(decode, 1)], [(prefill, 100)], [(decode, 1)]]


@pytest.mark.parametrize(
    "bad", [{"max_batch": 0}, {"prefill_chunk_tokens": 0}, {"wait_for_room_s": -1}]
)
def test_a_scheduler_that_could_never_run_anything_is_refused(bad):
    with pytest.raises(ValueError):
        Scheduler(**bad)
