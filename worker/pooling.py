"""Embedding requests on the worker: a prompt's final hidden states, pooled.

A request with ``sampling.pooling`` computes its prompt as any other does, in prefill chunks
batched with the step's other rows; the positions it pools are read out of the same forward pass
(``LlamaForCausalLM.forward``'s ``hidden_rows``: after the model's last norm, in float32).
"last" keeps the last prompt token's state, "mean" sums every prompt position's chunk by chunk
(which is why a mean-pooled request never takes its prompt from the prefix cache:
``SamplingParams.every_position``). The L2-normalised vector leaves with the request's one
output token, and the scheduler ends it there (max_tokens 1).
"""

from __future__ import annotations

import dataclasses

import torch

from worker.sequence import SequenceState


@dataclasses.dataclass
class PoolPositions:
    """The flat token indices of a step whose hidden states embedding rows pool; ``counts[i]``
    of them are ``seqs[i]``'s, in order."""

    indices: list[int] = dataclasses.field(default_factory=list)
    seqs: list[SequenceState] = dataclasses.field(default_factory=list)
    counts: list[int] = dataclasses.field(default_factory=list)

    def add(self, seq: SequenceState, first_index: int, start: int, length: int) -> None:
        """``seq``'s chunk of ``length`` tokens from position ``start``, at flat ``first_index``."""
        end = min(start + length, seq.num_prompt_tokens)
        if seq.sampling.pooling == "mean":
            first, count = first_index, end - start
        elif end == seq.num_prompt_tokens:  # last: only the chunk that holds the prompt's end
            first, count = first_index + end - 1 - start, 1
        else:
            return
        if count > 0:
            self.indices.extend(range(first, first + count))
            self.seqs.append(seq)
            self.counts.append(count)

    def pool(self, hidden: torch.Tensor) -> None:
        """Fold ``hidden`` (one row per index) into each sequence's pooled state."""
        first = 0
        for seq, count in zip(self.seqs, self.counts, strict=True):
            rows = hidden[first : first + count]
            if seq.sampling.pooling == "mean":
                total = rows.sum(dim=0)
                seq.pooled = total if seq.pooled is None else seq.pooled + total
                seq.num_pooled += count
            else:
                seq.pooled, seq.num_pooled = rows[-1], 1
            first += count


def embedding_bytes(seq: SequenceState) -> bytes:
    """``seq``'s pooled state, averaged and L2-normalised, as little-endian float32 bytes."""
    assert seq.pooled is not None
    vector = torch.nn.functional.normalize(seq.pooled / seq.num_pooled, dim=0)
    return vector.to(device="cpu", dtype=torch.float32).numpy().astype("<f4").tobytes()
