"""A weight kept quantized: the one form every GGUF block format Sluice computes on reduces to.

A row of the weight is cut into blocks of 32 inputs, and weight j of a block is
``scale * code_j + min`` with small unsigned integer codes: 4-bit (Q4_0, Q4_1, Q4_K) or up to
8-bit (Q5_0, Q5_1, Q5_K, Q8_0). ``worker.gguf.quants.block_codes`` reads a file's blocks into this
form exactly (its dequantization is ``dequantize()`` here, bit for bit the file's), and the C
kernel (``kernels/csrc/linear_q.c``) multiplies by it without ever widening the codes to floats.
"""

from __future__ import annotations

import dataclasses

import torch

BLOCK = 32  # inputs per block: every format here has a scale and a min per 32 inputs


@dataclasses.dataclass
class QuantizedWeight:
    codes: torch.Tensor   # [out, in] uint8, each < 2**bits
    scales: torch.Tensor  # [out, in / 32] float32
    mins: torch.Tensor    # [out, in / 32] float32
    bits: int             # 4 or 8: how the kernel stores the codes
    formats: tuple[str, ...]  # the GGUF types it came from ("Q4_1",), for the log and /v1/models

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 [out, in]."""
        out, in_features = self.codes.shape
        blocks = self.codes.reshape(out, in_features // BLOCK, BLOCK).float()
        return blocks.mul_(self.scales.unsqueeze(-1)).add_(self.mins.unsqueeze(-1)).reshape(out, in_features)

    def rows(self, order: torch.Tensor) -> QuantizedWeight:
        """The rows in ``order`` (a permutation or a selection of output rows)."""
        return dataclasses.replace(self, codes=self.codes[order], scales=self.scales[order], mins=self.mins[order])

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Parts stacked along the outputs (q, k, v into one qkv projection); 8-bit storage if any
        part needs it."""
        formats = tuple(dict.fromkeys(f for p in parts for f in p.formats))
        return QuantizedWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                               torch.cat([p.mins for p in parts]), max(p.bits for p in parts), formats)
