"""Constrained requests wait for their grammar to be compiled, off the critical path.

A request held to a grammar cannot sample its first token before the worker has compiled that
grammar into a matcher, and compiling can take a tenth of a second or more (a large ``anyOf``
on a 50k-token vocabulary). Planned at once, such a request made the whole step wait for the
compiler: with a dozen new schemas at once, every other stream in the batch stalled for the
sum of their compiles. So a constrained request whose grammar the worker has not compiled yet
waits here instead (vLLM's WAITING_FOR_FSM): the scheduler sends the grammar to the worker
(``PrepareGrammar``), other requests run meanwhile, and the worker's ``GrammarReady`` releases
its requests to the waiting queue. The same grammar text is sent once, however many requests use
it; a grammar compiled recently releases its requests at once.

The worker's compiled matchers are its own: when a worker is replaced, what it had compiled is
forgotten here too, and grammars still awaited are sent again to the new one.
"""

from __future__ import annotations

import collections

from scheduler.request import Request

# Grammars remembered as compiled: as many as the worker keeps (``worker/structured.py``); one
# forgotten there is compiled again when a request needs it, which is slower, not wrong.
REMEMBERED = 128


class GrammarGate:
    def __init__(self) -> None:
        self._compiled: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._waiting: dict[str, list[Request]] = {}  # grammar -> its requests, in arrival order
        self._ids: dict[int, str] = {}  # grammar id -> grammar, for the grammars being compiled
        self._next_id = 0
        self.to_prepare: list[tuple[int, str]] = []  # (id, grammar) to send to the worker

    def __contains__(self, req: Request) -> bool:
        grammar = req.sampling.grammar
        return grammar is not None and req in self._waiting.get(grammar, ())

    def __len__(self) -> int:
        return sum(len(reqs) for reqs in self._waiting.values())

    def holds(self, req: Request) -> bool:
        """Whether ``req`` must wait for its grammar (it is then held here); False for a request
        without a grammar or whose grammar is compiled."""
        grammar = req.sampling.grammar
        if grammar is None:
            return False
        if grammar in self._compiled:
            self._compiled.move_to_end(grammar)
            return False
        waiting = self._waiting.get(grammar)
        if waiting is None:
            waiting = self._waiting[grammar] = []
            self._ask(grammar)
        waiting.append(req)
        return True

    def _ask(self, grammar: str) -> None:
        self._next_id += 1
        self._ids[self._next_id] = grammar
        self.to_prepare.append((self._next_id, grammar))

    def compiled(self, grammar_id: int) -> list[Request]:
        """The worker compiled grammar ``grammar_id``: the requests that waited for it, to queue."""
        grammar = self._ids.pop(grammar_id, None)
        if grammar is None:
            return []  # asked of a worker since replaced, and asked again of the new one
        self._compiled[grammar] = None
        while len(self._compiled) > REMEMBERED:
            self._compiled.popitem(last=False)
        return self._waiting.pop(grammar, [])

    def remove(self, req: Request) -> None:
        """``req`` leaves (aborted, paused): it no longer waits. Its grammar is still compiled."""
        grammar = req.sampling.grammar
        waiting = self._waiting.get(grammar) if grammar is not None else None
        if waiting is not None and req in waiting:
            waiting.remove(req)

    def worker_replaced(self) -> None:
        """A new worker has compiled nothing: grammars still awaited are asked of it again."""
        self._compiled.clear()
        self._ids.clear()
        self.to_prepare.clear()
        for grammar in self._waiting:
            self._ask(grammar)
