"""Batched sampling on the device: logit bias, penalties, greedy, temperature, top-k, top-p,
min-p, min_tokens, per-request seeds, and optional logprobs.

In order, on the raw logits: ``logit_bias`` is added; EOS and stop ids are banned until
``min_tokens``; the repetition penalty divides positive (multiplies negative) logits of tokens
seen in the prompt or the output (vLLM's rule), then the frequency and presence penalties
subtract per occurrence / once for tokens of the output (OpenAI's). A request's counts are kept
on the device from its first penalised step on (``TokenCounts``) and bumped with each token it
samples, on the device too: a step costs the same at output 1,000 as at output 1, and the host
need not know a sampled id before the next step samples. Greedy rows take the argmax
of that; random rows divide by the temperature, keep their top-k / top-p nucleus and the tokens
at least ``min_p`` times as likely as the most likely one, and sample. Every step is batched;
rows that use none of an option cost it nothing, and a batch where nobody does skips it whole.

Random rows sample by the exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. per token
draws exactly from ``p``. A seeded request draws its ``E`` from a generator seeded by a mix of
``(seed, output index)``, so its tokens do not depend on what else is in the batch, nor on
whether its state was rebuilt after a preemption. Unseeded rows share one generator.

Logprobs are those of the model's own distribution (log-softmax of the raw logits, before
temperature, top-k/top-p and the min_tokens ban), as vLLM reports them by default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from protocol.messages import SamplingParams

GREEDY_BELOW = 1e-5  # temperatures this small are treated as 0: dividing by them overflows
_MASK64 = (1 << 64) - 1

WireLogprob = tuple[float, list[int], list[float]]


def seed_for(seed: int, output_index: int) -> int:
    """A generator seed for output token ``output_index`` of a request seeded with ``seed``:
    the splitmix64 finaliser over both, so neighbouring seeds and indices give unrelated streams."""
    z = (seed ^ ((output_index + 1) * 0x9E3779B97F4A7C15)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # 63 bits: what every torch generator accepts


@dataclasses.dataclass(frozen=True)
class SamplingRow:
    params: SamplingParams
    num_outputs: int  # outputs so far: the index of the token being sampled
    # Prompt + outputs so far, for the penalties; only rows whose params read their history
    # need it (the runner passes it to those alone), and with a ``rid`` only the first time.
    token_ids: Sequence[int] = ()
    num_prompt_tokens: int = 0
    rid: int | None = None  # set: the sampler keeps this request's counts between steps


@dataclasses.dataclass
class TokenCounts:
    """What the penalties read of one request's history, on the device."""

    output_counts: torch.Tensor  # [V] float: occurrences of each token among the outputs
    seen: torch.Tensor  # [V] bool: in the prompt or the outputs

    @classmethod
    def of(cls, row: SamplingRow, vocab: int, device: torch.device) -> TokenCounts:
        ids = torch.tensor(list(row.token_ids), dtype=torch.long, device=device)
        outputs = ids[row.num_prompt_tokens :]
        counts = torch.zeros(vocab, device=device)
        counts.index_add_(0, outputs, torch.ones_like(outputs, dtype=counts.dtype))
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        seen[ids] = True
        return cls(counts, seen)


@dataclasses.dataclass
class TopLogprobs:
    """Logprobs of the rows that asked for them, still on the device."""

    rows: list[int]  # batch rows, in order
    counts: list[int]  # top-k size each of those rows asked for
    sampled: torch.Tensor  # [R] logprob of the sampled token
    top_ids: torch.Tensor  # [R, max k]
    top_values: torch.Tensor  # [R, max k]

    def to_wire(self, batch_size: int) -> list[WireLogprob | None]:
        """``StepTokens.logprobs``: one entry per batch row, None for rows that did not ask."""
        out: list[WireLogprob | None] = [None] * batch_size
        sampled, ids, values = self.sampled.tolist(), self.top_ids.tolist(), self.top_values.tolist()
        for j, (row, k) in enumerate(zip(self.rows, self.counts, strict=True)):
            out[row] = (sampled[j], ids[j][:k], values[j][:k])
        return out


@dataclasses.dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] long, on the device
    logprobs: TopLogprobs | None


class Sampler:
    def __init__(self, device: torch.device, eos_token_ids: list[int], seed: int | None = None) -> None:
        self.device = device
        self.eos_token_ids = tuple(eos_token_ids)
        self.generator = torch.Generator(device=device)
        self.counts: dict[int, TokenCounts] = {}  # by rid: penalised requests seen so far
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """One token per row of ``logits`` [B, V] (float32; not modified)."""
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        # Computed before the ban, from the raw logits (see the module docstring).
        raw_logprobs = logits[torch.tensor(wanted, device=logits.device)].log_softmax(dim=-1) if wanted else None
        logits = self._add_bias(logits, rows)
        logits = self._ban_stop_tokens(logits, rows)
        logits = self._penalize(logits, rows)
        greedy = [r.params.temperature < GREEDY_BELOW for r in rows]
        if all(greedy):
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = self._sample_random(logits, rows)
            if any(greedy):
                token_ids = torch.where(torch.tensor(greedy, device=logits.device), logits.argmax(dim=-1), token_ids)
        self._count(rows, token_ids)
        logprobs = None
        if raw_logprobs is not None:
            counts = [min(int(rows[i].params.logprobs or 0), logits.shape[-1]) for i in wanted]
            logprobs = _top_logprobs(raw_logprobs, wanted, counts, token_ids)
        return SamplerOutput(token_ids, logprobs)

    def forget(self, rid: int) -> None:
        """Drop a request's counts (it stopped, or will be sent again from its tokens)."""
        self.counts.pop(rid, None)

    def _history(self, row: SamplingRow, vocab: int) -> TokenCounts:
        if row.rid is None:
            return TokenCounts.of(row, vocab, self.device)
        counts = self.counts.get(row.rid)
        if counts is None:
            counts = self.counts[row.rid] = TokenCounts.of(row, vocab, self.device)
        return counts

    def _count(self, rows: list[SamplingRow], token_ids: torch.Tensor) -> None:
        """Each kept history takes the token its row just sampled, without leaving the device."""
        for i, row in enumerate(rows):
            kept = self.counts.get(row.rid) if row.rid is not None else None
            if kept is not None:
                token = token_ids[i : i + 1]
                kept.output_counts.index_add_(0, token, torch.ones(1, device=token_ids.device))
                kept.seen[token] = True

    def _add_bias(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        row_idx: list[int] = []
        tok_idx: list[int] = []
        bias: list[float] = []
        for i, row in enumerate(rows):
            for token, value in row.params.logit_bias:
                row_idx.append(i)
                tok_idx.append(token)
                bias.append(value)
        if not row_idx:
            return logits
        device = logits.device
        return logits.index_put((torch.tensor(row_idx, device=device), torch.tensor(tok_idx, device=device)),
                                torch.tensor(bias, device=device, dtype=logits.dtype), accumulate=True)

    def _penalize(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        which = [i for i, r in enumerate(rows) if r.params.reads_history]
        if not which:
            return logits
        device, vocab = logits.device, logits.shape[-1]
        histories = [self._history(rows[i], vocab) for i in which]
        counts = torch.stack([h.output_counts for h in histories])  # [R, V]
        seen = torch.stack([h.seen for h in histories])
        params = [rows[i].params for i in which]
        rep = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
        freq = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        pres = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        picked = logits[torch.tensor(which, device=device)]
        picked = torch.where(seen, torch.where(picked > 0, picked / rep, picked * rep), picked)
        picked = picked - freq * counts - pres * (counts > 0)
        logits = logits.clone()
        logits[torch.tensor(which, device=device)] = picked
        return logits

    def _ban_stop_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Until a request has min_tokens outputs, EOS and its stop ids may not be sampled."""
        row_idx: list[int] = []
        tok_idx: list[int] = []
        for i, row in enumerate(rows):
            p = row.params
            if row.num_outputs < p.min_tokens:
                banned = [*p.stop_token_ids, *(() if p.ignore_eos else self.eos_token_ids)]
                row_idx += [i] * len(banned)
                tok_idx += banned
        if not row_idx:
            return logits
        logits = logits.clone()
        logits[torch.tensor(row_idx, device=logits.device), torch.tensor(tok_idx, device=logits.device)] = -torch.inf
        return logits

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        device = logits.device
        temps = torch.tensor([max(r.params.temperature, GREEDY_BELOW) for r in rows], device=device)
        scaled = logits / temps[:, None]
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            scaled = _filter_top_k_top_p(scaled, top_k, torch.tensor(top_p, device=device))
        probs = scaled.softmax(dim=-1)
        min_p = [r.params.min_p for r in rows]
        if any(m > 0.0 for m in min_p):
            floor = torch.tensor(min_p, device=device)[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)  # the most likely token always stays
        return (probs / self._exponentials(rows, logits.shape[-1])).argmax(dim=-1)

    def _exponentials(self, rows: list[SamplingRow], vocab: int) -> torch.Tensor:
        e = torch.empty((len(rows), vocab), device=self.device)
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        if unseeded:
            idx = torch.tensor(unseeded, device=self.device)
            e[idx] = torch.empty((len(unseeded), vocab), device=self.device).exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            if row.params.seed is not None:
                g = torch.Generator(device=self.device)
                g.manual_seed(seed_for(row.params.seed, row.num_outputs))
                e[i].exponential_(generator=g)
        # A zero draw would turn a masked token's 0 / 0 into NaN, which argmax then picks.
        return e.clamp_(min=torch.finfo(e.dtype).tiny)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf what lies outside each row's top-k, then outside the top-p nucleus of what is
    left. The most likely token always survives.

    Top-k comes first and bounds the work: when every row has a k, only the largest k columns
    are ranked (``topk``, linear in the vocabulary) instead of sorting the whole vocabulary per
    row; a row with top-p and no top-k needs the full sort."""
    vocab = logits.shape[-1]
    ks = [min(k, vocab) if k > 0 else vocab for k in top_k]
    width = max(ks)
    k = torch.tensor(ks, device=logits.device)
    if width < vocab:
        head, order = logits.topk(width, dim=-1)  # sorted, descending
    else:
        head, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(width, device=logits.device)[None, :]
    head = head.masked_fill(ranks >= k[:, None], -torch.inf)
    probs = head.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    head = head.masked_fill(before >= top_p[:, None], -torch.inf)
    return torch.full_like(logits, -torch.inf).scatter(-1, order, head)


def _top_logprobs(raw: torch.Tensor, rows: list[int], counts: list[int], token_ids: torch.Tensor) -> TopLogprobs:
    """``raw`` [R, V]: log-softmax of batch ``rows``; ``counts``: top-k size each row asked for."""
    picked = token_ids[torch.tensor(rows, device=raw.device)]
    top_values, top_ids = raw.topk(max(counts), dim=-1)
    return TopLogprobs(rows, counts, raw.gather(1, picked[:, None]).squeeze(1), top_ids, top_values)
