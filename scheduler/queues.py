"""The waiting queue as a strategy: one heap, ordered by a key the policy defines.

* ``fcfs``: (arrival time, rid)
* ``priority``: (priority, arrival time, rid) — lower priority value first, ties first come first
* ``fair``: per-user queues; among the users whose head request is most urgent, the one that has
  received the least service (tokens computed, charged by the scheduler) goes next, so one user's
  flood cannot starve the others

A preempted request is pushed back with its original arrival time, so it resumes before later
arrivals of its priority. Removal (abort) is lazy: the entry is skipped when it reaches the top.
Nothing is ever sorted wholesale; push and pop are O(log n).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Protocol

from scheduler.request import Request

OrderKey = tuple[float | int, ...]


class RequestQueue(Protocol):
    """What the scheduler needs of a waiting queue, whatever its policy."""

    @property
    def key(self) -> Callable[[Request], OrderKey]:
        """Urgency, smaller first: the running batch is kept in this order too."""

    @property
    def counts_service(self) -> bool:
        """``charge`` does something (the scheduler skips the call per row if not)."""

    @property
    def ranks_by_priority(self) -> bool:
        """Priority classes order it: a waiting request may outrank a running one (fcfs: never)."""

    def __len__(self) -> int: ...

    def __contains__(self, rid: int) -> bool: ...

    def __iter__(self) -> Iterator[Request]: ...

    def push(self, req: Request) -> None: ...

    def peek(self) -> Request | None: ...

    def pop(self) -> Request: ...

    def remove(self, rid: int) -> Request | None: ...

    def charge(self, user: str, tokens: int) -> None:
        """``user`` received ``tokens`` tokens of computation."""


def fcfs_key(req: Request) -> OrderKey:
    return (req.arrival_time, req.rid)


def priority_key(req: Request) -> OrderKey:
    return (req.priority, req.arrival_time, req.rid)


POLICIES: dict[str, Callable[[Request], OrderKey]] = {
    "fcfs": fcfs_key,
    "priority": priority_key,
    "fair": priority_key,  # within one user; users are picked by FairQueue
}


class WaitingQueue:
    """One heap ordered by the policy's key. ``charge`` is a no-op: only ``fair`` counts service."""

    __slots__ = ("_heap", "_live", "_pushes", "key", "ranks_by_priority")
    counts_service = False  # whether ``charge`` does anything: the scheduler skips it per row if not

    def __init__(self, policy: str) -> None:
        self.key = POLICIES[policy]
        self.ranks_by_priority = policy != "fcfs"
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

    def charge(self, user: str, tokens: int) -> None:
        pass

    def _drop_stale(self) -> None:
        heap, live = self._heap, self._live
        while heap:
            _, seq, req = heap[0]
            entry = live.get(req.rid)
            if entry is not None and entry[0] == seq:
                return
            heapq.heappop(heap)


class FairQueue:
    """Per-user ``WaitingQueue``s plus a service counter per user.

    ``peek``/``pop`` scan the users with waiting requests (not the requests): O(users) per call.
    Service is the tokens computed for a user; a user that has been idle re-enters at the current
    minimum, so past idleness is not banked as credit against busy users.
    """

    __slots__ = ("_queues", "_service", "_where", "key")
    counts_service = True
    ranks_by_priority = True

    def __init__(self, policy: str = "fair") -> None:
        self.key = priority_key
        self._queues: dict[str, WaitingQueue] = {}
        self._service: dict[str, int] = {}
        self._where: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, rid: int) -> bool:
        return rid in self._where

    def __iter__(self) -> Iterator[Request]:
        for q in self._queues.values():
            yield from q

    def service(self, user: str) -> int:
        return self._service.get(user, 0)

    def push(self, req: Request) -> None:
        q = self._queues.get(req.user)
        if q is None:
            q = self._queues[req.user] = WaitingQueue("priority")
            floor = min((self._service.get(u, 0) for u in self._queues if u != req.user), default=0)
            self._service[req.user] = max(self._service.get(req.user, 0), floor)
        q.push(req)
        self._where[req.rid] = req.user

    def _best(self) -> WaitingQueue | None:
        best, best_key = None, None
        for user, q in self._queues.items():
            head = q.peek()
            if head is None:
                continue
            key = (head.priority, self._service.get(user, 0), head.arrival_time, head.rid)
            if best_key is None or key < best_key:
                best, best_key = q, key
        return best

    def peek(self) -> Request | None:
        q = self._best()
        return q.peek() if q else None

    def pop(self) -> Request:
        q = self._best()
        if q is None:
            raise IndexError("pop from an empty queue")
        req = q.pop()
        self._forget(req)
        return req

    def remove(self, rid: int) -> Request | None:
        user = self._where.get(rid)
        if user is None:
            return None
        req = self._queues[user].remove(rid)
        if req is not None:
            self._forget(req)
        return req

    def _forget(self, req: Request) -> None:
        del self._where[req.rid]
        if not len(self._queues[req.user]):
            del self._queues[req.user]

    def charge(self, user: str, tokens: int) -> None:
        self._service[user] = self._service.get(user, 0) + tokens


def make_queue(policy: str) -> RequestQueue:
    return FairQueue() if policy == "fair" else WaitingQueue(policy)
