"""The scheduling core alone: no processes, no torch; a fake worker with the real plan semantics."""

from __future__ import annotations

import pytest
from fake_worker import FakeWorker
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.config import SchedulerConfig
from protocol.messages import AddRequest, SamplingParams, StepPlan, TokenBatch
from scheduler.block_pool import BlockPool, OutOfBlocks
from scheduler.queues import WaitingQueue
from scheduler.request import Request
from scheduler.scheduler import Scheduler

BS = 16


def make(num_blocks: int = 256, max_model_len: int = 8192, **cfg: object) -> tuple[Scheduler, FakeWorker]:
    cfg.setdefault("num_scheduler_steps", 1)
    sched = Scheduler(SchedulerConfig(**cfg), num_blocks, BS, max_model_len, [2])  # type: ignore[arg-type]
    return sched, FakeWorker(BS, eos=2, max_model_len=max_model_len)


def add(sched: Scheduler, rid: int, prompt_len: int, max_tokens: int = 8, priority: int = 0,
        arrival: float | None = None, **sampling: object) -> None:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)  # type: ignore[arg-type]
    prompt = [(rid * 31 + j) % 300 + 3 for j in range(prompt_len)]  # distinct: no accidental prefix hits
    msg = AddRequest(rid, f"req-{rid}", prompt, params, priority, "", arrival if arrival is not None else rid)
    assert sched.add(msg) == []


def step(sched: Scheduler, worker: FakeWorker) -> tuple[StepPlan | None, list[TokenBatch]]:
    plan = sched.schedule()
    if plan is None:
        return None, []
    return plan, [sched.update(out) for out in worker.run(plan)]


def run_to_end(sched: Scheduler, worker: FakeWorker, max_steps: int = 10_000) -> dict[int, str]:
    finished: dict[int, str] = {}
    for _ in range(max_steps):
        plan, batches = step(sched, worker)
        for b in batches:
            for f in b.finished:
                assert f.rid not in finished, "a request finished twice"
                finished[f.rid] = f.reason
        if plan is None:
            break
    return finished


# ---------------------------------------------------------------------------- block pool and queues


def test_block_pool_reuses_written_blocks_and_evicts_cached_prefixes_last() -> None:
    pool = BlockPool(6, enable_caching=True)
    a = pool.allocate(2)
    assert a == [0, 1] and pool.num_touched == 2
    with pytest.raises(OutOfBlocks):
        pool.allocate(5)
    pool.free(a)
    # Freed blocks come back before a never-used one (whose pages a CPU cache has not committed).
    b = pool.allocate(2)
    assert sorted(b) == [0, 1] and pool.num_touched == 2
    pool.register(b[0], b"link", b"key")
    pool.free(b)
    assert pool.num_free == 6 and pool.num_cached_free == 1
    # Then never-used blocks, in id order, before a cached prefix is evicted.
    assert pool.allocate(3) == [b[1], 2, 3] and pool.lookup(b"link") == (b[0], b"key")
    # The cached block goes last (the least recently freed of them first), and its prefix with it.
    assert pool.allocate(3) == [4, 5, b[0]] and pool.lookup(b"link") is None
    assert pool.num_free == 0 and pool.num_touched == 6
    with pytest.raises(RuntimeError):
        pool.free([0, 0, 0])


def test_priority_queue_orders_by_priority_then_arrival_and_skips_removed() -> None:
    q = WaitingQueue("priority")
    reqs = [Request(AddRequest(i, str(i), [1], SamplingParams(), prio, "", arr))
            for i, (prio, arr) in enumerate([(1, 0.0), (0, 2.0), (0, 1.0), (5, 0.5)])]
    for r in reqs:
        q.push(r)
    q.remove(2)
    assert [q.pop().rid for _ in range(len(q))] == [1, 0, 3]
    fcfs = WaitingQueue("fcfs")
    for r in reqs:
        fcfs.push(r)
    assert [fcfs.pop().rid for _ in range(len(fcfs))] == [0, 3, 2, 1]


# ---------------------------------------------------------------------------- the step


def test_continuous_batching_under_budget_and_max_seqs() -> None:
    sched, worker = make(max_num_batched_tokens=64, max_num_seqs=3)
    for rid in range(5):
        add(sched, rid, 20)
    plan, _ = step(sched, worker)
    assert plan is not None
    assert plan.rids == [0, 1, 2] and plan.num_tokens == [20, 20, 20]  # max_num_seqs caps the rows
    plan, _ = step(sched, worker)
    assert plan is not None and plan.rids == [0, 1, 2] and plan.num_tokens == [1, 1, 1]
    assert run_to_end(sched, worker) == {i: "length" for i in range(5)}


def test_decodes_first_then_the_last_prefill_is_chunked() -> None:
    sched, worker = make(max_num_batched_tokens=32)
    add(sched, 0, 10)
    step(sched, worker)  # prefill rid 0
    add(sched, 1, 100)
    plan, _ = step(sched, worker)
    assert plan is not None
    assert plan.rids == [0, 1] and plan.num_tokens == [1, 31]  # decode 1, then a 31-token chunk
    plan, _ = step(sched, worker)
    assert plan is not None and plan.num_tokens == [1, 31]
    assert [n.rid for n in plan.new_requests] == []  # the prompt crossed once


def test_seed_000_example_budget_split_between_two_prompts() -> None:
    sched, worker = make(num_blocks=1024, max_num_batched_tokens=512, min_concurrent_prefills=2)
    add(sched, 0, 8000)
    add(sched, 1, 300)
    plan, _ = step(sched, worker)
    assert plan is not None
    assert dict(zip(plan.rids, plan.num_tokens, strict=True)) == {0: 256, 1: 256}


def test_without_min_concurrent_prefills_the_long_prompt_takes_the_budget() -> None:
    sched, worker = make(num_blocks=1024, max_num_batched_tokens=512)
    add(sched, 0, 8000)
    add(sched, 1, 300)
    plan, _ = step(sched, worker)
    assert plan is not None and plan.rids == [0] and plan.num_tokens == [512]


def test_long_prefill_threshold_caps_one_prompt() -> None:
    sched, worker = make(max_num_batched_tokens=512, long_prefill_threshold=100)
    add(sched, 0, 1000)
    add(sched, 1, 300)
    plan, _ = step(sched, worker)
    assert plan is not None and plan.num_tokens == [100, 100]


def test_recompute_preemption_frees_blocks_and_keeps_arrival_order() -> None:
    # 6 blocks of 16: two requests of 40-token prompts (3 blocks each) fill the pool.
    sched, worker = make(num_blocks=6, max_num_batched_tokens=200)
    add(sched, 0, 40, max_tokens=30)
    add(sched, 1, 40, max_tokens=30)
    add(sched, 2, 10, max_tokens=2)  # arrives later than both
    step(sched, worker)
    assert sched.pool.num_free == 0
    preempted_plan = None
    for _ in range(20):
        plan, _ = step(sched, worker)
        if sched.num_preemptions:
            preempted_plan = plan
            break
    assert preempted_plan is not None and sched.num_preemptions == 1
    victim = sched.requests[1]
    assert victim.status.value == "preempted" and victim.blocks == [] and victim.num_computed == 0
    # The victim waits ahead of the later arrival.
    assert sched.queue.peek() is victim
    finished = run_to_end(sched, worker)
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert sched.pool.num_free == 6


def test_recomputed_request_is_resent_with_prompt_and_outputs() -> None:
    sched, worker = make(num_blocks=6, max_num_batched_tokens=200)
    add(sched, 0, 40, max_tokens=30)
    add(sched, 1, 40, max_tokens=30)
    resent = None
    for _ in range(40):
        plan, _ = step(sched, worker)
        if plan is None:
            break
        for new in plan.new_requests:
            if new.rid == 1 and len(new.token_ids) > 40:
                resent = new
    assert resent is not None
    assert resent.num_prompt_tokens == 40 and len(resent.token_ids) > 40 and resent.num_computed % BS == 0  # its own freed blocks may still be cached


def test_multi_step_reserves_lookahead_and_returns_it_on_early_stop() -> None:
    sched, worker = make(num_scheduler_steps=8, max_num_batched_tokens=256)
    add(sched, 0, 15, max_tokens=3)  # will stop after 3 tokens, inside the 8-step window
    # The prompt completes in step 0 and nothing waits, so the same plan goes on decoding.
    plan, batches = step(sched, worker)
    assert plan is not None and plan.num_steps == 8
    # Look-ahead capped at what the request can still produce: 15 + 3 tokens -> 2 blocks, not 3.
    assert len(plan.new_block_ids[0]) == 2
    assert [f.reason for b in batches for f in b.finished] == ["length"]
    assert sum(len(b.rids) for b in batches) == 3  # nothing past the stop
    assert sched.pool.num_free == sched.pool.num_blocks


def test_multi_step_plan_covers_decodes_of_several_requests() -> None:
    sched, worker = make(num_scheduler_steps=4, max_num_batched_tokens=256)
    add(sched, 0, 16, max_tokens=10)
    add(sched, 1, 5, max_tokens=2)
    plan, batches = step(sched, worker)
    assert plan is not None and plan.num_steps == 4
    assert [len(b.rids) for b in batches] == [2, 2, 1, 1]  # rid 1 stops after its 2nd token
    finished = run_to_end(sched, worker)
    assert finished == {0: "length"}
    assert sched.pool.num_free == sched.pool.num_blocks


def test_multi_step_unless_prefill_work_would_wait_for_the_window() -> None:
    # A prompt waiting for a seat cannot start sooner: the decode goes on multi-step.
    sched, worker = make(num_scheduler_steps=4, max_num_batched_tokens=16, max_num_seqs=1)
    add(sched, 0, 8, max_tokens=20)
    add(sched, 1, 8, max_tokens=20)
    plan, _ = step(sched, worker)
    assert plan is not None and plan.num_steps == 4
    assert run_to_end(sched, worker) == {0: "length", 1: "length"}
    # A prompt that only the token budget kept out starts next step: single step until it has.
    sched, worker = make(num_scheduler_steps=4, max_num_batched_tokens=16, max_num_seqs=4)
    for rid in range(3):
        add(sched, rid, 8, max_tokens=20)
    plan, _ = step(sched, worker)
    assert plan is not None and plan.rids == [0, 1] and plan.num_steps == 1
    plan, _ = step(sched, worker)
    assert plan is not None and sorted(plan.rids) == [0, 1, 2] and plan.num_steps == 4
    # A prompt mid-prefill (chunked) comes back after one step.
    sched, worker = make(num_scheduler_steps=4, max_num_batched_tokens=16, max_num_seqs=4)
    add(sched, 0, 24, max_tokens=20)
    plan, _ = step(sched, worker)
    assert plan is not None and plan.num_tokens == [16] and plan.num_steps == 1
    plan, _ = step(sched, worker)
    assert plan is not None and plan.num_tokens == [8] and plan.num_steps == 4
    assert run_to_end(sched, worker) == {0: "length"}
    assert sched.pool.num_free == sched.pool.num_blocks


def test_abort_frees_blocks_at_once_and_forgets_on_worker() -> None:
    sched, worker = make()
    add(sched, 0, 40, max_tokens=100)
    add(sched, 1, 40, max_tokens=100)
    step(sched, worker)
    finish = sched.abort(0)
    assert finish is not None and finish.reason == "abort"
    assert sched.abort(0) is None  # only once
    plan, _ = step(sched, worker)
    assert plan is not None and 0 in plan.forget and 0 not in plan.rids
    sched.abort(1)
    assert sched.pool.num_free == sched.pool.num_blocks
    assert sched.schedule() is None


def test_stop_rules_eos_min_tokens_and_stop_ids() -> None:
    sched, worker = make()
    worker.token_for = lambda rid, i: 2 if rid == 0 else (77 if i == 3 else 50)
    msg = AddRequest(0, "a", [5] * 4, SamplingParams(max_tokens=50), 0, "", 0)
    assert sched.add(msg) == []
    assert sched.add(AddRequest(1, "b", [5] * 4, SamplingParams(max_tokens=50, stop_token_ids=[77]), 0, "", 1)) == []
    finished = run_to_end(sched, worker)
    assert finished == {0: "stop", 1: "stop"}


def test_impossible_requests_are_rejected_with_a_reason() -> None:
    sched, _ = make(num_blocks=4, max_model_len=100)
    (too_long,) = sched.add(AddRequest(0, "a", [5] * 90, SamplingParams(max_tokens=20), 0, "", 0))
    assert too_long.reason == "error" and "max model length" in too_long.message
    (too_big,) = sched.add(AddRequest(1, "b", [5] * 60, SamplingParams(max_tokens=20), 0, "", 0))
    assert "KV blocks" in too_big.message
    assert [f.rid for f in sched.add(AddRequest(4, "c", [5] * 90, SamplingParams(max_tokens=20), n=3))] == [4, 5, 6]
    assert sched.requests == {}


def test_pause_all_stops_scheduling() -> None:
    sched, worker = make()
    add(sched, 0, 10)
    sched.paused = True
    assert sched.schedule() is None
    sched.paused = False
    assert run_to_end(sched, worker) == {0: "length"}


def test_a_pause_mid_window_keeps_the_tokens_made_until_the_worker_stops_the_row() -> None:
    """Paused after step 1 of a 4-step window: the scheduler keeps counting that row's tokens
    from the plan in flight (the worker stops it at its next step boundary), so both sides agree
    when it resumes; the fake worker checks every KV position it reads."""
    sched, worker = make(num_scheduler_steps=4)
    add(sched, 0, 8, max_tokens=20)
    add(sched, 1, 8, max_tokens=20)
    step(sched, worker)  # both prompts, then 3 more steps
    plan = sched.schedule()
    assert plan is not None and plan.num_steps == 4 and sched.plans_with(0) == sched.plans_with(1) == [plan.plan_id]
    outs = worker.run(plan, cancel_after={0: 1})
    got = [sched.update(outs[0]), sched.update(outs[1])]
    assert sched.pause(0)
    got += [sched.update(out) for out in outs[2:]]
    assert [len(b.rids) for b in got] == [2, 2, 1, 1] and sched.in_flight == {}
    assert sched.requests[0].num_outputs == 4 + 2  # the first window, then 2 steps of this one
    assert sched.resume(0)
    assert run_to_end(sched, worker) == {0: "length", 1: "length"}
    assert sched.pool.num_free == sched.pool.num_blocks


def test_tokens_of_an_aborted_request_still_in_flight_are_void() -> None:
    sched, worker = make(num_scheduler_steps=4)
    add(sched, 0, 8, max_tokens=20)
    step(sched, worker)
    plan = sched.schedule()
    assert plan is not None
    outs = worker.run(plan)
    sched.update(outs[0])
    assert sched.abort(0) is not None and sched.pool.num_free == sched.pool.num_blocks
    assert all(not sched.update(out).rids for out in outs[1:])


def _outputs(batches: list[TokenBatch], into: dict[int, list[int]]) -> None:
    for b in batches:
        for rid, tok in zip(b.rids, b.token_ids, strict=True):
            into.setdefault(rid, []).append(tok)


def test_async_scheduling_continues_windows_before_their_tokens_arrive() -> None:
    """Each window is planned while the previous one still runs (its tokens not yet applied);
    the tokens, stops and block accounting equal those of plain one-plan-at-a-time scheduling."""
    def requests(sched: Scheduler) -> None:
        add(sched, 0, 8, max_tokens=21)  # stops by max_tokens mid-window
        add(sched, 1, 8, max_tokens=40, stop_token_ids=[100 + (7 + 13) % 50])  # a stop id at output 13
        add(sched, 2, 5, max_tokens=30)

    sched, worker = make(num_scheduler_steps=4)
    requests(sched)
    want: dict[int, list[int]] = {}
    while (plan := sched.schedule()) is not None:
        _outputs([sched.update(out) for out in worker.run(plan)], want)

    sched, worker = make(num_scheduler_steps=4)
    requests(sched)
    got: dict[int, list[int]] = {}
    plan = sched.schedule()
    speculative = 0
    while plan is not None:
        following = sched.continue_plan()  # made before ``plan``'s tokens are applied
        speculative += following is not None
        _outputs([sched.update(out) for out in worker.run(plan)], got)
        plan = following if following is not None else sched.schedule()
    assert got == want and speculative >= 5
    assert len(got[1]) == 14 and len(got[0]) == 21 and len(got[2]) == 30
    assert sched.requests == {} and sched.in_flight == {} and sched.pool.num_free == sched.pool.num_blocks


def test_choices_of_one_prompt_share_its_blocks() -> None:
    """n = 3: the second and third choices wait for the first to compute the prompt, then take
    its full blocks from the prefix cache (shared, not copied) and compute only the last token."""
    sched, worker = make(num_scheduler_steps=1)
    prompt = [(j * 13) % 300 + 3 for j in range(4 * BS + 3)]  # four full blocks and a partial one
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    assert sched.add(AddRequest(0, "c", prompt, params, 0, "", 0.0, n=3)) == []
    assert sched.requests[1].request_id == "c-1" and sched.requests[2].token_ids == prompt
    plan, _ = step(sched, worker)
    assert plan is not None and plan.rids == [0] and len(sched.queue) == 2  # released once computed
    plan, _ = step(sched, worker)
    assert plan is not None and sorted(plan.rids) == [0, 1, 2]
    assert dict(zip(plan.rids, plan.num_tokens, strict=True))[1] == 3  # only the partial block recomputed
    blocks = {rid: sched.requests[rid].blocks for rid in range(3)}
    assert blocks[0][:4] == blocks[1][:4] == blocks[2][:4]
    assert len({blocks[0][4], blocks[1][4], blocks[2][4]}) == 3  # the divergent block: one each
    assert run_to_end(sched, worker) == {0: "length", 1: "length", 2: "length"}
    assert sched.pool.num_free == sched.pool.num_blocks


def test_a_held_choice_can_be_aborted_and_is_released_if_its_first_sibling_goes() -> None:
    sched, worker = make()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    assert sched.add(AddRequest(0, "c", [5] * 9, params, 0, "", 0.0, n=3)) == []
    assert sched.abort(1) is not None
    assert sched.abort(0) is not None  # before its prompt was computed: rid 2 is queued instead
    assert 2 in sched.queue
    assert run_to_end(sched, worker) == {2: "length"}
    assert sched.pool.num_free == sched.pool.num_blocks




@pytest.mark.parametrize("caching", [True, False])
def test_prompt_logprobs_are_computed_once_by_the_first_choice_without_the_prefix_cache(caching: bool) -> None:
    """Echo with logprobs: every prompt position's logits are needed, so the first choice takes
    no prefix hit; the other choices wait for it (with or without caching) and do not compute
    them again; once its first output is out, a recompute may use the cache like any request."""
    sched, worker = make(num_scheduler_steps=1, enable_prefix_caching=caching)
    prompt = [(j * 13) % 300 + 3 for j in range(4 * BS + 3)]
    warm = SamplingParams(max_tokens=2, ignore_eos=True)
    assert sched.add(AddRequest(9, "warm", prompt, warm, 0, "", 0.0)) == []
    assert run_to_end(sched, worker) == {9: "length"}  # the prompt's blocks are cached now (with caching)
    params = SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=2)
    assert sched.add(AddRequest(0, "c", prompt, params, 0, "", 0.0, n=2)) == []
    assert sched.requests[1].sampling.prompt_logprobs is None
    plan, _ = step(sched, worker)
    assert plan is not None and plan.rids == [0] and plan.num_tokens == [len(prompt)]  # no hit
    assert plan.new_requests[0].sampling.prompt_logprobs == 2
    assert sched.requests[0].sampling.prompt_logprobs is None  # its first output came with them
    plan, _ = step(sched, worker)
    assert plan is not None and sorted(plan.rids) == [0, 1]
    assert dict(zip(plan.rids, plan.num_tokens, strict=True))[1] == (3 if caching else len(prompt))
    assert run_to_end(sched, worker) == {0: "length", 1: "length"}
    continued = AddRequest(5, "d", prompt, params, 0, "", 0.0, output_token_ids=[7])
    assert sched.add(continued) == [] and sched.requests[5].sampling.prompt_logprobs is None
    assert run_to_end(sched, worker) == {5: "length"}
    assert sched.pool.num_free == sched.pool.num_blocks
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["allocate", "free", "cache"]), st.integers(0, 7)), max_size=60))
def test_block_pool_touches_a_new_block_only_when_no_written_uncached_one_is_free(ops: list[tuple[str, int]]) -> None:
    """On a CPU the cache commits a block's pages when it is first written: the pool may take a
    never-used block only when every free block it has written holds a cached prefix, so the
    blocks ever touched never exceed the most ever held plus cached-and-free at once."""
    pool = BlockPool(16, enable_caching=True)
    held: list[list[int]] = []
    most = 0
    for op, n in ops:
        if op == "allocate" and pool.can_allocate(n):
            touched, plain, untouched = pool.num_touched, len(pool._free_plain), len(pool._untouched)
            held.append(pool.allocate(n))
            assert pool.num_touched - touched == min(max(0, n - plain), untouched)  # written, uncached ones first
        elif op == "free" and held:
            pool.free(held.pop(n % len(held)))
        elif op == "cache" and held and held[-1]:
            block = held[-1][n % len(held[-1])]
            pool.register(block, f"link{block}".encode(), b"key")
        most = max(most, pool.num_used + pool.num_cached_free)
        assert pool.num_touched <= most


def test_a_continued_request_counts_the_tokens_it_brings_as_output() -> None:
    """Failover from another engine (``AddRequest.output_token_ids``): the tokens already generated
    are computed with the prompt and count against max_tokens; a continued request has one choice
    and fewer outputs than max_tokens, or it is refused."""
    sched, worker = make()
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    prompt, outputs = [5, 6, 7, 8], [9, 10, 11]
    assert sched.add(AddRequest(1, "req-1", prompt, params, output_token_ids=outputs)) == []
    req = sched.requests[1]
    assert req.token_ids == prompt + outputs and req.num_prompt_tokens == 4 and req.num_outputs == 3
    new = None
    generated, reasons = 0, []
    for _ in range(100):
        plan, batches = step(sched, worker)
        if plan is None:
            break
        new = new or (plan.new_requests[0] if plan.new_requests else None)
        generated += sum(len(b.rids) for b in batches)
        reasons += [f.reason for b in batches for f in b.finished]
    assert new is not None and new.token_ids[:7] == prompt + outputs and new.num_prompt_tokens == 4
    assert generated == 7 and reasons == ["length"]  # 10 in all, 3 of them brought along
    for bad in (AddRequest(2, "req-2", prompt, params, n=2, output_token_ids=outputs),
                AddRequest(4, "req-4", prompt, params, output_token_ids=list(range(3, 13)))):
        refused = sched.add(bad)
        assert refused and all(f.reason == "error" and "continued request" in f.message for f in refused)


def test_a_request_scoring_its_prompt_is_recomputed_not_swapped() -> None:
    """Its scores so far live in the worker's state of it, which a swap-in rebuilds from the
    swapped KV: preempted before its first output, it starts over instead (and keeps no hit)."""
    sched, worker = make(num_blocks=64, max_num_batched_tokens=16, max_num_seqs=1, preemption_mode="swap",
                         num_host_blocks=32)
    scored = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    assert sched.add(AddRequest(0, "scored", [(j * 7) % 90 + 3 for j in range(48)], scored, 0, "", 0.0)) == []
    plan, _ = step(sched, worker)
    assert plan is not None and plan.rids == [0] and sched.requests[0].num_computed == 16  # mid-prefill
    add(sched, 1, 8, max_tokens=2, priority=-1)  # more urgent: takes the only seat
    seen: dict[int, int] = {}
    for _ in range(50):
        plan, _ = step(sched, worker)
        if plan is None:
            break
        seen |= {new.rid: new.num_computed for new in plan.new_requests}
    assert seen[0] == 0 and sched.preemptor.strategy.num_swaps == 0
    assert sched.requests == {} and sched.pool.num_free == sched.pool.num_blocks
