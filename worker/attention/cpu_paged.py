"""The CPU backend (``cpu-paged``), float32 or bfloat16: rows that decode one token (multi-step
decode windows, the bulk of serving) go to a C kernel (``worker/kernels/csrc/paged_decode.c``)
that writes the new keys and values and attends reading the paged cache in place, no gathered
copy; prefill chunks keep the torch path (``sdpa``), whose blocked SDPA suits many queries.
Measured on SmolLM2 at 64 streams: the gather and SDPA were 41% of a decode step.

A step whose rows all decode builds only what the kernel reads, and its block tables stay on
the host, where the kernel reads them.
"""

from __future__ import annotations

import ctypes

import torch

from worker.attention.base import AttentionMetadata, DecodeRows, as_tables
from worker.attention.sdpa import SdpaBackend, SdpaMetadata
from worker.input_batch import RowTables
from worker.kernels import cpu as cpu_kernels
from worker.kv_cache import KVCache


class CpuPagedBackend(SdpaBackend):
    name = "cpu-paged (C kernel for decode rows, torch gather + SDPA for prefill chunks)"
    split_decode = True

    def __init__(self, kernel: ctypes.CDLL, device: torch.device, sliding_window: int | None = None) -> None:
        super().__init__(device, sliding_window)
        self.kernel = kernel

    def build(self, cache: KVCache, block_tables: RowTables | list[list[int]], starts: list[int], lengths: list[int],
              logits_indices: list[int], extra: list[torch.Tensor] | None = None) -> SdpaMetadata:
        if not all(n == 1 for n in lengths):
            return super().build(cache, block_tables, starts, lengths, logits_indices, extra)
        tables, bs = as_tables(block_tables), cache.block_size
        positions = torch.tensor(starts)
        rows = DecodeRows.of(tables, positions, torch.arange(len(starts)), self.sliding_window, bs)
        slots = rows.block_table[torch.arange(len(starts)), positions // bs].long() * bs + positions % bs
        logits, *moved = self.to_device([torch.tensor(logits_indices, dtype=torch.long), *(extra or [])])
        return SdpaMetadata(backend=self, positions=positions, slot_mapping=slots, logits_indices=logits, cache=cache,
                            extra=moved, groups=[], key_scratch=None, value_scratch=None, decode=rows)

    def forward(self, meta: AttentionMetadata, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> torch.Tensor:
        assert isinstance(meta, SdpaMetadata)
        if meta.groups:
            return super().forward(meta, layer, q, k, v, scale)
        cache = meta.cache  # a decode step: the kernel writes the keys too
        with torch.profiler.record_function("sluice::paged_decode"):  # ctypes calls are invisible to profiles
            cpu_kernels.write_kv(self.kernel, k, v, cache.key_slots[layer], cache.value_slots[layer],
                                 meta.slot_mapping)
            return self.decode_rows(meta, layer, q, scale)

    def decode_rows(self, meta: SdpaMetadata, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        rows, cache = meta.decode, meta.cache
        assert rows is not None
        with torch.profiler.record_function("sluice::paged_decode"):
            return cpu_kernels.decode(self.kernel, q, cache.key_slots[layer], cache.value_slots[layer],
                                      rows.block_table, rows.context_lens, rows.first_positions, cache.block_size,
                                      scale)
