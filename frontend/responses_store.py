"""Stored responses of the Responses API: what ``previous_response_id`` continues, and what
``GET`` / ``DELETE /v1/responses/{id}`` read.

One SQLite file (``--responses-store sqlite:PATH``; by default ``responses.sqlite3`` in Sluice's
directory, ``$SLUICE_CACHE`` or ``~/.cache/sluice``), so a conversation survives a frontend
restart. Each row holds the response object as the client got it, and the conversation that led
to it as chat messages (the stored input of its own predecessors included), so a continuation
reads one row. The store is bounded: at most ``max_count`` responses, none older than
``max_age_s``; the oldest go first.

SQLite calls run on one thread of their own, never on the event loop. A response is readable
the moment it is put (``_pending`` holds it until its row is written), so a client that sends
``previous_response_id`` right after its stream's last event finds it. Several frontends on one
machine may share the file (SQLite's WAL locking); across machines they may not (a network
file system breaks SQLite's locks): give each its own store and keep a conversation on one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("sluice.frontend")

MAX_COUNT = 10_000  # stored responses; the oldest are dropped beyond it
MAX_AGE_S = 30 * 24 * 3600.0  # as OpenAI keeps them: 30 days
PRUNE_EVERY = 100  # puts between two prunes

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    model TEXT NOT NULL,
    created_at REAL NOT NULL,
    response TEXT NOT NULL,
    messages TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created_at);
"""


@dataclass(frozen=True)
class StoredResponse:
    id: str
    model: str
    created_at: float
    response: dict[str, Any]  # the response object, as the client got it
    messages: list[dict[str, Any]]  # the conversation before its output, as chat messages


def default_path() -> Path:
    root = os.environ.get("SLUICE_CACHE") or os.path.join(Path.home(), ".cache", "sluice")
    return Path(root) / "responses.sqlite3"


def parse_spec(spec: str) -> Path | None:
    """``--responses-store``: ``none`` (nothing is stored), ``sqlite`` (the default file) or
    ``sqlite:PATH``. Raises ValueError for anything else."""
    if spec == "none":
        return None
    if spec == "sqlite":
        return default_path()
    if spec.startswith("sqlite:") and spec[len("sqlite:"):]:
        return Path(spec[len("sqlite:"):]).expanduser()
    raise ValueError(f"--responses-store must be none, sqlite or sqlite:PATH, got {spec!r}")


class ResponseStore:
    """Stored responses in one SQLite file (see the module's docstring)."""

    def __init__(self, path: Path, max_count: int = MAX_COUNT, max_age_s: float = MAX_AGE_S) -> None:
        self.path = path
        self.max_count, self.max_age_s = max_count, max_age_s
        self._pending: dict[str, StoredResponse] = {}
        self._puts = 0
        # One thread owns the connection: SQLite objects stay on the thread that made them.
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="responses-store")
        self._db: sqlite3.Connection | None = None
        self._thread.submit(self._open).result()  # a path that cannot be opened fails at start-up

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=10.0)
        db.execute("PRAGMA journal_mode=WAL")  # readers never wait for a writer; frontends may share it
        db.execute("PRAGMA synchronous=NORMAL")  # durable across a crash of the process, fast
        db.executescript(_SCHEMA)
        db.commit()
        self._db = db

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    # ------------------------------------------------------------------------------ writing

    def put(self, stored: StoredResponse) -> None:
        """Store ``stored`` (readable at once; written in the background)."""
        self._pending[stored.id] = stored
        self._puts += 1
        prune = (self._puts - 1) % PRUNE_EVERY == 0  # the first put, and every PRUNE_EVERY-th after
        future = self._thread.submit(self._write, stored, prune)
        future.add_done_callback(lambda f: self._written(stored.id, f))

    def _written(self, rid: str, future: concurrent.futures.Future[None]) -> None:
        error = future.exception()
        if error is not None:
            log.error("response %s could not be stored in %s: %s", rid, self.path, error)
        # (Kept in memory when the write failed: it stays readable until the frontend stops.)
        if error is None:
            self._pending.pop(rid, None)

    def _write(self, stored: StoredResponse, prune: bool) -> None:
        assert self._db is not None
        with self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO responses (id, model, created_at, response, messages) VALUES (?, ?, ?, ?, ?)",
                (stored.id, stored.model, stored.created_at, json.dumps(stored.response),
                 json.dumps(stored.messages)))
            if prune:
                self._db.execute("DELETE FROM responses WHERE created_at < ?", (time.time() - self.max_age_s,))
                self._db.execute(
                    "DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY created_at DESC "
                    "LIMIT -1 OFFSET ?)", (self.max_count,))

    # ------------------------------------------------------------------------------ reading

    async def get(self, rid: str) -> StoredResponse | None:
        pending = self._pending.get(rid)
        if pending is not None:
            return pending
        found: StoredResponse | None = await self._call(self._read, rid)
        return found

    def _read(self, rid: str) -> StoredResponse | None:
        assert self._db is not None
        row = self._db.execute(
            "SELECT id, model, created_at, response, messages FROM responses WHERE id = ? AND created_at >= ?",
            (rid, time.time() - self.max_age_s)).fetchone()
        if row is None:
            return None
        return StoredResponse(row[0], row[1], row[2], json.loads(row[3]), json.loads(row[4]))

    async def delete(self, rid: str) -> bool:
        """Forget ``rid``; False if it was not stored."""
        pending = self._pending.pop(rid, None) is not None
        deleted: bool = await self._call(self._delete, rid)
        return pending or deleted

    def _delete(self, rid: str) -> bool:
        assert self._db is not None
        with self._db:
            return self._db.execute("DELETE FROM responses WHERE id = ?", (rid,)).rowcount > 0

    def close(self) -> None:
        """Write what is pending and close the file."""
        def close_db() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None
        self._thread.submit(close_db).result()
        self._thread.shutdown(wait=True)
