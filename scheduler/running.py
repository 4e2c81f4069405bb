"""The running batch: requests holding a seat, most urgent first.

Kept sorted by the waiting queue's key (urgency), so preemption takes victims from the tail and
decodes are scheduled from the head. It also counts, for every priority class with a seat cap
(``--max-num-seqs-per-priority``: ``{P: N}`` = requests with priority >= P hold at most N seats),
how many seats that class holds now, updated on every change: checking a cap is a look-up, not a
walk over the batch.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator

from scheduler.queues import OrderKey
from scheduler.request import Request


class RunningBatch:
    __slots__ = ("_key", "_requests", "held")

    def __init__(self, key: Callable[[Request], OrderKey], capped_classes: Iterable[int] = ()) -> None:
        self._key = key
        self._requests: list[Request] = []
        self.held: dict[int, int] = dict.fromkeys(capped_classes, 0)  # min priority -> seats held

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def __reversed__(self) -> Iterator[Request]:
        return reversed(self._requests)

    def add(self, req: Request) -> None:
        bisect.insort(self._requests, req, key=self._key)
        for p in self.held:
            if req.priority >= p:
                self.held[p] += 1

    def remove(self, req: Request) -> None:
        self._requests.remove(req)
        for p in self.held:
            if req.priority >= p:
                self.held[p] -= 1
