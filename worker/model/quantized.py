"""A weight kept quantized: the one form every GGUF block format Sluice computes on reduces to.

A row of the weight is cut into groups of 32 (Q6_K: 16) inputs, and weight j of a group is
``scale * code_j + min`` with small unsigned integer codes. ``worker.gguf.quants.block_codes``
reads a file's blocks into this form exactly (``dequantize()`` here is bit for bit the file's
weights), and the C kernel (``kernels/csrc/linear_q.c``) multiplies by it without widening the
codes to floats. The factors are kept as the file keeps them, so that a decode step reads the
file's bytes and no more:

* ``half``: an fp16 scale per group, and an fp16 min (Q4_1, Q5_1) or ``min = offset * scale``
  (Q4_0: offset -8, Q5_0: -16, Q8_0: -128, its codes stored as ``q + 128``);
* ``super``: the K-quants' integer sub-scales (int8 per group) under fp16 factors per 256 inputs,
  ``scale = super_scale * sub_scale`` and ``min = super_min * sub_min`` (Q4_K, Q5_K) or
  ``offset * scale`` (Q6_K, offset -32);
* ``float``: float32 scales and mins per group. Exact for every format, one float a factor: the
  form that parts of different formats stacked into one projection share (``cat``).

The codes are stored in ``bits`` bits (4, 5, 6 or 8): a nibble, plus a plane of one or two high
bits, or a byte.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import torch

BLOCK = 32  # inputs per kernel block
SUPER = 256  # inputs per K-quant super-block

Kind = Literal["float", "half", "super"]
_TENSORS = ("codes", "scales", "mins", "super_scales", "super_mins")


@dataclasses.dataclass
class QuantizedWeight:
    codes: torch.Tensor                # [out, in] uint8, each below 2 ** bits
    bits: int                          # 4, 5, 6 or 8: the width the codes are stored in
    group: int                         # inputs per scale (and min): 32, or 16 (Q6_K)
    scales: torch.Tensor               # [out, in / group]: float32 ("float"), float16 ("half") or int8 ("super")
    mins: torch.Tensor | None          # as scales, or None: min = offset * scale
    offset: float                      # the min's multiple of the scale where mins is None
    formats: tuple[str, ...]           # the GGUF types it came from ("Q4_1",), for the log and /v1/models
    super_scales: torch.Tensor | None = None  # [out, in / 256] float16: "super" only
    super_mins: torch.Tensor | None = None    # [out, in / 256] float16: "super" with mins only

    @property
    def kind(self) -> Kind:
        return "super" if self.super_scales is not None else "half" if self.scales.dtype == torch.float16 else "float"

    def _per_group(self, t: torch.Tensor) -> torch.Tensor:
        """A factor per 256 inputs repeated for each of its groups."""
        return t.float().repeat_interleave(SUPER // self.group, dim=1)

    def float_scales(self) -> torch.Tensor:
        """The scale of every group as float32 [out, in / group] (exact: an fp16 times a small integer)."""
        if self.super_scales is not None:
            return self._per_group(self.super_scales) * self.scales.float()
        return self.scales.float()

    def float_mins(self) -> torch.Tensor:
        """The min of every group as float32 [out, in / group] (exact, as ``float_scales``)."""
        if self.mins is None:
            return self.float_scales() * self.offset  # offset a power of two: exact
        if self.super_mins is not None:
            return self._per_group(self.super_mins) * self.mins.float()
        return self.mins.float()

    @property
    def nbytes(self) -> int:
        """What the kernel's packed form holds: codes, factors and the K-quants' super factors."""
        total = self.codes.numel() * self.bits // 8
        for t in (self.scales, self.mins, self.super_scales, self.super_mins):
            total += t.numel() * t.element_size() if t is not None else 0
        return total

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 [out, in]."""
        out, in_features = self.codes.shape
        groups = self.codes.reshape(out, in_features // self.group, self.group).float()
        weight = groups.mul_(self.float_scales().unsqueeze(-1)).add_(self.float_mins().unsqueeze(-1))
        return weight.reshape(out, in_features)

    def _map(self, fn: Callable[[str, torch.Tensor], torch.Tensor]) -> QuantizedWeight:
        """The weight with ``fn(name, tensor)`` in place of each of its tensors (all indexed by output first)."""
        changes: dict[str, Any] = {name: fn(name, t) for name in _TENSORS if (t := getattr(self, name)) is not None}
        return dataclasses.replace(self, **changes)

    def rows(self, order: torch.Tensor) -> QuantizedWeight:
        """The rows in ``order`` (a permutation or a selection of output rows)."""
        return self._map(lambda _, t: t[order])

    def row_range(self, start: int, stop: int) -> QuantizedWeight:
        """Rows ``start`` .. ``stop`` - 1, as views."""
        return self._map(lambda _, t: t[start:stop])

    def pad_rows(self, rows: int) -> QuantizedWeight:
        """Zero rows appended up to ``rows`` (codes and factors all zero: weight 0)."""
        missing = rows - self.codes.shape[0]
        if missing <= 0:
            return self
        return self._map(lambda _, t: torch.cat([t, t.new_zeros((missing, *t.shape[1:]))]))

    def columns(self, start: int, stop: int) -> QuantizedWeight:
        """Input columns ``start``..``stop``, on group boundaries (a row-parallel shard). Off the
        K-quants' 256-input super-blocks, in the float form."""
        g = self.group
        assert start % g == 0 and stop % g == 0, (start, stop, g)
        w = self if self.super_scales is None or (start % SUPER == 0 and stop % SUPER == 0) else self.as_float()
        span = {"codes": 1, "scales": g, "mins": g, "super_scales": SUPER, "super_mins": SUPER}
        return w._map(lambda name, t: t[:, start // span[name] : stop // span[name]].contiguous())

    def as_float(self, bits: int | None = None, group: int | None = None) -> QuantizedWeight:
        """The same weight in the float form (codes stored in ``bits``, factors per ``group``
        inputs, 16 where the weight's group is 32): exact."""
        bits, group = bits or self.bits, group or self.group
        assert bits >= self.bits and self.group % group == 0, (self.bits, bits, self.group, group)
        per = self.group // group
        return QuantizedWeight(self.codes, bits, group, self.float_scales().repeat_interleave(per, dim=1),
                               self.float_mins().repeat_interleave(per, dim=1), 0.0, self.formats)

    def _shape(self) -> tuple[object, ...]:
        """What two weights must share to be stacked as they are."""
        return (self.kind, self.bits, self.group, self.mins is None, self.offset, self.super_mins is None)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Parts stacked along the outputs (q, k, v into one qkv projection). Parts of one format
        stay in it; parts of several take the float form, in the widest codes and narrowest
        groups any needs."""
        formats = tuple(dict.fromkeys(f for p in parts for f in p.formats))
        if len({p._shape() for p in parts}) > 1:
            bits, group = max(p.bits for p in parts), min(p.group for p in parts)
            parts = [p.as_float(bits, group) for p in parts]
        stacked = parts[0]._map(lambda name, _: torch.cat([getattr(p, name) for p in parts]))
        return dataclasses.replace(stacked, formats=formats)


@dataclasses.dataclass(frozen=True)
class PendingQuantized:
    """A quantized weight a checkpoint reads only when the model takes it (``read()``): a load
    that packs each weight as it is taken then holds one weight's codes (a byte a weight) at a
    time, not the whole model's (SmolLM2: 101 MiB of load peak)."""

    read: Callable[[], QuantizedWeight]


def read_now(value: Any) -> Any:
    """``value``, or the weight it stands for where it is a ``PendingQuantized``."""
    return value.read() if isinstance(value, PendingQuantized) else value


# What a checkpoint reader gives for a tensor name.
CheckpointValue = torch.Tensor | QuantizedWeight | PendingQuantized
