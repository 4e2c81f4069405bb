"""What one forward pass computes (``StepBatch``), and how a step is built from the host's
tokens row by row (``StepRows``): prefill chunks, decodes and the rows of proposed tokens that
speculative decoding verifies."""

from __future__ import annotations

import dataclasses

import torch

from worker.pooling import PoolPositions
from worker.sequence import SequenceState


@dataclasses.dataclass
class StepBatch:
    """One forward pass: who computes which positions, and which rows then sample.

    The input ids are ``host_ids`` (a plan's first step: its tokens, from the requests' lists),
    or ``device_ids`` (a later step of a window: the ids the previous step sampled, never seen
    by the host), of which rows ``keep`` (a host index; None: all) compute. Host tensors reach
    the device in the step's one staged copy."""

    seqs: list[SequenceState]
    starts: list[int]
    lengths: list[int]
    samplers: list[SequenceState]  # rows that sample, in logits order
    logits_indices: list[int]  # flat index of each sampler's last token
    host_ids: torch.Tensor | None = None  # [T] flattened tokens of every row
    device_ids: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    prompt: PromptPositions | None = None  # positions whose logits score the next prompt token
    pool: PoolPositions | None = None  # positions whose hidden states embedding rows pool
    # Speculative decoding: a row with drafts samples at each of its last 1 + d positions
    # (``samplers`` lists it that often). ``offsets[i]``: how many outputs sampler i's position
    # lies past the row's next; ``expected[i]``: the draft its sample must equal for the row's
    # next sample to count, -1 at a row's last position. None: no row drafts this step.
    offsets: list[int] | None = None
    expected: list[int] | None = None


@dataclasses.dataclass
class PromptPositions:
    """The positions of a step's prefill chunks whose rows asked for prompt logprobs: each
    position's logits score the prompt token after it (``targets``); ``counts[i]`` of them are
    ``seqs[i]``'s, in order."""

    indices: list[int] = dataclasses.field(default_factory=list)  # flat token indices
    targets: list[int] = dataclasses.field(default_factory=list)
    seqs: list[SequenceState] = dataclasses.field(default_factory=list)
    counts: list[int] = dataclasses.field(default_factory=list)

    def add(self, seq: SequenceState, first_index: int, start: int, length: int) -> None:
        """``seq``'s chunk of ``length`` tokens from position ``start`` (before the prompt's
        last), at flat ``first_index``: every position before the prompt's last scores a prompt
        token (the last one's logits sample the first output instead)."""
        count = min(start + length, seq.num_prompt_tokens - 1) - start
        self.indices.extend(range(first_index, first_index + count))
        self.targets.extend(seq.token_ids[start + 1 : start + 1 + count])
        self.seqs.append(seq)
        self.counts.append(count)


@dataclasses.dataclass
class StepRows:
    """A ``StepBatch`` from the host's tokens, row by row.

    A row's proposed tokens (speculative decoding) join the step as rows of one token each, at
    the positions after the row's own: with every row one token long, the step is a decode
    step, which the decode paths run (the CPU's whole-stack decoder among them) at the cost of
    a batch of rows that read the weights once, where a chunk of several tokens would go the
    slower prefill way. A decode step writes every row's key and value before any row attends
    (in each layer), so each draft's row sees the ones before it, as a chunk's causal mask
    would let it; and each row computes what it would alone (batching never changes a row's
    result), so its logits are those the row would have had decoding one token at a time.

    Proposals come once every row is in (``propose``, before ``build``): a draft model guesses
    for all of the step's rows in one batch of its own. Their rows go after every other row;
    a request's samplers stay together, its own position first."""

    ids: list[int] = dataclasses.field(default_factory=list)
    seqs: list[SequenceState] = dataclasses.field(default_factory=list)
    starts: list[int] = dataclasses.field(default_factory=list)
    lengths: list[int] = dataclasses.field(default_factory=list)
    prompt: PromptPositions | None = None
    pool: PoolPositions | None = None
    # Rows that sample: (request, flat index of its last token, the position after it, proposals).
    sampling: list[tuple[SequenceState, int, int, list[int]]] = dataclasses.field(default_factory=list)

    def add(self, seq: SequenceState, start: int, n: int) -> None:
        """``seq`` computes its ``n`` known tokens from position ``start``."""
        self.ids.extend(seq.token_ids[start : start + n])
        self.seqs.append(seq)
        self.starts.append(start)
        self.lengths.append(n)

    def sample(self, seq: SequenceState) -> int:
        """``seq``, the row just added, samples at its last position; returns its handle for
        ``propose``."""
        self.sampling.append((seq, len(self.ids) - 1, self.starts[-1] + self.lengths[-1], []))
        return len(self.sampling) - 1

    def propose(self, handle: int, proposed: list[int]) -> None:
        """The sampling row ``handle`` then verifies ``proposed`` (their positions already claimed):
        each a row of its own that samples too."""
        seq, index, after, _ = self.sampling[handle]
        self.sampling[handle] = (seq, index, after, proposed)

    def build(self) -> StepBatch:
        samplers: list[SequenceState] = []
        logits_indices: list[int] = []
        offsets: list[int] = []
        expected: list[int] = []
        drafted = any(proposed for *_, proposed in self.sampling)
        for seq, index, after, proposed in self.sampling:
            samplers.append(seq)
            logits_indices.append(index)
            for j, token in enumerate(proposed):
                samplers.append(seq)
                logits_indices.append(len(self.ids))
                self.ids.append(token)
                self.seqs.append(seq)
                self.starts.append(after + j)
                self.lengths.append(1)
            if drafted:
                offsets.extend(range(len(proposed) + 1))
                expected.extend(proposed)
                expected.append(-1)
        batch = StepBatch(self.seqs, self.starts, self.lengths, samplers, logits_indices,
                          host_ids=torch.tensor(self.ids, dtype=torch.long), prompt=self.prompt, pool=self.pool)
        if drafted:
            batch.offsets, batch.expected = offsets, expected
        return batch
