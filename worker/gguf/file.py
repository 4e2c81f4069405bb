"""The GGUF container: header, metadata and tensor directory, read straight from a memory map.

The ``gguf`` package supplies the format's vocabulary (value types, tensor types, block sizes) and
its ``GGUFReader`` is the reference the tests compare against. Sluice does not load files through
that reader because it wraps every element of every metadata array in its own numpy view: a
49k-token vocabulary plus its merges is ~150k views and several seconds before the first weight
is touched. Here metadata values become plain Python values (``struct`` for scalars and strings,
one ``np.frombuffer`` per numeric array), which takes a fraction of a second.

Layout (version 2 and 3, little-endian): magic ``GGUF``, u32 version, u64 tensor count, u64
metadata count; the metadata as (string key, u32 value type, value); the tensor directory as
(string name, u32 n_dims, u64 dims fastest-first, u32 tensor type, u64 offset); then, aligned to
``general.alignment`` (32 by default), the tensor data the offsets point into. A string is a u64
byte length and UTF-8 bytes; an array is a u32 item type, a u64 count and the items.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

_VERSIONS = (2, 3)
_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader understands; the message says where and why."""


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # rows first, as PyTorch lays the tensor out (GGUF lists dims fastest first)
    qtype: GGMLQuantizationType
    data: np.ndarray  # the tensor's bytes (uint8), a view of the file map: nothing is read until used

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape))


class GGUFFile:
    """``metadata`` (key -> int, float, bool, str or list) and ``tensors`` (name -> GGUFTensor)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # Copy-on-write: torch can wrap the pages without a copy or a read-only warning, and
        # nothing is ever written back to the file.
        self._map = np.memmap(path, mode="c")
        self._buf = self._map.data  # a memoryview: struct reads from it without copies
        self._at = 0
        magic, version = self._unpack("<II")
        if magic != GGUF_MAGIC:
            raise GGUFFormatError("no GGUF magic at the start")
        if version not in _VERSIONS:
            raise GGUFFormatError(f"GGUF version {version} (big-endian or unknown; readable: 2, 3)")
        self.version = version
        n_tensors, n_fields = self._unpack("<QQ")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            self.metadata[key] = self._value(self._value_type())
        directory = [self._tensor_entry() for _ in range(n_tensors)]
        alignment = int(self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"general.alignment {alignment} is not a power of two")
        data_start = -(-self._at // alignment) * alignment
        self.tensors: dict[str, GGUFTensor] = {}
        for name, shape, qtype, offset in directory:
            if name in self.tensors:
                raise GGUFFormatError(f"tensor {name} appears twice")
            self.tensors[name] = self._tensor(name, shape, qtype, data_start + offset)

    # ------------------------------------------------------------------ primitives

    def release(self, tensor: GGUFTensor) -> None:
        """Drop the pages that lie wholly inside ``tensor``'s bytes from resident memory, once it
        is copied out: the load then holds the file's pages one tensor at a time, not all at once
        (as ``release_pages``: a later read faults them back in from the file)."""
        raw = getattr(self._map, "_mmap", None)
        if raw is None or not hasattr(mmap, "MADV_DONTNEED") or tensor.data.size == 0:
            return
        begin = tensor.data.ctypes.data - self._map.ctypes.data
        start = -(-begin // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (begin + tensor.data.size) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            raw.madvise(mmap.MADV_DONTNEED, start, end - start)

    def release_pages(self) -> None:
        """Drop the file's pages from this process's resident memory once the weights are copied
        out (a quantized file kept quantized is read whole at load: ~its size in RSS otherwise).
        The map is private and unmodified, so a later read faults the bytes back in from the file."""
        raw = getattr(self._map, "_mmap", None)
        if raw is not None and hasattr(mmap, "MADV_DONTNEED"):
            raw.madvise(mmap.MADV_DONTNEED)

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        try:
            values = struct.unpack_from(fmt, self._buf, self._at)
        except struct.error:
            raise GGUFFormatError(f"truncated at byte {self._at}") from None
        self._at += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        end = self._at + length
        if end > len(self._buf):
            raise GGUFFormatError(f"a string at byte {self._at} runs past the end of the file")
        raw = bytes(self._buf[self._at : end])
        self._at = end
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFFormatError(f"a string ending at byte {end} is not UTF-8") from None

    def _value_type(self) -> GGUFValueType:
        (raw,) = self._unpack("<I")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise GGUFFormatError(f"unknown metadata value type {raw} at byte {self._at - 4}") from None

    def _value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind == GGUFValueType.ARRAY:
            item = self._value_type()
            (count,) = self._unpack("<Q")
            return self._array(item, count)
        return self._unpack(_SCALARS[kind])[0]

    def _array(self, item: GGUFValueType, count: int) -> list[Any]:
        fmt = _SCALARS.get(item)
        if fmt is None:  # strings (a vocabulary) or nested arrays: one at a time
            return [self._value(item) for _ in range(count)]
        dtype = np.dtype(fmt)
        if self._at + count * dtype.itemsize > len(self._buf):
            raise GGUFFormatError(f"an array at byte {self._at} runs past the end of the file")
        values = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._at)
        self._at += count * dtype.itemsize
        return values.tolist()

    def _tensor_entry(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        (n_dims,) = self._unpack("<I")
        dims = self._unpack(f"<{n_dims}Q")
        raw_type, offset = self._unpack("<IQ")
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFFormatError(f"tensor {name} has unknown tensor type {raw_type}") from None
        return name, tuple(int(d) for d in reversed(dims)), qtype, int(offset)

    def _tensor(self, name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType, start: int) -> GGUFTensor:
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        numel = int(np.prod(shape))
        if numel % block:
            raise GGUFFormatError(f"tensor {name} of {numel} values is not whole {qtype.name} blocks of {block}")
        end = start + numel // block * block_bytes
        if end > len(self._map):
            raise GGUFFormatError(f"tensor {name} runs past the end of the file (truncated download?)")
        return GGUFTensor(name, shape, qtype, self._map[start:end])
