"""Random sequences of add / abort / step against the scheduler, checking its invariants each step."""

from __future__ import annotations

import random

from fake_worker import FakeWorker, run_window
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from protocol.config import SchedulerConfig
from protocol.messages import AddRequest, SamplingParams, StepPlan
from scheduler.request import Status
from scheduler.scheduler import Scheduler

BS = 4

def priority_inversion(sched: Scheduler, plan: StepPlan, budget: int, max_seqs: int,
                       waited: set[int] | None = None) -> bool:
    """After a step, is the most urgent waiting request one that preempting the running requests
    of less urgent priority classes would have let in? Seats: such a victim always frees one.
    Token budget: the victims' rows give theirs back. Blocks: counted for the whole prompt and
    without prefix hits (an upper bound of what it needs), so a True here is a real inversion."""
    head = sched.queue.peek()
    if head is None or (waited is not None and head.rid not in waited):
        return False  # (a choice released by this very step was not there to be admitted)
    outranked = [r for r in sched.running if r.priority > head.priority]
    if not outranked:
        return False
    kept_tokens = sum(n for rid, n in zip(plan.rids, plan.num_tokens, strict=True)
                      if rid not in sched.requests or sched.requests[rid].priority <= head.priority)
    if kept_tokens >= budget:
        return False
    freeable = sched.pool.num_free + sum(1 for r in outranked for b in r.blocks if sched.pool.ref_count(b) == 1)
    return freeable >= -(-len(head.token_ids) // BS)


ops = st.lists(
    st.one_of(
        # ``constrained``: the worker jumps forward (a row's several tokens in one step).
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(-2, 2), st.booleans()),
        # Long constrained outputs: jumps that fill a row's blocks before its window ends.
        st.tuples(st.just("add"), st.integers(1, 16), st.integers(16, 40), st.integers(-2, 2), st.just(True)),
        # One shared system prompt + a suffix of the request's own: prefix hits across priorities.
        st.tuples(st.just("shared"), st.sampled_from([8, 16, 24]), st.integers(0, 24), st.integers(1, 8),
                  st.integers(-2, 2)),
        # ``scored``: echo with logprobs (the first choice computes every prompt position, no hit).
        st.tuples(st.just("choices"), st.integers(1, 40), st.integers(1, 8), st.integers(-2, 2), st.integers(1, 3),
                  st.booleans(), st.booleans()),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("pause"), st.integers(0, 30)),
        st.tuples(st.just("resume"), st.integers(0, 30)),
        st.tuples(st.just("priority"), st.integers(0, 30), st.integers(-2, 2), st.booleans()),
        st.tuples(st.just("reset_cache"),),
        # The worker reports one of the grammars it was asked to compile (constrained requests
        # wait for theirs before they are admitted).
        st.tuples(st.just("compiled"), st.integers(0, 3)),
        # A step; ``speculative``: the next window is planned before this one's tokens arrive;
        # ``cancel``: (row, abort or pause, the step of the window after which the worker sees it).
        st.tuples(st.just("step"), st.integers(1, 3), st.booleans(),
                  st.none() | st.tuples(st.integers(0, 5), st.sampled_from(["abort", "pause"]), st.integers(0, 2))),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Found by this test: a swap-in's host blocks were freed while its step was still being planned,
# and a swap-out later in the same step was handed them; the worker runs swap-outs first, so
# the swapped-in request read another request's KV back.
@example(ops=[("shared", 8, 16, 1, 1), ("add", 15, 16, 0, True), ("add", 13, 16, 1, True), ("add", 24, 2, 2, False),
              ("add", 21, 6, 0, False), ("shared", 16, 18, 4, 0), ("add", 15, 2, 2, False), ("choices", 25, 1, 2, 2, False, False)],
         policy="fair", num_blocks=27, budget=20, max_seqs=5, steps=1, k=1, mode="swap", priority_preemption=False,
         host_blocks=4, caps={}, drafts=0)
@given(
    ops=ops,
    policy=st.sampled_from(["fcfs", "priority", "fair"]),
    num_blocks=st.integers(10, 40),
    budget=st.integers(8, 64),
    max_seqs=st.integers(1, 6),
    steps=st.sampled_from([1, 3, 8]),
    k=st.integers(1, 3),
    mode=st.sampled_from(["recompute", "swap"]),
    priority_preemption=st.booleans(),
    host_blocks=st.sampled_from([0, 4]),
    caps=st.sampled_from([{}, {}, {1: 1}, {0: 2}]),
    # Speculative decoding: rows verify this many drafts a step (the fake worker accepts some),
    # in plans of at most 4 rows.
    drafts=st.sampled_from([0, 0, 2, 5]),
)
def test_scheduler_invariants(ops: list[tuple], policy: str, num_blocks: int, budget: int, max_seqs: int,
                              steps: int, k: int, mode: str, priority_preemption: bool, host_blocks: int,
                              caps: dict[int, int], drafts: int) -> None:
    config = SchedulerConfig(scheduling_policy=policy, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                             num_scheduler_steps=steps, min_concurrent_prefills=k, preemption_mode=mode,
                             priority_preemption=priority_preemption, num_host_blocks=host_blocks,
                             max_num_seqs_per_priority=caps, speculative="ngram" if drafts else "none",
                             num_speculative_tokens=max(drafts, 1), speculative_max_batch=4)
    sched = Scheduler(config, num_blocks, BS, 64, [2])
    worker = FakeWorker(BS, eos=2, max_model_len=64, token_for=lambda rid, i: 2 if (rid + i) % 9 == 0 else 50)
    accepted: set[int] = set()
    finished: dict[int, str] = {}
    next_rid = 0
    cut_in_since_check = False

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
        pool = sched.pool  # the three free sets: disjoint, exactly the unheld blocks, cached ones apart
        plain, untouched, cached_free = set(pool._free_plain), set(pool._untouched), set(pool._free_cached)
        assert len(plain) + len(untouched) + len(cached_free) == len(plain | untouched | cached_free) == pool.num_free
        assert plain | untouched | cached_free == set(range(pool.num_blocks)) - set(holders)
        assert cached_free == {b for b in plain | untouched | cached_free if b in pool._cached}
        for b, n in holders.items():
            assert sched.pool.ref_count(b) == n
        for p, cap in caps.items():  # seat caps bind at admission (a priority change may exceed them)
            assert sum(1 for r in sched.running if r.priority >= p) <= max(cap, len(sched.running))

    def check_plan(plan: StepPlan) -> None:
        # A request scoring its prompt reaches the worker with nothing computed (no prefix hit,
        # no swapped-in KV): its scores so far would be lost with the worker state it rebuilds.
        for new in plan.new_requests:
            assert new.sampling.prompt_logprobs is None or new.num_computed == 0, new

    def add(tokens: list[int], max_tokens: int, priority: int, n: int = 1, constrained: bool = False,
            scored: bool = False) -> int:
        nonlocal next_rid
        rid, next_rid = next_rid, next_rid + n
        sampling = SamplingParams(max_tokens=max_tokens, grammar=f"(grammar {rid % 3})" if constrained else None,
                                  prompt_logprobs=1 if scored else None)
        msg = AddRequest(rid, str(rid), tokens, sampling, priority, f"user{rid % 2}", float(rid), n)
        if not sched.add(msg):
            accepted.update(range(rid, rid + n))
        return rid

    def run_step(speculative: bool, cancel: tuple[int, str, int] | None) -> bool:
        nonlocal cut_in_since_check
        waited = {r.rid for r in sched.queue}
        plan = sched.schedule()
        if plan is None:
            return False
        assert sum(plan.num_tokens) <= budget
        assert len(plan.rids) <= max_seqs
        check_plan(plan)
        if priority_preemption and policy != "fcfs" and not caps and not cut_in_since_check:
            assert not priority_inversion(sched, plan, budget, max_seqs, waited)
        cut_in_since_check = False
        record(run_window(sched, worker, plan, sched.continue_plan() if speculative else None, cancel))
        return True

    for op in ops:
        if op[0] == "add":
            _, prompt, max_tokens, priority, constrained = op
            # Prompts share prefixes (three families), so the prefix cache is exercised across
            # priorities under block pressure.
            family = next_rid % 3
            add([(family * 50 + j) % 90 + 3 for j in range(prompt)], max_tokens, priority, constrained=constrained)
        elif op[0] == "shared":
            _, prefix, suffix, max_tokens, priority = op
            add([j % 90 + 3 for j in range(prefix)] + [(next_rid * 13 + j) % 90 + 3 for j in range(suffix)],
                max_tokens, priority)
        elif op[0] == "choices":  # n > 1: siblings wait to share the first one's prompt blocks
            _, prompt, max_tokens, priority, n, scored, constrained = op
            add([(next_rid * 7 + j) % 90 + 3 for j in range(prompt)], max_tokens, priority, n, scored=scored,
                constrained=constrained)
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
            cut_in_since_check |= op[3]
        elif op[0] == "reset_cache":
            sched.reset_prefix_cache()
        elif op[0] == "compiled":
            asked = sched.grammars.to_prepare
            if asked:
                grammar_id, _ = asked.pop(op[1] % len(asked))
                sched.grammar_compiled(grammar_id)
        else:
            for _ in range(op[1]):
                if not run_step(op[2], op[3]):
                    break
        check()
    # Drain: everything accepted ends exactly once and every block comes back.
    for rid in list(sched.paused_requests):
        sched.resume(rid)
    while sched.grammars.to_prepare:
        sched.grammar_compiled(sched.grammars.to_prepare.pop()[0])
    assert len(sched.grammars) == 0, "every request that waited for its grammar was released"
    for _ in range(2000):
        plan = sched.schedule()
        if plan is None:
            break
        check_plan(plan)
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
