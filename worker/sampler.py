"""Batched sampling on the device: greedy, temperature, top-k, top-p, min_tokens, per-request seeds.

Random rows sample by the exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. per token
draws exactly from ``p``. A seeded request draws its ``E`` from a generator seeded by
``(seed, output index)``, so its tokens do not depend on what else is in the batch, nor on whether
its state was rebuilt after a preemption.
"""

from __future__ import annotations

import dataclasses

import torch

from protocol.messages import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, index) over generator seeds


@dataclasses.dataclass(frozen=True)
class SamplingRow:
    params: SamplingParams
    num_outputs: int  # outputs so far; the index of the token being sampled
    eos_token_ids: tuple[int, ...]


def _ban_stop_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Until a request has min_tokens outputs, EOS and its stop ids may not be sampled."""
    for i, row in enumerate(rows):
        p = row.params
        if row.num_outputs < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(row.eos_token_ids))
            if banned:
                logits[i, banned] = float("-inf")


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf what lies outside each row's top-k and top-p nucleus (one sort for both)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    sorted_logits = sorted_logits.masked_fill(before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _exponentials(rows: list[SamplingRow], vocab: int, device: torch.device) -> torch.Tensor:
    e = torch.empty((len(rows), vocab), device=device)
    for i, row in enumerate(rows):
        seed = row.params.seed
        if seed is None:
            e[i].exponential_()
        else:
            g = torch.Generator(device=device)
            g.manual_seed(((seed * _SEED_MIX) ^ row.num_outputs) & 0x7FFF_FFFF_FFFF_FFFF)
            e[i].exponential_(generator=g)
    return e


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """One token id per row of ``logits`` [B, V] (float32), on the same device."""
    _ban_stop_tokens(logits, rows)
    greedy = [r.params.temperature == 0.0 for r in rows]
    if all(greedy):
        return logits.argmax(dim=-1)
    device = logits.device
    temps = torch.tensor([r.params.temperature or 1.0 for r in rows], device=device)
    scaled = logits / temps[:, None]
    top_k = torch.tensor([r.params.top_k for r in rows], device=device)
    top_p = torch.tensor([r.params.top_p for r in rows], device=device)
    if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
        scaled = _filter_top_k_top_p(scaled, top_k, top_p)
    probs = scaled.softmax(dim=-1)
    sampled = (probs / _exponentials(rows, logits.shape[-1], device)).argmax(dim=-1)
    if any(greedy):
        sampled = torch.where(torch.tensor(greedy, device=device), logits.argmax(dim=-1), sampled)
    return sampled
