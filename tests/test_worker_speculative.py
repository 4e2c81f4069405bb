"""Speculative decoding in the runner, on the tiny model: n-gram proposals verified inside
multi-step windows give exactly the tokens decoding one at a time gives, greedy or seeded, in
windows of any size, with prompts prefilled beside, stops inside the accepted drafts, and a
recompute preemption mid-stream, logprobs per token, penalties (each position's counting the drafts
before it), rows held to a grammar."""

from __future__ import annotations

import collections
import itertools
import json
from collections.abc import Iterator

import pytest
import torch
from tokenizers import Tokenizer
from worker_testing import Driver, greedy, one_cpu_thread, tiny_worker

from protocol.messages import NewRequest, SamplingParams, StepPlan, unpack_logprobs
from worker.attention import SdpaBackend
from worker.engine import Worker
from worker.ngram import NgramConfig
from worker.runner import ModelRunner

BS = 4
# Repeats, so that proposals find matches from the start (the tiny model also repeats itself).
PROMPT = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100] * 3
OTHER = [1, 84, 104, 101, 32, 113, 117, 105, 99, 107, 84, 104, 101, 32]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with one_cpu_thread():
        yield


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Worker:
    return tiny_worker(tmp_path_factory.mktemp("cache"), BS)


def runner_for(worker: Worker, drafts: int, n_min: int = 1, n_max: int = 3) -> ModelRunner:
    r = worker.runner
    return ModelRunner(r.model, r.cache, r.device, 8192, list(r.eos_token_ids),
                       ngram=NgramConfig(drafts, n_min, n_max) if drafts else None)


def generate(worker: Worker, prompts: dict[int, list[int]], params: SamplingParams, steps: int,
             drafts: int = 0) -> Driver:
    d = Driver(runner_for(worker, drafts), drafts=drafts)
    d.prefill(prompts, params, steps)
    d.decode_to_end(steps)
    assert d.runner.seqs == {}
    return d


def accepted(d: Driver) -> int:
    return sum(sum(m.accepted) for m in d.messages)


@pytest.mark.parametrize(("steps", "drafts"), [(1, 3), (4, 2), (8, 5)])
def test_greedy_tokens_are_the_same_with_drafts(worker: Worker, steps: int, drafts: int) -> None:
    prompts = {0: PROMPT, 1: OTHER, 2: PROMPT[:20]}
    plain = generate(worker, prompts, greedy(40), steps)
    drafted = generate(worker, prompts, greedy(40), steps, drafts)
    assert dict(drafted.outputs) == dict(plain.outputs)
    assert accepted(drafted) > 0  # proposals were verified and accepted, not only made
    assert len(drafted.messages) < len(plain.messages)  # and they saved forward passes


def test_seeded_samples_are_the_same_with_drafts(worker: Worker) -> None:
    """A seeded row samples each output from its own uniform draw: with drafts, each position's
    sample is the one decoding alone would take there, accepted while the drafts before it were.
    (For a proposal of one sure token this is the standard rejection rule: the draft is kept with
    its probability, and a rejection samples from the rest of the distribution.)"""
    for seed in range(6):
        params = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.95, seed=seed, ignore_eos=True)
        prompts = {0: PROMPT, 1: OTHER}
        assert dict(generate(worker, prompts, params, 4, drafts=3).outputs) == \
            dict(generate(worker, prompts, params, 4).outputs), seed


def test_a_stop_inside_the_accepted_drafts_ends_the_row_there(worker: Worker) -> None:
    reference = generate(worker, {0: PROMPT}, greedy(40), 1).outputs[0]
    drafted = generate(worker, {0: PROMPT}, greedy(40), 8, drafts=5)
    # A token the drafted run accepted as a draft (a step's second or later token of the row).
    step_tokens = [m.token_ids for m in drafted.messages if len(m.token_ids) > 2]
    assert step_tokens, "no step accepted two drafts"
    stop = step_tokens[0][1]
    cut = reference.index(stop) + 1
    for drafts in (0, 5):
        out = generate(worker, {0: PROMPT}, greedy(40, stop_token_ids=[stop]), 8, drafts).outputs[0]
        assert out == reference[:cut]  # the stop token, and nothing after it
    # max_tokens is exact whatever a proposal holds.
    for max_tokens in (1, 2, 7):
        assert generate(worker, {0: PROMPT}, greedy(max_tokens), 8, drafts=5).outputs[0] == reference[:max_tokens]


def test_a_recompute_preemption_mid_stream_continues_the_same(worker: Worker) -> None:
    reference = generate(worker, {0: PROMPT}, greedy(40), 1).outputs[0]
    d = Driver(runner_for(worker, 4), drafts=4)
    d.prefill({0: PROMPT}, greedy(40), 4)
    d.plan([(0, 1)], steps=4)
    # Preempted: the worker forgets it and gets it back whole, everything so far its prompt's.
    so_far = PROMPT + d.outputs[0]
    d.plan([(0, len(so_far))], [NewRequest(0, so_far, len(PROMPT), greedy(40))], steps=4, forget=[0])
    d.decode_to_end(4)
    assert d.outputs[0] == reference


# (A negative frequency penalty: text that repeats, so proposals are accepted, and a count more or
# less of a proposed token changes what these rows pick.)
@pytest.mark.parametrize("params", [
    greedy(40, repetition_penalty=1.1),
    greedy(40, frequency_penalty=-1.0, presence_penalty=0.1),
    SamplingParams(max_tokens=40, temperature=0.5, seed=3, frequency_penalty=-1.0, ignore_eos=True),
], ids=["repetition", "frequency-presence", "seeded"])
def test_rows_with_penalties_draft_and_keep_their_tokens(worker: Worker, params: SamplingParams) -> None:
    """Each position's penalties count the drafts before it as outputs: the same tokens as
    decoding one at a time, in multi-step windows; and the counts the sampler keeps between
    steps stay right where plans that draft and plans that do not (a large batch's) alternate."""
    prompts = {0: PROMPT, 1: OTHER}
    d = Driver(runner_for(worker, 4), drafts=4)
    d.prefill(prompts, params, 4)
    for k in itertools.count():
        live = d.live()
        if not live:
            break
        d.drafts = 4 if k % 2 == 0 else 0
        d.plan([(rid, len(seq.token_ids) - seq.num_computed + seq.num_ahead)
                for rid in live if (seq := d.runner.seqs[rid])], steps=4)
    assert accepted(d) > 0
    assert dict(d.outputs) == dict(generate(worker, prompts, params, 4).outputs)


def test_logprobs_of_accepted_drafts_are_those_of_decoding(worker: Worker) -> None:
    """Each kept token's logprobs come from its own position's logits: a step with accepted
    drafts carries one entry per token of the row, in order."""
    def tokens_and_logprobs(drafts: int) -> list[tuple[int, tuple[float, list[int], list[float]]]]:
        d = generate(worker, {0: PROMPT}, greedy(30, logprobs=2), 4, drafts)
        pairs = []
        for m in d.messages:
            entries = unpack_logprobs(m.logprobs).get(0, [])
            tokens = [t for rid, t in zip(m.rids, m.token_ids, strict=True) if rid == 0]
            assert len(entries) == len(tokens)
            pairs += zip(tokens, entries, strict=True)
        if drafts:
            assert accepted(d) > 0
        return pairs

    drafted, plain = tokens_and_logprobs(4), tokens_and_logprobs(0)
    assert [t for t, _ in drafted] == [t for t, _ in plain]
    for (_, (lp, ids, values)), (_, (lp0, ids0, values0)) in zip(drafted, plain, strict=True):
        assert ids == ids0 and lp == pytest.approx(lp0, abs=1e-5) and values == pytest.approx(values0, abs=1e-5)


def test_drafts_stay_inside_the_blocks_a_row_holds(worker: Worker) -> None:
    """Plans that reserve no room for drafts: the runner drafts only as far as the row's blocks
    reach (a draft past them would be written to a block the row does not hold)."""
    reference = generate(worker, {0: PROMPT}, greedy(40), 1).outputs[0]
    d = Driver(runner_for(worker, 6), drafts=6, reserve=0)
    d.prefill({0: PROMPT}, greedy(40), 4)
    d.decode_to_end(4)
    assert d.outputs[0] == reference
    assert accepted(d) > 0  # it still drafted, in what its last block had left


def test_a_swap_preemption_mid_stream_continues_the_same(worker: Worker) -> None:
    """Swapped out after windows that drafted, with the scheduler's count of computed tokens
    (short of the worker's by the last step's accepted drafts), swapped back into other blocks
    after another request wrote over the old ones: the answer goes on as decoding alone."""
    reference = generate(worker, {0: PROMPT}, greedy(40), 1).outputs[0]
    runner = runner_for(worker, 4)
    d = Driver(runner, first_block=100, drafts=4)
    d.prefill({0: PROMPT}, greedy(40), 4)
    seq = runner.seqs[0]
    d.plan([(0, len(seq.token_ids) - seq.num_computed + seq.num_ahead)], steps=4)
    seq = runner.seqs[0]
    known, computed = list(seq.token_ids), seq.num_computed - seq.num_ahead  # as the scheduler counts
    device_blocks = d.tables[0]
    host_blocks = list(range(len(device_blocks)))
    list(runner.execute(StepPlan(90, [], [], [], [], forget=[0],
                                 swap_out=list(zip(device_blocks, host_blocks, strict=True)))))
    other = Driver(runner_for(worker, 0), first_block=device_blocks[0])  # writes over the freed blocks
    other.prefill({1: OTHER * 3}, greedy(2))
    new_blocks = [300 + i for i in range(len(device_blocks))]
    d.tables[0] = [*new_blocks, *range(400, 410)]
    resume = StepPlan(91, [NewRequest(0, known, len(PROMPT), greedy(40), num_computed=computed)], [0],
                      [len(known) - computed], [d.tables[0]], num_steps=4, num_draft_tokens=4,
                      swap_in=list(zip(host_blocks, new_blocks, strict=True)))
    for msg in runner.execute(resume):
        d.outputs[0] += msg.token_ids
    d.decode_to_end(4)
    assert d.outputs[0] == reference


# Chi-square critical values at p = 0.001, by degrees of freedom: a correct sampler fails one run
# in a thousand, and the run is seeded (the same every time).
CHI2_CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46}


def test_unseeded_samples_follow_the_models_distribution(worker: Worker) -> None:
    """Unseeded sampling at temperature 1 with drafts: the token after a first token that
    occurred in the prompt (so its continuation there is proposed, and accepted or rejected) is
    distributed as the model says, by a chi-square test against the exact probabilities."""
    r = worker.runner
    loop = generate(worker, {0: PROMPT}, greedy(15), 8).outputs[0]  # the tiny model falls into a loop
    prompt = PROMPT + loop
    runner = ModelRunner(r.model, r.cache, r.device, 8192, list(r.eos_token_ids), seed=1, ngram=NgramConfig(2, 1, 3))
    pairs: list[tuple[int, int]] = []
    proposed = 0
    for _ in range(60):  # 20 requests a batch (the cache holds them), sampled on one generator
        d = Driver(runner, drafts=2)
        d.prefill(dict.fromkeys(range(20), prompt), SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True), 2)
        d.decode_to_end(2)
        pairs += [(d.outputs[i][0], d.outputs[i][1]) for i in range(20)]
        proposed += sum(sum(m.drafted) for m in d.messages)
    first = collections.Counter(a for a, _ in pairs).most_common(1)[0][0]
    assert first in prompt[:-1] and proposed > 100  # its continuation in the prompt was proposed
    seconds = [b for a, b in pairs if a == first]
    ids = torch.tensor([*prompt, first])
    meta = SdpaBackend(r.device).build(r.cache, [list(range(40))], [0], [len(ids)], [len(ids) - 1])
    with torch.inference_mode():
        probs = r.model(ids, meta)[-1].softmax(-1)
    # Bins: each token expected at least 5 times, and the rest together.
    likely = [t for t in probs.argsort(descending=True).tolist() if probs[t] * len(seconds) >= 5][:6]
    expected = [probs[t].item() * len(seconds) for t in likely]
    observed = [seconds.count(t) for t in likely]
    expected.append(len(seconds) - sum(expected))
    observed.append(len(seconds) - sum(observed))
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    assert len(likely) >= 1 and statistic < CHI2_CRITICAL[len(likely)], (likely, observed, expected)


# Structured output: words of lower-case letters, which the tiny model fills with text that repeats
# itself (n-gram lookups foresee it; nothing is ever forced, so no jump-forward), and a JSON
# record whose keys jump-forward appends.
WORDS = r"([a-z]+ ){10,20}"
RECORD = {"type": "object", "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
          "additionalProperties": False, "required": ["colour", "size", "ok"],
          "properties": {"colour": {"enum": ["red", "green", "blue"]}, "size": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 99},
                         "ok": {"type": "boolean"}}}


def held(grammar: str, seed: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=120, temperature=0.0 if seed is None else 1.0, seed=seed, grammar=grammar)


@pytest.mark.parametrize("steps", [1, 4])
def test_rows_held_to_a_grammar_draft_what_it_allows_and_keep_their_tokens(worker: Worker, steps: int) -> None:
    """A constrained row proposes only what its grammar allows, and each position samples under
    the grammar's mask after the drafts before it: the same tokens as without drafts, beside
    jump-forward and unconstrained rows."""
    import llguidance

    words = llguidance.LLMatcher.grammar_from_regex(WORDS)
    record = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(RECORD))

    def run(drafts: int) -> Driver:
        r = worker.runner
        d = Driver(ModelRunner(r.model, r.cache, r.device, 8192, list(r.eos_token_ids), grammars=r.grammars,
                               ngram=NgramConfig(drafts, 1, 3) if drafts else None), drafts=drafts)
        news = [NewRequest(0, PROMPT, len(PROMPT), held(words)), NewRequest(1, PROMPT, len(PROMPT), held(words, 5)),
                NewRequest(2, PROMPT[:8], 8, held(record)), NewRequest(3, OTHER, len(OTHER), greedy(30))]
        d.plan([(n.rid, len(n.token_ids)) for n in news], news, steps=steps)
        d.decode_to_end(steps)
        assert d.runner.seqs == {}
        return d

    plain, drafted = run(0), run(4)
    assert dict(drafted.outputs) == dict(plain.outputs)
    for rid in (0, 1):  # each token allowed where it stands (the longest outputs stop at max_tokens)
        matcher = llguidance.LLMatcher(llguidance.LLTokenizer(worker.info.tokenizer_json), words)
        assert matcher.consume_tokens(drafted.outputs[rid]) and not matcher.is_error(), rid
    tokenizer = Tokenizer.from_str(worker.info.tokenizer_json)
    value = json.loads(tokenizer.decode(drafted.outputs[2][:-1]))
    assert value["colour"] in ("red", "green", "blue") and 0 <= value["size"] <= 99
    # The words rows (nothing forced: two tokens of a row in one step are an accepted draft) drafted.
    assert any(m.rids.count(rid) > 1 for m in drafted.messages for rid in (0, 1))
    assert accepted(drafted) > 0
