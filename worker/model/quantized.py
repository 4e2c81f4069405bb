"""A weight kept quantized: the one form every GGUF block format Sluice computes on reduces to.

A row of the weight is cut into groups of 32 (or 16) inputs, and weight j of a group is
``scale * code_j + min`` with small unsigned integer codes. ``worker.gguf.quants.block_codes``
reads a file's blocks into this form exactly (``dequantize()`` here is bit for bit the file's
weights), and the C kernel (``kernels/csrc/linear_q.c``) multiplies by it without widening the
codes to floats. How the kernel stores it, its ``layout``:

* 4: codes below 16, a scale and min per 32 inputs (Q4_0, Q4_1, Q4_K): two codes a byte;
* 8: codes below 256, per 32 inputs (Q5_0, Q5_1, Q5_K, Q8_0): a byte each;
* 16: codes below 256, per 16 inputs (Q6_K): a byte each, two scales and mins per 32 inputs.
"""

from __future__ import annotations

import dataclasses

import torch

BLOCK = 32  # inputs per kernel block


@dataclasses.dataclass
class QuantizedWeight:
    codes: torch.Tensor   # [out, in] uint8
    scales: torch.Tensor  # [out, in / group] float32
    mins: torch.Tensor    # [out, in / group] float32
    layout: int           # 4, 8 or 16 (above)
    formats: tuple[str, ...]  # the GGUF types it came from ("Q4_1",), for the log and /v1/models

    @property
    def group(self) -> int:
        """Inputs per scale and min."""
        return 16 if self.layout == 16 else BLOCK

    @property
    def nbytes(self) -> int:
        """What the kernel's packed form holds (codes, scales and mins)."""
        return self.codes.numel() * (1 if self.layout == 4 else 2) // 2 + 4 * (self.scales.numel() + self.mins.numel())

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 [out, in]."""
        out, in_features = self.codes.shape
        groups = self.codes.reshape(out, in_features // self.group, self.group).float()
        return groups.mul_(self.scales.unsqueeze(-1)).add_(self.mins.unsqueeze(-1)).reshape(out, in_features)

    def rows(self, order: torch.Tensor) -> QuantizedWeight:
        """The rows in ``order`` (a permutation or a selection of output rows)."""
        return dataclasses.replace(self, codes=self.codes[order], scales=self.scales[order], mins=self.mins[order])

    def in_layout(self, layout: int) -> QuantizedWeight:
        """The same weight stored in a wider ``layout`` (4 -> 8 -> 16): exact, codes and factors unchanged."""
        if layout == self.layout:
            return self
        assert layout > self.layout, (self.layout, layout)
        per = 2 if layout == 16 and self.group == BLOCK else 1
        return dataclasses.replace(self, scales=self.scales.repeat_interleave(per, dim=1),
                                   mins=self.mins.repeat_interleave(per, dim=1), layout=layout)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Parts stacked along the outputs (q, k, v into one qkv projection), in the widest layout any needs."""
        layout = max(p.layout for p in parts)
        parts = [p.in_layout(layout) for p in parts]
        formats = tuple(dict.fromkeys(f for p in parts for f in p.formats))
        return QuantizedWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                               torch.cat([p.mins for p in parts]), layout, formats)
