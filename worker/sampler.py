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
from typing import Any

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


PARAM_COLUMNS = ("temperature", "top_p", "min_p", "top_k", "repetition_penalty", "frequency_penalty",
                 "presence_penalty")
_TOP_K_CAP = 1 << 24  # a float32 holds every integer up to here; larger k means "the whole vocabulary"


def param_row(p: SamplingParams) -> list[float]:
    """A request's numeric parameters, in ``PARAM_COLUMNS`` order (the input batch keeps one such
    row per slot)."""
    return [max(p.temperature, GREEDY_BELOW), p.top_p, p.min_p, float(min(p.top_k, _TOP_K_CAP)),
            p.repetition_penalty, p.frequency_penalty, p.presence_penalty]


def _index(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


@dataclasses.dataclass
class StepSampling:
    """What one step's sampling reads besides the logits, made on the host before the forward pass.

    Everything the device needs is a tensor field: each row's parameters (``params``, a slice of
    the input batch's per-slot table or built from the rows) and the index tensors of the options
    only some rows use (None where no row does). ``tensors``/``moved`` let the runner send them
    to the device in the step's one staged copy with the attention metadata, so sampling makes
    no host-to-device transfer of its own. Decisions that shape the work (all greedy? any top-k?
    the widest k?) are read from the rows on the host: the host never waits on the device."""

    rows: list[SamplingRow]
    params: torch.Tensor  # [B, len(PARAM_COLUMNS)] float32
    greedy: torch.Tensor | None = None  # [B] bool, when greedy and random rows mix
    wanted: torch.Tensor | None = None  # rows that asked for logprobs
    penalised: torch.Tensor | None = None  # rows whose penalties read their history
    bias_rows: torch.Tensor | None = None  # logit_bias entries: row, token, value
    bias_tokens: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    banned_rows: torch.Tensor | None = None  # (row, token) pairs banned by min_tokens
    banned_tokens: torch.Tensor | None = None
    unseeded: torch.Tensor | None = None  # random rows without a seed, when seeded ones are present

    @classmethod
    def build(cls, rows: list[SamplingRow], eos_token_ids: tuple[int, ...], params: torch.Tensor | None = None
              ) -> StepSampling:
        """``params``: the rows' ``param_row``s already gathered (the input batch's slice)."""
        if params is None:
            params = torch.tensor([param_row(r.params) for r in rows], dtype=torch.float32).view(len(rows), -1)
        step = cls(rows, params)
        greedy = [r.params.temperature < GREEDY_BELOW for r in rows]
        if any(greedy) and not all(greedy):
            step.greedy = torch.tensor(greedy)
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if wanted:
            step.wanted = _index(wanted)
        penalised = [i for i, r in enumerate(rows) if r.params.reads_history]
        if penalised:
            step.penalised = _index(penalised)
        bias = [(i, token, value) for i, r in enumerate(rows) for token, value in r.params.logit_bias]
        if bias:
            step.bias_rows, step.bias_tokens = _index([b[0] for b in bias]), _index([b[1] for b in bias])
            step.bias_values = torch.tensor([b[2] for b in bias], dtype=torch.float32)
        banned = [(i, token) for i, r in enumerate(rows) if r.num_outputs < r.params.min_tokens
                  for token in (*r.params.stop_token_ids, *(() if r.params.ignore_eos else eos_token_ids))]
        if banned:
            step.banned_rows, step.banned_tokens = _index([b[0] for b in banned]), _index([b[1] for b in banned])
        seeded = [r.params.seed is not None for r in rows]
        if any(seeded):
            step.unseeded = _index([i for i, s in enumerate(seeded) if not s])
        return step

    def tensors(self) -> list[torch.Tensor]:
        """The tensor fields that are set, in field order."""
        return [v for f in dataclasses.fields(self) if isinstance(v := getattr(self, f.name), torch.Tensor)]

    def moved(self, tensors: list[torch.Tensor]) -> StepSampling:
        """The same step with ``tensors`` (the device copies of ``tensors()``) in their places."""
        it = iter(tensors)
        fields: dict[str, Any] = {f.name: next(it) for f in dataclasses.fields(self)
                                  if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **fields)

    def column(self, name: str) -> torch.Tensor:
        return self.params[:, PARAM_COLUMNS.index(name)]


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

    def prepare(self, rows: list[SamplingRow], params: torch.Tensor | None = None) -> StepSampling:
        """The host half of sampling ``rows`` (see ``StepSampling``); move it, then call."""
        return StepSampling.build(rows, self.eos_token_ids, params)

    def __call__(self, logits: torch.Tensor, step: StepSampling | list[SamplingRow]) -> SamplerOutput:
        """One token per row of ``logits`` [B, V] (float32; not modified). ``step``: prepared and
        on the logits' device, or plain rows (prepared and moved here, a transfer of its own)."""
        if not isinstance(step, StepSampling):
            prepared = self.prepare(step)
            step = prepared.moved([t.to(logits.device) for t in prepared.tensors()])
        rows = step.rows
        # Computed before the ban, from the raw logits (see the module docstring).
        raw_logprobs = logits[step.wanted].log_softmax(dim=-1) if step.wanted is not None else None
        logits = self._add_bias(logits, step)
        logits = self._ban_stop_tokens(logits, step)
        logits = self._penalize(logits, step)
        if all(r.params.temperature < GREEDY_BELOW for r in rows):
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = self._sample_random(logits, step)
            if step.greedy is not None:
                token_ids = torch.where(step.greedy, logits.argmax(dim=-1), token_ids)
        self._count(rows, token_ids)
        logprobs = None
        if raw_logprobs is not None:
            assert step.wanted is not None
            wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
            counts = [min(int(rows[i].params.logprobs or 0), logits.shape[-1]) for i in wanted]
            logprobs = _top_logprobs(raw_logprobs, wanted, step.wanted, counts, token_ids)
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

    def _add_bias(self, logits: torch.Tensor, step: StepSampling) -> torch.Tensor:
        if step.bias_rows is None:
            return logits
        assert step.bias_tokens is not None and step.bias_values is not None
        return logits.index_put((step.bias_rows, step.bias_tokens), step.bias_values.to(logits.dtype),
                                accumulate=True)

    def _penalize(self, logits: torch.Tensor, step: StepSampling) -> torch.Tensor:
        if step.penalised is None:
            return logits
        vocab = logits.shape[-1]
        histories = [self._history(r, vocab) for r in step.rows if r.params.reads_history]
        counts = torch.stack([h.output_counts for h in histories])  # [R, V]
        seen = torch.stack([h.seen for h in histories])
        rep, freq, pres = (step.column(name)[step.penalised][:, None]
                           for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"))
        picked = logits[step.penalised]
        picked = torch.where(seen, torch.where(picked > 0, picked / rep, picked * rep), picked)
        picked = picked - freq * counts - pres * (counts > 0)
        logits = logits.clone()
        logits[step.penalised] = picked
        return logits

    def _ban_stop_tokens(self, logits: torch.Tensor, step: StepSampling) -> torch.Tensor:
        """Until a request has min_tokens outputs, EOS and its stop ids may not be sampled."""
        if step.banned_rows is None:
            return logits
        logits = logits.clone()
        logits[step.banned_rows, step.banned_tokens] = -torch.inf
        return logits

    def _sample_random(self, logits: torch.Tensor, step: StepSampling) -> torch.Tensor:
        rows = step.rows
        scaled = logits / step.column("temperature")[:, None]
        top_k = [r.params.top_k for r in rows]
        if any(k > 0 for k in top_k) or any(r.params.top_p < 1.0 for r in rows):
            scaled = _filter_top_k_top_p(scaled, top_k, step.column("top_k"), step.column("top_p"))
        probs = scaled.softmax(dim=-1)
        if any(r.params.min_p > 0.0 for r in rows):
            floor = step.column("min_p")[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)  # the most likely token always stays
        return (probs / self._exponentials(step, logits.shape[-1])).argmax(dim=-1)

    def _exponentials(self, step: StepSampling, vocab: int) -> torch.Tensor:
        rows = step.rows
        if step.unseeded is None:  # nobody is seeded: one draw for the whole batch
            e = torch.empty((len(rows), vocab), device=self.device).exponential_(generator=self.generator)
        else:
            e = torch.empty((len(rows), vocab), device=self.device)
            if step.unseeded.numel():
                e[step.unseeded] = torch.empty((step.unseeded.numel(), vocab), device=self.device).exponential_(
                    generator=self.generator)
            for i, row in enumerate(rows):
                if row.params.seed is not None:
                    g = torch.Generator(device=self.device)
                    g.manual_seed(seed_for(row.params.seed, row.num_outputs))
                    e[i].exponential_(generator=g)
        # A zero draw would turn a masked token's 0 / 0 into NaN, which argmax then picks.
        return e.clamp_(min=torch.finfo(e.dtype).tiny)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: list[int], k: torch.Tensor, top_p: torch.Tensor
                         ) -> torch.Tensor:
    """Mask to -inf what lies outside each row's top-k (``top_k`` on the host, ``k`` the same
    on the device; 0: off), then outside the top-p nucleus of what is left. The most likely
    token always survives.

    Top-k comes first and bounds the work: when every row has a k, only the largest k columns
    are ranked (``topk``, linear in the vocabulary) instead of sorting the whole vocabulary per
    row; a row with top-p and no top-k needs the full sort."""
    vocab = logits.shape[-1]
    width = max(min(n, vocab) if n > 0 else vocab for n in top_k)
    k = torch.where(k > 0, k.clamp(max=vocab), vocab).long()
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


def _top_logprobs(raw: torch.Tensor, rows: list[int], index: torch.Tensor, counts: list[int],
                  token_ids: torch.Tensor) -> TopLogprobs:
    """``raw`` [R, V]: log-softmax of batch ``rows`` (``index``: the same, on the device);
    ``counts``: top-k size each row asked for."""
    picked = token_ids[index]
    top_values, top_ids = raw.topk(max(counts), dim=-1)
    return TopLogprobs(rows, counts, raw.gather(1, picked[:, None]).squeeze(1), top_ids, top_values)
