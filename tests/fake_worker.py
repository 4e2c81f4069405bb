"""A stand-in for the worker's plan semantics, for scheduler unit tests (no torch).

It keeps each request's tokens and computed count exactly as ``worker.runner`` does, and samples
``token_for(rid, output_index)``; it stops requests by the worker's rule (``protocol/stop.py``).
A constrained request (its ``SamplingParams.grammar`` set, whatever it says) jumps forward as
the runner does: after a sampled token, ``jump_for(rid, output_index)`` more tokens (each
``token_for``'s), as far as its blocks reach, when another step of the window follows; the next
step computes them all.
In a plan with ``num_draft_tokens`` (speculative decoding), an unconstrained row that decodes
one token verifies as many drafts as its blocks hold, writing each draft's KV, and accepts
``accept_for(rid, output_index)`` of them (at most all) before its sampled token, as the runner
does: the rejected drafts' slots are left holding garbage (-1), which the content checks catch
if anything reads them; accepted drafts count as computed from then on, which the scheduler
learns from the row's next step (``ahead``).
Its "KV cache" stores, per slot, the token id written there, and swaps and copies move those:
every computation first checks that the context it would attend to holds exactly the request's
tokens, so prefix sharing, copy-on-write, swap and preemption bookkeeping are verified by
content, not by counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from protocol.messages import Finish, SamplingParams, StepPlan, StepTokens
from protocol.stop import stop_reason

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler


@dataclasses.dataclass
class _Seq:
    tokens: list[int]
    num_prompt: int
    sampling: SamplingParams
    computed: int = 0
    blocks: list[int] = dataclasses.field(default_factory=list)
    ahead: int = 0  # accepted drafts of its last step, which the scheduler does not count yet


class FakeWorker:
    def __init__(self, block_size: int, eos: int = 2, max_model_len: int = 10**9,
                 token_for: Callable[[int, int], int] | None = None,
                 jump_for: Callable[[int, int], int] | None = None,
                 accept_for: Callable[[int, int], int] | None = None) -> None:
        self.block_size = block_size
        self.eos = eos
        self.max_model_len = max_model_len
        self.token_for = token_for or (lambda rid, i: 100 + (rid * 7 + i) % 50)
        self.jump_for = jump_for or (lambda rid, i: (rid + i) % 4)
        self.accept_for = accept_for or (lambda rid, i: (rid * 3 + i) % 5)
        self.seqs: dict[int, _Seq] = {}
        self.device: dict[int, int] = {}  # slot -> token id whose KV is there
        self.host: dict[int, int] = {}

    def _slot(self, seq: _Seq, pos: int) -> int:
        return seq.blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def _compute(self, rid: int, seq: _Seq, start: int, n: int) -> None:
        """Attend to positions [0, start) and write KV for [start, start + n)."""
        if start + n > len(seq.blocks) * self.block_size:
            raise AssertionError(f"rid {rid}: writes position {start + n - 1} beyond its {len(seq.blocks)} blocks")
        for pos in range(start):
            got = self.device.get(self._slot(seq, pos))
            if got != seq.tokens[pos]:
                raise AssertionError(f"rid {rid}: position {pos} holds KV of {got}, expected {seq.tokens[pos]}")
        for pos in range(start, start + n):
            self.device[self._slot(seq, pos)] = seq.tokens[pos]

    def _move(self, src: dict[int, int], dst: dict[int, int], pairs: list[tuple[int, int]]) -> None:
        bs = self.block_size
        for a, b in pairs:
            for off in range(bs):
                if a * bs + off in src:
                    dst[b * bs + off] = src[a * bs + off]
                else:
                    dst.pop(b * bs + off, None)

    def _stopped(self, s: _Seq) -> bool:
        return stop_reason(s.tokens[-1], len(s.tokens) - s.num_prompt, len(s.tokens), s.sampling,
                           (self.eos,), self.max_model_len) is not None

    def run(self, plan: StepPlan, cancel_after: dict[int, int] | None = None,
            forget: frozenset[int] = frozenset()) -> list[StepTokens]:
        """``cancel_after[rid] = k``: a ``CancelRows`` for rid reached the worker after step k
        (k = -1: before the plan started; a speculative plan then skips the row, as the worker
        does). ``forget``: those cancels were aborts, so the rows' state goes once they stop."""
        cancel_after = cancel_after or {}
        for rid in plan.forget:
            self.seqs.pop(rid, None)
        for new in plan.new_requests:
            self.seqs[new.rid] = _Seq(list(new.token_ids), new.num_prompt_tokens, new.sampling, new.num_computed)
        self._move(self.device, self.host, plan.swap_out)
        self._move(self.host, self.device, plan.swap_in)
        self._move(dict(self.device), self.device, plan.copy_blocks)
        active = []
        for rid, n, blocks in zip(plan.rids, plan.num_tokens, plan.new_block_ids, strict=True):
            if plan.speculative and rid not in self.seqs:
                continue  # stopped after the plan was made
            s = self.seqs[rid]
            s.blocks += blocks
            if plan.speculative and cancel_after.get(rid, 0) < 0:
                continue  # paused after the plan was made
            if s.ahead and not plan.speculative:  # the scheduler asks again for drafts computed
                skip = min(n, s.ahead)
                s.ahead -= skip
                n -= skip
                if not n:
                    continue
            s.ahead = 0
            self._compute(rid, s, s.computed, n)
            s.computed += n
            if s.computed > len(s.tokens):
                raise AssertionError(f"rid {rid}: asked to compute past its tokens")
            if s.computed == len(s.tokens):
                active.append(rid)
        out = []
        for step in range(plan.num_steps):
            if step > 0:
                for rid in active:  # the token sampled last step, and any jumped to after it
                    s = self.seqs[rid]
                    n = len(s.tokens) - s.computed
                    self._compute(rid, s, s.computed, n)
                    s.computed += n
                    s.ahead = 0
            rids: list[int] = []
            tokens: list[int] = []
            jumped = 0
            for rid in active:
                s = self.seqs[rid]
                if plan.num_draft_tokens and s.sampling.grammar is None and len(s.tokens) > s.num_prompt:
                    self._draft(rid, s, plan.num_draft_tokens, rids, tokens)
                    continue
                jump = self.jump_for(rid, len(s.tokens) - s.num_prompt) if s.sampling.grammar is not None else 0
                room = len(s.blocks) * self.block_size - s.computed - 1
                for j in range(1 + (min(jump, room) if step < plan.num_steps - 1 else 0)):
                    jumped += j > 0
                    rids.append(rid)
                    tokens.append(self.token_for(rid, len(s.tokens) - s.num_prompt))
                    s.tokens.append(tokens[-1])
                    if self._stopped(s):
                        break
            still = [rid for rid in active
                     if not self._stopped(self.seqs[rid]) and cancel_after.get(rid, plan.num_steps) > step
                     and self.seqs[rid].computed < len(self.seqs[rid].blocks) * self.block_size]
            for rid in active:
                if self._stopped(self.seqs[rid]):
                    del self.seqs[rid]
            last = step == plan.num_steps - 1 or not still
            out.append(StepTokens(plan.plan_id, step, rids, tokens, last, jumped=jumped))
            if last:
                break
            active = still
        if not out:
            out.append(StepTokens(plan.plan_id, 0, [], [], True))
        for rid in forget:
            self.seqs.pop(rid, None)
        return out


    def _draft(self, rid: int, s: _Seq, most: int, rids: list[int], tokens: list[int]) -> None:
        """A drafting row's step: drafts written after its last token (computed just now),
        ``accept_for`` of them kept, then its sampled token."""
        drafts = min(most, len(s.blocks) * self.block_size - s.computed)
        keep = min(drafts, self.accept_for(rid, len(s.tokens) - s.num_prompt))
        for j in range(drafts):  # accepted drafts are the tokens that follow; rejected, garbage
            token = self.token_for(rid, len(s.tokens) - s.num_prompt + j) if j < keep else -1
            self.device[self._slot(s, s.computed + j)] = token
        accepted = 0
        for j in range(keep + 1):
            rids.append(rid)
            tokens.append(self.token_for(rid, len(s.tokens) - s.num_prompt))
            s.tokens.append(tokens[-1])
            if self._stopped(s):
                return
            accepted += j < keep
        s.computed += accepted
        s.ahead = accepted


def run_window(sched: Scheduler, worker: FakeWorker, plan: StepPlan, ahead: StepPlan | None,
               cancel: tuple[int, str, int] | None) -> list[Finish]:
    """Run ``plan``, then ``ahead`` (the window planned behind it, or None), feeding the tokens
    back as the scheduler process does. ``cancel = (row, "abort" | "pause", k)``: that row is
    aborted or paused now and the worker hears of it after step k (``ahead`` skips it). Returns
    every finish, the abort's included."""
    finishes: list[Finish] = []
    cancel_after: dict[int, int] = {}
    forget: frozenset[int] = frozenset()
    if cancel is not None and plan.rids:
        row, kind, at = cancel
        rid = plan.rids[row % len(plan.rids)]
        if kind == "abort":
            f = sched.abort(rid)
            if f is not None:
                finishes.append(f)
                forget = frozenset([rid])
        else:
            sched.pause(rid)
        cancel_after[rid] = at
    for out in worker.run(plan, cancel_after, forget):  # raises if a write falls outside the block table
        finishes += sched.update(out).finished
    if ahead is not None:
        for out in worker.run(ahead, {rid: -1 for rid in cancel_after}, forget):
            finishes += sched.update(out).finished
    return finishes
