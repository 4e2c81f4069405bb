"""Issue 13's scheduler defects, each reproduced exactly as found, plus per-priority seat caps."""

from __future__ import annotations

from test_scheduler_core import add, make, run_to_end, step
from test_scheduler_policies import add_tokens, prompt_of

from protocol.config import ConfigError, SchedulerConfig
from scheduler.request import Status

BS = 16


def test_an_urgent_request_takes_a_seat_from_a_running_less_urgent_one() -> None:
    # Defect 1: with every seat held by running decodes, the step filled up with them and
    # admission stopped before the seat-preemption branch could run.
    sched, worker = make(max_num_seqs=1, num_scheduler_steps=1)
    add(sched, 0, 8, max_tokens=500, priority=5)
    step(sched, worker)
    step(sched, worker)
    add(sched, 1, 8, max_tokens=4, priority=1, arrival=100.0)
    plan, _ = step(sched, worker)
    assert plan is not None and plan.rids == [1]
    assert sched.requests[0].status is Status.PREEMPTED and sched.num_preemptions == 1
    assert run_to_end(sched, worker) == {0: "length", 1: "length"}


def test_seat_preemption_frees_the_victims_share_of_a_full_token_budget() -> None:
    # Two seats, a budget the two running prompts' chunks use up: the urgent newcomer still gets
    # the seat (and the tokens) of the least urgent one, instead of waiting for its prefill to end.
    sched, worker = make(max_num_seqs=2, max_num_batched_tokens=64, num_scheduler_steps=1,
                         min_concurrent_prefills=2)
    add(sched, 0, 400, max_tokens=4, priority=3)
    add(sched, 1, 400, max_tokens=4, priority=5)
    plan, _ = step(sched, worker)
    assert plan is not None and plan.num_tokens == [32, 32]
    add(sched, 2, 8, max_tokens=4, priority=0, arrival=100.0)
    plan, _ = step(sched, worker)
    assert plan is not None and 2 in plan.rids and 1 not in plan.rids
    assert sched.requests[1].status is Status.PREEMPTED
    assert run_to_end(sched, worker) == {0: "length", 1: "length", 2: "length"}


def test_urgent_newcomer_sharing_a_victims_cached_prefix_does_not_run_out_of_blocks() -> None:
    # Defect 2, the reproduction from the issue: 8 blocks of 16. The victim's blocks that are the
    # newcomer's prefix hits are freed by the preemption and taken straight back by the newcomer,
    # so they must not count towards the blocks it needs freed (that raised OutOfBlocks).
    sched, worker = make(num_blocks=8, num_scheduler_steps=1)
    prefix = prompt_of(32, start=7)
    add_tokens(sched, 0, prompt_of(60, start=100), max_tokens=4, priority=0)
    add_tokens(sched, 1, prefix + prompt_of(8, start=200), max_tokens=4, priority=5)
    step(sched, worker)
    add_tokens(sched, 2, prefix + prompt_of(40, start=300), max_tokens=4, priority=0)
    plan, _ = step(sched, worker)  # raised OutOfBlocks
    assert plan is not None
    assert run_to_end(sched, worker) == {0: "length", 1: "length", 2: "length"}
    assert sched.pool.num_free == 8


def test_per_priority_seat_caps_hold_batch_traffic_to_its_share() -> None:
    # --max-num-seqs-per-priority 5:2 — priority >= 5 holds at most 2 of the 4 seats; a capped
    # request waits (never rejected), and an interactive one behind it is not held up.
    sched, worker = make(max_num_seqs=4, num_scheduler_steps=1, scheduling_policy="fcfs",
                         max_num_seqs_per_priority={5: 2})
    for rid in range(4):
        add(sched, rid, 8, max_tokens=20, priority=5)
    add(sched, 4, 8, max_tokens=20, priority=0, arrival=10.0)
    plan, _ = step(sched, worker)
    assert plan is not None and sorted(plan.rids) == [0, 1, 4]
    assert sched.stats()["seats_by_priority"] == {"5": 2}
    assert run_to_end(sched, worker) == {rid: "length" for rid in range(5)}


def test_per_priority_caps_parse_and_validate() -> None:
    assert SchedulerConfig.parse_priority_caps("5:32,10:4") == {5: 32, 10: 4}
    for bad in ("5", "a:3", "5:0", "5:-1", "5:3,5:4"):
        try:
            SchedulerConfig.parse_priority_caps(bad)
        except ConfigError as e:
            assert "--max-num-seqs-per-priority" in str(e)
        else:
            raise AssertionError(f"{bad!r} accepted")


def test_a_lost_worker_s_requests_are_recomputed_on_a_fresh_one_with_the_same_outputs() -> None:
    # Swap mode and a paused request too: everything the worker held (device and host KV) is
    # gone; the fake worker checks every KV read by content, so a request the scheduler thinks
    # is computed but is not would fail here.
    sched, worker = make(num_blocks=12, num_scheduler_steps=3, preemption_mode="swap", max_num_batched_tokens=32)
    for rid in range(4):
        add(sched, rid, 20 + rid, max_tokens=12, priority=rid % 2)
    for _ in range(4):
        step(sched, worker)
    sched.pause(3)
    step(sched, worker)
    before = set(sched.requests)
    assert sched.recompute_all() == len(before)
    assert sched.pool.num_free == 12 and not sched.running and sched.requests[3].status is Status.PAUSED
    fresh = type(worker)(BS, eos=2, max_model_len=8192)  # the restarted worker knows nothing
    sched.resume(3)
    finished = run_to_end(sched, fresh)
    assert set(finished) == set(before) and set(finished.values()) == {"length"}
    assert sched.pool.num_free == 12
