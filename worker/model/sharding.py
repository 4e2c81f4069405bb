"""Which part of each weight a tensor-parallel rank holds (Megatron-style).

With k ranks, rank r holds:

* attention: heads ``[r*H/k, (r+1)*H/k)`` of q (column-parallel q/k/v) and the matching
  columns of o_proj (row-parallel: each rank's partial sum, then one all-reduce). Its key/value
  heads are its share ``[r*KV/k, ...)`` when k divides the KV heads, else (k a multiple of
  them: GQA with few KV heads) the one KV head its query heads read, held by every rank that
  needs it (replicated). Either way a rank's local query head j reads its local KV head
  ``j // (local heads / local KV heads)``, the layout the attention kernels already take;
* the MLP: rows ``[r*I/k, ...)`` of gate and up (column-parallel), those columns of down
  (row-parallel, one all-reduce); in a mixture of experts, every expert's the same way (each
  rank holds every expert, a k-th of its rows; a shared expert too, its gate whole), the router
  whole, one all-reduce of the sum;
* the vocabulary: rows ``[r*S, (r+1)*S)`` of the embedding and of lm_head, ``S = ceil(V/k)``
  (the last shard padded with zero rows). The embedding looks up the ids in its rows and
  all-reduces; lm_head's logits are gathered on rank 0, which samples;
* norms whole; a row-parallel projection's bias on rank 0 only (it is added once, before the
  all-reduce: the other ranks hold zeros).

The model is built from ``local_config()`` (the per-rank head, KV-head, MLP and vocabulary
counts) and every checkpoint tensor is read as ``slice_for(name)`` says, so no rank holds
another's part of a weight, even while loading.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from worker.model.config import LlamaConfig, ModelLoadError
from worker.model.quantized import QuantizedWeight


@dataclasses.dataclass(frozen=True)
class Slice:
    """Elements ``[start, stop)`` along ``dim``, padded with zeros to ``size`` (``stop == start``:
    all zeros, the bias a rank other than 0 holds for a row-parallel projection)."""

    dim: int
    start: int
    stop: int
    size: int

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """This slice of a whole tensor (a copy only where padding needs one)."""
        part = x.narrow(self.dim, self.start, self.stop - self.start)
        return pad(part, self.dim, self.size)


def pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` with zeros appended along ``dim`` up to ``size``."""
    missing = size - x.shape[dim]
    if not missing:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


_LAYER = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(experts\.\d+\.|shared_expert\.)?(\w+)_proj\.(weight|bias)$")


class ShardLayout:
    def __init__(self, cfg: LlamaConfig, rank: int, size: int) -> None:
        h, kv, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
        if cfg.fused_checkpoint:
            raise ModelLoadError(f"--tensor-parallel-size {size}: {cfg.architecture}'s files hold q/k/v and "
                                 f"gate/up fused, which are not split across ranks yet")
        if cfg.qk_norm_whole:
            raise ModelLoadError(f"--tensor-parallel-size {size}: {cfg.architecture}'s q/k norms span every head, "
                                 f"which are not split across ranks yet")
        if size > h or h % size:
            raise ModelLoadError(f"--tensor-parallel-size {size} does not divide the model's {h} attention heads "
                                 f"(use a divisor of {h})")
        if kv % size and size % kv:
            raise ModelLoadError(f"--tensor-parallel-size {size} and the model's {kv} key/value heads: one must "
                                 f"divide the other (each rank holds a share of them, or one replicated)")
        if inter % size:
            raise ModelLoadError(f"--tensor-parallel-size {size} does not divide the model's intermediate size "
                                 f"{inter}")
        for what, rows in (("experts'", cfg.expert_intermediate_size),
                           ("shared expert's", cfg.shared_expert_intermediate_size)):
            if rows % size:
                raise ModelLoadError(f"--tensor-parallel-size {size} does not divide the model's {what} intermediate "
                                     f"size {rows}")
        self.cfg, self.rank, self.size = cfg, rank, size
        self.heads = h // size
        self.head_start = rank * self.heads
        self.replicated_kv = kv % size != 0
        self.kv_heads = 1 if self.replicated_kv else kv // size
        self.kv_start = self.head_start // (h // kv) if self.replicated_kv else rank * self.kv_heads
        self.inter = inter // size
        self.expert_inter = cfg.expert_intermediate_size // size  # each expert's rows, as the MLP's
        self.shared_inter = cfg.shared_expert_intermediate_size // size
        self.vocab = -(-cfg.vocab_size // size)
        self.vocab_start = rank * self.vocab

    def local_config(self) -> LlamaConfig:
        """The model one rank builds: its heads, KV heads, MLP rows and vocabulary rows."""
        return dataclasses.replace(self.cfg, num_heads=self.heads, num_kv_heads=self.kv_heads,
                                   intermediate_size=self.inter, expert_intermediate_size=self.expert_inter,
                                   shared_expert_intermediate_size=self.shared_inter,
                                   vocab_size=self.vocab)

    def describe(self) -> str:
        kv = (f"KV head {self.kv_start} (replicated: {self.cfg.num_kv_heads} KV heads for {self.size} ranks)"
              if self.replicated_kv else
              f"KV heads {self.kv_start}-{self.kv_start + self.kv_heads - 1} of {self.cfg.num_kv_heads}")
        return (f"rank {self.rank} of {self.size}: heads {self.head_start}-{self.head_start + self.heads - 1} of "
                f"{self.cfg.num_heads}, {kv}, MLP rows {self.rank * self.inter}-{(self.rank + 1) * self.inter - 1}, "
                f"vocabulary rows {self.vocab_start}-{min(self.cfg.vocab_size, self.vocab_start + self.vocab) - 1}")

    def slice_for(self, name: str, shape: tuple[int, ...]) -> Slice | None:
        """The part of checkpoint tensor ``name`` (whole shape ``shape``) this rank holds; None: all of it."""
        d = self.cfg.head_dim
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            stop = min(self.cfg.vocab_size, self.vocab_start + self.vocab)
            return Slice(0, self.vocab_start, max(self.vocab_start, stop), self.vocab)
        match = _LAYER.match(name)
        if match is None:
            return None  # norms
        _, expert, proj, kind = match.groups()
        inter = self.shared_inter if expert == "shared_expert." else self.expert_inter if expert else self.inter
        if proj == "q":
            return Slice(0, self.head_start * d, (self.head_start + self.heads) * d, self.heads * d)
        if proj in ("k", "v"):
            return Slice(0, self.kv_start * d, (self.kv_start + self.kv_heads) * d, self.kv_heads * d)
        if proj in ("gate", "up"):
            return Slice(0, self.rank * inter, (self.rank + 1) * inter, inter)
        # o and down: row-parallel. The weight's input columns; the bias on rank 0 only.
        if kind == "bias":
            return None if self.rank == 0 else Slice(0, 0, 0, shape[0])
        width = self.heads * d if proj == "o" else inter
        start = self.rank * width
        return Slice(1, start, start + width, width)


def take_quantized(w: QuantizedWeight, sl: Slice) -> QuantizedWeight:
    """A slice of a whole quantized weight: rows, or input columns on group boundaries."""
    if sl.dim == 0:
        part = w.rows(torch.arange(sl.start, sl.stop))
        return part.pad_rows(sl.size)
    g = w.group
    if sl.start % g or sl.stop % g:
        raise ModelLoadError(f"a quantized weight's columns {sl.start}-{sl.stop} do not fall on its groups of {g}")
    return w.columns(sl.start, sl.stop)
