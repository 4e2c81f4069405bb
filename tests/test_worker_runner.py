"""The worker's runner in-process against ``transformers``: greedy parity alone, batched, chunked
and multi-step; logits; and the llama3 rope-scaling variant."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from checkpoints import hf_greedy, save_llama_checkpoint

from protocol.config import WorkerConfig
from protocol.messages import NewRequest, SamplingParams, StepPlan
from worker.process import Worker
from worker.runner import ModelRunner

NEW = 32
PROMPTS = [[1, *range(10, 14)], [1, *range(20, 36)], [1, *range(40, 79)], [1, *(t % 300 + 3 for t in range(69))]]
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


class Driver:
    """Plays the scheduler's part by hand: allocates blocks from a counter and builds plans."""

    def __init__(self, runner: ModelRunner, block_size: int) -> None:
        self.runner = runner
        self.bs = block_size
        self.blocks = itertools.count()
        self.plan_ids = itertools.count(1)
        self.outputs: dict[int, list[int]] = {}
        self.held: dict[int, int] = {}  # rid -> tokens covered by its blocks

    def _blocks(self, rid: int, upto: int) -> list[int]:
        have = self.held.get(rid, 0)
        need = -(-upto // self.bs) - -(-have // self.bs)
        self.held[rid] = max(have, upto)
        return [next(self.blocks) for _ in range(max(0, need))]

    def run(self, rows: list[tuple[int, int]], new: list[NewRequest], steps: int = 1,
            computed: dict[int, int] | None = None) -> None:
        """rows: (rid, num_tokens); ``computed`` gives each row's computed count before the plan."""
        computed = computed or {}
        blocks = [self._blocks(rid, computed.get(rid, 0) + n + steps - 1) for rid, n in rows]
        plan = StepPlan(next(self.plan_ids), new, [r for r, _ in rows], [n for _, n in rows], blocks, steps)
        for out in self.runner.execute(plan):
            for rid, tok in zip(out.rids, out.token_ids, strict=True):
                self.outputs.setdefault(rid, []).append(tok)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama_checkpoint(tmp_path_factory.mktemp("w") / "llama")


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> list[list[int]]:
    return hf_greedy(checkpoint, PROMPTS, NEW)


@pytest.fixture
def worker(checkpoint: Path) -> Worker:
    return Worker(WorkerConfig(model=str(checkpoint), num_kv_blocks=128, block_size=8))


def _decode_to_end(d: Driver, rids: list[int], steps: int) -> None:
    while True:
        live = [r for r in rids if len(d.outputs.get(r, [])) < NEW and r in d.runner.seqs]
        if not live:
            return
        computed = {r: d.runner.seqs[r].num_computed for r in live}
        d.run([(r, 1) for r in live], [], steps, computed)


@pytest.mark.parametrize("steps", [1, 8])
def test_each_prompt_alone_matches_transformers(worker: Worker, expected: list[list[int]], steps: int) -> None:
    for rid, (prompt, want) in enumerate(zip(PROMPTS, expected, strict=True)):
        d = Driver(worker.runner, 8)
        d.run([(rid, len(prompt))], [NewRequest(rid, prompt, len(prompt), GREEDY)], steps)
        _decode_to_end(d, [rid], steps)
        assert d.outputs[rid] == want


@pytest.mark.parametrize("steps", [1, 2, 16])
def test_batched_prompts_match_transformers(worker: Worker, expected: list[list[int]], steps: int) -> None:
    d = Driver(worker.runner, 8)
    news = [NewRequest(i, p, len(p), GREEDY) for i, p in enumerate(PROMPTS)]
    d.run([(i, len(p)) for i, p in enumerate(PROMPTS)], news, steps)
    _decode_to_end(d, list(range(len(PROMPTS))), steps)
    assert [d.outputs[i] for i in range(len(PROMPTS))] == expected


def test_chunked_prefill_matches_transformers(worker: Worker, expected: list[list[int]]) -> None:
    d = Driver(worker.runner, 8)
    chunk = 7
    for rid, prompt in enumerate(PROMPTS):
        done = 0
        while done < len(prompt):
            n = min(chunk, len(prompt) - done)
            d.run([(rid, n)], [NewRequest(rid, prompt, len(prompt), GREEDY)] if done == 0 else [], 1, {rid: done})
            done += n
    _decode_to_end(d, list(range(len(PROMPTS))), 4)
    assert [d.outputs[i] for i in range(len(PROMPTS))] == expected


def test_logits_match_transformers_forward(worker: Worker, checkpoint: Path) -> None:
    from transformers import AutoModelForCausalLM

    from worker.attention import AttentionMetadata

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompt = PROMPTS[2]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    runner = worker.runner
    meta = AttentionMetadata.build(runner.cache, [list(range(8))], [0], [len(prompt)], list(range(len(prompt))),
                                   runner.device)
    with torch.inference_mode():
        got = runner.model(torch.tensor(prompt), meta)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_llama3_rope_scaling_matches_transformers(tmp_path: Path) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    ckpt = save_llama_checkpoint(tmp_path / "l3", seed=1, rope_scaling=scaling, max_position_embeddings=512)
    prompts = [PROMPTS[3] * 2]  # 140 tokens: well past the original 64 positions
    want = hf_greedy(ckpt, prompts, 16)
    w = Worker(WorkerConfig(model=str(ckpt), num_kv_blocks=64, block_size=8))
    d = Driver(w.runner, 8)
    p = prompts[0]
    d.run([(0, len(p))], [NewRequest(0, p, len(p), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))],
          16)
    assert d.outputs[0] == want[0]
