"""Attention on CUDA through FlashInfer's paged kernels, when ``flashinfer`` is importable.

FlashInfer reads the paged cache in place, as it is laid out here ([blocks, block_size,
kv_heads, head_dim] per layer: its "NHD" layout), through a CSR page table: row b's pages are
``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``, the last of them holding ``last_page_len[b]``
tokens; its queries are ``q[qo_indptr[b]:qo_indptr[b+1]]``, aligned to the end of its context
(causal: query i of a row of n queries and context length L sees positions <= L - n + i). That
is Sluice's chunked prefill, whose new keys and values are written before attention runs, and
a decode step is the case n = 1. A sliding window is ``window_left = window - 1``.

Per step the layout is built on the host (``PagedLayout``: CPU logic, tested there) and planned
once — decode steps with the decode wrapper, steps with prefill chunks with the prefill one —
and every layer's ``run`` reuses the plan. Positions, slots and logits indices travel in the
step's one staged copy, as on the torch path.

Written against FlashInfer's documented wrapper API (``plan``/``run``, 0.2 and later); no GPU
was available where it was written, so the CUDA selection logs which backend runs and the torch
path (gather + SDPA) remains the fallback whenever flashinfer is missing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from worker.attention import AttentionBackend, AttentionMetadata
from worker.input_batch import RowTables
from worker.kv_cache import KVCache

WORKSPACE_BYTES = 128 << 20


@dataclasses.dataclass
class PagedLayout:
    """A step's rows as FlashInfer's CSR page table, on the host."""

    qo_indptr: torch.Tensor  # [B + 1] int32
    kv_indptr: torch.Tensor  # [B + 1] int32
    kv_indices: torch.Tensor  # [sum of pages] int32
    last_page_len: torch.Tensor  # [B] int32, 1 .. block_size
    positions: torch.Tensor  # [T] long: the position of every query
    slot_mapping: torch.Tensor  # [T] long: where its key and value go

    @classmethod
    def build(cls, tables: RowTables, starts: list[int], lengths: list[int], block_size: int) -> PagedLayout:
        """Row b computes ``lengths[b]`` tokens from position ``starts[b]``; its context is then
        ``starts[b] + lengths[b]`` tokens long, in the first blocks of its table row."""
        starts_t, lengths_t = torch.tensor(starts), torch.tensor(lengths)
        kv_lens = starts_t + lengths_t
        pages = (kv_lens + block_size - 1) // block_size
        short = (tables.num_blocks < pages).nonzero()
        if len(short):
            i = int(short[0])
            raise ValueError(f"row {i}: {int(tables.num_blocks[i])} blocks do not cover position {int(kv_lens[i]) - 1}")
        zero = torch.zeros(1, dtype=torch.long)
        kv_indptr = torch.cat([zero, pages.cumsum(0)])
        width = tables.table.shape[1]
        in_row = torch.arange(width)[None, :] < pages[:, None]
        kv_indices = tables.table[in_row]  # row-major: each row's first pages, rows in order
        rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths_t)
        first = torch.cumsum(lengths_t, 0) - lengths_t
        positions = starts_t[rows] + torch.arange(rows.shape[0]) - first[rows]
        slots = tables.table[rows, positions // block_size].long() * block_size + positions % block_size
        return cls(
            qo_indptr=torch.cat([zero, lengths_t.cumsum(0)]).to(torch.int32),
            kv_indptr=kv_indptr.to(torch.int32),
            kv_indices=kv_indices.to(torch.int32),
            last_page_len=(kv_lens - (pages - 1) * block_size).to(torch.int32),
            positions=positions,
            slot_mapping=slots,
        )


@dataclasses.dataclass
class FlashInferStep:
    """A planned wrapper; ``attend`` is one layer's attention."""

    wrapper: Any

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, layer: int
               ) -> torch.Tensor:
        """Write the step's keys and values into their slots, then attend: q [T, H, D] -> [T, H, D]."""
        cache = meta.cache
        cache.key_slots[layer].index_copy_(0, meta.slot_mapping, k)
        cache.value_slots[layer].index_copy_(0, meta.slot_mapping, v)
        return self.wrapper.run(q.contiguous(), (cache.keys[layer], cache.values[layer]))


class FlashInferBackend(AttentionBackend):
    def __init__(self, flashinfer: Any, device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                 head_dim: int, block_size: int, sliding_window: int | None) -> None:
        super().__init__(None, device)
        self.name = "flashinfer (paged decode and prefill kernels)"
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self.dtype, self.block_size = dtype, block_size
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.window_left = sliding_window - 1 if sliding_window is not None else -1

    @classmethod
    def create(cls, device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
               block_size: int, sliding_window: int | None) -> FlashInferBackend | None:
        """The backend, or None where flashinfer is not installed."""
        try:
            import flashinfer
        except ImportError:
            return None
        return cls(flashinfer, device, dtype, num_heads, num_kv_heads, head_dim, block_size, sliding_window)

    def metadata(self, cache: KVCache, block_tables: RowTables | list[list[int]], starts: list[int], lengths: list[int],
                 logits_indices: list[int], device: torch.device, sliding_window: int | None,
                 extra: list[torch.Tensor] | None = None) -> AttentionMetadata:
        tables = block_tables if isinstance(block_tables, RowTables) else RowTables.from_lists(block_tables)
        layout = PagedLayout.build(tables, starts, lengths, cache.block_size)
        common = dict(num_kv_heads=self.num_kv_heads, page_size=cache.block_size, window_left=self.window_left,
                      q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.head_dim**-0.5)
        if all(n == 1 for n in lengths):
            wrapper = self.decode_wrapper
            wrapper.plan(layout.kv_indptr, layout.kv_indices, layout.last_page_len, num_qo_heads=self.num_heads,
                         head_dim=self.head_dim, **common)
        else:
            wrapper = self.prefill_wrapper
            wrapper.plan(layout.qo_indptr, layout.kv_indptr, layout.kv_indices, layout.last_page_len,
                         num_qo_heads=self.num_heads, head_dim_qk=self.head_dim, causal=True, **common)
        positions, slots, logits, *moved = self.to_device(
            [layout.positions, layout.slot_mapping, torch.tensor(logits_indices, dtype=torch.long), *(extra or [])])
        return AttentionMetadata(positions=positions, slot_mapping=slots, groups=[], logits_indices=logits,
                                 cache=cache, key_scratch=None, value_scratch=None, extra=moved,
                                 paged=FlashInferStep(wrapper))
