"""ModelRunner: the worker's persistent per-request state and the execution of step plans.

Every request the worker knows has a ``SequenceState``. A ``StepPlan`` carries only deltas;
``execute`` applies it and yields one ``StepTokens`` per step as soon as that step's tokens are
on the host, so the process can forward each step at once.

Step 0 runs every row of the plan in one forward pass (prefill chunks and decodes mixed); a row
whose tokens are then all computed samples from the logits of its last position. Steps
1..n-1 (multi-step) decode the rows that sampled and have not stopped, feeding each step's
sampled ids — still on the device — into the next step's input. A row stops early on EOS / a
stop id / max_tokens / max_model_len, by the rules the scheduler applies too, emits nothing past
its stop token, and its state is dropped.

The host reads a step's ids ``finalize_lag`` steps after launching it: 0 on the CPU, where the
copy is synchronous anyway; 1 on CUDA, so the next step is already queued on the device while
the host waits for the previous copy, and the device never idles on the host. With lag 1, a row
that stopped on EOS computes one more (discarded) token before the host knows; stops that need
no token value (max_tokens, the model length) are always known in time. Penalties need no id on
the host either: the sampler keeps each penalised request's token counts on the device.

Between steps, the caller may ``cancel`` rows (an abort or a pause that arrived mid-plan): they
leave the batch at the next step.

Speculative decoding (a plan's ``num_draft_tokens``): at each step, a row that decodes one token
may also verify tokens proposed after it (prompt lookup, ``worker/ngram.py``, or a draft model,
``worker/draft_model.py``), as rows of one token each
(``StepRows``). Each of its positions samples; it keeps the proposals that match what was sampled
before them, then the first sample that differs, and gives back the positions of the rest
(``SequenceState.settle_drafts``). Drafting rows read their ids with lag 0 (the host proposes
from them), and propose only as far as their blocks reach (``window_end``).

Jump-forward: where a constrained row's grammar allows only one continuation after its sampled
token (a JSON key, its quotes and colon), those tokens are appended with it and reported in the
same step, and the row's next step computes them all in one pass (as a short prefill chunk),
sampling once at its end. Constrained rows read their ids with lag 0, so the host has every id
when it builds that step. A row jumps only as far as the blocks it holds reach
(``SequenceState.window_end``; the scheduler reserves constrained rows room for a window's worth
of forced tokens beyond its steps), and leaves the window when they are full.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from protocol.messages import (
    CancelRows,
    StepPlan,
    StepTokens,
    pack_embeddings,
    pack_logprobs,
    pack_prompt_logprobs,
)
from worker.attention import select_backend
from worker.cpu_threads import ThreadPlan
from worker.host_copy import HostCopier, PendingCopy
from worker.input_batch import InputBatch
from worker.kv_cache import KVCache, SwapSpace
from worker.model.llama import LlamaForCausalLM
from worker.ngram import NgramConfig, NgramIndex
from worker.pooling import PoolPositions, embedding_bytes
from worker.sampler import Sampler, SamplerOutput, SamplingRow, TopLogprobs
from worker.sequence import PlanError, SequenceState
from worker.step_batch import PromptPositions, StepBatch, StepRows
from worker.structured import GrammarEngine

if TYPE_CHECKING:
    from worker.draft_model import DraftModel


@dataclasses.dataclass
class LaunchedStep:
    """A step whose sampled ids are on their way to the host."""

    step: int
    samplers: list[SequenceState]
    token_ids: torch.Tensor  # on the device: the next step's input
    copy: PendingCopy
    logprobs: TopLogprobs | None
    expected: list[int] | None = None  # ``StepBatch.expected``


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cache: KVCache, device: torch.device, max_model_len: int,
                 eos_token_ids: list[int], max_num_seqs: int = 256, seed: int | None = None,
                 finalize_lag: int | None = None, grammars: GrammarEngine | None = None,
                 jump_forward: bool = True, ngram: NgramConfig | None = None,
                 draft: DraftModel | None = None) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        cfg = model.config
        self.attention = select_backend(device, cache.keys[0].dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                        cache.block_size, cfg.sliding_window, cfg.attention_softcap)
        # Gemma 3's sliding-window layers: each window's own backend, whose metadata rides along
        # with the step's (``AttentionMetadata.windowed``).
        self.windowed = {w: select_backend(device, cache.keys[0].dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                           cache.block_size, w, cfg.attention_softcap)
                         for w in sorted(set(cfg.layer_windows) - {0})}
        self.seqs: dict[int, SequenceState] = {}
        max_blocks = -(-max_model_len // cache.block_size)
        self.batch = InputBatch(max_num_seqs, max_blocks, pin_memory=device.type == "cuda")
        self.grammars = grammars  # structured output (None: the model's requests are never constrained)
        self.jump_forward = jump_forward
        self.num_jumped = 0  # tokens appended by jump-forward, without a forward pass of their own
        self.sampler = Sampler(device, eos_token_ids, seed, grammars)
        self.copier = HostCopier(device, max_num_seqs)
        self.swap_space = SwapSpace(cache)
        self.finalize_lag = (1 if self.copier.asynchronous else 0) if finalize_lag is None else finalize_lag
        self.plan_id: int | None = None  # the plan being executed
        self.cancelled: set[int] = set()  # its rows that stop at the next step
        self.cancels_ahead: dict[int, set[int]] = {}  # for plans received but not started
        self.threads: ThreadPlan | None = None  # CPU threads per step size (worker.cpu_threads)
        # Speculative decoding's proposer (both None: off): prompt lookup, or a draft model.
        self.ngram = ngram
        self.draft = draft
        self.drafting = False  # the plan in progress verifies proposals (``StepPlan.num_draft_tokens``)

    def reset(self) -> int:
        """Forget every request (a new scheduler knows none of them); returns how many."""
        dropped = len(self.seqs)
        for rid in list(self.seqs):
            self.forget(rid)
        self.cancelled = set()
        self.cancels_ahead.clear()
        return dropped

    def cancel(self, msg: CancelRows) -> None:
        """Take rows out of the plan in progress from its next step; with ``forget``, also drop
        their state (an abort). A cancel for a plan already over only forgets."""
        if msg.plan_id == self.plan_id:
            self.cancelled.update(msg.rids)
        elif self.plan_id is None or msg.plan_id > self.plan_id:
            self.cancels_ahead.setdefault(msg.plan_id, set()).update(msg.rids)
        if msg.forget:
            for rid in msg.rids:
                self.forget(rid)

    def forget(self, rid: int) -> None:
        """Drop a request's state and free its slot in the input batch; rows of a plan in
        progress that hold it see it stopped."""
        seq = self.seqs.pop(rid, None)
        if seq is not None:
            seq.stopped = True
        self.batch.remove(rid)
        self.sampler.forget(rid)
        if self.draft is not None:
            self.draft.forget(rid)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> Iterator[StepTokens]:
        """Run ``plan``; yields one ``StepTokens`` per step that sampled, exactly one of them
        ``last``, and it is the final one (a plan that samples nothing yields one empty ``last``).

        ``busy_s`` counts the worker's own time (input building, forward, sampling, reading
        ids), not the time the consumer holds the generator between messages."""
        resumed = time.perf_counter()
        self.plan_id, self.cancelled = plan.plan_id, self.cancels_ahead.pop(plan.plan_id, set())
        for stale in [p for p in self.cancels_ahead if p < plan.plan_id]:
            del self.cancels_ahead[stale]
        self._apply_deltas(plan)
        self.drafting = (self.ngram is not None or self.draft is not None) and plan.num_draft_tokens > 0
        batch = self._first_batch(plan)
        num_steps = max(1, plan.num_steps)
        in_flight: deque[LaunchedStep] = deque()
        step, ended = 0, False
        while batch is not None:
            final_step = step == num_steps - 1
            # A row held to a grammar needs its token on the host before the next step's mask; a
            # row that drafts, before its proposals.
            lag = 0 if final_step or self.drafting or any(seq.grammar is not None for seq in batch.samplers) \
                else self.finalize_lag
            launched = self._launch(step, batch)
            if launched is None:  # only prefill chunks that sample nothing
                break
            in_flight.append(launched)
            keep: list[int] = []
            while len(in_flight) > lag:
                msg = self._finalize(plan.plan_id, in_flight.popleft(), jump=lag == 0 and not final_step)
                if not in_flight:  # the newest step: first decide whether another follows
                    keep = [] if final_step else self._alive(launched)
                    msg.last = ended = not keep
                msg.busy_s = time.perf_counter() - resumed
                yield msg  # the caller may cancel rows here
                resumed = time.perf_counter()
            if in_flight and not final_step:
                keep = self._alive(launched)
            keep = [i for i in keep if self._runs_on(launched.samplers[i])]
            batch = self._decode_batch(launched, keep) if keep else None
            step += 1
        while in_flight:
            msg = self._finalize(plan.plan_id, in_flight.popleft())
            msg.last = ended = not in_flight
            msg.busy_s = time.perf_counter() - resumed
            yield msg
            resumed = time.perf_counter()
        if not ended:  # nothing sampled, or every row was cancelled after its last message
            yield StepTokens(plan.plan_id, step if step == 0 else step - 1, [], [], True,
                             time.perf_counter() - resumed)
        self.plan_id = None

    def _runs_on(self, seq: SequenceState) -> bool:
        return not seq.stopped and seq.rid not in self.cancelled

    def _alive(self, launched: LaunchedStep) -> list[int]:
        """Rows of ``launched`` that decode another step, as far as the host knows now."""
        return [i for i, seq in enumerate(launched.samplers) if self._runs_on(seq)
                and seq.num_computed < seq.window_end and not seq.surely_stops(self.max_model_len)]

    def _launch(self, step: int, batch: StepBatch) -> LaunchedStep | None:
        out = self._forward(batch)
        if out is None:
            return None
        for seq in batch.samplers:
            seq.num_in_flight += 1
        extras = out.logprobs.tensors() if out.logprobs is not None else None
        return LaunchedStep(step, batch.samplers, out.token_ids, self.copier.start(out.token_ids, extras), out.logprobs,
                            batch.expected)

    def _finalize(self, plan_id: int, launched: LaunchedStep, jump: bool = False) -> StepTokens:
        """Read a step's ids on the host and apply them: each row's token, unless the row had
        already stopped (a lagged step computed past its stop); stopped rows are forgotten.
        ``jump``: another step of the window may follow, so constrained rows may jump forward."""
        tokens = launched.copy.result()
        asked = launched.logprobs.by_row(launched.copy.extra_results()) if launched.logprobs is not None else None
        rids: list[int] = []
        kept: list[int] = []
        logprobs = []
        prompt_logprobs = []
        embeddings = []
        expected = launched.expected
        jumped = 0  # tokens jump-forward appended
        drafted_at: list[int] = []  # per draft position: proposals verified, and accepted
        accepted_at: list[int] = []
        if expected is not None:  # drafts verified, by row; how many were accepted; rows done
            verified = collections.Counter(seq.rid for seq, draft in zip(launched.samplers, expected, strict=True)
                                           if draft >= 0)
            accepted = dict.fromkeys(verified, 0)
            settled: set[int] = set()
        for i, (seq, token) in enumerate(zip(launched.samplers, tokens, strict=True)):
            if seq.stopped:
                continue
            if expected is not None:
                # A row's sample at each of its positions is what it would have sampled there
                # without drafts (the same logits, the same uniform): it goes out while the draft
                # before it was sampled too. The first that differs replaces its draft and ends
                # the row's step. For a random row this is the standard rejection rule for a
                # proposal that is one token for sure: accepted with its probability, else a
                # sample from the rest of the distribution.
                if seq.rid in settled:
                    continue
                if expected[i] == token:
                    accepted[seq.rid] += 1
                else:
                    settled.add(seq.rid)
            rids.append(seq.rid)
            kept.append(token)
            if asked is not None and i in asked:
                logprobs.append((seq.rid, asked[i]))
            if seq.prompt_logprobs:  # its first output: they go with it
                prompt_logprobs.append((seq.rid, seq.prompt_logprobs))
                seq.prompt_logprobs = []
            if seq.pooled is not None:  # an embedding row's one output: its vector goes with it
                embeddings.append((seq.rid, embedding_bytes(seq)))
                seq.pooled = None
            if seq.grammar is not None:
                seq.grammar.consume(token)
            if seq.append(token, self.eos_token_ids, self.max_model_len):
                self.forget(seq.rid)
            elif jump and seq.grammar is not None and self._jumps(seq) and (expected is None or seq.rid in settled):
                # (A drafting row jumps after its step's last token, the first that differs from
                # its draft; the positions its rejected drafts claimed keep the jump short.)
                for forced in seq.grammar.forced(seq.window_end - seq.num_computed - 1):
                    rids.append(seq.rid)
                    kept.append(forced)
                    jumped += 1
                    if seq.append(forced, self.eos_token_ids, self.max_model_len):
                        self.forget(seq.rid)
                        break
        self.num_jumped += jumped
        if expected is not None:
            for rid, num_drafts in verified.items():
                num_accepted = accepted[rid]
                _count_by_position(drafted_at, accepted_at, num_drafts, num_accepted)
                drafted = self.seqs.get(rid)
                if drafted is not None and not drafted.stopped:
                    drafted.settle_drafts(num_drafts, num_accepted)
        return StepTokens(plan_id, launched.step, rids, kept, False, 0.0, pack_logprobs(logprobs),
                          pack_prompt_logprobs(prompt_logprobs), pack_embeddings(embeddings), drafted_at, accepted_at,
                          jumped)

    def _jumps(self, seq: SequenceState) -> bool:
        """Whether a constrained row may jump forward: not when it asked for logprobs (a forced
        token has none sampled) or penalties (their counts follow sampled tokens only)."""
        return self.jump_forward and seq.sampling.logprobs is None and not seq.sampling.reads_history

    # ------------------------------------------------------------------ plan application

    def _apply_deltas(self, plan: StepPlan) -> None:
        for rid in plan.forget:
            self.forget(rid)
        for new in plan.new_requests:
            self.forget(new.rid)  # a request sent again (after a preemption) starts over
            seq = self.seqs[new.rid] = SequenceState.from_new(new)
            if new.sampling.grammar is not None:
                if self.grammars is None:
                    raise PlanError(f"rid {new.rid}: a constrained request, and no grammar engine")
                seq.grammar = self.grammars.start(new.sampling.grammar, seq.token_ids[seq.num_prompt_tokens :])
            self.batch.add(new.rid, new.sampling)
        # Block moves come before the forward pass that may read them, in the protocol's order.
        self.swap_space.swap_out(plan.swap_out)
        self.swap_space.swap_in(plan.swap_in)
        self.cache.copy_blocks(plan.copy_blocks)

    def _first_batch(self, plan: StepPlan) -> StepBatch | None:
        if not len(plan.rids) == len(plan.num_tokens) == len(plan.new_block_ids):
            raise PlanError(f"plan {plan.plan_id}: rids, num_tokens and new_block_ids differ in length")
        if len(set(plan.rids)) != len(plan.rids):
            raise PlanError(f"plan {plan.plan_id}: a request appears twice")
        rows = StepRows()
        drafting: list[tuple[int, SequenceState]] = []
        for rid, n, new_blocks in zip(plan.rids, plan.num_tokens, plan.new_block_ids, strict=True):
            seq = self.seqs.get(rid)
            if seq is None:
                if plan.speculative:
                    continue  # stopped or aborted after this plan was made
                raise PlanError(f"plan {plan.plan_id}: unknown rid {rid} (never sent, or forgotten)")
            self.batch.append_blocks(rid, new_blocks)  # the scheduler counts them as sent, run or not
            if plan.speculative and rid in self.cancelled:
                continue  # paused after this plan was made
            if seq.num_ahead and not plan.speculative:
                # Drafts accepted in the row's last step of an earlier plan: the scheduler, which
                # counts a step's tokens computed when the next step reports, asks for them again.
                skip = min(n, seq.num_ahead)
                seq.num_ahead -= skip
                n -= skip
                if not n:
                    continue
            start = seq.schedule(n, self.cache.block_size, self.batch.blocks_of(rid))
            if seq.sampling.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                rows.prompt = rows.prompt or PromptPositions()
                rows.prompt.add(seq, len(rows.ids), start, n)
            if seq.sampling.pooling is not None and start < seq.num_prompt_tokens:
                rows.pool = rows.pool or PoolPositions()
                rows.pool.add(seq, len(rows.ids), start, n)
            rows.add(seq, start, n)
            if seq.fully_computed:
                seq.window_end = self.batch.blocks_of(rid) * self.cache.block_size
                self._sample(rows, seq, n, drafting)
        if not rows.seqs:
            return None
        self._propose(rows, drafting)
        return rows.build()

    def _sample(self, rows: StepRows, seq: SequenceState, n: int, drafting: list[tuple[int, SequenceState]]) -> None:
        """``seq``, just added with its last ``n`` known tokens, samples at its last position;
        in a drafting plan, a row that decodes one token also verifies what is proposed after it
        (added to ``drafting``, proposed for once the step's rows are in)."""
        handle = rows.sample(seq)
        if self.drafting and n == 1:
            drafting.append((handle, seq))

    def _propose(self, rows: StepRows, drafting: list[tuple[int, SequenceState]]) -> None:
        """Speculative decoding: tokens proposed after each drafting row's last known one, which
        it computes this step (scheduled already), as many as its blocks and its length allow;
        a draft model guesses for all of them in one batch.

        A row held to a grammar proposes only what the grammar allows; at each position, its
        mask and its penalties follow the drafts before it (``_sampling_rows``)."""
        proposer = self.ngram or self.draft
        if proposer is None or not drafting:
            return
        wanted = []
        for handle, seq in drafting:
            limit = min(seq.draft_budget or proposer.num_tokens,
                        seq.window_end - seq.num_computed,  # the blocks the row holds in this plan
                        seq.sampling.max_tokens - seq.num_sampled - 1,  # (the step's own sample counts too)
                        self.max_model_len - seq.num_known - 1)
            if seq.num_outputs >= 1 and limit > 0:
                wanted.append((handle, seq, limit))
        if self.draft is not None:
            guesses = self.draft.propose([(seq, limit) for _, seq, limit in wanted], self.batch.table_of)
            # (A draft whose vocabulary is padded past the model's could guess an id it lacks.)
            vocab = self.model.config.vocab_size
            guesses = [list(itertools.takewhile(vocab.__gt__, g)) for g in guesses]
        else:
            assert self.ngram is not None
            guesses = []
            for _, seq, limit in wanted:
                if seq.ngrams is None:
                    seq.ngrams = NgramIndex(self.ngram)
                guesses.append(seq.ngrams.propose(seq.token_ids, limit))
        for (handle, seq, _), proposed in zip(wanted, guesses, strict=True):
            if seq.grammar is not None and proposed:
                proposed = seq.grammar.valid_prefix(proposed)
            if proposed:
                seq.claim_drafts(len(proposed), self.cache.block_size, self.batch.blocks_of(seq.rid))
                rows.propose(handle, proposed)

    def _decode_batch(self, prev: LaunchedStep, keep: list[int]) -> StepBatch:
        """The next multi-step step: rows ``keep`` of the previous step each compute the token
        they just sampled, taken from the device without a host round trip — or, when a row
        jumped forward or the plan drafts, every row its tokens from the host (which has them
        all: lag 0)."""
        seqs = [prev.samplers[i] for i in keep]
        if self.drafting:
            # (A drafting step lists a row once per position it sampled at.)
            return self._catch_up_batch(list({seq.rid: seq for seq in seqs}.values()))
        if any(seq.num_known - seq.num_computed > 1 for seq in seqs):
            return self._catch_up_batch(seqs)
        starts = [seq.schedule(1, self.cache.block_size, self.batch.blocks_of(seq.rid)) for seq in seqs]
        index = torch.tensor(keep, dtype=torch.long) if len(keep) < len(prev.samplers) else None
        return StepBatch(seqs, starts, [1] * len(seqs), seqs, list(range(len(seqs))), device_ids=prev.token_ids,
                         keep=index)

    def _catch_up_batch(self, seqs: list[SequenceState]) -> StepBatch:
        """A step in which each row computes all its tokens not yet computed (its sampled token,
        and those jump-forward appended after it) and samples at the last."""
        rows = StepRows()
        drafting: list[tuple[int, SequenceState]] = []
        for seq in seqs:
            if seq.num_in_flight:
                raise PlanError(f"rid {seq.rid}: jumped forward with a token still in flight")
            n = seq.num_known - seq.num_computed
            rows.add(seq, seq.schedule(n, self.cache.block_size, self.batch.blocks_of(seq.rid)), n)
            self._sample(rows, seq, n, drafting)
        self._propose(rows, drafting)
        return rows.build()

    # ------------------------------------------------------------------ one step

    def _sampling_rows(self, batch: StepBatch) -> list[SamplingRow]:
        """What each sampler row samples by. In a drafting step, a row at a proposed token's
        position samples as if the proposals before it were its outputs: its grammar's mask after
        them, and for the penalties its history with them. The penalty counts of a request that
        proposes are built from its history at that step (rows the sampler does not keep: which of
        its proposals become outputs is known only once the step is read)."""
        if batch.offsets is None:
            return [SamplingRow(s.sampling, s.num_sampled, s.token_ids, s.num_prompt_tokens, s.rid, s.grammar)
                    if s.sampling.reads_history else SamplingRow(s.sampling, s.num_sampled, grammar=s.grammar)
                    for s in batch.samplers]
        rows = []
        samplers, offsets = batch.samplers, batch.offsets
        for i, (s, offset) in enumerate(zip(samplers, offsets, strict=True)):
            drafts = _drafts_before(batch, i, offset)
            after = drafts if s.grammar is not None else ()
            if s.sampling.reads_history:
                drafted = offset > 0 or (i + 1 < len(offsets) and offsets[i + 1] > 0)
                if not drafted:  # this step it proposed nothing: as in a plain step
                    rows.append(SamplingRow(s.sampling, s.num_sampled, s.token_ids, s.num_prompt_tokens, s.rid,
                                            s.grammar))
                    continue
                if offset == 0:
                    self.sampler.forget(s.rid)  # counts kept from earlier steps: rebuilt when next kept
                rows.append(SamplingRow(s.sampling, s.num_sampled + offset, [*s.token_ids, *drafts],
                                        s.num_prompt_tokens, None, s.grammar, after))
            else:
                rows.append(SamplingRow(s.sampling, s.num_sampled + offset, grammar=s.grammar, grammar_drafts=after))
        return rows

    def _forward(self, batch: StepBatch) -> SamplerOutput | None:
        """Build the step's inputs on the host, send them in one copy, run the model, sample."""
        if self.threads is not None:
            self.threads.apply(sum(batch.lengths))
        tables, params = self.batch.gather([s.rid for s in batch.seqs], [s.rid for s in batch.samplers])
        group = self.model.group
        # Under tensor parallelism rank 0 alone samples: the others prepare nothing of it (no
        # grammar masks, no penalty histories) and take its ids.
        samples_here = group is None or group.rank == 0
        sampling = self.sampler.prepare(self._sampling_rows(batch), params) \
            if batch.samplers and samples_here else None
        ids = batch.host_ids if batch.host_ids is not None else batch.keep
        host = ([ids] if ids is not None else []) + (sampling.tensors() if sampling is not None else [])
        prompt = batch.prompt
        logits_indices = batch.logits_indices if prompt is None else batch.logits_indices + prompt.indices
        meta = self.attention.build(self.cache, tables, batch.starts, batch.lengths, logits_indices, host)
        for window, backend in self.windowed.items():
            meta.windowed[window] = backend.build(self.cache, tables, batch.starts, batch.lengths, logits_indices)
        rotary = self.model.rotary
        if rotary.long_offset:  # LongRoPE: requests with long prompts read the long table
            offsets = [rotary.long_offset if s.num_prompt_tokens > rotary.long_after else 0 for s in batch.seqs]
            if any(offsets):
                meta.rope_offsets = torch.tensor(offsets).repeat_interleave(torch.tensor(batch.lengths)).to(
                    meta.positions.device)
        moved = meta.extra
        if batch.host_ids is not None:
            input_ids, moved = moved[0], moved[1:]
        else:
            assert batch.device_ids is not None
            input_ids = batch.device_ids
            if batch.keep is not None:
                input_ids, moved = input_ids[moved[0]], moved[1:]
        pool = batch.pool
        hidden_rows = torch.tensor(pool.indices, device=input_ids.device) if pool is not None and pool.indices else None
        logits = self.model(input_ids, meta, hidden_rows)
        if hidden_rows is not None:
            assert pool is not None and self.model.hidden is not None
            pool.pool(self.model.hidden)
            self.model.hidden = None
        if prompt is not None and logits is not None:  # (on rank 0 alone under tensor parallelism)
            num_samplers = len(batch.samplers)
            _score_prompt(prompt, logits[num_samplers:])
            logits = logits[:num_samplers]
        if not batch.samplers:
            return None
        if group is None:
            assert logits is not None and sampling is not None
            return self.sampler(logits, sampling.moved(moved))
        # Tensor parallel: rank 0 samples (it alone has the logits) and hands every rank the ids,
        # the next step's input; the others need no logprobs, they send nothing.
        if logits is not None:
            assert sampling is not None
            out = self.sampler(logits, sampling.moved(moved))
        else:
            out = SamplerOutput(torch.empty(len(batch.samplers), dtype=torch.long, device=self.device), None)
        group.broadcast_tokens(out.token_ids)
        return out


def _drafts_before(batch: StepBatch, i: int, offset: int) -> tuple[int, ...]:
    """The proposed tokens before sampler ``i``'s position, ``offset`` past its row's next."""
    if not offset:
        return ()
    assert batch.expected is not None
    return tuple(batch.expected[i - offset : i])


def _count_by_position(drafted_at: list[int], accepted_at: list[int], num_drafts: int, num_accepted: int) -> None:
    """A row's verified drafts, and the first ``num_accepted`` of them accepted, into the
    step's counts per draft position."""
    if len(drafted_at) < num_drafts:
        drafted_at.extend([0] * (num_drafts - len(drafted_at)))
        accepted_at.extend([0] * (num_drafts - len(accepted_at)))
    for j in range(num_drafts):
        drafted_at[j] += 1
        accepted_at[j] += j < num_accepted


SCORE_ROWS = 256  # prompt positions scored at once: a slice of log-softmax, not one per position of the chunk


def _score_prompt(prompt: PromptPositions, logits: torch.Tensor) -> None:
    """Each prompt position's logprob of the token after it, that token's rank, and its row's
    ``prompt_logprobs`` most likely alternatives, appended to its sequence (raw logprobs, as
    sampled tokens' are). Read on the host at once: only scoring requests ask for them, and a
    step that does waits for its copy."""
    targets = torch.tensor(prompt.targets, dtype=torch.long, device=logits.device)
    most = min(max(int(seq.sampling.prompt_logprobs or 0) for seq in prompt.seqs), logits.shape[-1])
    chosen: list[float] = []
    ranks: list[int] = []
    top_logprobs: list[list[float]] = []
    top_ids: list[list[int]] = []
    for first in range(0, len(targets), SCORE_ROWS):
        logprobs = logits[first : first + SCORE_ROWS].log_softmax(dim=-1)  # (float32: the model gives them so)
        picked = logprobs.gather(1, targets[first : first + SCORE_ROWS].unsqueeze(1))
        chosen += picked.squeeze(1).tolist()
        ranks += ((logprobs > picked).sum(dim=-1, dtype=torch.int32) + 1).tolist()  # (int32: half the time)
        if most:
            top = logprobs.topk(most, dim=-1)
            top_logprobs += top.values.tolist()
            top_ids += top.indices.tolist()
    first = 0
    for seq, count in zip(prompt.seqs, prompt.counts, strict=True):
        k = int(seq.sampling.prompt_logprobs or 0)
        seq.prompt_logprobs.extend(
            (chosen[i], ranks[i], top_ids[i][:k] if k else [], top_logprobs[i][:k] if k else [])
            for i in range(first, first + count))
        first += count
