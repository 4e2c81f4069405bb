"""A quantized weight (``worker.model.quantized``) in the records the quantized linear kernel
reads (``csrc/linear_q.c``, whose header draws them), and read back.

A record holds 16 outputs by 32 inputs: the codes in their own width (a nibble vector per two
4-input groups, then the planes of the high bits, or a byte each), then per part (the 32
inputs, or 0-15 and 16-31 where a scale covers 16) the 16 scales and, unless ``min = offset *
scale``, the 16 mins, each in the weight's own type (float32, fp16, or the K-quants' int8 under
a header of fp16 super-factors before every 8 records). The records are what a decode step
reads: their size is within a few percent of the file's tensors (``PackedFormat.bits_per_weight``).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from worker.model.quantized import BLOCK, QuantizedWeight

OUTPUTS = 16  # outputs per record
_KINDS = {"float": 0, "half": 1, "super": 2}
_FACTOR_DTYPES = {"float": torch.float32, "half": torch.float16, "super": torch.int8}


@dataclasses.dataclass(frozen=True)
class PackedFormat:
    bits: int          # 4, 5, 6 or 8
    kind: str          # "float", "half" or "super" (QuantizedWeight.kind)
    parts: int         # 2 where a scale covers 16 inputs, else 1
    mins: bool         # mins stored (else min = offset * scale)
    offset: float      # -8, -16, -32, -128: a negative power of two, or 0 with mins

    @staticmethod
    def of(w: QuantizedWeight) -> PackedFormat:
        return PackedFormat(w.bits, w.kind, BLOCK // w.group, w.mins is not None, 0.0 if w.mins is not None else w.offset)

    @property
    def word(self) -> int:
        """The int linear_q.c's parse_format reads."""
        shift = 0 if self.mins else int(math.log2(-self.offset))
        assert self.mins or self.offset == -(2 ** shift), self.offset
        return self.bits | _KINDS[self.kind] << 4 | (self.parts == 2) << 6 | self.mins << 7 | shift << 8

    @property
    def code_bytes(self) -> int:
        return 512 if self.bits == 8 else 256 + 64 * (self.bits - 4)

    @property
    def unit(self) -> int:
        """Bytes of 16 factors."""
        return 16 * _FACTOR_DTYPES[self.kind].itemsize

    @property
    def record(self) -> int:
        return self.code_bytes + self.parts * self.unit * (2 if self.mins else 1)

    @property
    def header(self) -> int:
        """Bytes before every 8 records: 16 fp16 super-scales (and super-mins)."""
        return 32 * (2 if self.mins else 1) if self.kind == "super" else 0

    @property
    def bits_per_weight(self) -> float:
        return 8 * (self.record + self.header / 8) / (OUTPUTS * BLOCK)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor [..., n] of any dtype as its bytes [..., n * itemsize]."""
    return t.contiguous().view(torch.uint8)


# Output blocks packed at a time: the temporaries (codes regrouped, nibbles, bit planes) are then
# a slice's, not the whole weight's (for SmolLM2's tied 49,152-row Q8_0 embedding, 28 MiB each,
# and the worker's load peaked there).
PACK_SLICE = 256


def pack(w: QuantizedWeight) -> tuple[torch.Tensor, PackedFormat]:
    """``w`` as records, one uint8 tensor [output blocks of 16, bytes], the last outputs padded
    with zeros; and the format to read them by."""
    fmt = PackedFormat.of(w)
    out, in_features = w.codes.shape
    blocks = in_features // BLOCK
    w = w.pad_rows(out + -out % OUTPUTS)
    ob = w.codes.shape[0] // OUTPUTS
    packed = torch.empty((ob, blocks * fmt.record + blocks // 8 * fmt.header), dtype=torch.uint8)
    for first in range(0, ob, PACK_SLICE):
        packed[first : first + PACK_SLICE] = _records(w.row_range(first * OUTPUTS, (first + PACK_SLICE) * OUTPUTS), fmt)
    return packed, fmt


def _records(w: QuantizedWeight, fmt: PackedFormat) -> torch.Tensor:
    """``pack``'s records of ``w``, whose rows fill whole output blocks."""
    ob, blocks = w.codes.shape[0] // OUTPUTS, w.codes.shape[1] // BLOCK
    groups = w.codes.reshape(ob, OUTPUTS, blocks, 8, 4).permute(0, 2, 3, 1, 4)  # [ob, block, group, output, input]
    if fmt.bits == 8:
        fields = [groups.reshape(ob, blocks, 512)]
    else:
        low = groups & 0x0F
        fields = [(low[:, :, :4] | (low[:, :, 4:] << 4)).reshape(ob, blocks, 256)]
        high = groups >> 4
        if fmt.bits == 5:  # bit g: group g's fifth bit
            plane = torch.zeros_like(high[:, :, 0])
            for g in range(8):
                plane |= (high[:, :, g] & 1) << g
            fields.append(plane.reshape(ob, blocks, 64))
        elif fmt.bits == 6:  # plane h, bits 2 j and 2 j + 1: group 4 h + j's fifth and sixth
            for h in range(2):
                plane = torch.zeros_like(high[:, :, 0])
                for j in range(4):
                    plane |= (high[:, :, 4 * h + j] & 3) << (2 * j)
                fields.append(plane.reshape(ob, blocks, 64))
    factors = [t for t in (w.scales, w.mins) if t is not None]
    for part in range(fmt.parts):
        for t in factors:  # [out, in / group] -> [ob, block, 16 outputs] of this part
            per_block = t.reshape(ob, OUTPUTS, blocks, fmt.parts)[..., part].transpose(1, 2)
            fields.append(_bytes(per_block))
    records = torch.cat(fields, dim=2)
    assert records.shape[2] == fmt.record, (records.shape, fmt)
    if fmt.header:
        supers = [t for t in (w.super_scales, w.super_mins) if t is not None]
        header = torch.cat([_bytes(t.reshape(ob, OUTPUTS, -1).transpose(1, 2)) for t in supers], dim=2)
        records = torch.cat([header, records.reshape(ob, blocks // 8, -1)], dim=2)
    return records.reshape(ob, -1)


def unpack(packed: torch.Tensor, fmt: PackedFormat, out_features: int,
           rows: torch.Tensor | None = None) -> QuantizedWeight:
    """The weight (or its ``rows``) back from ``pack``'s records: what the kernel multiplies by,
    and how a tied embedding looks its rows up in the output projection."""
    selected = torch.arange(out_features) if rows is None else rows
    per_block = packed[selected // OUTPUTS]  # [R, bytes]
    n = len(selected)
    blocks = per_block.shape[1] * 8 // (8 * fmt.record + fmt.header)
    lane = selected % OUTPUTS
    pick = torch.arange(n)
    supers: list[torch.Tensor] = []
    if fmt.header:
        by_super = per_block.reshape(n, blocks // 8, -1)
        header = by_super[:, :, : fmt.header].reshape(n, blocks // 8, -1, OUTPUTS, 2)
        supers = [h.contiguous().view(torch.float16)[pick, :, lane, 0] for h in header.unbind(2)]  # [R, supers]
        records = by_super[:, :, fmt.header :].reshape(n, blocks, fmt.record)
    else:
        records = per_block.reshape(n, blocks, fmt.record)
    if fmt.bits == 8:
        codes = records[:, :, :512].reshape(n, blocks, 8, OUTPUTS, 4)[pick, :, :, lane]  # [R, block, group, 4]
    else:
        nibbles = records[:, :, :256].reshape(n, blocks, 4, OUTPUTS, 4)[pick, :, :, lane]
        codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=2)
        planes = records[:, :, 256 : fmt.code_bytes].reshape(n, blocks, -1, OUTPUTS, 4)[pick, :, :, lane]
        for g in range(8):
            if fmt.bits == 5:
                codes[:, :, g] |= ((planes[:, :, 0] >> g) & 1) << 4
            elif fmt.bits == 6:
                codes[:, :, g] |= ((planes[:, :, g // 4] >> (2 * (g % 4))) & 3) << 4
    dtype = _FACTOR_DTYPES[fmt.kind]
    count = 2 if fmt.mins else 1
    factors = records[:, :, fmt.code_bytes :].reshape(n, blocks, fmt.parts, count, fmt.unit)
    values = factors.contiguous().view(dtype).reshape(n, blocks, fmt.parts, count, OUTPUTS)[pick, :, :, :, lane]
    scales = values[:, :, :, 0].reshape(n, -1)
    mins = values[:, :, :, 1].reshape(n, -1) if fmt.mins else None
    return QuantizedWeight(codes.reshape(n, -1), fmt.bits, BLOCK // fmt.parts, scales, mins, fmt.offset, (),
                           super_scales=supers[0] if supers else None,
                           super_mins=supers[1] if len(supers) > 1 else None)
