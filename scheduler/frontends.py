"""The scheduler's frontends: who they are, which requests each owns, and how to reach them.

Frontends connect DEALER sockets to the scheduler's ROUTER sockets, so every message arrives with
its sender's routing id. A request belongs to the frontend that added it, and its tokens and
finish go to that frontend alone. A frontend silent for ``FRONTEND_TIMEOUT_S`` (they ping every
0.5 s) is gone: the caller aborts the requests it owned.

Token batches are numbered per frontend (``TokenBatch.seq``). A send can fail (the ROUTER has no
connection to that frontend right now: a tcp link reconnecting), and ZeroMQ can also drop what
was queued on a connection that breaks; either way the frontend sees a gap in the numbers and
ends its streams with an error instead of missing tokens in silence.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import zmq

from protocol.messages import TokenBatch
from protocol.transport import Codec

log = logging.getLogger("sluice.scheduler")

FRONTEND_TIMEOUT_S = 5.0


class Frontends:
    def __init__(self, sock: zmq.Socket[Any], codec: Codec[Any]) -> None:
        self._sock = sock  # the ROUTER that sends to frontends
        self._codec = codec
        self.last_heard: dict[bytes, float] = {}  # routing id -> when it was last heard from
        self.owner: dict[int, bytes] = {}  # rid -> the frontend that added it
        self.sender: bytes | None = None  # the frontend whose message is being handled
        self.seq: dict[bytes, int] = {}  # frontend -> the number of the last batch sent to it
        self.lost_batches = 0  # batches a frontend could not be sent

    def __len__(self) -> int:
        return len(self.last_heard)

    def heard_from(self, frontend: bytes | None) -> None:
        """A message from ``frontend`` (None: not from a frontend) is about to be handled."""
        self.sender = frontend
        if frontend is not None:
            self.last_heard[frontend] = time.monotonic()

    def own(self, rid: int) -> None:
        """The frontend being handled added ``rid``."""
        assert self.sender is not None
        self.owner[rid] = self.sender

    def owns(self, rid: int) -> bool:
        """Is ``rid`` a live request of the frontend being handled?"""
        return self.owner.get(rid) == self.sender

    def gone(self) -> list[tuple[bytes, list[int]]]:
        """Frontends silent for FRONTEND_TIMEOUT_S, forgotten now, with the rids they owned."""
        now = time.monotonic()
        silent = [f for f, seen in self.last_heard.items() if now - seen > FRONTEND_TIMEOUT_S]
        result = []
        for frontend in silent:
            del self.last_heard[frontend]
            self.seq.pop(frontend, None)
            rids = [rid for rid, owner in self.owner.items() if owner == frontend]
            for rid in rids:
                del self.owner[rid]
            result.append((frontend, rids))
        return result

    # ------------------------------------------------------------------ sending

    def send(self, frontend: bytes, msg: object) -> bool:
        """Send without blocking; False if ``frontend`` cannot be reached now."""
        if isinstance(msg, TokenBatch):
            msg.seq = self.seq[frontend] = self.seq.get(frontend, 0) + 1
        try:
            self._sock.send_multipart([frontend, self._codec.encode(msg)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            # Not connected (yet, or any more): a frontend's receiving socket connects in the
            # background, so a ping can arrive before it does. Pings repeat; a frontend that is
            # gone has its requests aborted once it has been silent for FRONTEND_TIMEOUT_S.
            if isinstance(msg, TokenBatch):
                self.lost_batches += 1
                log.warning("frontend %s cannot be reached (%s): a batch of %d tokens and %d finishes is lost "
                            "(%d batches so far)", frontend.decode(errors="replace"), e.strerror, len(msg.rids),
                            len(msg.finished), self.lost_batches)
            else:
                log.debug("frontend %r not connected; dropped a %s", frontend, type(msg).__name__)
            return False

    def reply(self, msg: object) -> bool:
        """Answer the frontend whose message is being handled."""
        return self.send(self.sender, msg) if self.sender is not None else False

    def broadcast(self, msg: object) -> None:
        for frontend in self.last_heard:
            self.send(frontend, msg)

    def to_owners(self, batch: TokenBatch) -> list[int]:
        """Tokens and finishes to the frontends that own them; a finished request is forgotten.
        Returns the rids of a batch that could not be sent (their output is lost)."""
        owner = self.owner
        if len(self.last_heard) == 1:  # the usual deployment: no need to split the batch
            for f in batch.finished:
                owner.pop(f.rid, None)
            if self.send(next(iter(self.last_heard)), batch):
                return []
            return batch.rids + [f.rid for f in batch.finished]
        parts: dict[bytes, TokenBatch] = {}

        def part(dest: bytes) -> TokenBatch:
            if dest not in parts:
                # Each part carries the step's logprobs whole: a frontend reads its own rids'.
                parts[dest] = TokenBatch([], [], [], batch.logprobs, prompt_logprobs=batch.prompt_logprobs,
                                         embeddings=batch.embeddings)
            return parts[dest]

        started = dict(batch.started)
        for rid, token in zip(batch.rids, batch.token_ids, strict=True):
            dest = owner.get(rid)
            if dest is not None:
                p = part(dest)
                p.rids.append(rid)
                p.token_ids.append(token)
                if rid in started:
                    p.started.append((rid, started[rid]))
        for f in batch.finished:
            dest = owner.pop(f.rid, None)
            if dest is not None:
                part(dest).finished.append(f)
        lost: list[int] = []
        for dest, p in parts.items():
            if not self.send(dest, p):
                lost += p.rids + [f.rid for f in p.finished]
        return lost
