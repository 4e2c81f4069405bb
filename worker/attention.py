"""Paged attention: new keys/values go into cache slots, each sequence reads its context through
its block table.

The metadata of a step is built once on the host and shared by every layer:

* ``slot_mapping[t]`` — cache slot (``block * block_size + offset``) where token t's K/V go;
* ``block_table[b, j]`` — the j-th block sequence b reads (padded with block 0);
* ``mask[b, 1, i, c]`` — query i of sequence b may see gathered column c (causal, in range, and
  inside the sliding window);
* ``query_rows``/``query_cols`` — where each flat token sits in the padded [B, max_q] layout.

Each layer gathers the step's context *block by block* (one ``index_select`` of whole blocks,
each a contiguous run of ``block_size * kv_heads * head_dim`` values) into a scratch buffer that
every layer reuses, then runs ``scaled_dot_product_attention`` on a strided view of it.
Gathering single slots instead costs about three times as much on the CPU (a copy per
``head_dim`` row), and a freshly allocated buffer pays a page fault per 4 KiB on first touch
(at 64 x 4096 tokens, six times the copy itself). So the scratch outlives the step: one pair per
KV cache, grown on demand and kept while it holds no more blocks than the cache itself (at most
one layer's share of the cache's memory; a step whose padded context is larger borrows a
buffer for that step only).

With a sliding window, a sequence skips the leading blocks that no query of this step can see,
so a long Mistral context costs what its window costs: column c of row b is then context
position ``first_block[b] * block_size + c``.

A decode step is the special case max_q = 1, and a prefill chunk after an already computed
prefix is the general case: its queries start at position ``start`` and see everything before.
Positions a sequence reads were always written by that same sequence first (in this step or an
earlier one); the rest of a gathered block (stale data of a recycled block, or block 0's) is
masked, and the cache only ever holds finite values, so masked columns contribute nothing.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
import torch.nn.functional as F

from worker.kv_cache import KVCache


@dataclasses.dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    block_table: torch.Tensor  # [B, max_blocks] long
    mask: torch.Tensor  # [B, 1, max_q, max_blocks * block_size] bool
    query_rows: torch.Tensor  # [T]
    query_cols: torch.Tensor  # [T]
    max_q: int
    logits_indices: torch.Tensor  # flat token indices whose logits are needed
    cache: KVCache
    key_scratch: torch.Tensor  # [B * max_blocks, block numel]: every layer gathers into these
    value_scratch: torch.Tensor

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
        starts_t = torch.tensor(starts)
        lengths_t = torch.tensor(lengths)
        kv_lens = starts_t + lengths_t
        last_block = (kv_lens - 1) // bs  # inclusive
        first_block = torch.zeros(b, dtype=torch.long)
        if sliding_window is not None:
            # The earliest query (position start) sees positions > start - window.
            first_block = (starts_t - sliding_window + 1).clamp(min=0) // bs
        num_blocks = last_block - first_block + 1
        max_blocks = int(num_blocks.max())
        table = torch.zeros((b, max_blocks), dtype=torch.long)
        for i, blocks in enumerate(block_tables):
            lo, n = int(first_block[i]), int(num_blocks[i])
            if len(blocks) < lo + n:
                raise ValueError(f"row {i}: {len(blocks)} blocks do not cover position {int(kv_lens[i]) - 1}")
            table[i, :n] = torch.tensor(blocks[lo : lo + n], dtype=torch.long)
        cols = torch.arange(max_blocks * bs)
        kv_pos = first_block[:, None] * bs + cols[None, :]  # [B, C]: context position of each column
        q_off = torch.arange(max_q)
        valid_q = q_off[None, :] < lengths_t[:, None]
        # Padded query rows see their sequence's first gathered position only: no all-masked NaN rows.
        q_pos = torch.where(valid_q, starts_t[:, None] + q_off[None, :], first_block[:, None] * bs)  # [B, max_q]
        mask = (kv_pos[:, None, :] <= q_pos[:, :, None]) & (kv_pos[:, None, :] < kv_lens[:, None, None])
        if sliding_window is not None:
            mask &= kv_pos[:, None, :] > q_pos[:, :, None] - sliding_window
        rows = torch.repeat_interleave(torch.arange(b), lengths_t)
        q_cols = torch.arange(rows.shape[0]) - torch.repeat_interleave(torch.cumsum(lengths_t, 0) - lengths_t, lengths_t)
        positions = starts_t[rows] + q_cols
        # Every position computed now lies in a gathered block (first_block <= start // bs).
        slots = table[rows, positions // bs - first_block[rows]] * bs + positions % bs
        key_scratch, value_scratch = _scratch(cache, b * max_blocks)
        return cls(
            positions=positions.to(device),
            slot_mapping=slots.to(device),
            block_table=table.to(device),
            mask=mask.unsqueeze(1).to(device),
            query_rows=rows.to(device),
            query_cols=q_cols.to(device),
            max_q=max_q,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
            cache=cache,
            key_scratch=key_scratch,
            value_scratch=value_scratch,
        )


# Per KV cache: the kept (key, value) scratch pair, [blocks, block numel] each.
_kept_scratch: weakref.WeakKeyDictionary[KVCache, tuple[torch.Tensor, torch.Tensor]] = weakref.WeakKeyDictionary()


def _scratch(cache: KVCache, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffers for ``num_blocks`` gathered blocks of keys and of values (see the module docstring)."""
    kept = _kept_scratch.get(cache)
    if kept is not None and kept[0].shape[0] >= num_blocks:
        return kept[0][:num_blocks], kept[1][:num_blocks]
    layer = cache.keys[0]
    pair = (layer.new_empty((num_blocks, layer[0].numel())), layer.new_empty((num_blocks, layer[0].numel())))
    if num_blocks <= cache.num_blocks:
        _kept_scratch[cache] = pair
    return pair


def _gather(layer: torch.Tensor, table: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """``layer`` [num_blocks, bs, KVH, D] -> the rows' context as a [B, KVH, max_blocks * bs, D]
    view of ``scratch`` (strided: SDPA reads it as it is)."""
    b, max_blocks = table.shape
    _, bs, kv_heads, head_dim = layer.shape
    torch.index_select(layer.view(layer.shape[0], -1), 0, table.view(-1), out=scratch)
    return scratch.view(b, max_blocks * bs, kv_heads, head_dim).transpose(1, 2)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, layer: int,
                    scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] of this step's tokens -> attention output [T, H, D]."""
    cache = meta.cache
    cache.key_slots[layer].index_copy_(0, meta.slot_mapping, k)
    cache.value_slots[layer].index_copy_(0, meta.slot_mapping, v)
    keys = _gather(cache.keys[layer], meta.block_table, meta.key_scratch)
    values = _gather(cache.values[layer], meta.block_table, meta.value_scratch)
    b = meta.block_table.shape[0]
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
