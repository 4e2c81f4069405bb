"""Device-to-host copy of each step's sampled token ids (and its logprobs, where rows asked).

On CUDA the copy goes to a pinned buffer on a side stream, fenced by an event: the compute
stream never waits for the host, and only the thread that needs the ids blocks, on that event.
A small ring of pinned buffers lets several steps' copies be in flight at once (the runner reads
step k while step k+1 computes). Logprobs travel the same way, into pinned tensors from torch's
caching host allocator: reading them with ``.tolist()`` on the device tensors would wait for
everything queued on the compute stream, the next step included, and undo the overlap. On the
CPU the same calls degenerate to a plain synchronous read.
"""

from __future__ import annotations

import dataclasses

import torch

RING = 4  # copies in flight at once; the runner keeps at most two


@dataclasses.dataclass
class PendingCopy:
    source: torch.Tensor  # on CUDA, kept alive until the copy is done
    host: torch.Tensor  # the pinned destination (or ``source`` itself on the CPU)
    event: torch.cuda.Event | None
    extras: list[torch.Tensor] = dataclasses.field(default_factory=list)  # host copies of ``start``'s extras

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())

    def result(self) -> list[int]:
        """Block until the copy has landed, then read it."""
        if self.event is not None:
            self.event.synchronize()
        return [int(t) for t in self.host.tolist()]

    def extra_results(self) -> list[torch.Tensor]:
        """The extras' host copies, once landed."""
        if self.event is not None:
            self.event.synchronize()
        return self.extras


class HostCopier:
    def __init__(self, device: torch.device, capacity: int = 256) -> None:
        self.asynchronous = device.type == "cuda" and torch.cuda.is_available()
        if self.asynchronous:
            self.stream = torch.cuda.Stream(device=device)
            self.ring = [torch.empty(capacity, dtype=torch.long, pin_memory=True) for _ in range(RING)]
            self.extras: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
            self.next = 0

    def start(self, ids: torch.Tensor, extras: list[torch.Tensor] | None = None) -> PendingCopy:
        """Begin copying ``ids`` (1-D, long) and ``extras`` (any tensors) to the host. A copy
        must be read before ``RING`` more have started: they take turns with the pinned buffers."""
        extras = extras or []
        if not self.asynchronous:
            return PendingCopy(ids, ids.cpu(), None, [t.cpu() for t in extras])
        n = ids.shape[0]
        slot = self.next
        self.next = (self.next + 1) % RING
        if n > self.ring[slot].shape[0]:
            self.ring[slot] = torch.empty(max(n, 2 * self.ring[slot].shape[0]), dtype=torch.long, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(ids.device))  # the ids must exist first
        with torch.cuda.stream(self.stream):
            host = self.ring[slot][:n]
            host.copy_(ids, non_blocking=True)
            pinned = [self._pinned(slot, i, t) for i, t in enumerate(extras)]
            for dst, src in zip(pinned, extras, strict=True):
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        for t in (ids, *extras):
            t.record_stream(self.stream)  # the caching allocator must not reuse their memory early
        return PendingCopy(ids, host, event, pinned)

    def _pinned(self, slot: int, i: int, like: torch.Tensor) -> torch.Tensor:
        """Pinned room for extra ``i`` of ring slot ``slot``, shaped like ``like``: kept and grown
        by doubling, as the ids' buffers are (a fresh pinned allocation of a size the host
        allocator has not cached calls cudaHostAlloc, which waits for the device)."""
        key = (slot, i, like.dtype)
        flat = self.extras.get(key)
        if flat is None or flat.numel() < like.numel():
            flat = self.extras[key] = torch.empty(max(like.numel(), 2 * (flat.numel() if flat is not None else 64)),
                                                  dtype=like.dtype, pin_memory=True)
        return flat[: like.numel()].view(like.shape)
