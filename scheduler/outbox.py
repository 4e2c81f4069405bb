"""Token batches on their way to the frontends that own them.

While the worker's inbox is drained (``merged``), the steps' batches are merged and sent as one
when the drain ends: nothing waits for it (they have all arrived), and a scheduler that fell behind
catches up with a send per wake-up, not one per step. A batch with logprobs or embeddings is never
merged: those travel as one opaque field per batch.

A batch a frontend could not be sent (its link is down or reconnecting) is lost to it: ``lost`` is
called for each of its rids, so that the process aborts those still running (freeing their
blocks); the frontend, finding a gap in its batches' numbers, ends its streams with an error.
"""

from __future__ import annotations

from collections.abc import Callable

from protocol.messages import TokenBatch
from scheduler.frontends import Frontends


class Outbox:
    def __init__(self, frontends: Frontends, lost: Callable[[int], None]) -> None:
        self._frontends = frontends
        self._lost = lost
        self._merging = False
        self._pending: TokenBatch | None = None

    def merged(self) -> Outbox:
        """``with outbox.merged():`` the batches sent meanwhile are merged; what is left goes out
        at the end. (A class's ``__enter__``/``__exit__``, not contextlib's generator: this wraps
        every wake-up of the scheduler, and the generator machinery cost more than the merge.)"""
        return self

    def __enter__(self) -> None:
        self._merging = True

    def __exit__(self, *exc: object) -> None:
        self._merging = False
        self.flush()

    def send(self, batch: TokenBatch) -> None:
        """Tokens and finishes to the frontends that own them (at once, unless ``merged``)."""
        if not self._merging:
            self._send_now(batch)
            return
        pending = self._pending
        if pending is not None and not _carries_logprobs(pending) and not _carries_logprobs(batch):
            # In order: a request's tokens, then its finish (nothing of it follows a finish).
            pending.rids += batch.rids
            pending.token_ids += batch.token_ids
            pending.finished += batch.finished
            pending.started += batch.started
            return
        self.flush()
        self._pending = batch

    def flush(self) -> None:
        """What was merged so far goes out now (before a message that must follow it)."""
        batch, self._pending = self._pending, None
        if batch is not None:
            self._send_now(batch)

    def _send_now(self, batch: TokenBatch) -> None:
        for rid in self._frontends.to_owners(batch):
            self._lost(rid)


def _carries_logprobs(batch: TokenBatch) -> bool:
    """Its logprobs (and embeddings) travel as one opaque field per batch: such a batch is not merged."""
    return len(batch.logprobs) > 1 or len(batch.prompt_logprobs) > 1 or len(batch.embeddings) > 1
