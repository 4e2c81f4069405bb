"""The waiting queue as a strategy: one heap, ordered by a key the policy defines.

* ``fcfs``: (arrival time, rid)
* ``priority``: (priority, arrival time, rid) — lower priority value first, ties first come first

A preempted request is pushed back with its original arrival time, so it resumes before later
arrivals of its priority. Removal (abort) is lazy: the entry is skipped when it reaches the top.
Nothing is ever sorted wholesale; push and pop are O(log n).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator

from scheduler.request import Request

OrderKey = tuple[float | int, ...]


def fcfs_key(req: Request) -> OrderKey:
    return (req.arrival_time, req.rid)


def priority_key(req: Request) -> OrderKey:
    return (req.priority, req.arrival_time, req.rid)


POLICIES: dict[str, Callable[[Request], OrderKey]] = {
    "fcfs": fcfs_key,
    "priority": priority_key,
    # "fair" (per-user service counters) arrives with the scheduling-policy work; until then it
    # orders like "priority".
    "fair": priority_key,
}


class WaitingQueue:
    def __init__(self, policy: str) -> None:
        self.key = POLICIES[policy]
        # Entries carry a push sequence number; only the latest push of a rid is live.
        self._heap: list[tuple[OrderKey, int, Request]] = []
        self._live: dict[int, tuple[int, Request]] = {}
        self._pushes = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, rid: int) -> bool:
        return rid in self._live

    def __iter__(self) -> Iterator[Request]:
        return (req for _, req in self._live.values())

    def push(self, req: Request) -> None:
        seq = next(self._pushes)
        self._live[req.rid] = (seq, req)
        heapq.heappush(self._heap, (self.key(req), seq, req))

    def peek(self) -> Request | None:
        self._drop_stale()
        return self._heap[0][2] if self._heap else None

    def pop(self) -> Request:
        self._drop_stale()
        _, _, req = heapq.heappop(self._heap)
        del self._live[req.rid]
        return req

    def remove(self, rid: int) -> Request | None:
        entry = self._live.pop(rid, None)
        return entry[1] if entry else None

    def _drop_stale(self) -> None:
        heap, live = self._heap, self._live
        while heap:
            _, seq, req = heap[0]
            entry = live.get(req.rid)
            if entry is not None and entry[0] == seq:
                return
            heapq.heappop(heap)
