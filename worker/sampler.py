"""Batched sampling on the device: greedy, temperature, top-k, top-p, min_tokens, per-request
seeds, and optional logprobs.

Random rows sample by the exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. per token
draws exactly from ``p``. A seeded request draws its ``E`` from a generator seeded by a mix of
``(seed, output index)``, so its tokens do not depend on what else is in the batch, nor on
whether its state was rebuilt after a preemption. Unseeded rows share one generator.

Logprobs are those of the model's own distribution (log-softmax of the raw logits, before
temperature, top-k/top-p and the min_tokens ban), as vLLM reports them by default.
"""

from __future__ import annotations

import dataclasses

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
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """One token per row of ``logits`` [B, V] (float32; not modified)."""
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        # Computed before the ban, from the raw logits (see the module docstring).
        raw_logprobs = logits[torch.tensor(wanted, device=logits.device)].log_softmax(dim=-1) if wanted else None
        logits = self._ban_stop_tokens(logits, rows)
        greedy = [r.params.temperature < GREEDY_BELOW for r in rows]
        if all(greedy):
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = self._sample_random(logits, rows)
            if any(greedy):
                token_ids = torch.where(torch.tensor(greedy, device=logits.device), logits.argmax(dim=-1), token_ids)
        logprobs = None
        if raw_logprobs is not None:
            counts = [min(int(rows[i].params.logprobs or 0), logits.shape[-1]) for i in wanted]
            logprobs = _top_logprobs(raw_logprobs, wanted, counts, token_ids)
        return SamplerOutput(token_ids, logprobs)

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
            scaled = _filter_top_k_top_p(scaled, torch.tensor(top_k, device=device),
                                         torch.tensor(top_p, device=device))
        probs = scaled.softmax(dim=-1)
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


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf what lies outside each row's top-k, then outside the top-p nucleus of what is
    left (one sort for both). The most likely token always survives."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], -torch.inf)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    sorted_logits = sorted_logits.masked_fill(before >= top_p[:, None], -torch.inf)
    return torch.full_like(logits, -torch.inf).scatter(-1, order, sorted_logits)


def _top_logprobs(raw: torch.Tensor, rows: list[int], counts: list[int], token_ids: torch.Tensor) -> TopLogprobs:
    """``raw`` [R, V]: log-softmax of batch ``rows``; ``counts``: top-k size each row asked for."""
    picked = token_ids[torch.tensor(rows, device=raw.device)]
    top_values, top_ids = raw.topk(max(counts), dim=-1)
    return TopLogprobs(rows, counts, raw.gather(1, picked[:, None]).squeeze(1), top_ids, top_values)
