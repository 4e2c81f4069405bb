"""A draft model as proposer (``--speculative-model``), in the runner on the tiny model: the
draft's greedy guesses, verified by the target, give exactly the tokens decoding alone gives
(greedy, seeded, penalised, in windows of several sizes, beside prefills, after a recompute or a
swap preemption), whether the draft is the target itself (every guess accepted) or the same
model in another dtype (some rejected: the draft's copy of a request is rewound to the target's
tokens and goes on from there)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from worker_testing import Driver, greedy, one_cpu_thread, tiny_worker

from protocol.config import WorkerConfig
from protocol.messages import NewRequest, SamplingParams, StepPlan
from worker.draft_model import DraftModel
from worker.engine import Worker
from worker.model.tiny import materialize_tiny
from worker.runner import ModelRunner

BS = 4
PROMPT = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100] * 3
OTHER = [1, 84, 104, 101, 32, 113, 117, 105, 99, 107, 84, 104, 101, 32]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with one_cpu_thread():
        yield


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Worker:
    return tiny_worker(tmp_path_factory.mktemp("cache"), BS)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Worker]:
    """Draft models with the target's tokenizer and as many KV blocks: the same model, and the
    same weights in bfloat16 (near the target's guesses, not always on them)."""
    path = str(materialize_tiny(tmp_path_factory.mktemp("draft")))
    return {"same": tiny_worker(tmp_path_factory.mktemp("same"), BS),
            "bfloat16": Worker(WorkerConfig(model=path, num_kv_blocks=512, block_size=BS, dtype="bfloat16"))}


def runner_with(worker: Worker, draft: Worker | None, num_tokens: int = 4) -> ModelRunner:
    r = worker.runner
    proposer = None
    if draft is not None:
        d = draft.runner
        proposer = DraftModel(ModelRunner(d.model, d.cache, d.device, 8192, list(d.eos_token_ids)), num_tokens)
    return ModelRunner(r.model, r.cache, r.device, 8192, list(r.eos_token_ids), draft=proposer)


def generate(runner: ModelRunner, prompts: dict[int, list[int]], params: SamplingParams, steps: int,
             drafts: int) -> Driver:
    d = Driver(runner, drafts=drafts)
    d.prefill(prompts, params, steps)
    d.decode_to_end(steps)
    assert runner.seqs == {}
    if runner.draft is not None:
        assert runner.draft.runner.seqs == {}  # the draft forgot what the target forgot
    return d


def counts(d: Driver) -> tuple[int, int]:
    return sum(sum(m.drafted) for m in d.messages), sum(sum(m.accepted) for m in d.messages)


@pytest.mark.parametrize("kind", ["same", "bfloat16"])
@pytest.mark.parametrize("steps", [1, 4])
def test_greedy_tokens_are_the_same_with_a_draft_model(worker: Worker, drafts: dict[str, Worker], kind: str,
                                                       steps: int) -> None:
    prompts = {0: PROMPT, 1: OTHER, 2: PROMPT[:20]}
    plain = generate(runner_with(worker, None), prompts, greedy(40), steps, 0)
    drafted = generate(runner_with(worker, drafts[kind]), prompts, greedy(40), steps, 4)
    assert dict(drafted.outputs) == dict(plain.outputs)
    proposed, kept = counts(drafted)
    assert proposed > 40
    if kind == "same":
        assert kept == proposed  # its own guesses: every one is what the target samples
    else:
        assert kept > 0
    assert len(drafted.messages) < len(plain.messages)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=30, temperature=0.8, top_p=0.95, seed=2, ignore_eos=True),
    greedy(30, frequency_penalty=-1.0),
], ids=["seeded", "penalised"])
def test_seeded_and_penalised_rows_keep_their_tokens(worker: Worker, drafts: dict[str, Worker],
                                                     params: SamplingParams) -> None:
    prompts = {0: PROMPT, 1: OTHER}
    drafted = generate(runner_with(worker, drafts["bfloat16"]), prompts, params, 4, 3)
    assert dict(drafted.outputs) == dict(generate(runner_with(worker, None), prompts, params, 4, 0).outputs)
    assert counts(drafted)[1] > 0


def test_preemptions_mid_stream_continue_the_same(worker: Worker, drafts: dict[str, Worker]) -> None:
    """By recompute (the target forgets the request, so does the draft) and by swap (the draft's
    cache follows no block move: every request's draft starts over)."""
    reference = generate(runner_with(worker, None), {0: PROMPT}, greedy(100), 1, 0).outputs[0]
    runner = runner_with(worker, drafts["bfloat16"])
    d = Driver(runner, first_block=100, drafts=4)
    d.prefill({0: PROMPT}, greedy(100), 4)

    def step() -> None:
        seq = runner.seqs[0]
        d.plan([(0, len(seq.token_ids) - seq.num_computed + seq.num_ahead)], steps=4)

    step()
    so_far = PROMPT + d.outputs[0]
    d.plan([(0, len(so_far))], [NewRequest(0, so_far, len(PROMPT), greedy(100))], steps=4, forget=[0])
    step()
    seq = runner.seqs[0]
    known, computed = list(seq.token_ids), seq.num_computed - seq.num_ahead  # as the scheduler counts
    device_blocks = d.tables[0]
    host_blocks = list(range(len(device_blocks)))
    list(runner.execute(StepPlan(90, [], [], [], [], forget=[0],
                                 swap_out=list(zip(device_blocks, host_blocks, strict=True)))))
    new_blocks = [300 + i for i in range(len(device_blocks))]
    d.tables[0] = [*new_blocks, *range(400, 410)]
    resume = StepPlan(91, [NewRequest(0, known, len(PROMPT), greedy(100), num_computed=computed)], [0],
                      [len(known) - computed], [d.tables[0]], num_steps=4, num_draft_tokens=4,
                      swap_in=list(zip(host_blocks, new_blocks, strict=True)))
    for msg in runner.execute(resume):
        d.outputs[0] += msg.token_ids
    d.decode_to_end(4)
    assert d.outputs[0] == reference
    assert counts(d)[1] > 0
