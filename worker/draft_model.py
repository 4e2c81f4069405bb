"""A draft model's proposals for speculative decoding (``--speculative-model``): a smaller model
with the same tokenizer guesses a request's next tokens greedily, and the target verifies them
in one forward pass (``worker/runner.py``), as it verifies prompt lookup's.

The draft is a model Sluice serves, run by its own ``ModelRunner`` in the same worker, on a KV
cache of its own with as many blocks as the target's. A request's draft KV lives at the same
block ids as its target KV: the scheduler's blocks for the request, reserved for its proposals
too, hold both, each in its own cache. The draft keeps its own copy of each drafting request
(its tokens and how many of them its cache holds) and, before proposing, takes the target's
tokens: what it had computed of a proposal the target rejected is written over, what the
target accepted is kept. A proposal is one draft plan: compute the tokens the draft has not seen
yet (a whole prompt the first time), then decode greedily, one step per proposed token; the
requests of a target step propose together, in one plan of the draft's.

The draft's KV only ever affects which tokens are proposed, never which are kept: the target
verifies every one. So where the draft's cache cannot follow the target's (blocks swapped
out and back, or copied for a fork), the draft starts the request over rather than trust it.
"""

from __future__ import annotations

import itertools
import logging

from protocol.messages import CancelRows, NewRequest, SamplingParams, StepPlan
from worker.runner import ModelRunner
from worker.sequence import SequenceState

log = logging.getLogger("sluice.worker")


class DraftModel:
    """Proposals from ``runner`` (the draft model's own runner, whose cache has the target's
    number of blocks and block size)."""

    def __init__(self, runner: ModelRunner, num_tokens: int) -> None:
        self.runner = runner
        self.num_tokens = num_tokens  # most tokens proposed per step
        self._sent: dict[int, list[int]] = {}  # rid -> the target's blocks the draft's copy holds
        self._plan_ids = itertools.count(1)

    def propose(self, requests: list[tuple[SequenceState, int, list[int]]]) -> list[list[int]]:
        """For each (request, limit, table): up to ``limit`` tokens the draft model would write
        after the request's known tokens (greedy), within the blocks of ``table`` (the target's
        block ids for it). One plan of the draft's for all of them: its first step computes what
        each has not seen, the next ones decode; a request leaves it once it has its tokens."""
        rids: list[int] = []
        num_tokens: list[int] = []
        new_blocks: list[list[int]] = []
        new: list[NewRequest] = []
        limits: dict[int, int] = {}
        for seq, limit, table in requests:
            rid, tokens = seq.rid, seq.token_ids
            # (A draft model shorter than the target proposes nothing past its own length.)
            limit = min(limit, self.num_tokens, self.runner.max_model_len - len(tokens))
            if limit <= 0:
                continue
            draft = self.runner.seqs.get(rid)
            sent = self._sent.get(rid)
            if draft is None or sent is None or table[: len(sent)] != sent:
                self.forget(rid)  # (new, or its blocks moved: start over)
                params = SamplingParams(max_tokens=self.runner.max_model_len, temperature=0.0, ignore_eos=True)
                new.append(NewRequest(rid, list(tokens), len(tokens), params))
                sent, computed = [], 0
            else:
                draft.rewind(tokens)
                computed = draft.num_computed
            rids.append(rid)
            num_tokens.append(len(tokens) - computed)
            new_blocks.append(table[len(sent):])
            self._sent[rid] = list(table)
            limits[rid] = limit
        guesses: dict[int, list[int]] = {rid: [] for rid in rids}
        if rids:
            plan = StepPlan(next(self._plan_ids), new, rids, num_tokens, new_blocks, num_steps=max(limits.values()))
            for msg in self.runner.execute(plan):
                done = []
                for rid, token in zip(msg.rids, msg.token_ids, strict=True):
                    guessed = guesses[rid]
                    if len(guessed) < limits[rid]:
                        guessed.append(token)
                        if len(guessed) == limits[rid]:
                            done.append(rid)
                if done and not msg.last:
                    self.runner.cancel(CancelRows(plan.plan_id, done))
        return [guesses.get(seq.rid, []) for seq, _, _ in requests]

    def forget(self, rid: int) -> None:
        self.runner.forget(rid)
        self._sent.pop(rid, None)

    def reset(self) -> None:
        """Every request starts over (its blocks were moved or the target forgot them all)."""
        for rid in list(self._sent):
            self.forget(rid)
