"""The soak's load: mixed streaming traffic at ``--rate`` a minute (greedy streams compared with
their references, non-streaming and sampled requests, client disconnects, hostile requests), each
request read to its end and recorded, and the settling once it stops (scripts/soak.py)."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import random
import time
from typing import Any

import httpx
from soak_requests import HOSTILE, VOCAB, Record, Reference, greedy_references, path_of
from soak_server import AUTH, Server

READ_TIMEOUT_S = 90.0  # no byte for this long on an open stream: the request is lost
REQUEST_DEADLINE_S = 300.0
DRAIN_S = 180.0  # after the load stops, how long in-flight requests may take to end
SETTLE_S = 30.0  # then, how long the scheduler may take to show no request and no used block


class Soak:
    """One soak run: its requests and what was seen of them, the faults injected so far, and the
    load itself (``load``: arrivals of every kind of request, each read to its end). The faults
    (soak_faults) and the report (soak_report) read and add to this state."""

    def __init__(self, args: argparse.Namespace, server: Server) -> None:
        self.args = args
        self.server = server
        self.url = server.url
        self.rng = random.Random(args.seed)
        self.refs = greedy_references()
        self.records: list[Record] = []
        self.live: dict[int, Record] = {}
        self.faults: collections.Counter[str] = collections.Counter()
        self.notes: list[str] = []
        self.worker_kills: list[float] = []
        self.scheduler_kill: float | None = None
        self.scheduler_back: float | None = None
        self.t0 = 0.0
        self.duration = 60.0 * args.minutes
        self.stopping = False
        self.reference_mismatch: list[str] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    def note(self, text: str) -> None:
        line = f"[{self.now():7.1f} s] {text}"
        self.notes.append(line)
        print(line, flush=True)

    # ------------------------------------------------------------------ references

    async def compute_references(self, client: httpx.AsyncClient) -> None:
        """Each greedy prompt alone (nothing else running), then all at once: the two must agree,
        or greedy output depends on what shares the batch and no comparison below means much."""
        async def one(ref: Reference) -> tuple[str, list[int]]:
            r = await client.post(self.url + path_of(ref.chat), json=ref.body | {"return_token_ids": True})
            r.raise_for_status()
            choice = r.json()["choices"][0]
            text = choice["message"]["content"] if ref.chat else choice["text"]
            return text, list(choice["token_ids"])

        for ref in self.refs:
            ref.text, ref.token_ids = await one(ref)
        together = await asyncio.gather(*(one(ref) for ref in self.refs))
        for i, (ref, (text, ids)) in enumerate(zip(self.refs, together, strict=True)):
            if (text, ids) != (ref.text, ref.token_ids):
                self.reference_mismatch.append(f"reference {i}: alone and batched outputs differ")

    # ------------------------------------------------------------------ load

    def _new_record(self, kind: str) -> Record:
        rec = Record(len(self.records), kind, self.now())
        self.records.append(rec)
        return rec

    async def load(self, client: httpx.AsyncClient) -> None:
        """Arrivals at ``--rate`` a minute (exponential gaps), at most ``--max-in-flight`` at once."""
        slots = asyncio.Semaphore(self.args.max_in_flight)
        tasks: set[asyncio.Task[None]] = set()
        next_at = self.now()
        while self.now() < self.duration:
            next_at += self.rng.expovariate(self.args.rate / 60.0)
            await asyncio.sleep(max(0.0, next_at - self.now()))
            await slots.acquire()
            if self.now() >= self.duration:
                slots.release()
                break
            task = asyncio.create_task(self._one(client, slots))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        self.note(f"load stopped; waiting up to {DRAIN_S:.0f} s for {len(tasks)} requests in flight")
        _done, pending = await asyncio.wait(tasks, timeout=DRAIN_S) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _one(self, client: httpx.AsyncClient, slots: asyncio.Semaphore) -> None:
        try:
            roll = self.rng.random()
            if roll < 0.42:
                await self._greedy(client, "greedy")
            elif roll < 0.52:
                await self._greedy(client, "greedy-nonstream")
            elif roll < 0.77:
                await self._sampled(client)
            elif roll < 0.90:
                await self._greedy(client, "disconnect")
            else:
                await self._hostile(client)
        finally:
            slots.release()

    def _priority(self, body: dict[str, Any]) -> dict[str, str]:
        priority = self.rng.choice((0, 0, 0, 1, 2, 5, -1))
        body["priority"] = priority
        body["user"] = f"user{self.rng.randrange(6)}"
        return AUTH if priority < 0 else {}

    async def _greedy(self, client: httpx.AsyncClient, kind: str) -> None:
        index = self.rng.randrange(len(self.refs))
        ref = self.refs[index]
        rec = self._new_record(kind)
        rec.ref, rec.chat, rec.stream = index, ref.chat, kind != "greedy-nonstream"
        body = dict(ref.body, return_token_ids=True)
        headers = self._priority(body)
        if kind == "disconnect":
            rec.disconnect_after = self.rng.randrange(max(1, len(ref.token_ids)))
            self.faults["client disconnect"] += 1
        await self._send(client, rec, body, headers)

    async def _sampled(self, client: httpx.AsyncClient) -> None:
        rec = self._new_record("sampled")
        rec.chat = self.rng.random() < 0.3
        rec.n = 2 if self.rng.random() < 0.15 else 1
        body: dict[str, Any] = {"max_tokens": self.rng.randrange(4, 96), "temperature": self.rng.choice((0.7, 1.0)),
                                "top_p": self.rng.choice((1.0, 0.9)), "top_k": self.rng.choice((0, 40)), "n": rec.n}
        if rec.chat:
            body["messages"] = [{"role": "user", "content": f"Request {rec.seq}: say something."}]
        else:
            body["prompt"] = [1, *(self.rng.randrange(3, VOCAB) for _ in range(self.rng.randrange(4, 200)))]
            body["return_token_ids"] = True
            if self.rng.random() < 0.3:
                body["logprobs"] = 2
        if self.rng.random() < 0.5:
            body["seed"] = self.rng.randrange(2**31)
        if self.rng.random() < 0.2:
            body["stop"] = ["e ", "."]
        if self.rng.random() < 0.2:
            body["presence_penalty"] = 0.5
        await self._send(client, rec, body, self._priority(body))

    async def _send(self, client: httpx.AsyncClient, rec: Record, body: dict[str, Any], headers: dict[str, str]) -> None:
        self.live[rec.seq] = rec
        try:
            if rec.stream:
                body |= {"stream": True, "stream_options": {"include_usage": True}}
                await asyncio.wait_for(self._read_stream(client, rec, body, headers), REQUEST_DEADLINE_S)
            else:
                await asyncio.wait_for(self._read_whole(client, rec, body, headers), REQUEST_DEADLINE_S)
        except Exception as e:  # a broken connection, a timeout, a body that is not what it should be
            rec.exception = f"{type(e).__name__}: {e}"
        finally:
            rec.ended = self.now()
            self.live.pop(rec.seq, None)

    async def _read_whole(self, client: httpx.AsyncClient, rec: Record, body: dict[str, Any],
                          headers: dict[str, str]) -> None:
        r = await client.post(self.url + path_of(rec.chat), json=body, headers=headers)
        rec.status = r.status_code
        rec.request_id = r.headers.get("x-request-id")
        data = r.json()
        if r.status_code != 200:
            rec.error_code = data["error"]["code"]
            rec.errors.append(data["error"]["message"])
            return
        for choice in data["choices"]:
            i = choice["index"]
            rec.text[i] = choice["message"]["content"] if rec.chat else choice["text"]
            rec.token_ids[i] = list(choice.get("token_ids") or [])
            rec.finishes[i].append(choice["finish_reason"])

    async def _read_stream(self, client: httpx.AsyncClient, rec: Record, body: dict[str, Any],
                           headers: dict[str, str]) -> None:
        async with client.stream("POST", self.url + path_of(rec.chat), json=body, headers=headers) as r:
            rec.status = r.status_code
            rec.request_id = r.headers.get("x-request-id")
            if r.status_code != 200:
                data = json.loads(await r.aread())
                rec.error_code = data["error"]["code"]
                rec.errors.append(data["error"]["message"])
                return
            chunks = 0
            if rec.disconnect_after == 0:
                rec.disconnected = True
                return  # closing the response closes the connection: the server sees a disconnect
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    rec.after_end |= rec.done_count > 0
                    rec.done_count += 1
                    continue
                data = json.loads(line[6:])
                if rec.done_count:
                    rec.after_end = True
                if "error" in data:
                    rec.after_end |= bool(rec.errors)
                    rec.errors.append(data["error"]["message"])
                    continue
                for choice in data["choices"]:
                    self._take(rec, choice)
                chunks += 1
                if rec.disconnect_after is not None and chunks >= rec.disconnect_after:
                    rec.disconnected = True
                    return

    @staticmethod
    def _take(rec: Record, choice: dict[str, Any]) -> None:
        i = choice["index"]
        text = ((choice.get("delta") or {}).get("content") or "") if rec.chat else (choice.get("text") or "")
        ids = choice.get("token_ids") or []
        if (text or ids) and (rec.finishes[i] or rec.errors):
            rec.after_end = True
        rec.text[i] += text
        rec.token_ids[i] += ids
        reason = choice.get("finish_reason")
        if reason is not None:
            if rec.finishes[i] or rec.errors:
                rec.after_end = True
            rec.finishes[i].append(reason)

    async def _hostile(self, client: httpx.AsyncClient) -> None:
        what, method, path, raw, body, headers = self.rng.choice(HOSTILE)
        rec = self._new_record("hostile")
        rec.stream = False
        self.faults["hostile request"] += 1
        try:
            if raw is not None:
                r = await client.request(method, self.url + path, content=raw,
                                         headers={"Content-Type": "application/json", **headers})
            else:
                r = await client.request(method, self.url + path, json=body, headers=headers)
            rec.status = r.status_code
            with contextlib.suppress(ValueError, KeyError, TypeError):
                rec.error_code = r.json()["error"]["code"]
            rec.errors.append(what)
        except httpx.HTTPError as e:
            rec.exception = f"{what}: {type(e).__name__}: {e}"
        finally:
            rec.ended = self.now()


    async def until_answered(self, admin: httpx.AsyncClient, url: str) -> None:
        """POST until the scheduler answers (200, or 404 when the request is gone)."""
        for _ in range(120):
            with contextlib.suppress(httpx.HTTPError):
                if (await admin.post(url)).status_code in (200, 404):
                    return
            await asyncio.sleep(0.5)
        self.note(f"no answer from {url}")

    # ------------------------------------------------------------------ settling

    async def settle(self, admin: httpx.AsyncClient) -> dict[str, Any]:
        """Once traffic has stopped: /admin/stats and /admin/requests until idle (SETTLE_S)."""
        await self.until_answered(admin, f"{self.url}/admin/resume")
        deadline = time.monotonic() + SETTLE_S
        stats: dict[str, Any] = {}
        live: list[Any] = []
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                stats = (await admin.get(f"{self.url}/admin/stats")).json()
                live = (await admin.get(f"{self.url}/admin/requests")).json()["data"]
                if stats["running"] == stats["waiting"] == stats["kv_blocks_used"] == 0 and not live:
                    break
            await asyncio.sleep(0.2)
        return stats | {"live_requests": len(live)}

