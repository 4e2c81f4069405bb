"""A draft model's proposals for speculative decoding (``--speculative-model``): a smaller model
with the same tokenizer guesses a request's next tokens greedily, and the target verifies them
in one forward pass (``worker/runner.py``), as it verifies prompt lookup's.

The draft is a model Sluice serves, run by its own ``ModelRunner`` in the same worker, on a KV
cache of its own with as many blocks as the target's. A request's draft KV lives at the same
block ids as its target KV: the scheduler's blocks for the request, reserved for its proposals
too, hold both, each in its own cache. The draft keeps its own copy of each drafting request
(its tokens and how many of them its cache holds) and, before proposing, takes the target's
tokens: what it had computed of a proposal the target rejected is written over, what the
target accepted is kept. A request the target forgets (finished, preempted: a preempted one
comes back as a new request, in new blocks) the draft forgets too.

The requests of a target step propose together, in one plan of the draft's: its first step
computes what each has not seen, the next ones decode greedily, one step per proposed token,
and a request leaves that plan once it has its guesses. What a request has not seen is at
first its whole prompt: at most ``catch_up`` tokens of such prompts are computed per target
step (the scheduler's token budget), a long one over several steps, proposing nothing until it
has caught up, so that no step stalls on a draft's prefill.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from protocol.messages import CancelRows, NewRequest, SamplingParams, StepPlan
from worker.runner import ModelRunner
from worker.sequence import SequenceState

# The target's block ids of a request from the n-th on: ``InputBatch.table_of``.
BlocksOf = Callable[[int, int], list[int]]


class DraftModel:
    """Proposals from ``runner`` (the draft model's own runner, whose cache has the target's
    number of blocks and block size)."""

    def __init__(self, runner: ModelRunner, num_tokens: int, catch_up: int) -> None:
        self.runner = runner
        self.num_tokens = num_tokens  # most tokens proposed per step
        self.catch_up = catch_up  # most tokens a target step's proposals compute before they decode
        self._plan_ids = itertools.count(1)

    def propose(self, requests: list[tuple[SequenceState, int]], blocks_of: BlocksOf) -> list[list[int]]:
        """For each (request, limit): up to ``limit`` tokens the draft model would write after
        the request's known tokens (greedy), or none while it catches up on them."""
        rids: list[int] = []
        num_tokens: list[int] = []
        new_blocks: list[list[int]] = []
        new: list[NewRequest] = []
        limits: dict[int, int] = {}
        budget = self.catch_up
        for seq, limit in requests:
            rid, tokens = seq.rid, seq.token_ids
            # (A draft model shorter than the target proposes nothing past its own length.)
            limit = min(limit, self.num_tokens, self.runner.max_model_len - len(tokens))
            if limit <= 0:
                continue
            draft = self.runner.seqs.get(rid)
            if draft is not None:
                draft.rewind(tokens)
            unseen = len(tokens) - (draft.num_computed if draft is not None else 0)
            if unseen > 1:  # (one token, the target's last sample, is every step's)
                if budget <= 0:
                    continue
                if unseen > budget:  # a chunk of it this step, no proposal yet
                    unseen, limit = budget, 0
                budget -= unseen
            if draft is None:
                params = SamplingParams(max_tokens=self.runner.max_model_len, temperature=0.0, ignore_eos=True)
                new.append(NewRequest(rid, list(tokens), len(tokens), params))
            # The target's blocks the draft's copy does not hold yet (its own input batch counts them).
            new_blocks.append(blocks_of(rid, self.runner.batch.blocks_of(rid) if draft is not None else 0))
            rids.append(rid)
            num_tokens.append(unseen)
            limits[rid] = limit
        guesses: dict[int, list[int]] = {rid: [] for rid in rids}
        if rids:
            plan = StepPlan(next(self._plan_ids), new, rids, num_tokens, new_blocks,
                            num_steps=max(1, *limits.values()))
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
        return [guesses.get(seq.rid, []) for seq, _ in requests]

    def forget(self, rid: int) -> None:
        self.runner.forget(rid)
