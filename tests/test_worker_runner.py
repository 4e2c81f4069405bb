"""The runner's plan semantics on the tiny model: stop rules inside multi-step windows, the
message shape of a plan, min_tokens, seeded sampling across batches and preemption, logprobs,
swap-out/in and copy-on-write block moves, and clear errors for plans it cannot follow."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from worker_testing import Driver, greedy, one_cpu_thread, tiny_worker

from protocol.config import WorkerConfig
from protocol.messages import CancelRows, NewRequest, SamplingParams, StepPlan, StepTokens, unpack_logprobs
from worker.engine import Worker
from worker.model.tiny import materialize_tiny
from worker.runner import ModelRunner
from worker.sequence import PlanError

BS = 4
PROMPT = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
OTHER = [1, 84, 104, 101, 32, 113, 117, 105, 99, 107]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with one_cpu_thread():
        yield


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Worker:
    return tiny_worker(tmp_path_factory.mktemp("cache"), BS)


def runner_like(worker: Worker, eos: list[int] | None = None, max_model_len: int = 8192,
                lag: int = 0) -> ModelRunner:
    """``lag`` 1 runs the CUDA pipeline's logic on the CPU: step k's ids are read only after
    step k+1 was launched."""
    r = worker.runner
    return ModelRunner(r.model, r.cache, r.device, max_model_len, list(r.eos_token_ids) if eos is None else eos,
                       finalize_lag=lag)


def run_alone(runner: ModelRunner, prompt: list[int], params: SamplingParams, steps: int = 1) -> Driver:
    d = Driver(runner)
    d.prefill({0: prompt}, params, steps)
    d.decode_to_end(steps)
    return d


@pytest.fixture(scope="module")
def reference(worker: Worker) -> list[int]:
    """24 greedy tokens of PROMPT, one step per plan, never stopping early."""
    return run_alone(runner_like(worker), PROMPT, greedy(24)).outputs[0]


def _check_plan_messages(messages: list[StepTokens]) -> None:
    """Per plan: steps numbered 0.., exactly one ``last``, and it is the final message."""
    by_plan: dict[int, list[StepTokens]] = {}
    for m in messages:
        by_plan.setdefault(m.plan_id, []).append(m)
    for msgs in by_plan.values():
        assert [m.step for m in msgs] == list(range(len(msgs)))
        assert [m.last for m in msgs] == [False] * (len(msgs) - 1) + [True]


@pytest.mark.parametrize("lag", [0, 1])
def test_stop_token_inside_a_multi_step_window(worker: Worker, reference: list[int], lag: int) -> None:
    stop = reference[5]
    cut = reference.index(stop) + 1
    runner = runner_like(worker, lag=lag)
    d = Driver(runner)
    d.prefill({0: PROMPT}, greedy(24, stop_token_ids=[stop]), steps=8)
    d.prefill({1: OTHER}, greedy(10), steps=8)  # another request, in its own plans
    d.decode_to_end(8)
    assert d.outputs[0] == reference[:cut]  # the stop token is emitted, nothing after it
    assert len(d.outputs[1]) == 10
    assert runner.seqs == {}  # both forgotten once stopped
    _check_plan_messages(d.messages)


@pytest.mark.parametrize("lag", [0, 1])
def test_max_tokens_and_max_model_len_stop_early(worker: Worker, reference: list[int], lag: int) -> None:
    d = run_alone(runner_like(worker, lag=lag), PROMPT, greedy(5), steps=8)
    assert d.outputs[0] == reference[:5]
    assert [(m.step, m.last) for m in d.messages] == [(0, False), (1, False), (2, False), (3, False), (4, True)]
    d = run_alone(runner_like(worker, max_model_len=len(PROMPT) + 3, lag=lag), PROMPT, greedy(24), steps=8)
    assert d.outputs[0] == reference[:3]


@pytest.mark.parametrize("lag", [0, 1])
def test_eos_stops_unless_ignored_and_only_after_min_tokens(worker: Worker, reference: list[int], lag: int) -> None:
    eos = reference[5]
    first = reference.index(eos)
    stopping = SamplingParams(max_tokens=24, temperature=0.0)
    runner = runner_like(worker, eos=[eos], lag=lag)
    d = run_alone(runner, PROMPT, stopping, 8)
    assert d.outputs[0] == reference[: first + 1] and runner.seqs == {}
    _check_plan_messages(d.messages)
    assert run_alone(runner_like(worker, eos=[eos], lag=lag), PROMPT, greedy(24), 8).outputs[0] == reference
    # Held back past its first appearance, EOS then ends the request the first time it is sampled
    # (on the tiny model it comes back two tokens later).
    held = SamplingParams(max_tokens=24, temperature=0.0, min_tokens=first + 2)
    out = run_alone(runner_like(worker, eos=[eos]), PROMPT, held, 8).outputs[0]
    assert out[:first] == reference[:first] and eos not in out[: first + 2]
    assert eos not in out[:-1] and (out[-1] == eos or len(out) == 24)


def test_plans_that_sample_nothing_still_end_with_one_last_message(worker: Worker) -> None:
    runner = runner_like(worker)
    (empty,) = runner.execute(StepPlan(1, [], [], [], [], num_steps=8))
    assert (empty.rids, empty.token_ids, empty.last) == ([], [], True)
    d = Driver(runner)
    (chunk,) = d.plan([(0, 5)], [NewRequest(0, PROMPT, len(PROMPT), greedy(4))], steps=8)  # a partial prefill
    assert (chunk.step, chunk.rids, chunk.last) == (0, [], True)
    msgs = d.plan([(0, len(PROMPT) - 5)], steps=8)
    assert [len(m.rids) for m in msgs] == [1, 1, 1, 1] and msgs[-1].last


@pytest.mark.parametrize("lag", [0, 1])
def test_seeded_sampling_ignores_the_batch_and_survives_recompute(worker: Worker, lag: int) -> None:
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = run_alone(runner_like(worker), PROMPT, seeded, steps=4).outputs[0]

    d = Driver(runner_like(worker, lag=lag))
    noisy = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    d.plan([(0, len(PROMPT)), (1, len(OTHER)), (2, len(OTHER))],
           [NewRequest(0, PROMPT, len(PROMPT), seeded), NewRequest(1, OTHER, len(OTHER), noisy),
            NewRequest(2, OTHER, len(OTHER), SamplingParams(max_tokens=12, temperature=0.7, seed=5))], steps=3)
    d.decode_to_end(3)
    assert d.outputs[0] == alone

    d = Driver(runner_like(worker))
    d.prefill({0: PROMPT}, seeded)
    for _ in range(4):
        d.plan([(0, 1)])
    known = PROMPT + d.outputs[0]
    d.plan([(0, len(known))], [NewRequest(0, known, len(PROMPT), seeded)], forget=[0])
    d.decode_to_end(2)
    assert d.outputs[0] == alone


@pytest.mark.parametrize("lag", [0, 1])
def test_logprobs_travel_with_their_rows(worker: Worker, lag: int) -> None:
    d = Driver(runner_like(worker, lag=lag))
    d.plan([(0, len(PROMPT)), (1, len(OTHER))],
           [NewRequest(0, PROMPT, len(PROMPT), greedy(6, logprobs=3)), NewRequest(1, OTHER, len(OTHER), greedy(6))],
           steps=6)
    for msg in d.messages:
        entries = unpack_logprobs(msg.logprobs)
        assert sorted(entries) == [0], "only the row that asked has logprobs"
        token = dict(zip(msg.rids, msg.token_ids, strict=True))[0]
        [(sampled, ids, values)] = entries[0]
        assert ids[0] == token and sampled == values[0]  # greedy: the sampled token is the top one
        assert len(ids) == 3 and values == sorted(values, reverse=True) and values[0] <= 0.0
    d = run_alone(runner_like(worker), PROMPT, greedy(3), steps=3)
    assert all(unpack_logprobs(m.logprobs) == {} for m in d.messages)


def test_swap_out_then_in_resumes_exactly(worker: Worker, reference: list[int]) -> None:
    runner = runner_like(worker)
    d = Driver(runner, first_block=100)
    d.prefill({0: PROMPT}, greedy(24))
    for _ in range(4):
        d.plan([(0, 1)])
    device_blocks = d.tables[0]
    host_blocks = list(range(len(device_blocks)))
    swapped = runner.seqs[0]
    known, computed = list(swapped.token_ids), swapped.num_computed
    list(runner.execute(StepPlan(90, [], [], [], [], forget=[0],
                                 swap_out=list(zip(device_blocks, host_blocks, strict=True)))))
    # Another request overwrites the freed device blocks before the swapped one comes back.
    other = Driver(runner, first_block=device_blocks[0])
    other.prefill({1: OTHER * 3}, greedy(2))
    new_blocks = [200 + i for i in range(len(device_blocks))]
    resume = StepPlan(91, [NewRequest(0, known, len(PROMPT), greedy(24), num_computed=computed)], [0],
                      [len(known) - computed], [[*new_blocks, 210, 211]], num_steps=8,
                      swap_in=list(zip(host_blocks, new_blocks, strict=True)))
    outputs = d.outputs[0] + [t for m in runner.execute(resume) for t in m.token_ids]
    assert outputs == reference[: len(outputs)] and len(outputs) == 5 + 8


def test_copy_on_write_of_a_shared_partial_block(worker: Worker) -> None:
    """B shares A's first 10 tokens: two full blocks by reference, the third (half full) copied."""
    runner = runner_like(worker)
    b_prompt = [*PROMPT[:10], 33, 34, 35]
    want = run_alone(runner, b_prompt, greedy(8)).outputs[0]
    d = Driver(runner, first_block=300)
    d.prefill({0: PROMPT}, greedy(24))
    a0, a1, a2 = d.tables[0][:3]
    plan = StepPlan(50, [NewRequest(1, b_prompt, len(b_prompt), greedy(8), num_computed=10)], [1], [3],
                    [[a0, a1, 400, 401, 402]], num_steps=8, copy_blocks=[(a2, 400)])
    assert [t for m in runner.execute(plan) for t in m.token_ids] == want


def test_plans_the_runner_cannot_follow_fail_clearly(worker: Worker) -> None:
    runner = runner_like(worker)
    with pytest.raises(PlanError, match="unknown rid 42"):
        list(runner.execute(StepPlan(7, [], [42], [1], [[0]])))
    with pytest.raises(PlanError, match="beyond its 2 blocks"):
        list(runner.execute(StepPlan(8, [NewRequest(3, PROMPT, len(PROMPT), greedy(1))], [3], [len(PROMPT)],
                                     [[0, 1]])))


def test_warm_up_leaves_no_state(tmp_path: Path) -> None:
    w = Worker(WorkerConfig(model=str(materialize_tiny(tmp_path)), num_kv_blocks=8, dtype="float32"))
    w.warm_up()
    assert w.runner.seqs == {}


@pytest.mark.parametrize("lag", [0, 1])
def test_rows_cancelled_mid_plan_leave_at_the_next_step(worker: Worker, reference: list[int], lag: int) -> None:
    """An abort (forget) and a pause (keep the state) arrive after step 2 of an 8-step plan: both
    rows stop there; the paused one then resumes in a later plan exactly where it stopped."""
    runner = runner_like(worker, lag=lag)
    d = Driver(runner)
    d.prefill({0: PROMPT, 1: PROMPT, 2: PROMPT}, greedy(24))
    tables = {rid: d.tables[rid] + [300 + 10 * rid + i for i in range(3)] for rid in (0, 1, 2)}
    plan = StepPlan(77, [], [0, 1, 2], [1, 1, 1], [tables[rid][len(d.tables[rid]):] for rid in (0, 1, 2)], 8)
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    messages = []
    for msg in runner.execute(plan):
        messages.append(msg)
        for rid, tok in zip(msg.rids, msg.token_ids, strict=True):
            got[rid].append(tok)
        if msg.step == 2:
            runner.cancel(CancelRows(77, [0], forget=True))
            runner.cancel(CancelRows(77, [1]))
    _check_plan_messages(messages)
    # Both ran steps 0..2. With lag 1 step 3 was already launched: the paused row reports its
    # token, the aborted one (forgotten) reports nothing more.
    assert len(got[0]) == 3 and len(got[1]) == 3 + lag and len(got[2]) == 8
    assert got[1] == reference[1 : 4 + lag] and got[2] == reference[1:9]
    assert 0 not in runner.seqs and runner.seqs[1].num_in_flight == 0
    paused = runner.seqs[1]
    assert paused.num_computed == len(paused.token_ids) - 1  # its newest token waits to be computed
    resumed = list(runner.execute(StepPlan(78, [], [1], [1], [[]], 2)))
    assert [t for m in resumed for t in m.token_ids] == reference[4 + lag : 6 + lag]


@pytest.mark.parametrize("lag", [0, 1])
def test_penalties_see_every_token_inside_a_multi_step_window(worker: Worker, lag: int) -> None:
    penalised = greedy(24, frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.3)
    single = run_alone(runner_like(worker), PROMPT, penalised, steps=1).outputs[0]
    assert run_alone(runner_like(worker, lag=lag), PROMPT, penalised, steps=8).outputs[0] == single
    assert single != run_alone(runner_like(worker), PROMPT, greedy(24), steps=1).outputs[0]


def test_penalties_with_the_ids_still_in_flight(worker: Worker) -> None:
    """Penalised requests no longer force the host to read every id before the next step: in
    multi-step windows with a lagged read (the CUDA pipeline's logic), their greedy tokens are
    those of single steps read at once."""
    params = greedy(20, repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.2)
    single = run_alone(runner_like(worker), PROMPT, params, steps=1).outputs[0]
    lagged = run_alone(runner_like(worker, lag=1), PROMPT, params, steps=8).outputs[0]
    plain = run_alone(runner_like(worker), PROMPT, greedy(20), steps=1).outputs[0]
    assert lagged == single
    assert single != plain  # the penalties changed the text, so the comparison means something


def test_one_staged_copy_per_step_carries_every_input(worker: Worker) -> None:
    """What a CUDA worker does with a step's host inputs — the ids, the attention metadata and
    every sampling tensor packed byte for byte into one buffer and read back as views — run on
    the CPU, gives the tokens and logprobs of the direct path, for a batch that uses every
    sampling option at once, in multi-step windows whose rows stop at different steps (so later
    steps select rows of the previous step's ids)."""
    from worker.staging import HostToDevice

    mixed = {
        0: greedy(9),
        1: SamplingParams(max_tokens=14, temperature=0.8, top_k=5, top_p=0.9, seed=3, logprobs=2, ignore_eos=True),
        2: SamplingParams(max_tokens=6, temperature=1.1, min_p=0.05, seed=8, ignore_eos=True,
                          repetition_penalty=1.2, frequency_penalty=0.3),
        3: greedy(11, logit_bias=[(72, 5.0)], min_tokens=4, presence_penalty=0.4),
        4: SamplingParams(max_tokens=8, temperature=0.7, top_p=0.5, seed=21, ignore_eos=True),
    }

    def run(staged: bool) -> tuple[dict[int, list[int]], list]:
        runner = runner_like(worker)
        if staged:
            runner.attention.to_device = HostToDevice(runner.device, always=True)
        d = Driver(runner)
        news = [NewRequest(rid, PROMPT[: 6 + rid], 6 + rid, p) for rid, p in mixed.items()]
        d.plan([(n.rid, len(n.token_ids)) for n in news], news, steps=4)
        d.decode_to_end(4)
        return dict(d.outputs), [unpack_logprobs(m.logprobs) for m in d.messages]

    direct, staged = run(False), run(True)
    assert staged == direct
    assert [len(direct[0][rid]) for rid in mixed] == [9, 14, 6, 11, 8]


def test_warm_up_runs_a_two_step_window_of_a_greedy_and_a_sampled_row_and_leaves_nothing(tmp_path: Path) -> None:
    # Decode steps, random sampling (top-k, top-p) and logprobs used to first run on a real
    # user's request after /ready: the warm-up ran one prefill step of one greedy row.
    worker = Worker(WorkerConfig(model=str(materialize_tiny()), num_kv_blocks=16, block_size=16, dtype="float32",
                                 log_level="warning"))
    seen: list[StepTokens] = []
    run = worker.runner.execute

    def spy(plan: StepPlan) -> Iterator[StepTokens]:
        for msg in run(plan):
            seen.append(msg)
            yield msg

    worker.runner.execute = spy  # type: ignore[method-assign]
    worker.warm_up()
    assert [m.step for m in seen] == [0, 1]
    assert all(sorted(m.rids) == [-2, -1] for m in seen)
    assert all(len(unpack_logprobs(m.logprobs)) == 1 for m in seen)  # the sampled row's, each step
    assert not worker.runner.seqs and len(worker.runner.batch) == 0
