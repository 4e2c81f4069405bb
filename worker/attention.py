"""Paged attention: new keys/values go into cache slots, each sequence reads its context through
its block table.

The metadata of a step is built once on the host and shared by every layer:

* ``slot_mapping[t]`` — cache slot (``block * block_size + offset``) where token t's K/V go;
* ``gather_slots[b, j]`` — slot of context position j of sequence b (padded with slot 0);
* ``mask[b, 1, i, j]`` — query i of sequence b may see context position j (causal, in range);
* ``query_rows``/``query_cols`` — where each flat token sits in the padded [B, max_q] layout.

A decode step is the special case max_q = 1. Positions a sequence reads were always written by
that same sequence first, so stale data in recycled blocks is never seen.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class KVCache:
    """Per layer one key and one value tensor shaped [num_blocks * block_size, kv_heads, head_dim]
    (a flat slot view of [num_blocks, block_size, ...])."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    block_size: int
    num_blocks: int

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> KVCache:
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return cls(keys, values, block_size, num_blocks)

    def _block(self, t: torch.Tensor, block: int) -> torch.Tensor:
        return t[block * self.block_size : (block + 1) * self.block_size]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Device-to-device copies (copy-on-write of a shared block)."""
        for layer in (*self.keys, *self.values):
            for src, dst in pairs:
                self._block(layer, dst).copy_(self._block(layer, src))

    def swap(self, host: KVCache, pairs: list[tuple[int, int]], to_host: bool) -> None:
        """Copy (device block, host block) pairs out to ``host``, or (host, device) pairs back in."""
        for dev_layer, host_layer in zip((*self.keys, *self.values), (*host.keys, *host.values), strict=True):
            for a, b in pairs:
                if to_host:
                    host._block(host_layer, b).copy_(self._block(dev_layer, a), non_blocking=True)
                else:
                    self._block(dev_layer, b).copy_(host._block(host_layer, a), non_blocking=True)
        if self.keys[0].is_cuda:
            torch.cuda.current_stream(self.keys[0].device).synchronize()

    def host_copy(self) -> KVCache:
        """A cache of the same shape in host memory (pinned on CUDA): the swap space."""
        pin = self.keys[0].is_cuda
        make = lambda t: torch.zeros(t.shape, dtype=t.dtype, pin_memory=pin)  # noqa: E731
        return KVCache([make(t) for t in self.keys], [make(t) for t in self.values], self.block_size, self.num_blocks)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


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
              logits_indices: list[int], device: torch.device) -> AttentionMetadata:
        """Sequence b computes ``lengths[b]`` tokens at positions ``starts[b]`` onwards."""
        bs = cache.block_size
        b = len(lengths)
        max_q = max(lengths)
        kv_lens = [s + n for s, n in zip(starts, lengths, strict=True)]
        max_kv = max(kv_lens)
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
        q_pos = torch.where(valid_q, q_pos, 0)  # padded query rows look at position 0 only (no NaN)
        mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] < torch.tensor(kv_lens)[:, None, None])
        rows = torch.repeat_interleave(torch.arange(b), lengths_t)
        cols = torch.cat([torch.arange(n) for n in lengths])
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
    k_cache, v_cache = meta.cache.keys[layer], meta.cache.values[layer]
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    keys = k_cache[meta.gather_slots].transpose(1, 2)  # [B, KVH, max_kv, D]
    values = v_cache[meta.gather_slots].transpose(1, 2)
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
