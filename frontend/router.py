"""Which engine a request goes to, when one frontend serves several (data parallelism).

SGLang's router in miniature: by load, with prefix affinity. Each engine has a record of the
prompt prefixes routed to it lately (chained hashes of whole ``PREFIX_BLOCK``-token blocks, as
its prefix cache keys them, most recent ``MAX_PREFIXES`` kept). A request whose prompt is mostly
a prefix some engine has seen (at least ``AFFINITY_SHARE`` of its blocks) goes there, where that
prefix is likely cached, unless that engine is busier than the least-loaded one by more than
``SLACK_ABS`` requests and ``SLACK_REL`` times: then, like every other request, it goes to the
least-loaded engine (ties taken in turn, so equal engines share a burst).

An engine's load is what the frontend knows of it: its requests in flight from this frontend, or
its scheduler's running + waiting count (every frontend's) from its last pong, whichever is
larger. An engine out of rotation (its scheduler or worker down, or it serves another model)
has no load and gets nothing; its prefix record is dropped, since its cache may be gone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

PREFIX_BLOCK = 16
MAX_PREFIXES = 1 << 16  # per engine: a million tokens of prompts
AFFINITY_SHARE = 0.5
SLACK_ABS = 8
SLACK_REL = 1.5


def prefix_hashes(prompt: Sequence[int]) -> list[int]:
    """One hash per whole block of the prompt (all but its last token, which is always computed),
    each covering every token before it."""
    hashes, h = [], 0
    usable = (len(prompt) - 1) // PREFIX_BLOCK * PREFIX_BLOCK
    for start in range(0, usable, PREFIX_BLOCK):
        h = hash((h, tuple(prompt[start : start + PREFIX_BLOCK])))
        hashes.append(h)
    return hashes


class Router:
    def __init__(self, num_engines: int) -> None:
        self.seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_engines)]
        self._turn = 0
        self.affinity_routed = 0  # requests sent where their prefix was, for /admin/stats
        self.load_routed = 0

    def choose(self, prompt: Sequence[int], loads: Sequence[float | None]) -> int | None:
        """The engine for ``prompt`` given each engine's load (None: out of rotation); None when
        no engine is in rotation."""
        for i, load in enumerate(loads):
            if load is None:
                self.seen[i].clear()
        live = [i for i, load in enumerate(loads) if load is not None]
        if not live:
            return None
        least = min(live, key=lambda i: (loads[i], (i - self._turn) % len(loads)))
        hashes = prefix_hashes(prompt)
        best = max(live, key=lambda i: (self._matched(i, hashes), -(loads[i] or 0.0)))
        lightest, busiest = loads[least] or 0.0, loads[best] or 0.0
        near = busiest <= max(lightest + SLACK_ABS, lightest * SLACK_REL)
        if hashes and self._matched(best, hashes) >= AFFINITY_SHARE * len(hashes) and near:
            choice = best
            self.affinity_routed += 1
        else:
            choice = least
            self._turn = (least + 1) % len(loads)
            self.load_routed += 1
        seen = self.seen[choice]
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > MAX_PREFIXES:
            seen.popitem(last=False)
        return choice

    def _matched(self, engine: int, hashes: list[int]) -> int:
        """How many leading blocks of the prompt ``engine`` has seen."""
        seen = self.seen[engine]
        n = 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n
