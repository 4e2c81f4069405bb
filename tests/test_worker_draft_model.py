"""A draft model as proposer (``--speculative-model``), in the runner on the tiny model: the
draft's greedy guesses, verified by the target, give exactly the tokens decoding alone gives
(greedy, seeded, penalised, in windows of several sizes, beside prefills, after a recompute or a
swap preemption), whether the draft is the target itself (every guess accepted) or the same
model with jittered embeddings (some rejected: the draft's copy of a request is rewound to the
target's tokens and goes on from there); a long prompt reaches the draft over several steps."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from worker_testing import Driver, greedy, one_cpu_thread, tiny_worker

from protocol.messages import NewRequest, SamplingParams, StepPlan
from worker.draft_model import DraftModel
from worker.engine import Worker
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
    same model with its input embeddings jittered (near the target's guesses, not always on
    them)."""
    jittered = tiny_worker(tmp_path_factory.mktemp("jittered"), BS)
    embeddings = jittered.runner.model.model.embed_tokens.weight
    with torch.no_grad():
        noise = torch.randn(embeddings.shape, generator=torch.Generator().manual_seed(0))
        embeddings.add_(noise * embeddings.std() * 0.5)
    return {"same": tiny_worker(tmp_path_factory.mktemp("same"), BS), "jittered": jittered}


def runner_with(worker: Worker, draft: Worker | None, num_tokens: int = 4, catch_up: int = 2048) -> ModelRunner:
    r = worker.runner
    proposer = None
    if draft is not None:
        d = draft.runner
        proposer = DraftModel(ModelRunner(d.model, d.cache, d.device, 8192, list(d.eos_token_ids)), num_tokens,
                              catch_up)
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


@pytest.mark.parametrize("kind", ["same", "jittered"])
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
        assert 0 < kept < proposed  # some rejected: its copies were rewound, and went on
    assert len(drafted.messages) < len(plain.messages)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=30, temperature=0.8, top_p=0.95, seed=2, ignore_eos=True),
    greedy(30, frequency_penalty=-1.0),
], ids=["seeded", "penalised"])
def test_seeded_and_penalised_rows_keep_their_tokens(worker: Worker, drafts: dict[str, Worker],
                                                     params: SamplingParams) -> None:
    prompts = {0: PROMPT, 1: OTHER}
    drafted = generate(runner_with(worker, drafts["jittered"]), prompts, params, 4, 3)
    assert dict(drafted.outputs) == dict(generate(runner_with(worker, None), prompts, params, 4, 0).outputs)
    assert counts(drafted)[1] > 0


def test_preemptions_mid_stream_continue_the_same(worker: Worker, drafts: dict[str, Worker]) -> None:
    """By recompute (the target forgets the request, so does the draft) and by swap (the draft's
    cache follows no block move: every request's draft starts over)."""
    reference = generate(runner_with(worker, None), {0: PROMPT}, greedy(100), 1, 0).outputs[0]
    runner = runner_with(worker, drafts["jittered"])
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


def test_a_long_prompt_catches_up_over_several_steps(worker: Worker, drafts: dict[str, Worker]) -> None:
    """At most ``catch_up`` tokens of unseen prompts are computed per target step: a prompt longer
    than that proposes nothing until the draft has seen it, then as before."""
    prompts = {0: PROMPT, 1: OTHER}
    plain = generate(runner_with(worker, None), prompts, greedy(40), 4, 0)
    runner = runner_with(worker, drafts["same"], catch_up=8)
    drafted = generate(runner, prompts, greedy(40), 4, 4)
    assert dict(drafted.outputs) == dict(plain.outputs)
    proposed, kept = counts(drafted)
    assert kept == proposed > 0
    # The 39-token prompt took five steps of its decode to reach the draft (8 tokens each): its
    # first steps proposed nothing; the 14-token one proposed from its third step.
    first_drafting = next(i for i, m in enumerate(drafted.messages) if m.rids.count(0) > 1)
    assert first_drafting >= 4


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_the_device_checks_decode_runs_with_speculation(method: str) -> None:
    """``scripts/gpu_checks.sh``'s speculative stage, on the CPU with the tiny model: two runs
    of a mixed batch give the same tokens, and proposals are accepted (the script fails
    otherwise), so the stage a GPU session runs does not rot between them."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_decode.py"
    done = subprocess.run([sys.executable, str(script), "--device", "cpu", "--dtype", "float32", "--model", "tiny",
                           "--rows", "5", "--context", "40", "--steps", "24", "--window", "4", "--mixed",
                           "--speculative", method], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-1000:] + done.stderr[-2000:]
    assert "proposals accepted" in done.stdout and "both runs gave the same tokens" in done.stdout
