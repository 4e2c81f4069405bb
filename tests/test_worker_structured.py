"""Structured output in the runner, on the tiny model (random weights: whatever it says is the
grammar's doing): the output matches inside multi-step windows, with the CUDA pipeline's lag,
after a recompute that rebuilds the matcher from the outputs so far, beside unconstrained rows
that stay bit-identical, and the masks are the bits the matcher allows."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import llguidance
import pytest
import torch
from worker_testing import Driver, greedy, one_cpu_thread, tiny_worker

from protocol.messages import NewRequest, SamplingParams
from worker.engine import Worker
from worker.runner import ModelRunner
from worker.structured import GrammarEngine, apply_masks

BS = 4
PROMPT = [1, 72, 101, 108, 108, 111, 44, 32]
PATTERN = r"[a-z]{3,6} [0-9]{2}!"


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with one_cpu_thread():
        yield


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Worker:
    return tiny_worker(tmp_path_factory.mktemp("cache"), BS)


def runner(worker: Worker, lag: int = 0) -> ModelRunner:
    r = worker.runner
    return ModelRunner(r.model, r.cache, r.device, 8192, list(r.eos_token_ids), finalize_lag=lag, grammars=r.grammars)


def constrained(seed: int) -> SamplingParams:
    grammar = llguidance.LLMatcher.grammar_from_regex(PATTERN)
    return SamplingParams(max_tokens=40, temperature=1.0, seed=seed, grammar=grammar)


def text(worker: Worker, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return str(Tokenizer.from_str(worker.info.tokenizer_json).decode(ids, skip_special_tokens=True))


@pytest.mark.parametrize("lag", [0, 1])
def test_constrained_rows_match_in_multi_step_windows_beside_unconstrained_ones(worker: Worker, lag: int) -> None:
    alone = Driver(runner(worker))
    alone.prefill({9: PROMPT}, greedy(12), steps=4)
    alone.decode_to_end(4)
    d = Driver(runner(worker, lag))
    news = [NewRequest(0, PROMPT, len(PROMPT), constrained(3)), NewRequest(1, PROMPT[:5], 5, constrained(4)),
            NewRequest(9, PROMPT, len(PROMPT), greedy(12))]
    d.plan([(n.rid, len(n.token_ids)) for n in news], news, steps=4)
    d.decode_to_end(4)
    for rid in (0, 1):
        out = d.outputs[rid]
        assert out[-1] in worker.info.eos_token_ids, "it ends on EOS, where the grammar accepts"
        assert re.fullmatch(PATTERN, text(worker, out[:-1])), text(worker, out)
    assert d.outputs[9] == alone.outputs[9], "an unconstrained neighbour samples exactly as alone"


def test_a_recomputed_request_rebuilds_its_matcher_from_its_outputs(worker: Worker) -> None:
    d = Driver(runner(worker))
    d.prefill({0: PROMPT}, constrained(5), steps=3)
    so_far = list(d.outputs[0])
    assert so_far and so_far[-1] not in worker.info.eos_token_ids
    # Preempted by recompute: forgotten, then sent again with everything known so far.
    again = NewRequest(0, PROMPT + so_far, len(PROMPT), constrained(5))
    d.plan([(0, len(again.token_ids))], [again], steps=3, forget=[0])
    d.decode_to_end(3)
    out = d.outputs[0]
    assert re.fullmatch(PATTERN, text(worker, out[:-1])), text(worker, out)


def test_the_mask_is_what_the_matcher_allows(worker: Worker) -> None:
    engine = GrammarEngine(worker.info.tokenizer_json, worker.info.vocab_size, worker.info.eos_token_ids)
    state = engine.start(llguidance.grammar_from("choice", json.dumps(["yes", "no"])), [])
    masks = engine.masks([state])
    allowed = {t for t in range(worker.info.vocab_size) if (int(masks[0, t // 32]) >> (t % 32)) & 1}
    words = {text(worker, [t]) for t in allowed}
    assert words and all("yes".startswith(w) or "no".startswith(w) for w in words), words
    logits = torch.zeros(3, worker.info.vocab_size)
    masked = apply_masks(logits, torch.tensor([1]), masks)
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    assert {int(t) for t in torch.nonzero(masked[1] == 0).flatten()} == allowed


# A JSON object written as json.dumps writes it: its keys and punctuation are forced.
LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
RECORD = {"type": "object", "x-guidance": LAYOUT, "additionalProperties": False, "required": ["colour", "size", "ok"],
          "properties": {"colour": {"enum": ["red", "green", "blue"]}, "size": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 99},
                         "ok": {"type": "boolean"}}}


def record(seed: int | None = None) -> SamplingParams:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(RECORD))
    return SamplingParams(max_tokens=60, temperature=0.0 if seed is None else 1.0, seed=seed, grammar=grammar)


@pytest.mark.parametrize("lag", [0, 1])
def test_jump_forward_appends_forced_tokens_in_fewer_passes_and_changes_no_output(worker: Worker, lag: int) -> None:
    outputs, passes = [], []
    for jump in (False, True):
        r = worker.runner
        d = Driver(ModelRunner(r.model, r.cache, r.device, 8192, list(r.eos_token_ids), finalize_lag=lag,
                               grammars=r.grammars, jump_forward=jump))
        news = [NewRequest(0, PROMPT, len(PROMPT), record()), NewRequest(1, PROMPT[:6], 6, record(seed=7)),
                NewRequest(9, PROMPT, len(PROMPT), greedy(30))]
        d.plan([(n.rid, len(n.token_ids)) for n in news], news, steps=6)
        d.decode_to_end(6)
        for rid in (0, 1):
            out = d.outputs[rid]
            assert out[-1] in worker.info.eos_token_ids
            value = json.loads(text(worker, out[:-1]))
            assert value["colour"] in ("red", "green", "blue") and 0 <= value["size"] <= 99, value
        outputs.append(dict(d.outputs))
        passes.append(len(d.messages))
        if jump:
            assert d.runner.num_jumped > 10
            # A row's forced tokens travel with its sampled one, in the same step's message.
            assert any(len(m.rids) > len(set(m.rids)) for m in d.messages)
    assert outputs[0] == outputs[1], "the same tokens, with and without jump-forward"
    assert passes[1] < passes[0]


def test_jump_forward_stays_inside_the_blocks_the_row_holds(worker: Worker) -> None:
    # The driver reserves each row exactly its window's positions, rounded up to blocks of 4: a
    # jump may only fill that slack (a position past the blocks would be a PlanError), and a
    # one-step plan has no later step to compute forced tokens in.
    for steps in (1, 2, 3, 5):
        outputs = []
        for jump in (False, True):
            r = worker.runner
            d = Driver(ModelRunner(r.model, r.cache, r.device, 8192, list(r.eos_token_ids), grammars=r.grammars,
                                   jump_forward=jump))
            d.prefill({0: PROMPT}, record(), steps=steps)
            d.decode_to_end(steps)
            outputs.append(d.outputs[0])
            if steps == 1:
                assert d.runner.num_jumped == 0
        assert outputs[0] == outputs[1], steps
        assert json.loads(text(worker, outputs[1][:-1]))["colour"] in ("red", "green", "blue")
