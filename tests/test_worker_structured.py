"""Structured output in the runner, on the tiny model (random weights: whatever it says is the
grammar's doing): the output matches inside multi-step windows, with the CUDA pipeline's lag,
after a recompute that rebuilds the matcher from the outputs so far, beside unconstrained rows
that stay bit-identical, and the masks are the bits the matcher allows; masks applied in place
equal the full boolean masking they replaced, and masks filled beside the forward pass give the
same output as masks filled before it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import llguidance
import pytest
import torch
from worker_testing import Driver, greedy, one_cpu_thread, tiny_worker

from protocol.messages import NewRequest, SamplingParams
from worker import structured
from worker.engine import Worker
from worker.runner import ModelRunner
from worker.structured import GrammarEngine, GrammarState, apply_masks_

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
    masked = logits.clone()
    apply_masks_(masked, torch.tensor([1]), masks)
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    assert {int(t) for t in torch.nonzero(masked[1] == 0).flatten()} == allowed


def test_rows_filled_together_get_the_masks_each_gets_alone(worker: Worker) -> None:
    """Several healthy rows are filled by llguidance's thread pool in one call (the pointer, row
    stride and count Sluice passes it), one row by its own matcher: the same bits."""
    engine = GrammarEngine(worker.info.tokenizer_json, worker.info.vocab_size, worker.info.eos_token_ids)
    grammars = [("choice", ["yes", "no"]), ("choice", ["maybe"]), ("json", {"type": "integer"})]
    states = [engine.start(llguidance.grammar_from(kind, json.dumps(spec)), []) for kind, spec in grammars]
    together = engine.masks(states)
    alone = torch.cat([engine.masks([state]) for state in states])
    assert together.shape == alone.shape and torch.equal(together, alone)
    assert len({bytes(row.numpy()) for row in together}) == 3  # three different masks, not one copied


def _masked_by_a_full_boolean_tensor(logits: torch.Tensor, rows: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """What the sampler did before masking in place: every mask expanded to a boolean per token,
    the logits copied, the constrained rows gathered and written back."""
    bits = ((torch.arange(256, dtype=torch.int32).unsqueeze(-1) >> torch.arange(8, dtype=torch.int32)) & 1).bool()
    allowed = bits[masks.view(torch.uint8).int()].view(masks.shape[0], -1)[:, : logits.shape[-1]]
    out = logits.clone()
    out[rows] = torch.where(allowed, logits[rows], -torch.inf)
    return out


@pytest.mark.parametrize("vocab", [32, 49, 1000, 4099])
def test_masks_applied_in_place_equal_the_full_boolean_masking(vocab: int) -> None:
    """Random masks (all-allowed and all-blocked words among them) on random logits, every row
    constrained or a subset in any order, vocabularies not a multiple of 32; and logits wider than
    the masks' bits (a model's padded vocabulary past the tokenizer's), whose extra tokens no
    grammar allows. Chunked: a few rows per chunk here, as 128k-token rows are in production."""
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    for rows in ([0, 1, 2, 3, 4, 5], [4, 1], [2], [5, 0, 3]):
        logits = torch.randn(6, vocab, generator=gen)
        masks = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), generator=gen, dtype=torch.int64)
        masks = masks.to(torch.int32)
        masks[0, 0], masks[-1, -1] = -1, 0
        index = torch.tensor(rows)
        want = _masked_by_a_full_boolean_tensor(logits, index, masks)
        for scratch in (structured.MASK_SCRATCH_BYTES, 2 * vocab):
            got = logits.clone()
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(structured, "MASK_SCRATCH_BYTES", scratch)
                apply_masks_(got, index, masks)
            assert torch.equal(got, want), (rows, scratch)
        wider = torch.randn(6, 32 * words + 40, generator=gen)
        got = wider.clone()
        apply_masks_(got, index, masks)
        assert torch.equal(got[:, : 32 * words], _masked_by_a_full_boolean_tensor(wider[:, : 32 * words], index, masks))
        assert (got[index, 32 * words :] == -torch.inf).all()
        others = [r for r in range(6) if r not in rows]
        assert torch.equal(got[others], wider[others])


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


def test_masks_filled_beside_the_forward_pass_give_what_masks_filled_before_it_give(worker: Worker) -> None:
    """With ``masks_later`` (CUDA's default) a step's masks are filled on the mask thread:
    preparing the step does not wait for them (here a matcher still compiling: prepare returns
    at once), the sampler waits when it samples, and the tokens are those of masks filled first."""
    from concurrent.futures import Future

    from worker.sampler import Sampler, SamplingRow

    engine = worker.runner.grammars
    assert engine is not None
    grammar = llguidance.grammar_from("choice", json.dumps(["yes", "no"]))
    ready = engine.start(grammar, [])
    compiling: Future[llguidance.LLMatcher] = Future()
    eos = worker.info.eos_token_ids
    rows = [SamplingRow(greedy(4), 0, grammar=GrammarState(compiling, eos[0])), SamplingRow(greedy(4), 0),
            SamplingRow(SamplingParams(temperature=1.0, seed=3), 0, grammar=engine.start(grammar, []))]
    later = Sampler(torch.device("cpu"), eos, grammars=engine, masks_later=True)
    step = later.prepare(rows)
    assert step.grammar_masks is None and step.pending_masks is not None and not step.pending_masks.done()
    compiling.set_result(ready.matcher.deep_copy())
    logits = torch.randn(3, worker.info.vocab_size, generator=torch.Generator().manual_seed(0))
    got = later(logits.clone(), step).token_ids
    first = Sampler(torch.device("cpu"), eos, grammars=engine, masks_later=False)
    want = first(logits.clone(), [SamplingRow(r.params, 0, grammar=engine.start(grammar, [])) if r.grammar else r
                                  for r in rows]).token_ids
    assert torch.equal(got, want)


def test_a_runner_filling_masks_beside_the_forward_pass_writes_the_same_output(worker: Worker) -> None:
    outputs = []
    for later in (False, True):
        r = runner(worker, lag=0)
        r.sampler.masks_later = later
        d = Driver(r)
        news = [NewRequest(0, PROMPT, len(PROMPT), record()), NewRequest(1, PROMPT[:6], 6, record(seed=7)),
                NewRequest(9, PROMPT, len(PROMPT), greedy(20))]
        d.plan([(n.rid, len(n.token_ids)) for n in news], news, steps=4)
        d.decode_to_end(4)
        outputs.append(dict(d.outputs))
    assert outputs[0] == outputs[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_masks_applied_in_place_and_filled_later_match_the_cpu(worker: Worker) -> None:
    from worker.sampler import Sampler, SamplingRow

    cuda = torch.device("cuda")
    gen = torch.Generator().manual_seed(1)
    for vocab, rows in ((49, [0, 2]), (4099, [0, 1, 2]), (128_256, [1])):
        logits = torch.randn(3, vocab, generator=gen)
        masks = torch.randint(-(2**31), 2**31 - 1, (len(rows), (vocab + 31) // 32), generator=gen).to(torch.int32)
        want = _masked_by_a_full_boolean_tensor(logits, torch.tensor(rows), masks)
        got = logits.to(cuda)
        apply_masks_(got, torch.tensor(rows, device=cuda), masks.to(cuda))
        assert torch.equal(got.cpu(), want)
    engine = worker.runner.grammars
    assert engine is not None
    grammar = llguidance.grammar_from("choice", json.dumps(["yes", "no"]))
    eos = worker.info.eos_token_ids
    logits = torch.randn(2, worker.info.vocab_size, generator=gen)
    tokens = []
    for later in (False, True):
        s = Sampler(cuda, eos, grammars=engine, masks_later=later)
        step = s.prepare([SamplingRow(greedy(4), 0, grammar=engine.start(grammar, [])), SamplingRow(greedy(4), 0)])
        tokens.append(s(logits.to(cuda), step.moved([t.to(cuda) for t in step.tensors()])).token_ids.cpu())
    assert torch.equal(tokens[0], tokens[1])
    assert int(tokens[0][1]) == int(logits[1].argmax())


def test_masks_after_drafts_are_those_of_a_matcher_that_consumed_them(worker: Worker) -> None:
    """Speculative decoding's masks: at each proposed position, the mask of the grammar after the
    proposals before it (filled before the forward pass, and beside it as on CUDA); the matcher
    itself is left where it was; proposals are cut at the first token the grammar refuses."""
    from tokenizers import Tokenizer

    engine = worker.runner.grammars
    assert engine is not None
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(RECORD))
    ids = Tokenizer.from_str(worker.info.tokenizer_json).encode('{"colour": "red", "size": 12',
                                                                add_special_tokens=False).ids
    state = engine.start(grammar, [])
    assert state.valid_prefix(ids) == ids
    prefixes = [tuple(ids[:j]) for j in range(len(ids) + 1)]
    want = torch.cat([engine.masks([engine.start(grammar, list(prefix))]) for prefix in prefixes])
    assert len({tuple(row.tolist()) for row in want}) > 3  # the masks differ along the way
    assert torch.equal(engine.masks([state] * len(prefixes), drafts=prefixes), want)
    assert torch.equal(engine.masks_later([state] * len(prefixes), False, prefixes).result(), want)
    assert torch.equal(engine.masks([state]), want[:1])  # the matcher is back at its start
    # A draft the grammar refuses (a letter where the number goes on) ends the proposal there.
    letter = Tokenizer.from_str(worker.info.tokenizer_json).encode("q", add_special_tokens=False).ids
    assert state.valid_prefix([*ids, *letter, *ids]) == ids
