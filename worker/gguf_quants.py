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
    """A tensor's bytes as GGUF stores them (any dtype: only the bytes count) -> float32 tensor of
    ``shape`` (rows first, as PyTorch lays a weight out). F32 data comes back as a view of
    ``data`` when that is writable (a copy-on-write file map): no copy for weights that need none."""
    raw = _torch_bytes(data)
    if qtype == QType.F32:
        return raw.view(torch.float32).reshape(shape)
    if qtype == QType.F16:
        return raw.view(torch.float16).float().reshape(shape)
    if qtype == QType.BF16:
        return raw.view(torch.bfloat16).float().reshape(shape)
    size = _BLOCK_BYTES.get(qtype)
    if size is None:
        name = getattr(qtype, "name", str(qtype))
        raise UnsupportedTensorType(f"tensor type {name} is not supported (supported: "
                                    f"{', '.join(t.name for t in SUPPORTED)})")
    blocks = raw.reshape(-1, size)
    d = _f16(blocks, 0)
    if qtype == QType.Q8_0:
        return blocks[:, 2:].contiguous().view(torch.int8).float().mul_(d).reshape(shape)
    # The codes go straight into the float output and the arithmetic runs in place: a third
    # less time than building an integer tensor first (load time is mostly this function).
    with_offset = qtype in (QType.Q4_1, QType.Q5_1)
    five_bits = qtype in (QType.Q5_0, QType.Q5_1)
    at = 4 if with_offset else 2
    codes = blocks[:, at + 4 if five_bits else at :]
    out = torch.empty(blocks.shape[0], BLOCK, dtype=torch.float32)
    out[:, : BLOCK // 2] = codes & 0x0F
    out[:, BLOCK // 2 :] = codes >> 4
    if five_bits:
        high = blocks[:, at : at + 4].contiguous().view(torch.int32)  # [N, 1], little-endian
        out.add_((high >> torch.arange(BLOCK, dtype=torch.int32)) & 1, alpha=16)  # bit j -> weight j
    if with_offset:
        return out.mul_(d).add_(_f16(blocks, 2)).reshape(shape)
    return out.sub_(16.0 if five_bits else 8.0).mul_(d).reshape(shape)


def _torch_bytes(data: np.ndarray) -> torch.Tensor:
    """``data``'s bytes as a flat uint8 tensor; shared with ``data`` unless torch cannot share a
    read-only array (then copied)."""
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return torch.from_numpy(raw if raw.flags.writeable else raw.copy())


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte ``at`` of every block, as a float32 column [N, 1]."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()
