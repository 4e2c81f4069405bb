"""Random sequences of add / abort / step against the scheduler, checking its invariants each step."""

from __future__ import annotations

import random

from fake_worker import FakeWorker
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.config import SchedulerConfig
from protocol.messages import AddRequest, SamplingParams, StepPlan
from scheduler.request import Status
from scheduler.scheduler import Scheduler

BS = 4

def priority_inversion(sched: Scheduler, plan: StepPlan, budget: int, max_seqs: int) -> bool:
    """After a step that left room, is the most urgent waiting request one that preempting less
    urgent running requests would have let in? (Blocks counted without prefix hits: an upper
    bound of what it needs, so a True here is a real inversion.)"""
    head = sched.queue.peek()
    if head is None or sum(plan.num_tokens) >= budget or len(plan.rids) >= max_seqs:
        return False
    less_urgent = [r for r in sched.running if sched.key(r) > sched.key(head)]
    freeable = sched.pool.num_free + sum(1 for r in less_urgent for b in r.blocks if sched.pool.ref_count(b) == 1)
    seat = len(sched.running) < max_seqs or bool(less_urgent)
    return seat and freeable >= -(-len(head.token_ids) // BS)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(-2, 2)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("pause"), st.integers(0, 30)),
        st.tuples(st.just("resume"), st.integers(0, 30)),
        st.tuples(st.just("priority"), st.integers(0, 30), st.integers(-2, 2), st.booleans()),
        st.tuples(st.just("reset_cache"),),
        st.tuples(st.just("step"), st.integers(1, 3)),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    policy=st.sampled_from(["fcfs", "priority", "fair"]),
    num_blocks=st.integers(12, 40),
    budget=st.integers(8, 64),
    max_seqs=st.integers(1, 6),
    steps=st.sampled_from([1, 3, 8]),
    k=st.integers(1, 3),
    mode=st.sampled_from(["recompute", "swap"]),
    priority_preemption=st.booleans(),
    host_blocks=st.sampled_from([0, 4]),
)
def test_scheduler_invariants(ops: list[tuple], policy: str, num_blocks: int, budget: int, max_seqs: int,
                              steps: int, k: int, mode: str, priority_preemption: bool, host_blocks: int) -> None:
    config = SchedulerConfig(scheduling_policy=policy, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                             num_scheduler_steps=steps, min_concurrent_prefills=k, preemption_mode=mode,
                             priority_preemption=priority_preemption, num_host_blocks=host_blocks)
    sched = Scheduler(config, num_blocks, BS, 64, [2])
    worker = FakeWorker(BS, eos=2, max_model_len=64, token_for=lambda rid, i: 2 if (rid + i) % 9 == 0 else 50)
    accepted: set[int] = set()
    finished: dict[int, str] = {}
    next_rid = 0

    def record(batch_finishes: list) -> None:
        for f in batch_finishes:
            assert f.rid not in finished, f"rid {f.rid} finished twice"
            finished[f.rid] = f.reason

    def check() -> None:
        holders: dict[int, int] = {}
        for r in sched.requests.values():
            assert r.blocks == [] or r.status in (Status.RUNNING, Status.PAUSED)
            assert len(set(r.blocks)) == len(r.blocks)
            for b in r.blocks:
                holders[b] = holders.get(b, 0) + 1
        # free + held = total, and each held block's ref count is its number of holders.
        assert len(holders) + sched.pool.num_free == sched.pool.num_blocks
        for b, n in holders.items():
            assert sched.pool.ref_count(b) == n

    def check_no_inversion(plan) -> None:  # type: ignore[no-untyped-def]
        assert not priority_inversion(sched, plan, budget, max_seqs)

    for op in ops:
        if op[0] == "add":
            _, prompt, max_tokens, priority = op
            # Prompts share prefixes (three families), so the prefix cache is exercised too.
            family = next_rid % 3
            tokens = [(family * 50 + j) % 90 + 3 for j in range(prompt)]
            msg = AddRequest(next_rid, str(next_rid), tokens, SamplingParams(max_tokens=max_tokens),
                             priority, f"user{next_rid % 2}", float(next_rid))
            rejected = sched.add(msg)
            if rejected is None:
                accepted.add(next_rid)
            next_rid += 1
        elif op[0] == "abort":
            f = sched.abort(op[1])
            if f is not None:
                record([f])
        elif op[0] == "pause":
            sched.pause(op[1])
        elif op[0] == "resume":
            sched.resume(op[1])
        elif op[0] == "priority":
            sched.set_priority(op[1], op[2], cut_in=op[3])
        elif op[0] == "reset_cache":
            sched.reset_prefix_cache()
        else:
            for _ in range(op[1]):
                plan = sched.schedule()
                if plan is None:
                    break
                assert sum(plan.num_tokens) <= budget
                assert len(plan.rids) <= max_seqs
                if priority_preemption:
                    check_no_inversion(plan)
                for out in worker.run(plan):  # raises if a write falls outside the block table
                    record(sched.update(out).finished)
        check()
    # Drain: everything accepted ends exactly once and every block comes back.
    for rid in list(sched.paused_requests):
        sched.resume(rid)
    for _ in range(2000):
        plan = sched.schedule()
        if plan is None:
            break
        for out in worker.run(plan):
            record(sched.update(out).finished)
        check()
    assert set(finished) == accepted
    assert sched.pool.num_free == num_blocks
    assert sched.host_pool is None or sched.host_pool.num_free == sched.host_pool.num_blocks


def test_no_priority_inversion_over_random_workloads() -> None:
    """Seeded random arrivals of mixed priorities: after every step that left room, the most
    urgent waiting request is never one that preempting less urgent running ones would admit."""
    violations = 0
    for seed in range(150):
        rng = random.Random(seed)
        budget, max_seqs = rng.randint(8, 64), rng.randint(1, 6)
        config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, num_scheduler_steps=1)
        sched = Scheduler(config, rng.randint(12, 40), BS, 64, [2])
        worker = FakeWorker(BS, eos=2, max_model_len=64, token_for=lambda rid, i: 50)
        rid = 0
        for _ in range(60):
            if rng.random() < 0.4:
                params = SamplingParams(max_tokens=rng.randint(1, 12))
                sched.add(AddRequest(rid, str(rid), [3 + rid % 7] * rng.randint(1, 40), params,
                                     rng.randint(-2, 2), "", float(rid)))
                rid += 1
            plan = sched.schedule()
            if plan is None:
                continue
            violations += priority_inversion(sched, plan, budget, max_seqs)
            for out in worker.run(plan):
                sched.update(out)
    assert violations == 0
