"""A step's host-built metadata reaches the device in one non-blocking copy.

The attention metadata of a step is a handful of small tensors (positions, slots, block
tables, masks) made on the host. Sent one by one, each ``.to(cuda)`` is a separate transfer
from pageable memory, which the host must wait for. ``HostToDevice`` packs them, byte for
byte, into one pinned buffer, sends it with one ``non_blocking`` copy and hands back views of
the device copy; the host goes on at once.

Two buffers take turns, each guarded by an event recorded after its copy: a buffer is
refilled only once the copy that read it has finished (by then, one whole step later, it has).
On the CPU nothing moves, unless ``always`` asks for the packing anyway (tests of the
packing itself).
"""

from __future__ import annotations

import torch

_ALIGN = 16  # every tensor starts at a multiple of this many bytes: any dtype's view is aligned


class HostToDevice:
    def __init__(self, device: torch.device, always: bool = False) -> None:
        self.device = device
        self.active = device.type == "cuda" or always
        self.pin = device.type == "cuda"
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def __call__(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` (on the host) as device tensors of the same dtypes, shapes and values."""
        if not self.active:
            return tensors
        flat = [t.contiguous().view(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
                for t in tensors]
        offsets, total = [], 0
        for f in flat:
            offsets.append(total)
            total += -(-f.numel() // _ALIGN) * _ALIGN
        staging = self._buffer(max(total, _ALIGN))
        for f, off in zip(flat, offsets, strict=True):
            staging[off : off + f.numel()].copy_(f)
        device_copy = staging[:total].to(self.device, non_blocking=self.pin)
        if self.pin:
            event = torch.cuda.Event()
            event.record()
            self._events[self._turn] = event
        self._turn ^= 1
        return [device_copy[off : off + f.numel()].view(t.dtype).view(t.shape)
                for t, f, off in zip(tensors, flat, offsets, strict=True)]

    def _buffer(self, nbytes: int) -> torch.Tensor:
        event = self._events[self._turn]
        if event is not None:
            event.synchronize()  # the copy that last read this buffer is done
        buf = self._buffers[self._turn]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 2 * (buf.numel() if buf is not None else 0)), dtype=torch.uint8,
                              pin_memory=self.pin)
            self._buffers[self._turn] = buf
        return buf
