"""The worker's record of one request: what it knows, what it has computed, where its KV lives.

Created from a ``NewRequest`` (the prompt, or everything known after a preemption) and changed
only through the methods here, following the scheduler's plans. The stop rule is
``protocol/stop.py``'s, which the scheduler applies too: both sides must agree on when a
request ends.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from protocol.messages import NewRequest, PromptLogprob, SamplingParams
from protocol.stop import length_reached, stop_reason

if TYPE_CHECKING:
    import torch

    from worker.ngram import NgramIndex
    from worker.structured import GrammarState


class PlanError(RuntimeError):
    """A plan the worker cannot follow (unknown request, blocks that do not cover the tokens):
    a scheduler bug, reported as one line rather than as silently wrong attention."""


@dataclasses.dataclass
class SequenceState:
    rid: int
    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int
    sampling: SamplingParams
    num_computed: int = 0  # tokens whose KV is in the cache (its blocks: the runner's input batch)
    # Tokens sampled on the device whose ids have not reached the host yet (multi-step with a
    # copy in flight). They count as known for scheduling: the device feeds them forward itself.
    num_in_flight: int = 0
    stopped: bool = False
    grammar: GrammarState | None = None  # structured output: its matcher (``worker/structured.py``)
    # Where the blocks it holds in the plan in progress end: jump-forward appends no more tokens
    # than they can hold, and a row whose blocks are full leaves its window. (Without jumps, the
    # scheduler's lookahead blocks always reach past the window's last step.)
    window_end: int = 0
    # Prompt logprobs computed so far (``sampling.prompt_logprobs``), chunk by chunk: entry i for
    # prompt token i + 1. They leave with the first output token.
    prompt_logprobs: list[PromptLogprob] = dataclasses.field(default_factory=list)
    # An embedding request's pooled final hidden states so far (``worker/pooling.py``): their
    # sum over ``num_pooled`` positions (mean), or the last position's (last).
    pooled: torch.Tensor | None = None
    num_pooled: int = 0
    # Speculative decoding: the n-gram index its proposals come from (made at its first), and
    # how many of its computed tokens the scheduler does not count as computed yet: drafts its
    # latest step verified and accepted, which the scheduler learns were computed only from the
    # row's next step (so a plan of its own asks for them again, ``ModelRunner._first_batch``).
    ngrams: NgramIndex | None = None
    num_ahead: int = 0
    # How many tokens its next proposal may hold (None: as many as the proposer's most): one
    # more than its last step accepted, or twice as many as it proposed when all were accepted.
    # A draft's verification costs a row's compute; text that stops following its input should
    # not pay for long proposals, nor text that quotes it be held to short ones.
    draft_budget: int | None = None

    @classmethod
    def from_new(cls, new: NewRequest) -> SequenceState:
        return cls(new.rid, list(new.token_ids), new.num_prompt_tokens, new.sampling, new.num_computed)

    @property
    def num_outputs(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_known(self) -> int:
        """Tokens the sequence has, on the host or still in flight from the device."""
        return len(self.token_ids) + self.num_in_flight

    @property
    def num_sampled(self) -> int:
        """Outputs sampled so far, in flight included: the index of the next token sampled."""
        return self.num_known - self.num_prompt_tokens

    @property
    def fully_computed(self) -> bool:
        """Every known token has its KV: the next forward's last logits sample a new token."""
        return self.num_computed == self.num_known

    def surely_stops(self, max_model_len: int) -> bool:
        """Stops with its newest sampled token whatever that token is (max_tokens or the model
        length): decidable without waiting for in-flight ids."""
        return length_reached(self.num_sampled, self.num_known, self.sampling, max_model_len)

    def schedule(self, num_tokens: int, block_size: int, num_blocks: int) -> int:
        """Claim the next ``num_tokens`` tokens for computation, the sequence holding
        ``num_blocks`` blocks; returns their first position."""
        start = self.num_computed
        end = start + num_tokens
        if num_tokens < 1 or end > self.num_known:
            raise PlanError(f"rid {self.rid}: cannot compute {num_tokens} tokens from position {start} "
                            f"of {self.num_known} known")
        if end > num_blocks * block_size:
            raise PlanError(f"rid {self.rid}: position {end - 1} lies beyond its {num_blocks} blocks")
        self.num_computed = end
        self.num_ahead = 0  # the step reports: the scheduler then counts what came before as computed
        return start

    def claim_drafts(self, num_drafts: int, block_size: int, num_blocks: int) -> None:
        """Claim the positions of ``num_drafts`` proposed tokens after the last known one, which
        the step computes with them (its KV written, its logits verifying them); ``settle_drafts``
        gives back the positions of those rejected once the step's tokens are known."""
        end = self.num_computed + num_drafts
        if self.num_computed != self.num_known:
            raise PlanError(f"rid {self.rid}: drafts after position {self.num_computed}, of {self.num_known} known")
        if end > num_blocks * block_size:
            raise PlanError(f"rid {self.rid}: draft position {end - 1} lies beyond its {num_blocks} blocks")
        self.num_computed = end

    def settle_drafts(self, num_drafts: int, num_accepted: int) -> None:
        """After a step verified ``num_drafts`` drafts of which the first ``num_accepted`` were
        sampled too (and appended): only those, and the token before them, hold their KV."""
        self.num_computed -= num_drafts - num_accepted
        self.num_in_flight = 0
        self.num_ahead = num_accepted
        self.draft_budget = 2 * num_drafts if num_accepted == num_drafts else num_accepted + 1

    def rewind(self, token_ids: list[int]) -> None:
        """A draft model's copy of a request takes the target's tokens (``worker/draft_model.py``):
        its KV holds only the positions where its tokens and these agree, written over from there."""
        common = 0
        for mine, theirs in zip(self.token_ids, token_ids, strict=False):
            if mine != theirs:
                break
            common += 1
        self.token_ids = list(token_ids)
        self.num_computed = min(self.num_computed, common, len(token_ids) - 1)
        self.num_in_flight = 0
        self.num_ahead = 0

    def append(self, token: int, eos_token_ids: tuple[int, ...], max_model_len: int) -> bool:
        """Add a sampled token that reached the host; True when the request stops with it (the
        token itself counts)."""
        self.num_in_flight = max(0, self.num_in_flight - 1)
        self.token_ids.append(token)
        return stop_reason(token, self.num_outputs, len(self.token_ids), self.sampling,
                           eos_token_ids, max_model_len) is not None
