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
yet (a whole prompt the first time), then decode greedily, one step per proposed token.

The draft's KV only ever affects which tokens are proposed, never which are kept: the target
verifies every one. So where the draft's cache cannot follow the target's (blocks swapped
out and back, or copied for a fork), the draft starts the request over rather than trust it.
"""

from __future__ import annotations

import itertools
import logging

from protocol.messages import NewRequest, SamplingParams, StepPlan
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

    def propose(self, seq: SequenceState, limit: int, table: list[int]) -> list[int]:
        """Up to ``limit`` tokens the draft model would write after ``seq``'s known tokens
        (greedy), within the blocks of ``table`` (the target's block ids for the request)."""
        rid, tokens = seq.rid, seq.token_ids
        # (A draft model shorter than the target proposes nothing past its own length.)
        limit = min(limit, self.num_tokens, self.runner.max_model_len - len(tokens))
        if limit <= 0:
            return []
        draft = self.runner.seqs.get(rid)
        sent = self._sent.get(rid)
        new: list[NewRequest] = []
        if draft is None or sent is None or table[: len(sent)] != sent:
            self.forget(rid)  # (its blocks moved: start over)
            params = SamplingParams(max_tokens=self.runner.max_model_len, temperature=0.0, ignore_eos=True)
            new.append(NewRequest(rid, list(tokens), len(tokens), params))
            sent, computed = [], 0
        else:
            draft.rewind(tokens)
            computed = draft.num_computed
        plan = StepPlan(next(self._plan_ids), new, [rid], [len(tokens) - computed], [table[len(sent):]],
                        num_steps=limit)
        self._sent[rid] = list(table)
        proposed = [token for msg in self.runner.execute(plan) for r, token in zip(msg.rids, msg.token_ids,
                                                                                 strict=True) if r == rid]
        return proposed[:limit]

    def forget(self, rid: int) -> None:
        self.runner.forget(rid)
        self._sent.pop(rid, None)

    def reset(self) -> None:
        """Every request starts over (its blocks were moved or the target forgot them all)."""
        for rid in list(self._sent):
            self.forget(rid)
