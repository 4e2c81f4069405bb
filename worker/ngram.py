"""N-gram proposals for speculative decoding (prompt lookup): the next tokens guessed by finding
the sequence's last few tokens earlier in its own prompt and output, and copying what followed.

No second model: text that quotes or edits its input (code edits, summaries with quotes, a JSON
record filled from a document) repeats long runs of it, and each run costs one forward pass
instead of one per token once verified (``worker/runner.py``).

Each sequence keeps an index from every n-gram (``n_min <= n <= n_max``) to the position right
after its latest occurrence, grown as tokens arrive: a proposal is a dictionary look-up per n,
whatever the context length, never a scan of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class NgramConfig:
    num_tokens: int  # most tokens proposed per step
    n_min: int = 1
    n_max: int = 4


class NgramIndex:
    """One sequence's n-gram index over its tokens (prompt and output)."""

    __slots__ = ("_after", "_indexed", "config")

    def __init__(self, config: NgramConfig) -> None:
        self.config = config
        # (n-gram) -> the position after its latest occurrence whose next token is known.
        self._after: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # tokens[: _indexed] are in the index as continuations

    def _catch_up(self, tokens: Sequence[int]) -> None:
        """Index every n-gram whose following token is now known. The sequence's own last n-gram
        is never indexed (nothing follows it yet): a look-up finds only earlier occurrences."""
        after, n_min, n_max = self._after, self.config.n_min, self.config.n_max
        for pos in range(max(self._indexed, n_min), len(tokens)):
            # The n-grams ending right before ``pos`` continue with tokens[pos].
            for n in range(n_min, min(n_max, pos) + 1):
                after[tuple(tokens[pos - n : pos])] = pos
        self._indexed = max(self._indexed, len(tokens))

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to ``min(limit, num_tokens)`` tokens that followed the longest suffix of ``tokens``
        (of ``n_max`` down to ``n_min`` tokens) where it occurred last before; [] when no suffix
        occurred before. ``tokens`` is the sequence's whole list, grown since the last call."""
        limit = min(limit, self.config.num_tokens)
        if limit <= 0:
            return []
        self._catch_up(tokens)
        end = len(tokens)
        for n in range(min(self.config.n_max, end - 1), self.config.n_min - 1, -1):
            start = self._after.get(tuple(tokens[end - n :]))
            if start is not None:
                return list(tokens[start : min(start + limit, end)])
        return []
