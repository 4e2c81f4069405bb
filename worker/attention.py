"""Paged attention: new keys/values go into cache slots, each sequence reads its context through
its block table.

The metadata of a step is built once on the host and shared by every layer:

* ``slot_mapping[t]`` — cache slot (``block * block_size + offset``) where token t's K/V go;
* ``gather_slots[b, j]`` — slot of context position j of sequence b (padded with slot 0);
* ``mask[b, 1, i, j]`` — query i of sequence b may see context position j (causal, in range);
* ``query_rows``/``query_cols`` — where each flat token sits in the padded [B, max_q] layout.

A decode step is the special case max_q = 1, and a prefill chunk after an already computed
prefix is the general case: its queries start at position ``start`` and see everything before.
Positions a sequence reads were always written by that same sequence first (in this step or an
earlier one), so stale data in recycled blocks is never seen.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from worker.kv_cache import KVCache


@dataclasses.dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    gather_slots: torch.Tensor  # [B, max_kv]
    mask: torch.Tensor  # [B, 1, max_q, max_kv] bool
    query_rows: torch.Tensor  # [T]
    query_cols: torch.Tensor  # [T]
    max_q: int
    logits_indices: torch.Tensor  # flat token indices whose logits are needed
    cache: KVCache

    @classmethod
    def build(cls, cache: KVCache, block_tables: list[list[int]], starts: list[int], lengths: list[int],
              logits_indices: list[int], device: torch.device, sliding_window: int | None = None
              ) -> AttentionMetadata:
        """Sequence b computes ``lengths[b]`` (>= 1) tokens at positions ``starts[b]`` onwards,
        reading its context through ``block_tables[b]``, which must cover them. With a sliding
        window, a query at position i sees only positions > i - window (Mistral's rule)."""
        bs = cache.block_size
        b = len(lengths)
        max_q = max(lengths)
        kv_lens = torch.tensor([s + n for s, n in zip(starts, lengths, strict=True)])
        max_kv = int(kv_lens.max())
        max_blocks = -(-max_kv // bs)
        table = torch.zeros((b, max_blocks), dtype=torch.long)
        for i, blocks in enumerate(block_tables):
            n = min(len(blocks), max_blocks)
            table[i, :n] = torch.tensor(blocks[:n], dtype=torch.long)
        kv_pos = torch.arange(max_kv)
        gather = table[:, kv_pos // bs] * bs + kv_pos % bs  # [B, max_kv]
        starts_t = torch.tensor(starts)
        lengths_t = torch.tensor(lengths)
        q_off = torch.arange(max_q)
        q_pos = starts_t[:, None] + q_off[None, :]  # [B, max_q]
        valid_q = q_off[None, :] < lengths_t[:, None]
        q_pos = torch.where(valid_q, q_pos, 0)  # padded query rows see position 0 only: no all-masked NaN rows
        mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] < kv_lens[:, None, None])
        if sliding_window is not None:
            mask &= kv_pos[None, None, :] > q_pos[:, :, None] - sliding_window
        rows = torch.repeat_interleave(torch.arange(b), lengths_t)
        cols = torch.arange(rows.shape[0]) - torch.repeat_interleave(torch.cumsum(lengths_t, 0) - lengths_t, lengths_t)
        positions = starts_t[rows] + cols
        slots = gather[rows, positions]
        return cls(
            positions=positions.to(device),
            slot_mapping=slots.to(device),
            gather_slots=gather.to(device),
            mask=mask.unsqueeze(1).to(device),
            query_rows=rows.to(device),
            query_cols=cols.to(device),
            max_q=max_q,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
            cache=cache,
        )


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, layer: int,
                    scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] of this step's tokens -> attention output [T, H, D]."""
    k_slots, v_slots = meta.cache.key_slots[layer], meta.cache.value_slots[layer]
    k_slots.index_copy_(0, meta.slot_mapping, k)
    v_slots.index_copy_(0, meta.slot_mapping, v)
    keys = k_slots[meta.gather_slots].transpose(1, 2)  # [B, KVH, max_kv, D]
    values = v_slots[meta.gather_slots].transpose(1, 2)
    b = meta.gather_slots.shape[0]
    if meta.max_q == 1:
        q_pad = q.unsqueeze(1)  # decode: one token per sequence, already in batch order
    else:
        q_pad = q.new_zeros((b, meta.max_q, q.shape[1], q.shape[2]))
        q_pad[meta.query_rows, meta.query_cols] = q
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2), keys, values, attn_mask=meta.mask, scale=scale,
        enable_gqa=keys.shape[1] != q.shape[1],
    )
    out = out.transpose(1, 2)  # [B, max_q, H, D]
    if meta.max_q == 1:
        return out.squeeze(1)
    return out[meta.query_rows, meta.query_cols]
