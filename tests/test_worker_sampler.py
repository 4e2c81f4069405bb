"""The sampler alone, on hand-made logits: greedy, top-k, top-p, temperature, seeds,
min_tokens, and logprobs; penalties' counts and seeded draws made for the whole batch at once."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from protocol.messages import SamplingParams
from worker.sampler import Sampler, SamplingRow, seed_for

CPU = torch.device("cpu")
EOS = 2


def sampler(seed: int = 0) -> Sampler:
    return Sampler(CPU, [EOS], seed=seed)


def rows(*params: SamplingParams, outputs: int = 0) -> list[SamplingRow]:
    return [SamplingRow(p, outputs) for p in params]


def random_logits(b: int, v: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_top_k_1_and_tiny_temperature_are_argmax() -> None:
    logits = random_logits(6, 50)
    want = logits.argmax(-1).tolist()
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=1),
                   SamplingParams(temperature=1e-7)):
        assert sampler()(logits, rows(*[params] * 6)).token_ids.tolist() == want


def test_greedy_and_random_rows_mix_in_one_batch() -> None:
    logits = random_logits(4, 50)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 2
    out = sampler()(logits, rows(*params)).token_ids
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_logits_are_not_modified() -> None:
    logits = random_logits(2, 20)
    before = logits.clone()
    sampler()(logits, rows(SamplingParams(temperature=0.5, top_k=3, top_p=0.5, min_tokens=2, logprobs=2),
                            SamplingParams(temperature=0.0, min_tokens=1)))
    assert torch.equal(logits, before)


def test_temperature_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = probs.log().expand(4000, 4).clone()
    out = sampler()(logits, rows(*[SamplingParams(temperature=1.0)] * 4000)).token_ids
    freq = torch.bincount(out, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03) and freq[3] == 0


def test_top_k_and_top_p_keep_only_the_head() -> None:
    logits = torch.tensor([[5.0, 4.9, 4.8, -5.0, -6.0]]).expand(300, 5).clone()
    top_k = sampler()(logits, rows(*[SamplingParams(temperature=1.0, top_k=2)] * 300)).token_ids
    assert set(top_k.tolist()) == {0, 1}
    top_p = sampler()(logits, rows(*[SamplingParams(temperature=1.0, top_p=0.5)] * 300)).token_ids
    assert set(top_p.tolist()) == {0, 1}  # 0 alone holds < 0.5 of the mass; 0 and 1 hold more
    nucleus = sampler()(logits[:50], rows(*[SamplingParams(temperature=1.0, top_p=0.01)] * 50)).token_ids
    assert set(nucleus.tolist()) == {0}  # the most likely token always survives


def test_seeded_rows_do_not_depend_on_the_batch_or_the_shared_generator() -> None:
    logits = random_logits(6, 100, seed=1)
    seeded = SamplingParams(temperature=1.0, seed=42)
    for index in range(20):
        alone = sampler(seed=0)(logits[2:3], rows(seeded, outputs=index)).token_ids
        others = [SamplingParams(temperature=1.0)] * 2 + [seeded] + [SamplingParams(temperature=0.5, top_p=0.5)] * 3
        batched = sampler(seed=99)(logits, rows(*others, outputs=index)).token_ids
        assert batched[2] == alone[0]
    draws = {int(sampler()(logits[2:3], rows(seeded, outputs=i)).token_ids) for i in range(30)}
    assert len(draws) > 1  # each output index draws afresh


def test_seed_mix_separates_neighbouring_seeds_and_indices() -> None:
    seeds = {seed_for(s, i) for s in range(-20, 30) for i in range(50)}
    assert len(seeds) == 50 * 50 and all(0 <= s < 2**63 for s in seeds)


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(1, 10)
    logits[0, EOS] = 10.0
    logits[0, 7] = 9.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7])
    assert int(sampler()(logits, rows(params, outputs=2)).token_ids) not in (EOS, 7)
    assert int(sampler()(logits, rows(params, outputs=3)).token_ids) == EOS
    ignoring = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7], ignore_eos=True)
    assert int(sampler()(logits, rows(ignoring, outputs=0)).token_ids) == EOS  # EOS is no stop here


def test_logprobs_are_the_raw_model_distribution() -> None:
    logits = random_logits(3, 30, seed=2)
    params = [SamplingParams(temperature=0.7, logprobs=4, min_tokens=5),  # the ban does not change them
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logprobs=0)]
    out = sampler()(logits, rows(*params))
    assert out.logprobs is not None
    by_row = out.logprobs.by_row()
    raw = logits.log_softmax(-1)
    assert sorted(by_row) == [0, 2]  # the row that did not ask has none
    first, third = by_row[0], by_row[2]
    sampled, ids, values = first
    assert math.isclose(sampled, float(raw[0, int(out.token_ids[0])]), rel_tol=1e-6)
    assert ids == raw[0].topk(4).indices.tolist()
    assert torch.allclose(torch.tensor(values), raw[0].topk(4).values)
    assert third[1:] == ([], []) and math.isclose(third[0], float(raw[2].max()), rel_tol=1e-6)
    assert sampler()(logits, rows(SamplingParams(temperature=0.0))).logprobs is None


# ------------------------------------------------------------------------------------ bias, penalties, min_p


def _reference_penalties(logits: torch.Tensor, history: list[int], num_prompt: int, p: SamplingParams) -> torch.Tensor:
    """The rules written out one token at a time."""
    out = logits.clone()
    outputs = history[num_prompt:]
    for token in set(history):
        if p.repetition_penalty != 1.0:
            out[token] = out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
    for token in set(outputs):
        out[token] -= p.frequency_penalty * outputs.count(token) + p.presence_penalty
    return out


def test_penalties_follow_the_rules_row_by_row() -> None:
    logits = random_logits(3, 40, seed=3)
    histories = [([5, 6, 7, 5], 2), ([1, 2, 3], 3), ([9, 9, 9, 4, 4, 30], 1)]  # (prompt + outputs, prompt length)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3),
              SamplingParams(temperature=0.0),  # no penalties: untouched
              SamplingParams(temperature=0.0, repetition_penalty=0.8, frequency_penalty=0.7, presence_penalty=-0.4)]
    batch = [SamplingRow(p, len(h) - n, h, n) for p, (h, n) in zip(params, histories, strict=True)]
    s = sampler()
    got = s._penalize(logits, s.prepare(batch))
    for i, (p, (h, n)) in enumerate(zip(params, histories, strict=True)):
        torch.testing.assert_close(got[i], _reference_penalties(logits[i], h, n, p))


def test_logit_bias_forces_and_forbids_tokens() -> None:
    logits = random_logits(2, 30, seed=4)
    top = logits.argmax(-1).tolist()
    forced = SamplingParams(temperature=0.0, logit_bias=[(17, 100.0)])
    banned = SamplingParams(temperature=0.0, logit_bias=[(top[1], -100.0)])
    out = sampler()(logits, rows(forced, banned)).token_ids.tolist()
    assert out[0] == 17
    assert out[1] == logits[1].clone().index_fill_(0, torch.tensor([top[1]]), -1e9).argmax().item()


def test_min_p_keeps_only_tokens_near_the_most_likely() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    params = SamplingParams(temperature=1.0, min_p=0.25)  # keeps p >= 0.125: tokens 0 and 1
    s = sampler(seed=11)
    drawn = {int(s(logits, rows(params)).token_ids[0]) for _ in range(300)}
    assert drawn == {0, 1}


def test_penalised_seeded_rows_ignore_the_batch() -> None:
    logits = random_logits(3, 60, seed=5)
    p = SamplingParams(temperature=0.9, seed=77, frequency_penalty=0.5, repetition_penalty=1.2)
    row = SamplingRow(p, 2, [3, 4, 5, 3, 3], 3)
    alone = sampler(seed=1)(logits[:1], [row]).token_ids.tolist()
    noisy = [SamplingRow(SamplingParams(temperature=1.0), 0), row, SamplingRow(SamplingParams(temperature=0.0), 0)]
    together = sampler(seed=2)(torch.stack([logits[1], logits[0], logits[2]]), noisy).token_ids.tolist()
    assert together[1] == alone[0]


def test_top_k_by_topk_keeps_what_a_full_sort_keeps() -> None:
    """The filter ranks only the widest k it needs (and, on the CPU, looks for a top-p-only
    nucleus among the best ``TOP_P_PROBE`` tokens first); the tokens it keeps are those a full
    sort keeps, for rows with top-k only, top-k then top-p, top-p alone (with a nucleus inside
    the probe and, on flat rows, far wider than it), and rows with no filter in the same batch."""
    from worker.sampler import TOP_P_PROBE, _filter_top_k_top_p

    def by_sort(logits: torch.Tensor, k: int, p: float) -> set[int]:
        order = logits.argsort(descending=True).tolist()
        head = order[: k if k > 0 else len(order)]
        probs = logits[head].softmax(-1).tolist()
        kept, mass = set(), 0.0
        for token, prob in zip(head, probs, strict=True):
            if mass >= p and p < 1.0:  # p = 1 keeps the whole head (a float sum may reach 1 early)
                break
            kept.add(token)
            mass += prob
        return kept

    gen = torch.Generator().manual_seed(3)
    peaked = torch.randn(6, 1000, generator=gen) * 3
    flat = torch.randn(6, 1000, generator=gen) * 0.1  # a 0.95 nucleus holds ~900 tokens: beyond the probe
    assert TOP_P_PROBE < 900
    for logits, ks, ps in [(peaked, [5, 40, 1, 7, 20, 3], [1.0] * 6),
                           (peaked, [50, 10, 200, 2, 9, 30], [0.5, 0.9, 0.3, 1.0, 0.7, 0.95]),
                           (peaked, [0, 10, 0, 5, 0, 1], [0.6, 1.0, 0.2, 0.8, 0.9, 1.0]),
                           (flat, [0, 0, 30, 0, 0, 0], [0.95, 0.5, 0.9, 1.0, 0.99, 0.2]),
                           (peaked, [0, 0, 0, 3, 0, 0], [1.0, 0.7, 1.0, 1.0, 1.0, 0.9])]:
        out = _filter_top_k_top_p(logits, ks, ps, torch.tensor(ks, dtype=torch.float32), torch.tensor(ps))
        for row in range(6):
            kept = set(torch.nonzero(out[row] > -torch.inf).flatten().tolist())
            assert kept == by_sort(logits[row], ks[row], ps[row]), (ks[row], ps[row])
            if ks[row] == 0 and ps[row] == 1.0:
                assert torch.equal(out[row], logits[row])  # no filter: the row as it was


def test_random_draws_follow_a_filtered_distribution_and_never_pick_a_removed_token() -> None:
    """Sampling inverts the cumulative distribution at one uniform per row: frequencies follow
    the probabilities left by top-p, and a token top-p removed is never drawn."""
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log().expand(6000, 4).clone()
    out = sampler()(logits, rows(*[SamplingParams(temperature=1.0, top_p=0.85)] * 6000)).token_ids
    freq = torch.bincount(out, minlength=4).float() / 6000
    assert freq[3] == 0  # outside the 0.85 nucleus (0.4 + 0.3 + 0.2 = 0.9 already holds it)
    torch.testing.assert_close(freq[:3], probs[:3] / 0.9, atol=0.03, rtol=0)


def test_running_counts_equal_a_rebuild_from_the_history() -> None:
    """A request's penalties read counts the sampler keeps and bumps with each token it samples;
    at every step they must equal the counts rebuilt from the whole history, with another
    penalised request and an unpenalised one in the batch, until the request is forgotten and
    its counts rebuilt from its tokens (a preemption)."""
    s = sampler(seed=3)
    p = SamplingParams(temperature=1.0, repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.3)
    histories = {10: [5, 6, 7, 5], 11: [1, 2]}
    prompts = {10: 3, 11: 2}
    for step in range(12):
        if step == 6:
            s.forget(10)
        logits = random_logits(3, 40, seed=step)
        rows = [SamplingRow(p, len(h) - prompts[rid], h, prompts[rid], rid) for rid, h in histories.items()]
        rebuilt = [SamplingRow(p, len(h) - prompts[rid], h, prompts[rid]) for rid, h in histories.items()]
        plain = SamplingRow(SamplingParams(temperature=1.0), step)
        torch.testing.assert_close(s._penalize(logits, s.prepare([*rows, plain])),
                                   s._penalize(logits, s.prepare([*rebuilt, plain])),
                                   rtol=0, atol=0)
        out = s(logits, [*rows, plain]).token_ids.tolist()
        for rid, token in zip(histories, out, strict=False):
            histories[rid].append(token)
    assert set(s.counts.rows) == {10, 11}


def test_what_only_some_rows_need_travels_in_the_steps_staged_copy() -> None:
    # The rows with top-k/top-p (when others have none) and a new penalised request's history
    # were made into device tensors mid-step: on CUDA a transfer that waits for the whole queued
    # step. They are now host tensors of the prepared step, moved with the attention metadata.
    s = sampler()
    history = [1, 5, 9, 5, 7]
    batch = [SamplingRow(SamplingParams(temperature=0.0), 0),
             SamplingRow(SamplingParams(temperature=1.0, top_p=0.9), 0),
             SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=1.3), 2, history, 3, rid=7)]
    step = s.prepare(batch)
    assert step.filtered is not None and step.filtered.tolist() == [1]
    assert step.history_ids is not None and step.history_ids.tolist() == history
    assert step.history_weights is not None and step.history_weights.tolist() == [0, 0, 0, 1, 1]  # outputs count
    assert step.fill_rows is not None and step.history_rows is not None and step.count_rows is not None
    assert step.history_rows.tolist() == step.fill_rows.tolist() * len(history) and step.fill_rids == [7]
    moved = step.tensors()
    assert any(t is step.filtered for t in moved) and any(t is step.history_ids for t in moved)
    logits = random_logits(3, 40)
    first = s(logits, step.moved([t.clone() for t in moved]))
    assert first.token_ids[0] == logits[0].argmax()
    again = s.prepare(batch)  # the history now lives on the device: nothing to send
    assert again.history_ids is None and again.fill_rows is None and again.count_rows is not None
    assert torch.equal(s(logits, again.moved(again.tensors())).token_ids[2], first.token_ids[2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sampling_a_mixed_step_on_cuda_makes_no_synchronizing_call() -> None:
    cuda = torch.device("cuda")
    s = Sampler(cuda, [EOS], seed=0)
    batch = [SamplingRow(SamplingParams(temperature=0.0, logprobs=3), 0),
             SamplingRow(SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=3), 1),
             SamplingRow(SamplingParams(temperature=0.0, frequency_penalty=0.5), 1, [1, 4, 4], 2, rid=9)]
    step = s.prepare(batch)
    moved = step.moved([t.to(cuda) for t in step.tensors()])
    logits = random_logits(3, 64).to(cuda)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = s(logits, moved)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.token_ids.shape == (3,)


# ------------------------------------------------------------------------------------ batched per-step work


def _per_row_counts(history: list[int], num_prompt: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's counts as they were built a row at a time: outputs counted, all ids seen."""
    counts = torch.zeros(vocab)
    outputs = torch.tensor(history[num_prompt:], dtype=torch.long)
    counts.index_add_(0, outputs, torch.ones(len(outputs)))
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[torch.tensor(history, dtype=torch.long)] = True
    return counts, seen


def test_the_count_table_equals_counts_built_row_by_row() -> None:
    """Twenty requests' histories scattered into the table at once (more rows than it starts
    with, so it grows), bumped a token each for a few steps, some released and their rows handed
    to new requests: every row reads as its request's counts built alone."""
    from worker.token_counts import TokenCounts

    vocab, gen = 50, random.Random(4)
    table = TokenCounts(CPU)
    histories = {rid: ([gen.randrange(vocab) for _ in range(gen.randrange(1, 30))], 0) for rid in range(20)}
    histories = {rid: (h, gen.randrange(len(h) + 1)) for rid, (h, _) in histories.items()}
    for step in range(6):
        if step == 3:  # two requests stop; two new ones take their rows
            for rid in (4, 11):
                table.release(rid)
                del histories[rid]
            histories |= {20: ([1, 2, 2, 3], 1), 21: ([7] * 9, 9)}
        rids = sorted(histories)
        fills = [(rid, *table.assign(rid)) for rid in rids]
        new = [(rid, row) for rid, row, fill in fills if fill]
        if new:
            ids = [t for rid, _ in new for t in histories[rid][0]]
            id_rows = [row for rid, row in new for _ in histories[rid][0]]
            weights = [float(i >= histories[rid][1]) for rid, _ in new for i in range(len(histories[rid][0]))]
            table.fill(torch.tensor([row for _, row in new]), torch.tensor(ids), torch.tensor(id_rows),
                       torch.tensor(weights), vocab)
            table.filled([rid for rid, _ in new])
        rows = torch.tensor([row for _, row, _ in fills])
        counts, seen = table.read(rows, vocab)
        for i, rid in enumerate(rids):
            want_counts, want_seen = _per_row_counts(*histories[rid], vocab)
            assert torch.equal(counts[i], want_counts) and torch.equal(seen[i], want_seen), (step, rid)
        tokens = [gen.randrange(vocab) for _ in rids]
        table.bump(rows, torch.tensor(tokens), vocab)
        for rid, token in zip(rids, tokens, strict=True):
            histories[rid][0].append(token)
    assert table.used <= 22 and sorted(table.rows) == sorted(histories)


def test_a_seeded_rows_draw_is_its_own_alone_or_in_any_batch() -> None:
    """The uniform that samples a seeded row is a function of (seed, output index) alone: the
    same alone, at another position of a batch of seeded and unseeded rows, and from a sampler
    with another generator; over many (seed, index) pairs the draws are uniform on [0, 1)."""
    from worker.sampler import seeded_uniform

    row = SamplingRow(SamplingParams(temperature=1.0, seed=42), 7)
    alone = sampler(seed=0)._uniforms(sampler().prepare([row]))
    mixed = [SamplingRow(SamplingParams(temperature=1.0), 3), SamplingRow(SamplingParams(temperature=0.7, seed=5), 0),
             row, SamplingRow(SamplingParams(temperature=1.0, seed=42), 8)]
    batched = sampler(seed=99)._uniforms(sampler().prepare(mixed))
    assert batched[2] == alone[0] == seeded_uniform(42, 7)
    assert batched[3] == seeded_uniform(42, 8) != batched[2]
    draws = torch.tensor([seeded_uniform(s, i) for s in range(100) for i in range(100)])
    assert draws.min() >= 0.0 and draws.max() < 1.0
    counts = torch.histc(draws, bins=10, min=0.0, max=1.0)
    assert counts.min() > 900 and counts.max() < 1100  # 1,000 expected per tenth


class _OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_a_steps_operators_do_not_grow_with_its_penalised_and_seeded_rows() -> None:
    """Counting tokens and drawing seeded rows' uniforms are one set of operators for the whole
    batch: a step of 48 penalised, seeded rows runs as many torch operators as one of 3."""

    def ops(n: int) -> int:
        s = sampler()
        p = SamplingParams(temperature=0.9, seed=3, frequency_penalty=0.4, repetition_penalty=1.1)
        batch = [SamplingRow(p, 2, [5, 6, 7, 8 + i], 2, rid=i) for i in range(n)]
        logits = random_logits(n, 64)
        s(logits, s.prepare(batch))  # the first step fills the histories
        step = s.prepare([SamplingRow(p, 3, (), 2, rid=i) for i in range(n)])
        with _OpCount() as counter:
            s(logits, step)
        return counter.ops

    assert ops(48) == ops(3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_seeded_rows_ignore_the_batch_and_counts_match_the_cpu() -> None:
    cuda = torch.device("cuda")
    logits = random_logits(5, 300, seed=8)
    seeded = SamplingParams(temperature=1.0, seed=1234, top_p=0.95, frequency_penalty=0.5)
    noise = [SamplingRow(SamplingParams(temperature=1.0), 0), SamplingRow(SamplingParams(temperature=0.8, seed=9), 4),
             SamplingRow(SamplingParams(temperature=0.0, presence_penalty=0.3), 1, [3, 3, 4], 2, rid=50),
             SamplingRow(SamplingParams(temperature=1.2), 2)]
    history = [1, 2, 3, 2]
    for index in range(8):
        row = SamplingRow(seeded, index, history, 2, rid=7)
        alone = Sampler(cuda, [EOS], seed=0)
        batched = Sampler(cuda, [EOS], seed=1)
        on_cpu = Sampler(CPU, [EOS], seed=2)
        got_alone = alone(logits[2:3].to(cuda), [row]).token_ids.cpu()
        got_batched = batched(logits.to(cuda), [*noise[:2], row, *noise[2:]]).token_ids.cpu()
        assert got_batched[2] == got_alone[0]
        # The same uniform on both devices: the same token wherever the CDFs agree (they may
        # round differently at a boundary, so the draw is compared, not the token).
        step = alone.prepare([row])
        on_device = alone._uniforms(step.moved([t.to(cuda) for t in step.tensors()]))
        assert torch.equal(on_device.cpu(), on_cpu._uniforms(on_cpu.prepare([row])))
        counts, seen = alone.counts.read(torch.tensor([alone.counts.rows[7]], device=cuda), 300)
        want_counts, want_seen = _per_row_counts([*history, int(got_alone[0])], 2, 300)
        assert torch.equal(counts[0].cpu(), want_counts) and torch.equal(seen[0].cpu(), want_seen)
