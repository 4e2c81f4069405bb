"""Dequantization of the GGUF tensor types llama.cpp files commonly use, vectorised in torch.

Each quantized type stores a row as blocks of 32 weights; a block starts with an fp16 scale
``d`` (and, for the ``_1`` types, an fp16 offset ``m``), then packed integer codes:

=======  =====  ==========================================================================
type     bytes  weight j of a block
=======  =====  ==========================================================================
Q4_0     18     d * (q_j - 8), q_j a 4-bit code: the low nibbles of the 16 code bytes are
                weights 0..15, the high nibbles weights 16..31
Q4_1     20     d * q_j + m, codes as Q4_0
Q5_0     22     d * (q_j - 16), q_j = 4-bit code as Q4_0 plus a fifth bit, bit j of the
                little-endian uint32 that follows the scale
Q5_1     24     d * q_j + m, codes as Q5_0
Q8_0     34     d * q_j, q_j an int8
=======  =====  ==========================================================================

F32, F16 and BF16 tensors are read as they are. Any other type is refused by name.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

BLOCK = 32
_BLOCK_BYTES = {QType.Q4_0: 18, QType.Q4_1: 20, QType.Q5_0: 22, QType.Q5_1: 24, QType.Q8_0: 34}
SUPPORTED = (QType.F32, QType.F16, QType.BF16, *_BLOCK_BYTES)


class UnsupportedTensorType(ValueError):
    pass


def dequantize(data: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> torch.Tensor:
    """``data`` as a GGUF reader returns it (raw bytes for quantized types) -> float32 tensor of
    ``shape`` (rows first, as PyTorch lays a weight out)."""
    if qtype == QType.F32:
        return torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape)
    if qtype == QType.F16:
        return torch.from_numpy(np.array(data).view(np.float16)).float().reshape(shape)
    if qtype == QType.BF16:
        raw = torch.from_numpy(np.array(data).view(np.int16))
        return raw.view(torch.bfloat16).float().reshape(shape)
    size = _BLOCK_BYTES.get(qtype)
    if size is None:
        name = getattr(qtype, "name", str(qtype))
        raise UnsupportedTensorType(f"tensor type {name} is not supported (supported: "
                                    f"{', '.join(t.name for t in SUPPORTED)})")
    blocks = torch.from_numpy(np.array(data, dtype=np.uint8)).reshape(-1, size)  # a copy: the map is read-only
    d = _f16(blocks, 0)
    if qtype == QType.Q8_0:
        q = blocks[:, 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(shape)
    offset = 4 if qtype in (QType.Q4_1, QType.Q5_1) else 2
    m = _f16(blocks, 2) if offset == 4 else None
    if qtype in (QType.Q5_0, QType.Q5_1):
        high = blocks[:, offset : offset + 4].contiguous().view(torch.int32)  # [N, 1], little-endian
        bits = (high >> torch.arange(BLOCK, dtype=torch.int32)) & 1  # [N, 32]: bit j for weight j
        q = _nibbles(blocks[:, offset + 4 :]) | (bits << 4).to(torch.uint8)
        zero = 16.0
    else:
        q = _nibbles(blocks[:, offset:])
        zero = 8.0
    values = q.float()
    out = d * values + m if m is not None else d * (values - zero)
    return out.reshape(shape)


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte ``at`` of every block, as a float32 column [N, 1]."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[N, 16] bytes -> [N, 32] 4-bit codes: the low nibbles first, then the high ones."""
    return torch.cat([codes & 0x0F, codes >> 4], dim=1)
