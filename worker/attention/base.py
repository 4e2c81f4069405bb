"""What every attention backend is: ``build`` a step's metadata on the host once, then
``forward`` one layer's attention with it, for every layer of the step.

A backend is chosen once, at start-up, by ``worker.attention.select_backend``, which checks what
it supports (device, dtype, head size, GQA group) and says in the log which one runs and why the
others do not. The runner never asks which backend it has: it calls ``build``; the model calls
``AttentionMetadata.attend``, which hands the layer to the backend that built the metadata.
"""

from __future__ import annotations

import abc
import dataclasses

import torch

from worker.input_batch import RowTables
from worker.kv_cache import KVCache
from worker.staging import HostToDevice


@dataclasses.dataclass(kw_only=True)
class AttentionMetadata:
    """What every backend's step has: each query's position, the cache slot its key and value
    go to, which positions' logits are needed, and the step's other host inputs (input ids,
    sampling tensors) moved to the device in the same staged copy. Backends add their own."""

    backend: AttentionBackend
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    logits_indices: torch.Tensor  # flat token indices whose logits are needed
    cache: KVCache
    extra: list[torch.Tensor] = dataclasses.field(default_factory=list)
    # [T] added to ``positions`` where the rotation is read (LongRoPE's long table); None: nothing
    rope_offsets: torch.Tensor | None = None
    # Gemma 3: the same step as layers with a sliding window of that many tokens see it
    windowed: dict[int, AttentionMetadata] = dataclasses.field(default_factory=dict)

    @property
    def rope_positions(self) -> torch.Tensor:
        """Where each token's rotation is read in the model's tables."""
        return self.positions if self.rope_offsets is None else self.positions + self.rope_offsets

    def decode_only(self) -> DecodeRows | None:
        """Where every row of the step decodes one token through a paged decode kernel that
        reads the cache in place: those rows, for a caller that runs the kernel itself (the
        CPU's whole-stack decoder, ``worker/model/cpu_decoder.py``); else None."""
        return None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """One layer: q [T, H, D], k/v [T, KVH, D] of this step's tokens -> [T, H, D]; the keys
        and values are written into the cache first."""
        return self.backend.forward(self, layer, q, k, v, scale)


@dataclasses.dataclass
class DecodeRows:
    """A step whose rows compute one token each, for a paged decode kernel: int32 host tensors."""

    block_table: torch.Tensor  # [B, max blocks], contiguous
    context_lens: torch.Tensor  # [B]: positions 0 .. len - 1 exist once this step's token is written
    first_positions: torch.Tensor  # [B]: the earliest position the row's query sees (sliding window)

    @classmethod
    def of(cls, tables: RowTables, positions: torch.Tensor, sliding_window: int | None, bs: int) -> DecodeRows:
        """Row b of ``tables`` computing the token at ``positions[b]``."""
        used = positions // bs + 1  # blocks up to the one this step's token goes into
        check_cover(tables.num_blocks, used, positions)
        table = tables.table[:, : int(used.max())].contiguous()
        first = (positions - sliding_window + 1).clamp(min=0) if sliding_window is not None else torch.zeros_like(positions)
        return cls(table, (positions + 1).to(torch.int32), first.to(torch.int32))


class AttentionBackend(abc.ABC):
    name: str

    def __init__(self, device: torch.device, sliding_window: int | None = None, softcap: float = 0.0) -> None:
        self.device = device
        self.sliding_window = sliding_window
        self.softcap = softcap  # > 0: each scaled score s is softcap * tanh(s / softcap) (Gemma 2)
        self.to_device = HostToDevice(device)  # one staged copy per step, buffers kept across steps

    @abc.abstractmethod
    def build(self, cache: KVCache, block_tables: RowTables | list[list[int]], starts: list[int], lengths: list[int],
              logits_indices: list[int], extra: list[torch.Tensor] | None = None) -> AttentionMetadata:
        """Row b computes ``lengths[b]`` (>= 1) tokens at positions ``starts[b]`` onwards,
        reading its context through its block table (row b of ``block_tables``: the input
        batch's ``RowTables``, or plain lists), which must cover them. With a sliding window, a
        query at position i sees only positions > i - window (Mistral's rule). The host tensors
        ``extra`` travel in the step's one copy; their device copies are the result's ``extra``."""

    @abc.abstractmethod
    def forward(self, meta: AttentionMetadata, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> torch.Tensor:
        """``AttentionMetadata.attend`` for metadata this backend built."""


def as_tables(block_tables: RowTables | list[list[int]]) -> RowTables:
    return block_tables if isinstance(block_tables, RowTables) else RowTables.from_lists(block_tables)


def check_cover(num_blocks: torch.Tensor, needed: torch.Tensor, last_positions: torch.Tensor) -> None:
    """Each row's blocks reach the last position it touches, or a ValueError naming the first that does not."""
    short = (num_blocks < needed).nonzero()
    if len(short):
        i = int(short[0])
        raise ValueError(f"row {i}: {int(num_blocks[i])} blocks do not cover position {int(last_positions[i])}")


@dataclasses.dataclass
class FlatTokens:
    """Where a step's flattened tokens come from: row b computes ``lengths[b]`` tokens from
    position ``starts[b]``, flat tokens ``first_tokens[b]`` onwards."""

    row_of: torch.Tensor  # [T] the row of each token
    first_tokens: torch.Tensor  # [B]
    positions: torch.Tensor  # [T]

    @classmethod
    def of(cls, starts: torch.Tensor, lengths: torch.Tensor) -> FlatTokens:
        row_of = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        first_tokens = torch.cumsum(lengths, 0) - lengths
        return cls(row_of, first_tokens, starts[row_of] + torch.arange(row_of.shape[0]) - first_tokens[row_of])

    def slots(self, table: torch.Tensor, block_size: int) -> torch.Tensor:
        """Each token's cache slot, through the rows' block tables (``table[b, j]``: row b's
        j-th block)."""
        return table[self.row_of, self.positions // block_size].long() * block_size + self.positions % block_size

