"""The torch reference backend (``sdpa``): every step gathers its rows' context from the paged
cache and runs ``scaled_dot_product_attention``; it runs on every device and dtype (the CPU's
own kernels are ``cpu_paged``; CUDA's, ``flashinfer``).

Paged attention: new keys/values go into cache slots, each sequence reads its context through
its block table. The metadata of a step is built once on the host and shared by every layer:

* ``slot_mapping[t]`` — cache slot (``block * block_size + offset``) where token t's K/V go;
* ``groups`` — the rows split by context length, so a long row is not padded onto short ones
  (padding at most doubles what a group reads). Per group:
  ``block_table[g, j]`` — the j-th block row g reads (padded with block 0);
  ``mask[g, 1, i, c]`` — query i of row g may see gathered column c (causal, in range, inside
  the sliding window); ``query_rows``/``query_cols`` — where each of the group's queries sits in
  its padded [G, max_q] layout; ``tokens`` — which of the step's flat tokens those are.

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
so a long Mistral context costs what its window costs: column c of row g is then context
position ``first_block[g] * block_size + c``.

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

from worker.attention.base import AttentionBackend, AttentionMetadata, FlatTokens, as_tables, check_cover
from worker.input_batch import RowTables
from worker.kv_cache import KVCache


@dataclasses.dataclass
class AttentionGroup:
    """Rows of similar context length, gathered and attended together."""

    tokens: torch.Tensor | None  # [Tg] flat indices of the group's queries; None: all of the step's, in order
    block_table: torch.Tensor  # [G, blocks] long, padded with block 0
    mask: torch.Tensor  # [G, 1, max_q, blocks * block_size] bool
    query_rows: torch.Tensor  # [Tg] row within the group of each query
    query_cols: torch.Tensor  # [Tg] its index among that row's queries
    max_q: int


@dataclasses.dataclass(kw_only=True)
class SdpaMetadata(AttentionMetadata):
    groups: list[AttentionGroup]
    key_scratch: torch.Tensor | None  # [blocks, block numel]: every group of every layer gathers into these
    value_scratch: torch.Tensor | None


class SdpaBackend(AttentionBackend):
    """Gather + SDPA for every row of every step."""

    name = "torch (gather + SDPA)"

    def build(self, cache: KVCache, block_tables: RowTables | list[list[int]], starts: list[int], lengths: list[int],
              logits_indices: list[int], extra: list[torch.Tensor] | None = None) -> SdpaMetadata:
        tables = as_tables(block_tables)
        bs, window = cache.block_size, self.sliding_window
        rows = _Rows(starts, lengths, bs, window)
        table = rows.table(tables)
        positions, row_of = rows.tokens.positions, rows.tokens.row_of
        # Every position computed now lies in a gathered block (first_block <= start // bs).
        slots = table[row_of, positions // bs - rows.first_block[row_of]] * bs + positions % bs
        blocks = rows.num_blocks.tolist()
        groups = [rows.group(members, table) for members in _group_rows(blocks, bs)]
        key_scratch, value_scratch = _scratch(cache, max(g.block_table.numel() for g in groups))
        if len(groups) == 1:
            groups[0].tokens = None
        host = [positions, slots, torch.tensor(logits_indices, dtype=torch.long)]
        for g in groups:
            host += [g.block_table, g.mask, g.query_rows, g.query_cols] + ([g.tokens] if g.tokens is not None else [])
        moved = iter(self.to_device(host + (extra or [])))
        positions, slots, logits = next(moved), next(moved), next(moved)
        for g in groups:
            g.block_table, g.mask, g.query_rows, g.query_cols = next(moved), next(moved), next(moved), next(moved)
            if g.tokens is not None:
                g.tokens = next(moved)
        return SdpaMetadata(backend=self, positions=positions, slot_mapping=slots, logits_indices=logits, cache=cache,
                            extra=list(moved), groups=groups, key_scratch=key_scratch, value_scratch=value_scratch)

    def forward(self, meta: AttentionMetadata, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> torch.Tensor:
        assert isinstance(meta, SdpaMetadata)
        cache = meta.cache
        cache.key_slots[layer].index_copy_(0, meta.slot_mapping, k)
        cache.value_slots[layer].index_copy_(0, meta.slot_mapping, v)
        if meta.groups[0].tokens is None:  # one group: the whole step, in order
            return _attend(q, *_gather_both(cache, layer, meta.groups[0], meta), meta.groups[0], scale, self.softcap)
        out = torch.empty_like(q)
        for group in meta.groups:
            out[group.tokens] = _attend(q[group.tokens], *_gather_both(cache, layer, group, meta), group, scale,
                                        self.softcap)
        return out


class _Rows:
    """Per-row facts of a step on the host, and the groups' tensors made from them."""

    def __init__(self, starts: list[int], lengths: list[int], bs: int, sliding_window: int | None) -> None:
        self.bs, self.window = bs, sliding_window
        self.starts = torch.tensor(starts)
        self.lengths = torch.tensor(lengths)
        self.kv_lens = self.starts + self.lengths
        self.tokens = FlatTokens.of(self.starts, self.lengths)
        self.first_token = self.tokens.first_tokens  # flat index of each row's first query
        self.first_block = torch.zeros(len(lengths), dtype=torch.long)
        if sliding_window is not None:
            # The earliest query (position start) sees positions > start - window.
            self.first_block = (self.starts - sliding_window + 1).clamp(min=0) // bs
        self.num_blocks = (self.kv_lens - 1) // bs - self.first_block + 1

    def table(self, tables: RowTables) -> torch.Tensor:
        """[B, max blocks] long: the blocks each row reads, from its first visible one."""
        check_cover(tables.num_blocks, self.first_block + self.num_blocks, self.kv_lens - 1)
        cols = self.first_block[:, None] + torch.arange(int(self.num_blocks.max()))[None, :]
        # Columns past a row's last block read padding (or beyond the table: clamped); masked.
        in_row = cols < (self.first_block + self.num_blocks)[:, None]
        cols = cols.clamp(max=tables.table.shape[1] - 1)
        return torch.where(in_row, tables.table.gather(1, cols).long(), 0)

    def group(self, members: list[int], table: torch.Tensor) -> AttentionGroup:
        """The group's tensors, on the host."""
        idx = torch.tensor(members)
        starts, lengths, kv_lens, first = self.starts[idx], self.lengths[idx], self.kv_lens[idx], self.first_block[idx]
        num_blocks = int(self.num_blocks[idx].max())
        max_q = int(lengths.max())
        kv_pos = first[:, None] * self.bs + torch.arange(num_blocks * self.bs)[None, :]  # [G, C]
        q_off = torch.arange(max_q)
        valid_q = q_off[None, :] < lengths[:, None]
        # Padded query rows see their row's first gathered position only: no all-masked NaN rows.
        q_pos = torch.where(valid_q, starts[:, None] + q_off[None, :], first[:, None] * self.bs)  # [G, max_q]
        mask = (kv_pos[:, None, :] <= q_pos[:, :, None]) & (kv_pos[:, None, :] < kv_lens[:, None, None])
        if self.window is not None:
            mask &= kv_pos[:, None, :] > q_pos[:, :, None] - self.window
        query_rows = torch.repeat_interleave(torch.arange(len(members)), lengths)
        query_cols = torch.arange(query_rows.shape[0]) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths,
                                                                                lengths)
        tokens = self.first_token[idx][query_rows] + query_cols
        return AttentionGroup(
            tokens=tokens,
            block_table=table[idx, :num_blocks],
            mask=mask.unsqueeze(1),
            query_rows=query_rows,
            query_cols=query_cols,
            max_q=max_q,
        )


SPLIT_ABOVE_TOKENS = 256  # shorter contexts cost less to pad than to attend separately


def _group_rows(num_blocks: list[int], bs: int) -> list[list[int]]:
    """Rows in groups whose padding at most doubles what they gather: from the longest context
    down, a row joins the current group while it needs more than half the group's longest (or
    that longest is short anyway). A single group keeps the rows in batch order."""
    order = sorted(range(len(num_blocks)), key=lambda r: -num_blocks[r])
    groups: list[list[int]] = []
    for r in order:
        longest = num_blocks[groups[-1][0]] if groups else 0
        if groups and (2 * num_blocks[r] > longest or longest * bs <= SPLIT_ABOVE_TOKENS):
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups if len(groups) > 1 else [list(range(len(num_blocks)))]


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
    """``layer`` [num_blocks, bs, KVH, D] -> the rows' context as a [G, KVH, blocks * bs, D]
    view of ``scratch`` (strided: SDPA reads it as it is)."""
    g, blocks = table.shape
    _, bs, kv_heads, head_dim = layer.shape
    out = scratch[: g * blocks]
    torch.index_select(layer.view(layer.shape[0], -1), 0, table.view(-1), out=out)
    return out.view(g, blocks * bs, kv_heads, head_dim).transpose(1, 2)


def _gather_both(cache: KVCache, layer: int, group: AttentionGroup, meta: SdpaMetadata
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    assert meta.key_scratch is not None and meta.value_scratch is not None
    return (_gather(cache.keys[layer], group.block_table, meta.key_scratch),
            _gather(cache.values[layer], group.block_table, meta.value_scratch))


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, group: AttentionGroup,
            scale: float, softcap: float = 0.0) -> torch.Tensor:
    """The group's queries q [Tg, H, D] against its gathered context -> [Tg, H, D]."""
    if group.max_q == 1:
        q_pad = q.unsqueeze(1)  # decode: one token per row, already in row order
    else:
        q_pad = q.new_zeros((group.block_table.shape[0], group.max_q, q.shape[1], q.shape[2]))
        q_pad[group.query_rows, group.query_cols] = q
    if softcap:
        out = _capped_attention(q_pad.transpose(1, 2), keys, values, group.mask, scale, softcap)
    else:
        out = F.scaled_dot_product_attention(q_pad.transpose(1, 2), keys, values, attn_mask=group.mask, scale=scale,
                                             enable_gqa=keys.shape[1] != q.shape[1])
    out = out.transpose(1, 2)  # [G, max_q, H, D]
    if group.max_q == 1:
        return out.squeeze(1)
    return out[group.query_rows, group.query_cols]


CAPPED_SCORES_BYTES = 256 << 20  # the capped path's float32 scores, at most about this much at once


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                      softcap: float) -> torch.Tensor:
    """``scaled_dot_product_attention`` (q [G, H, Q, D], k/v [G, KVH, L, D], ``mask`` [G, 1, Q, L]
    bool) with each scaled score s soft-capped to softcap * tanh(s / softcap) before the mask and
    the softmax (Gemma 2), which SDPA cannot do: the scores written out, as ``transformers``' eager
    attention computes them, in float32 whatever the dtype (as SDPA's CPU kernels accumulate).
    A query head reads its KV head through a broadcast (no copy of the cache per query head), and
    the queries go in chunks that keep the float32 scores near ``CAPPED_SCORES_BYTES``."""
    g, heads, nq, d = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    grouped = q.reshape(g, kv_heads, heads // kv_heads, nq, d)
    keys, values = k.float().unsqueeze(2), v.float().unsqueeze(2)  # [G, KVH, 1, L, D]
    out = torch.empty((g, kv_heads, heads // kv_heads, nq, d), dtype=q.dtype, device=q.device)
    step = max(1, CAPPED_SCORES_BYTES // (4 * g * heads * length))
    for first in range(0, nq, step):
        rows = slice(first, min(nq, first + step))
        scores = torch.tanh((grouped[:, :, :, rows].float() @ keys.transpose(-1, -2)) * scale / softcap) * softcap
        scores = scores.masked_fill(~mask[:, :, rows].unsqueeze(2), float("-inf"))
        out[:, :, :, rows] = (torch.softmax(scores, dim=-1) @ values).to(q.dtype)
    return out.view(g, heads, nq, d)
