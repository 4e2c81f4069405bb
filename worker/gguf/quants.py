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

The K-quants (the ``Q*_K_M`` / ``Q*_K_S`` files) use super-blocks of 256 weights in 16 or 8
sub-blocks, each with its own integer scale (and minimum) under fp16 super-scales:

=======  =====  ==========================================================================
type     bytes  layout; weight l of sub-block i
=======  =====  ==========================================================================
Q4_K     144    d, dmin, 12 bytes of 6-bit scales sc_i and mins m_i (8 sub-blocks of 32),
                128 code bytes: sub-blocks 2k and 2k+1 are the low and high nibbles of
                bytes 32k..32k+31; weight = d * sc_i * q - dmin * m_i
Q5_K     176    as Q4_K, with 32 bytes before the codes whose bit i of byte l is the fifth
                bit of weight l of sub-block i
Q6_K     210    128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 int8 scales (16
                sub-blocks of 16), d last; weight = d * sc_i * (q - 32)
=======  =====  ==========================================================================

F32, F16 and BF16 tensors are read as they are. Any other type is refused by name.

``block_codes`` reads every quantized type above into one form, per 32 inputs (Q6_K: per 16),
``scale * code + min`` with unsigned codes and the file's own factors: the quantized linear
kernel's input, and what ``dequantize`` multiplies out (each type bit for bit as the ``gguf``
package's dequantizer).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from worker.model.quantized import SUPER, QuantizedWeight

BLOCK = 32
_BLOCK_BYTES = {QType.Q4_0: 18, QType.Q4_1: 20, QType.Q5_0: 22, QType.Q5_1: 24, QType.Q8_0: 34}
_K_BYTES = {QType.Q4_K: 144, QType.Q5_K: 176, QType.Q6_K: 210}
SUPPORTED = (QType.F32, QType.F16, QType.BF16, *_BLOCK_BYTES, *_K_BYTES)


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
    per_block = SUPER if qtype in _K_BYTES else BLOCK
    codes = block_codes(data, qtype, (int(np.prod(shape)) // per_block, per_block)) if qtype in KEPT_BITS else None
    if codes is None:
        name = getattr(qtype, "name", str(qtype))
        raise UnsupportedTensorType(f"tensor type {name} is not supported (supported: "
                                    f"{', '.join(t.name for t in SUPPORTED)})")
    return codes.dequantize().reshape(shape)  # one reading of the blocks, shared with the kernel's


# The types ``block_codes`` reads, with the width their codes are stored in (``worker.model.quantized``).
KEPT_BITS = {QType.Q4_0: 4, QType.Q4_1: 4, QType.Q4_K: 4, QType.Q5_0: 5, QType.Q5_1: 5, QType.Q5_K: 5,
             QType.Q8_0: 8, QType.Q6_K: 6}


def reads_codes(qtype: QType, shape: tuple[int, ...]) -> bool:
    """Whether ``block_codes`` reads a tensor of this type and shape."""
    return qtype in KEPT_BITS and len(shape) == 2 and shape[1] % BLOCK == 0


def block_codes(data: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> QuantizedWeight | None:
    """A 2-D tensor of one of ``KEPT_BITS``' types as unsigned codes and the file's own factors
    (fp16 scales, the K-quants' integer sub-scales); None for any other type (or shape)."""
    if not reads_codes(qtype, shape):
        return None
    rows, cols = shape
    raw = _torch_bytes(data)
    bits, name = KEPT_BITS[qtype], (qtype.name,)
    if qtype == QType.Q6_K:
        blocks = raw.reshape(-1, _K_BYTES[qtype])
        n = blocks.shape[0]
        low = blocks[:, :128].reshape(n, 2, 64)  # two halves of 128 weights
        high = blocks[:, 128:192].reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
        codes = torch.cat([low & 0x0F, low >> 4], dim=2) | ((high & 3).reshape(n, 2, 128) << 4)
        return QuantizedWeight(codes.reshape(rows, cols).contiguous(), bits, 16,
                               blocks[:, 192:208].contiguous().view(torch.int8).reshape(rows, cols // 16), None,
                               -32.0, name, super_scales=_f16(blocks, 208).reshape(rows, cols // SUPER))
    if qtype in _K_BYTES:
        blocks = raw.reshape(-1, _K_BYTES[qtype])
        n = blocks.shape[0]
        sc, mins = _scales_and_mins(blocks[:, 4:16])
        packed = (blocks[:, 48:] if qtype == QType.Q5_K else blocks[:, 16:]).reshape(n, 4, 1, BLOCK)
        codes = torch.cat([packed & 0x0F, packed >> 4], dim=2).reshape(n, 8, BLOCK)
        if qtype == QType.Q5_K:
            fifth = blocks[:, 16:48].reshape(n, 1, BLOCK) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
            codes |= (fifth & 1) << 4
        per_row = cols // SUPER
        return QuantizedWeight(codes.reshape(rows, cols).contiguous(), bits, BLOCK,
                               sc.view(torch.int8).reshape(rows, cols // BLOCK), mins.view(torch.int8).reshape(rows, cols // BLOCK),
                               0.0, name, super_scales=_f16(blocks, 0).reshape(rows, per_row),
                               super_mins=(-_f16(blocks, 2)).reshape(rows, per_row))  # fp16 negation: exact
    blocks = raw.reshape(-1, _BLOCK_BYTES[qtype])
    scales = _f16(blocks, 0).reshape(rows, cols // BLOCK)
    if qtype == QType.Q8_0:
        codes = blocks[:, 2:] ^ 0x80  # q + 128 for an int8 q, without widening (a 28 MiB embedding took 140 at load)
        return QuantizedWeight(codes.reshape(rows, cols), bits, BLOCK, scales, None, -128.0, name)
    with_offset = qtype in (QType.Q4_1, QType.Q5_1)
    five_bits = qtype in (QType.Q5_0, QType.Q5_1)
    at = 4 if with_offset else 2
    packed = blocks[:, at + 4 if five_bits else at :]
    codes = torch.cat([packed & 0x0F, packed >> 4], dim=1)
    if five_bits:
        high = blocks[:, at : at + 4].contiguous().view(torch.int32)
        codes |= (((high >> torch.arange(BLOCK, dtype=torch.int32)) & 1) << 4).to(torch.uint8)
    offsets = _f16(blocks, 2).reshape(rows, cols // BLOCK) if with_offset else None
    return QuantizedWeight(codes.reshape(rows, cols), bits, BLOCK, scales, offsets, -16.0 if five_bits else -8.0, name)


def _scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of Q4_K/Q5_K -> 8 six-bit scales and 8 six-bit mins. Sub-blocks 0-3:
    the low 6 bits of bytes 0-3 (scales) and 4-7 (mins). Sub-blocks 4-7: the low (scales) and
    high (mins) nibbles of bytes 8-11, topped with the 2 spare high bits of bytes 0-3 / 4-7."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], dim=1)
    mins = torch.cat([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], dim=1)
    return scales, mins


def _torch_bytes(data: np.ndarray) -> torch.Tensor:
    """``data``'s bytes as a flat uint8 tensor; shared with ``data`` unless torch cannot share a
    read-only array (then copied)."""
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return torch.from_numpy(raw if raw.flags.writeable else raw.copy())


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte ``at`` of every block, as a column [N, 1]."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16)
