"""Issue-3 capabilities of the scheduling core, each seed's worked example as an exact assertion."""

from __future__ import annotations

from fake_worker import FakeWorker
from test_scheduler_core import add, make, run_to_end, step

from protocol.config import SchedulerConfig
from protocol.messages import AddRequest, SamplingParams
from scheduler.queues import FairQueue
from scheduler.request import Request, Status
from scheduler.scheduler import Scheduler

BS = 16


def prompt_of(n: int, start: int = 3) -> list[int]:
    return [(start + j) % 300 + 3 for j in range(n)]


def add_tokens(sched: Scheduler, rid: int, tokens: list[int], max_tokens: int = 4, priority: int = 0,
               user: str = "") -> None:
    msg = AddRequest(rid, f"r{rid}", tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), priority, user,
                     float(rid))
    assert sched.add(msg) == []


# ------------------------------------------------------------------ prefix-cache-aware admission: prefix-cache-aware admission


def test_seed_003_sixteen_block_prompt_with_twelve_cached_needs_four() -> None:
    # 17 blocks: a running request holds 12 prompt blocks + 1 for its decodes; 4 are free.
    sched, worker = make(num_blocks=17)
    shared = prompt_of(12 * BS)
    add_tokens(sched, 0, shared, max_tokens=10)
    step(sched, worker)
    step(sched, worker)
    assert sched.pool.num_free == 4
    # A 16-block prompt whose first 12 blocks are the running request's: it needs only 4.
    add_tokens(sched, 2, shared + prompt_of(4 * BS, start=500), max_tokens=1)
    plan = sched.schedule()
    assert plan is not None and 2 in plan.rids
    assert plan.num_tokens[plan.rids.index(2)] == 4 * BS  # only uncached tokens cost budget
    assert sched.pool.num_free == 0 and sched.num_preemptions == 0
    finishes = [f for out in worker.run(plan) for f in sched.update(out).finished]
    assert [(f.rid, f.cached_tokens) for f in finishes] == [(2, 12 * BS)]


def test_seed_003_two_prompts_sharing_a_cached_prefix_cost_only_their_uncached_tokens() -> None:
    sched, worker = make(num_blocks=256, max_num_batched_tokens=2048)
    prefix = prompt_of(512)
    add_tokens(sched, 0, prefix, max_tokens=1)
    run_to_end(sched, worker)
    add_tokens(sched, 1, prefix + prompt_of(512, start=7), max_tokens=1)
    add_tokens(sched, 2, prefix + prompt_of(512, start=9), max_tokens=1)
    plan, batches = step(sched, worker)
    assert plan is not None and sorted(plan.rids) == [1, 2]
    assert sum(plan.num_tokens) == 1024  # not 2048
    finishes = {f.rid: f for b in batches for f in b.finished}
    assert finishes[1].cached_tokens == finishes[2].cached_tokens == 512
    assert sched.pool.queries == 512 + 2 * 1024 and sched.pool.hits == 1024


def test_seed_003_fully_cached_prompt_computes_only_its_last_token() -> None:
    sched, worker = make(num_blocks=64)
    tokens = prompt_of(4 * BS)
    add_tokens(sched, 0, tokens, max_tokens=3)
    first = run_to_end(sched, worker)
    assert first == {0: "length"}
    outputs_before = worker.token_for
    add_tokens(sched, 1, tokens, max_tokens=3)
    plan, _batches = step(sched, worker)
    assert plan is not None and plan.num_tokens == [1]
    assert len(plan.copy_blocks) == 1  # the last block is copied, never written in place
    assert plan.new_requests[0].num_computed == 4 * BS - 1
    run_to_end(sched, worker)  # the fake worker verified every position's KV by content
    assert outputs_before is worker.token_for


def test_preempted_request_gets_its_own_blocks_back_from_the_cache() -> None:
    sched, worker = make(num_blocks=6, max_num_batched_tokens=200)
    add(sched, 0, 40, max_tokens=30)
    add(sched, 1, 40, max_tokens=30)
    while not sched.num_preemptions:
        step(sched, worker)
    victim = sched.requests[1]
    assert victim.status is Status.PREEMPTED
    assert run_to_end(sched, worker) == {0: "length", 1: "length"}
    assert sched.pool.hits > 0


def test_prefix_cache_reset_drops_only_unheld_blocks() -> None:
    sched, worker = make(num_blocks=32)
    add_tokens(sched, 0, prompt_of(2 * BS), max_tokens=1)
    run_to_end(sched, worker)
    assert sched.pool.num_cached_free == 2
    assert sched.reset_prefix_cache() == 2
    assert sched.pool.num_cached_free == 0


# ------------------------------------------------------------------ priority scheduling: priorities, cut-in, pause


def test_priority_preemption_evicts_the_fewest_less_urgent() -> None:
    # 8 blocks; three low-priority requests hold 2 blocks each (+ decode growth).
    sched, worker = make(num_blocks=8, max_num_batched_tokens=512)
    for rid in range(3):
        add(sched, rid, 2 * BS - 8, max_tokens=8, priority=5)  # 2 blocks each, room to decode
    step(sched, worker)
    add(sched, 9, 3 * BS, max_tokens=4, priority=0, arrival=100.0)  # needs 3 blocks; 2 are free
    plan, _ = step(sched, worker)
    assert plan is not None and 9 in plan.rids
    assert sched.num_preemptions == 1  # the fewest: one victim freed enough
    assert sched.requests[2].status is Status.PREEMPTED  # the least urgent = latest arrival at prio 5
    assert run_to_end(sched, worker) == {0: "length", 1: "length", 2: "length", 9: "length"}


def test_without_priority_preemption_urgent_request_waits() -> None:
    sched, worker = make(num_blocks=8, max_num_batched_tokens=512, priority_preemption=False)
    for rid in range(3):
        add(sched, rid, 2 * BS - 8, max_tokens=8, priority=5)
    step(sched, worker)
    add(sched, 9, 3 * BS, max_tokens=4, priority=0, arrival=100.0)
    plan, _ = step(sched, worker)
    assert plan is not None and 9 not in plan.rids and sched.num_preemptions == 0
    assert sched.queue.peek() is sched.requests[9]  # but it is first in line


def test_priority_orders_admission_and_ties_are_fcfs() -> None:
    sched, worker = make(max_num_seqs=1, num_scheduler_steps=1)
    add(sched, 0, 8, priority=3)
    add(sched, 1, 8, priority=1)
    add(sched, 2, 8, priority=1)
    order = []
    for _ in range(100):
        plan, _ = step(sched, worker)
        if plan is None:
            break
        if plan.new_requests:
            order.append(plan.new_requests[0].rid)
    assert order == [1, 2, 0]


def test_cut_in_runs_at_the_next_step_preempting_a_less_urgent_one() -> None:
    sched, worker = make(max_num_seqs=1, num_scheduler_steps=1, priority_preemption=False)
    add(sched, 0, 8, max_tokens=50)
    add(sched, 1, 8, max_tokens=5, priority=5)
    step(sched, worker)
    assert sched.set_priority(1, -1, cut_in=True)
    plan, _ = step(sched, worker)
    assert plan is not None and plan.rids == [1]
    assert sched.requests[0].status is Status.PREEMPTED
    assert run_to_end(sched, worker) == {0: "length", 1: "length"}


def test_pause_keeps_blocks_and_resume_continues_without_recompute() -> None:
    sched, worker = make()
    add(sched, 0, 40, max_tokens=20)
    step(sched, worker)
    step(sched, worker)
    req = sched.requests[0]
    computed, blocks = req.num_computed, list(req.blocks)
    assert sched.pause(0)
    assert sched.schedule() is None and req.status is Status.PAUSED and req.blocks == blocks
    assert sched.resume(0)
    plan, _ = step(sched, worker)
    assert plan is not None and plan.new_requests == [] and plan.num_tokens == [1]
    assert req.num_computed == computed + 1
    assert run_to_end(sched, worker) == {0: "length"}


def test_paused_request_releases_blocks_under_memory_pressure_and_recomputes() -> None:
    sched, worker = make(num_blocks=6, max_num_batched_tokens=200)
    add(sched, 0, 40, max_tokens=10)
    step(sched, worker)
    sched.pause(0)
    add(sched, 1, 80, max_tokens=10)  # needs 6 blocks: only available if the paused one lets go
    plan, _ = step(sched, worker)
    assert plan is not None and plan.rids == [1] and 0 in plan.forget
    assert sched.requests[0].blocks == [] and sched.requests[0].status is Status.PAUSED
    run_to_end(sched, worker)
    sched.resume(0)
    assert run_to_end(sched, worker) == {0: "length"}


# ------------------------------------------------------------------ preemption: swap


def test_swap_preemption_moves_kv_to_host_and_back_without_recompute() -> None:
    sched, worker = make(num_blocks=6, max_num_batched_tokens=200, preemption_mode="swap")
    add(sched, 0, 40, max_tokens=30)
    add(sched, 1, 40, max_tokens=30)
    swap_outs, swap_ins, resent = [], [], []
    for _ in range(200):
        plan, _ = step(sched, worker)
        if plan is None:
            break
        swap_outs += plan.swap_out
        swap_ins += plan.swap_in
        resent += [n for n in plan.new_requests if n.rid == 1 and n.num_computed > 0]
    assert sched.num_swaps >= 1 and swap_outs and swap_ins
    assert resent and resent[0].num_computed > 40  # resumed where it was, prompt not recomputed
    assert sched.host_pool is not None and sched.host_pool.num_free == sched.host_pool.num_blocks
    assert sched.pool.num_free == 6


def test_swap_falls_back_to_recompute_when_host_memory_is_full() -> None:
    config = SchedulerConfig(num_scheduler_steps=1, preemption_mode="swap", num_host_blocks=1,
                             max_num_batched_tokens=200)
    sched = Scheduler(config, 6, BS, 8192, [2])
    worker = FakeWorker(BS)
    add(sched, 0, 40, max_tokens=30)
    add(sched, 1, 40, max_tokens=30)
    assert run_to_end(sched, worker) == {0: "length", 1: "length"}
    assert sched.num_preemptions >= 1 and sched.num_swaps == 0


# ------------------------------------------------------------------ fair policy


def test_fair_queue_serves_the_least_served_user_first() -> None:
    q = FairQueue()
    reqs = [Request(AddRequest(i, str(i), [1], SamplingParams(), 0, user, float(i)))
            for i, user in enumerate(["flood"] * 5 + ["quiet"])]
    for r in reqs:
        q.push(r)
    q.charge("flood", 100)
    assert q.pop().user == "quiet"
    assert q.pop().user == "flood"
    urgent = Request(AddRequest(9, "9", [1], SamplingParams(), -1, "flood", 9.0))
    q.push(urgent)
    assert q.pop() is urgent  # priority still comes first


def test_fair_policy_interleaves_users_under_a_flood() -> None:
    sched, worker = make(scheduling_policy="fair", max_num_seqs=1, num_scheduler_steps=1)
    for rid in range(6):
        add_tokens(sched, rid, prompt_of(8, start=rid * 10), max_tokens=2, user="flood")
    add_tokens(sched, 6, prompt_of(8, start=99), max_tokens=2, user="quiet")
    order = []
    for _ in range(200):
        plan, _ = step(sched, worker)
        if plan is None:
            break
        order += [n.rid for n in plan.new_requests]
    assert order.index(6) <= 1  # the quiet user's one request goes first or second, not last
