"""Batched sampling on the device: logit bias, penalties, greedy, temperature, top-k, top-p,
min-p, min_tokens, per-request seeds, and optional logprobs.

In order, on the raw logits: ``logit_bias`` is added; EOS and stop ids are banned until
``min_tokens``; the repetition penalty divides positive (multiplies negative) logits of tokens
seen in the prompt or the output (vLLM's rule), then the frequency and presence penalties
subtract per occurrence / once for tokens of the output (OpenAI's). A request's counts are kept
on the device from its first penalised step on, a row of one table for every penalised request
(``worker.token_counts``), and bumped with each token it samples, every row in one operation: a
step costs the same at output 1,000 as at output 1, and the host need not know a sampled id
before the next step samples. Greedy rows take the argmax
of that; random rows divide by the temperature, keep their top-k / top-p nucleus and the tokens
at least ``min_p`` times as likely as the most likely one, and sample. Every step is batched;
rows that use none of an option cost it nothing, and a batch where nobody does skips it whole.

Random rows sample by inverting their distribution's cumulative sum at one uniform draw per row
(``searchsorted``): exact, and one random number per row instead of one per vocabulary entry
(the exponential race drawn before this took 45 of 60 ms per step at 64 rows of SmolLM2's 49k
vocabulary, more than the forward pass). A seeded request's uniform is a counter-based draw:
the top 24 bits of a hash of ``(seed, output index)`` (``seeded_uniform``), computed on the host
when the step is prepared and sent in its staged copy, every seeded row's put in place with one
``index_copy_``. Its tokens therefore depend on nothing but its seed, its position and its
logits: not on what else is in the batch, nor on whether its state was rebuilt after a
preemption, nor on the device (the CPU and CUDA draw the same numbers). Unseeded rows share one
generator.

Logprobs are those of the model's own distribution (log-softmax of the raw logits, before
temperature, top-k/top-p and the min_tokens ban), as vLLM reports them by default — except for a
request held to a grammar (structured output), whose logits are masked first of all: its
logprobs are those of the constrained distribution.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from protocol.messages import SamplingParams
from worker.structured import GrammarEngine, GrammarState, apply_masks_
from worker.token_counts import TokenCounts

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


def seeded_uniform(seed: int, output_index: int) -> float:
    """The U[0, 1) draw that samples output ``output_index`` of a request seeded with ``seed``:
    the top 24 bits of ``seed_for``, a multiple of 2**-24 (exact in float32, as torch's own
    float32 uniforms are)."""
    return (seed_for(seed, output_index) >> 39) * 2.0**-24


@dataclasses.dataclass(frozen=True)
class SamplingRow:
    params: SamplingParams
    num_outputs: int  # outputs so far: the index of the token being sampled
    # Prompt + outputs so far, for the penalties; only rows whose params read their history
    # need it (the runner passes it to those alone), and with a ``rid`` only the first time.
    token_ids: Sequence[int] = ()
    num_prompt_tokens: int = 0
    rid: int | None = None  # set: the sampler keeps this request's counts between steps
    grammar: GrammarState | None = None  # structured output: the matcher that masks its logits
    # Speculative decoding: the proposed tokens before this row's position (its request's own
    # position listed earlier in the step), which its grammar mask follows.
    grammar_drafts: tuple[int, ...] = ()


@dataclasses.dataclass
class TopLogprobs:
    """Logprobs of the rows that asked for them, still on the device."""

    rows: list[int]  # batch rows, in order
    counts: list[int]  # top-k size each of those rows asked for
    sampled: torch.Tensor  # [R] logprob of the sampled token
    top_ids: torch.Tensor  # [R, max k]
    top_values: torch.Tensor  # [R, max k]

    def tensors(self) -> list[torch.Tensor]:
        """What ``by_row`` reads, for the copy to the host."""
        return [self.sampled, self.top_ids, self.top_values]

    def by_row(self, host: list[torch.Tensor] | None = None) -> dict[int, WireLogprob]:
        """Each asking row's entry (sampled logprob, top ids, top logprobs), by batch row, read
        from ``host`` (``tensors()`` copied to the host) or from the tensors themselves."""
        sampled, ids, values = (t.tolist() for t in (host or self.tensors()))
        return {row: (sampled[j], ids[j][:k], values[j][:k])
                for j, (row, k) in enumerate(zip(self.rows, self.counts, strict=True))}


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
    seeded: torch.Tensor | None = None  # rows with a seed
    seed_uniforms: torch.Tensor | None = None  # [S] float32: their draws (``seeded_uniform``)
    constrained: torch.Tensor | None = None  # rows held to a grammar
    grammar_masks: torch.Tensor | None = None  # [R, ceil(V / 32)] int32: their allowed tokens, a bit each
    pending_masks: Future[torch.Tensor] | None = None  # the same, still being filled beside the forward pass
    filtered: torch.Tensor | None = None  # rows with top-k or top-p, when some rows have neither
    # Penalties (``worker.token_counts``): the table row of each penalised row; which of them
    # are kept between steps (positions in ``penalised``; None: all); the rows filled this step
    # from their histories, which are their prompts and outputs one after the other, each id's
    # row, and 1.0 for an output (counted) or 0.0 for a prompt token (only seen).
    count_rows: torch.Tensor | None = None
    count_kept: torch.Tensor | None = None
    fill_rows: torch.Tensor | None = None
    history_ids: torch.Tensor | None = None
    history_rows: torch.Tensor | None = None
    history_weights: torch.Tensor | None = None
    fill_rids: list[int] = dataclasses.field(default_factory=list)  # host: kept rows filled this step
    transient_rows: list[int] = dataclasses.field(default_factory=list)  # host: released once read

    @classmethod
    def build(cls, rows: list[SamplingRow], eos_token_ids: tuple[int, ...], params: torch.Tensor | None = None,
              grammars: GrammarEngine | None = None, masks_later: bool = False, pin: bool = False) -> StepSampling:
        """``params``: the rows' ``param_row``s already gathered (the input batch's slice);
        ``grammars``: fills the masks of the rows held to one, now or, with ``masks_later``, on
        its mask thread (``pending_masks``; into pinned memory with ``pin``)."""
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
        seeded = [(i, r.params.seed, r.num_outputs) for i, r in enumerate(rows) if r.params.seed is not None]
        if seeded:
            step.seeded = _index([i for i, _, _ in seeded])
            step.seed_uniforms = torch.tensor([seeded_uniform(seed, n) for _, seed, n in seeded], dtype=torch.float32)
        filtered = [i for i, r in enumerate(rows) if _filters(r.params.top_k, r.params.top_p)]
        if filtered and len(filtered) < len(rows):
            step.filtered = _index(filtered)
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        if constrained:
            assert grammars is not None
            step.constrained = _index(constrained)
            states = [rows[i].grammar for i in constrained]
            drafts = [rows[i].grammar_drafts for i in constrained]
            after = drafts if any(drafts) else None
            if masks_later:
                step.pending_masks = grammars.masks_later(states, pin, after)  # type: ignore[arg-type]
            else:
                step.grammar_masks = grammars.masks(states, drafts=after)  # type: ignore[arg-type]
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
    def __init__(self, device: torch.device, eos_token_ids: list[int], seed: int | None = None,
                 grammars: GrammarEngine | None = None, masks_later: bool | None = None) -> None:
        """``masks_later``: fill grammar masks beside the forward pass (``worker.structured``);
        by default on CUDA, where the host is free while the device computes."""
        self.device = device
        self.eos_token_ids = tuple(eos_token_ids)
        self.grammars = grammars
        self.masks_later = device.type == "cuda" if masks_later is None else masks_later
        self.generator = torch.Generator(device=device)
        self.counts = TokenCounts(device)  # penalised requests' histories, a row each
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def prepare(self, rows: list[SamplingRow], params: torch.Tensor | None = None) -> StepSampling:
        """The host half of sampling ``rows`` (see ``StepSampling``); move it, then call."""
        step = StepSampling.build(rows, self.eos_token_ids, params, self.grammars, self.masks_later,
                                  pin=self.device.type == "cuda")
        if step.penalised is not None:
            self._prepare_counts(step)
        return step

    def _prepare_counts(self, step: StepSampling) -> None:
        """Each penalised row's table row; a new row's history goes to the device in the step's
        staged copy, not in a transfer of its own."""
        count_rows: list[int] = []
        kept: list[int] = []
        fill_rows: list[int] = []
        ids: list[int] = []
        id_rows: list[int] = []
        weights: list[float] = []
        for j, row in enumerate(r for r in step.rows if r.params.reads_history):
            table_row, fill = self.counts.assign(row.rid)
            count_rows.append(table_row)
            if row.rid is None:
                step.transient_rows.append(table_row)
            else:
                kept.append(j)
            if fill:
                if row.rid is not None:
                    step.fill_rids.append(row.rid)
                fill_rows.append(table_row)
                ids.extend(row.token_ids)
                id_rows.extend([table_row] * len(row.token_ids))
                outputs = len(row.token_ids) - row.num_prompt_tokens
                weights.extend([0.0] * row.num_prompt_tokens + [1.0] * outputs)
        step.count_rows = _index(count_rows)
        if len(kept) < len(count_rows):
            step.count_kept = _index(kept)
        if fill_rows:
            step.fill_rows = _index(fill_rows)
        if ids:
            step.history_ids, step.history_rows = _index(ids), _index(id_rows)
            step.history_weights = torch.tensor(weights, dtype=torch.float32)

    def __call__(self, logits: torch.Tensor, step: StepSampling | list[SamplingRow]) -> SamplerOutput:
        """One token per row of ``logits`` [B, V] (float32; modified only where a grammar forbids a
        token: set to -inf in place, the rows being the step's own). ``step``: prepared and on the
        logits' device, or plain rows (prepared and moved here, a transfer of its own)."""
        if not isinstance(step, StepSampling):
            prepared = self.prepare(step)
            step = prepared.moved([t.to(logits.device) for t in prepared.tensors()])
        rows = step.rows
        if step.constrained is not None:
            masks = step.grammar_masks
            if masks is None:  # filled beside the forward pass: now wait for it
                assert step.pending_masks is not None
                masks = step.pending_masks.result().to(logits.device, non_blocking=True)
            apply_masks_(logits, step.constrained, masks)
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
        self._count(step, token_ids, logits.shape[-1])
        logprobs = None
        if raw_logprobs is not None:
            assert step.wanted is not None
            wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
            counts = [min(int(rows[i].params.logprobs or 0), logits.shape[-1]) for i in wanted]
            logprobs = _top_logprobs(raw_logprobs, wanted, step.wanted, counts, token_ids)
        return SamplerOutput(token_ids, logprobs)

    def forget(self, rid: int) -> None:
        """Drop a request's counts (it stopped, or will be sent again from its tokens)."""
        self.counts.release(rid)

    def _count(self, step: StepSampling, token_ids: torch.Tensor, vocab: int) -> None:
        """Each kept history takes the token its row just sampled, without leaving the device:
        one scatter for every row."""
        if step.penalised is None or step.count_rows is None:
            return
        rows, penalised = step.count_rows, step.penalised
        if step.count_kept is not None:
            if not step.count_kept.numel():
                return
            rows, penalised = rows[step.count_kept], penalised[step.count_kept]
        self.counts.bump(rows, token_ids[penalised], vocab)

    def _add_bias(self, logits: torch.Tensor, step: StepSampling) -> torch.Tensor:
        if step.bias_rows is None:
            return logits
        assert step.bias_tokens is not None and step.bias_values is not None
        return logits.index_put((step.bias_rows, step.bias_tokens), step.bias_values.to(logits.dtype),
                                accumulate=True)

    def _penalize(self, logits: torch.Tensor, step: StepSampling) -> torch.Tensor:
        if step.penalised is None:
            return logits
        assert step.count_rows is not None
        vocab = logits.shape[-1]
        if step.fill_rows is not None:
            self.counts.fill(step.fill_rows, step.history_ids, step.history_rows, step.history_weights, vocab)
            self.counts.filled(step.fill_rids)
        counts, seen = self.counts.read(step.count_rows, vocab)  # [R, V]
        self.counts.release_rows(step.transient_rows)  # read: later kernels may reuse them
        step.transient_rows.clear()  # (a list the prepared step and its moved copy share)
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
        top_p = [r.params.top_p for r in rows]
        if any(_filters(k, p) for k, p in zip(top_k, top_p, strict=True)):
            scaled = _filter_top_k_top_p(scaled, top_k, top_p, step.column("top_k"), step.column("top_p"),
                                         step.filtered)
        probs = scaled.softmax(dim=-1)
        if any(r.params.min_p > 0.0 for r in rows):
            floor = step.column("min_p")[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)  # the most likely token always stays
        return _invert_cdf(probs, self._uniforms(step))

    def _uniforms(self, step: StepSampling) -> torch.Tensor:
        """One U[0, 1) draw per row: a seeded row's its own (``seeded_uniform``), all put in
        place at once; the others' from the shared generator."""
        u = torch.rand(len(step.rows), device=self.device, generator=self.generator)
        if step.seeded is not None:
            assert step.seed_uniforms is not None
            u.index_copy_(0, step.seeded, step.seed_uniforms)
        return u


def _invert_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For each row, the first token whose cumulative probability exceeds ``u`` times the row's
    total: a draw from ``probs`` (unnormalised is fine; tokens of probability 0 are never chosen,
    as their cumulative sum equals their predecessor's)."""
    cdf = probs.cumsum(dim=-1)
    target = (u * cdf[:, -1])[:, None]
    token = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)
    # u * total can round up to the total itself; then the last token was "chosen": take the
    # most likely one instead rather than a token the filters removed.
    chosen = probs.gather(1, token[:, None]).squeeze(1)
    return torch.where(chosen > 0, token, probs.argmax(dim=-1))


TOP_P_PROBE = 512  # on the CPU, top-p alone first looks for its nucleus among this many best tokens


def _filters(top_k: int, top_p: float) -> bool:
    return top_k > 0 or top_p < 1.0


def _filter_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float], k: torch.Tensor,
                        p: torch.Tensor, filtered: torch.Tensor | None = None) -> torch.Tensor:
    """Mask to -inf what lies outside each row's top-k (``top_k`` on the host, ``k`` the same on
    the device; 0: off), then outside the top-p nucleus of what is left (``top_p`` / ``p``). The
    most likely token always survives; rows with neither filter are returned as they are.

    Top-k comes first and bounds the work: only the largest k columns are ranked (``topk``,
    linear in the vocabulary) instead of sorting the whole vocabulary per row. A row with top-p
    and no top-k would need the full sort; on the CPU its nucleus is first looked for among the
    ``TOP_P_PROBE`` best tokens (normalised over the whole vocabulary), which almost always hold
    it, and only rows whose nucleus is wider are sorted whole (the host can check for free there;
    on CUDA that check would wait for the device, and sorting is cheap there).

    ``filtered``: the rows that have a filter, on the logits' device (the step's staged copy
    brought it: an index made here would be a transfer that waits for the whole queued step)."""
    vocab = logits.shape[-1]
    ks = [min(n, vocab) if n > 0 else vocab for n in top_k]
    rows = [i for i, (n, q) in enumerate(zip(top_k, top_p, strict=True)) if _filters(n, q)]
    if len(rows) < len(ks):
        idx = filtered if filtered is not None else torch.tensor(rows, device=logits.device)
        out = logits.clone()
        out[idx] = _filter_top_k_top_p(logits[idx], [top_k[i] for i in rows], [top_p[i] for i in rows], k[idx], p[idx])
        return out
    k_dev = torch.where(k > 0, k.clamp(max=vocab), vocab).long()
    width = max(ks)
    if width == vocab and logits.device.type == "cpu":
        width = min(vocab, max([TOP_P_PROBE, *(n for n in ks if n < vocab)]))
    head, order = logits.topk(width, dim=-1) if width < vocab else logits.sort(dim=-1, descending=True)
    ranks = torch.arange(width, device=logits.device)[None, :]
    head = head.masked_fill(ranks >= k_dev[:, None], -torch.inf)
    # Each row's distribution: over its top-k when it has one (all of it lies in the head), over
    # the whole vocabulary when it has none (the head holds only part of it).
    whole = k_dev == vocab
    norm = torch.where(whole, logits.logsumexp(dim=-1), head.logsumexp(dim=-1)) if width < vocab \
        else head.logsumexp(dim=-1)
    probs = (head - norm[:, None]).exp()
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    head = head.masked_fill(before >= p[:, None], -torch.inf)
    filtered = torch.full_like(logits, -torch.inf).scatter(-1, order, head)
    if width < vocab and any(n == vocab for n in ks):
        wider = (whole & (probs.sum(dim=-1) < p)).nonzero().flatten().tolist()  # nucleus beyond the head
        if wider:
            idx = torch.tensor(wider, device=logits.device)
            sorted_head, sorted_order = logits[idx].sort(dim=-1, descending=True)
            sorted_probs = sorted_head.softmax(dim=-1)
            keep_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            sorted_head = sorted_head.masked_fill(keep_before >= p[idx][:, None], -torch.inf)
            filtered[idx] = torch.full_like(sorted_head, -torch.inf).scatter(-1, sorted_order, sorted_head)
    return filtered


def _top_logprobs(raw: torch.Tensor, rows: list[int], index: torch.Tensor, counts: list[int],
                  token_ids: torch.Tensor) -> TopLogprobs:
    """``raw`` [R, V]: log-softmax of batch ``rows`` (``index``: the same, on the device);
    ``counts``: top-k size each row asked for."""
    picked = token_ids[index]
    top_values, top_ids = raw.topk(max(counts), dim=-1)
    return TopLogprobs(rows, counts, raw.gather(1, picked[:, None]).squeeze(1), top_ids, top_values)
