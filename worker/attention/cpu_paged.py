"""The CPU backend (``cpu-paged``), float32 or bfloat16 (and float32 over a bfloat16 cache,
``--kv-cache-dtype bfloat16``): a C kernel (``worker/kernels/csrc/
paged_attention.c``) writes each step's new keys and values into their slots and attends reading
the paged cache in place, for decode rows and prefill chunks alike: no gathered copy of the
context, no mask, and no scores for positions a query cannot see.

Measured on SmolLM2: at 64 decode streams the gather and SDPA had been 41% of a step. Prefill
chunks went through that gather and a masked SDPA (which computes the masked half of a causal
chunk too) until the kernel took every row; and a query's arithmetic in the kernel depends only
on its own position, so a token's attention is the same bits in a prefill, a chunk or a decode
step (``sdpa`` rounds differently by shape, which broke greedy text after a recompute in
bfloat16).

A step whose rows all decode builds only what the decode entry reads (``DecodeRows``, which the
whole-stack decoder of ``worker/model/cpu_decoder.py`` runs itself); its block tables stay on
the host, where the kernel reads them.
"""

from __future__ import annotations

import ctypes
import dataclasses

import torch

from worker.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    DecodeRows,
    FlatTokens,
    as_tables,
    check_cover,
)
from worker.input_batch import RowTables
from worker.kernels import cpu as cpu_kernels
from worker.kv_cache import KVCache


@dataclasses.dataclass
class ChunkRows:
    """Rows of any length for the kernel: row r computes ``lengths[r]`` queries ending at position
    ``ends[r] - 1``, flat tokens ``first_tokens[r]`` onwards. int32 host tensors."""

    block_table: torch.Tensor  # [B, blocks], contiguous
    ends: torch.Tensor
    lengths: torch.Tensor
    first_tokens: torch.Tensor
    first_positions: torch.Tensor  # what each row's first query sees from (the sliding window)
    window: int  # > 0: later queries see from position - window + 1


@dataclasses.dataclass(kw_only=True)
class CpuPagedMetadata(AttentionMetadata):
    decode: DecodeRows | None = None  # every row decodes one token
    chunks: ChunkRows | None = None  # otherwise

    def decode_only(self) -> DecodeRows | None:
        return self.decode


class CpuPagedBackend(AttentionBackend):
    name = "cpu-paged (C kernels reading the paged cache in place, decode and prefill)"

    def __init__(self, kernel: ctypes.CDLL, device: torch.device, sliding_window: int | None = None,
                 softcap: float = 0.0) -> None:
        super().__init__(device, sliding_window, softcap)
        self.kernel = kernel

    def build(self, cache: KVCache, block_tables: RowTables | list[list[int]], starts: list[int], lengths: list[int],
              logits_indices: list[int], extra: list[torch.Tensor] | None = None) -> CpuPagedMetadata:
        tables, bs = as_tables(block_tables), cache.block_size
        logits, *moved = self.to_device([torch.tensor(logits_indices, dtype=torch.long), *(extra or [])])
        if all(n == 1 for n in lengths):
            positions = torch.tensor(starts)
            rows = DecodeRows.of(tables, positions, self.sliding_window, bs)
            slots = rows.block_table[torch.arange(len(starts)), positions // bs].long() * bs + positions % bs
            return CpuPagedMetadata(backend=self, positions=positions, slot_mapping=slots, logits_indices=logits,
                                    cache=cache, extra=moved, decode=rows)
        starts_t, lengths_t = torch.tensor(starts), torch.tensor(lengths)
        ends = starts_t + lengths_t
        needed = (ends - 1) // bs + 1
        check_cover(tables.num_blocks, needed, ends - 1)
        table = tables.table[:, : int(needed.max())].contiguous()
        tokens = FlatTokens.of(starts_t, lengths_t)
        window = self.sliding_window or 0
        first = (starts_t - window + 1).clamp(min=0) if window else torch.zeros_like(starts_t)
        chunks = ChunkRows(table, ends.to(torch.int32), lengths_t.to(torch.int32),
                           tokens.first_tokens.to(torch.int32), first.to(torch.int32), window)
        return CpuPagedMetadata(backend=self, positions=tokens.positions, slot_mapping=tokens.slots(table, bs),
                                logits_indices=logits, cache=cache, extra=moved, chunks=chunks)

    def forward(self, meta: AttentionMetadata, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> torch.Tensor:
        assert isinstance(meta, CpuPagedMetadata)
        cache = meta.cache
        with torch.profiler.record_function("sluice::paged_attention"):  # ctypes calls are invisible to profiles
            cpu_kernels.write_kv(self.kernel, k, v, cache.key_slots[layer], cache.value_slots[layer],
                                 meta.slot_mapping, cache.block_size)
            if meta.decode is not None:
                rows = meta.decode
                return cpu_kernels.decode(self.kernel, q, cache.key_slots[layer], cache.value_slots[layer],
                                          rows.block_table, rows.context_lens, rows.first_positions,
                                          cache.block_size, scale, self.softcap)
            chunks = meta.chunks
            assert chunks is not None
            return cpu_kernels.attention(self.kernel, q, cache.key_slots[layer], cache.value_slots[layer],
                                         chunks.block_table, chunks.ends, chunks.lengths, chunks.first_tokens,
                                         chunks.first_positions, chunks.window, cache.block_size, scale, self.softcap)
