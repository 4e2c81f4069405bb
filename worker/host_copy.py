"""Device-to-host copy of each step's sampled token ids.

On CUDA the copy goes to a pinned buffer on a side stream, fenced by an event: the compute
stream never waits for the host, and only the thread that needs the ids blocks, on that event.
On the CPU the same two calls degenerate to a plain synchronous read.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class PendingCopy:
    source: torch.Tensor  # on CUDA, kept alive until the copy is done
    host: torch.Tensor  # the pinned destination (or ``source`` itself on the CPU)
    event: torch.cuda.Event | None

    def result(self) -> list[int]:
        """Block until the copy has landed, then read it."""
        if self.event is not None:
            self.event.synchronize()
        return [int(t) for t in self.host.tolist()]


class HostCopier:
    def __init__(self, device: torch.device, capacity: int = 256) -> None:
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        if self.cuda:
            self.stream = torch.cuda.Stream(device=device)
            self.pinned = torch.empty(capacity, dtype=torch.long, pin_memory=True)

    def start(self, ids: torch.Tensor) -> PendingCopy:
        """Begin copying ``ids`` (1-D, long) to the host. One copy is read before the next starts:
        they share the pinned buffer."""
        if not self.cuda:
            return PendingCopy(ids, ids.cpu(), None)
        n = ids.shape[0]
        if n > self.pinned.shape[0]:
            self.pinned = torch.empty(max(n, 2 * self.pinned.shape[0]), dtype=torch.long, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(ids.device))  # the ids must exist first
        with torch.cuda.stream(self.stream):
            host = self.pinned[:n]
            host.copy_(ids, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        ids.record_stream(self.stream)  # the caching allocator must not reuse ids' memory early
        return PendingCopy(ids, host, event)
