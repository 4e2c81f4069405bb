"""Soak (issue 14): mixed streaming load on a fresh ``sluice serve --model tiny`` for N minutes,
with faults injected on a schedule, and a count of everything that must never happen.

    python scripts/soak.py --minutes 10

It starts its own server (127.0.0.1, a free port, an admin token, its own process group; always
stopped at the end, its log kept in a temp dir), computes the greedy reference outputs of a fixed
set of prompts one at a time before any fault, then drives a few hundred requests a minute
(``--rate``, at most ``--max-in-flight`` at once) while it injects:

- a worker SIGKILL every ``--worker-kill-every`` seconds (``sluice serve`` starts it again, and
  the scheduler recomputes the live requests: their streams must simply continue);
- one scheduler SIGKILL (``sluice serve`` starts it again; streams open at that moment end with an
  error chunk, counted as "ended by the scheduler crash", not as lost);
- client disconnects (a stream closed after k chunks), hostile requests (bad JSON, bad fields: a
  4xx is expected), admin aborts, pauses + resumes (of one request and of the whole server),
  priority changes and cut-ins, prefix-cache resets.

It prints what was sent and how each request ended, the faults by kind, the figures that must be
0 — requests lost (neither a finish nor an error), duplicated (two finishes, or tokens after a
finish), greedy outputs differing from the undisturbed reference (every greedy request that ended
normally, worker kill or not; and the tokens a cut-short one got must be a prefix of it),
unexpected errors, hostile requests not answered with a 4xx, KV blocks still used and requests
still running or waiting once the traffic has stopped — and the RSS of each process (frontend =
the serve process, scheduler, worker) at start and end. Exit status 0 when every must-be-0
figure is 0, else 1.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

TOKEN = "soak-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# A 503 that means "the engine is restarting" (or loading): the request was refused, not lost.
DEFERRED_CODES = {"engine_down", "not_ready", "overloaded"}
VOCAB = 512  # the tiny model's; token ids 3.. are ordinary tokens
READ_TIMEOUT_S = 90.0  # no byte for this long on an open stream: the request is lost
REQUEST_DEADLINE_S = 300.0
DRAIN_S = 180.0  # after the load stops, how long in-flight requests may take to end
SETTLE_S = 30.0  # then, how long the scheduler may take to show no request and no used block


# --------------------------------------------------------------------------------------- server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``sluice serve`` in its own process group, its output in ``log_path``."""

    def __init__(self, flags: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "frontend", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--admin-token", TOKEN, "--dtype", "float32", *flags]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sluice serve exited with {self.proc.returncode}; see {self.log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"sluice serve not ready after {timeout:.0f} s; see {self.log_path}")

    def children(self) -> dict[str, int]:
        """The serve process's direct children by role (``-m scheduler``, ``-m worker``)."""
        found: dict[str, int] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            if ppid == self.proc.pid and len(argv) > 2 and argv[1] == b"-m":
                found[argv[2].decode(errors="replace")] = int(entry.name)
        return found

    def memory(self) -> dict[str, tuple[int, int | None]]:
        """(pid, RSS in KiB) of the frontend (the serve process), the scheduler and the worker."""
        pids = {"frontend": self.proc.pid} | self.children()
        return {role: (pid, rss_kib(pid)) for role, pid in pids.items()}

    def stop(self) -> int | None:
        """SIGTERM (``sluice serve`` stops its children), then SIGKILL to the whole group."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=15)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()
        return self.proc.returncode


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


# --------------------------------------------------------------------------------------- requests


@dataclasses.dataclass
class Reference:
    """A greedy request and its undisturbed output."""

    chat: bool
    body: dict[str, Any]
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)


def greedy_references() -> list[Reference]:
    shared = [1, *((17 * j + 5) % (VOCAB - 3) + 3 for j in range(40))]  # a prefix several prompts share
    refs = []
    for i in range(6):
        suffix = [(31 * i + 7 * j) % (VOCAB - 3) + 3 for j in range(5 + 3 * i)]
        refs.append(Reference(False, {"prompt": shared + suffix, "max_tokens": (16, 48, 96, 400, 32, 64)[i]}))
    for i, length in enumerate((8, 30, 120, 250)):
        prompt = [1, *((13 * i + 11 * j + 3) % (VOCAB - 3) + 3 for j in range(length))]
        refs.append(Reference(False, {"prompt": prompt, "max_tokens": (1500, 24, 80, 800)[i]}))
    for i, text in enumerate(("The quick brown fox", "Once upon a time there was",
                              "Inference servers batch requests and")):
        refs.append(Reference(False, {"prompt": text, "max_tokens": (40, 120, 64)[i]}))
    for i, text in enumerate(("Hello!", "Tell me about ZeroMQ sockets.", "Count: one, two, three")):
        refs.append(Reference(True, {"messages": [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": text}],
                                     "max_tokens": (32, 72, 300)[i]}))
    for ref in refs:
        ref.body |= {"temperature": 0, "ignore_eos": True}
    return refs


def path_of(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


# Each: (what, method, path, raw body or None, json body or None, extra headers).
HOSTILE: list[tuple[str, str, str, bytes | None, Any, dict[str, str]]] = [
    ("truncated JSON", "POST", "/v1/completions", b'{"prompt": "x", "max_tokens": ', None, {}),
    ("not JSON", "POST", "/v1/completions", b"\xff\xfe<html>", None, {}),
    ("JSON array body", "POST", "/v1/chat/completions", b"[1, 2, 3]", None, {}),
    ("empty body", "POST", "/v1/completions", b"", None, {}),
    ("no prompt", "POST", "/v1/completions", None, {"max_tokens": 4}, {}),
    ("empty prompt", "POST", "/v1/completions", None, {"prompt": []}, {}),
    ("prompt id out of vocab", "POST", "/v1/completions", None, {"prompt": [1, 10**6]}, {}),
    ("negative token id", "POST", "/v1/completions", None, {"prompt": [1, -3]}, {}),
    ("max_tokens 0", "POST", "/v1/completions", None, {"prompt": "x", "max_tokens": 0}, {}),
    ("max_tokens a string", "POST", "/v1/completions", None, {"prompt": "x", "max_tokens": "ten"}, {}),
    ("max_tokens past the context", "POST", "/v1/completions", None, {"prompt": "x", "max_tokens": 10**9}, {}),
    ("temperature -1", "POST", "/v1/completions", None, {"prompt": "x", "temperature": -1}, {}),
    ("top_p 0", "POST", "/v1/completions", None, {"prompt": "x", "top_p": 0}, {}),
    ("n 0", "POST", "/v1/completions", None, {"prompt": "x", "n": 0}, {}),
    ("n 1000", "POST", "/v1/completions", None, {"prompt": "x", "n": 1000}, {}),
    ("logprobs 99", "POST", "/v1/completions", None, {"prompt": "x", "logprobs": 99}, {}),
    ("logit_bias bad key", "POST", "/v1/completions", None, {"prompt": "x", "logit_bias": {"²": 1}}, {}),
    ("min_tokens > max_tokens", "POST", "/v1/completions", None,
     {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, {}),
    ("echo", "POST", "/v1/completions", None, {"prompt": "x", "echo": True}, {}),
    ("unknown model", "POST", "/v1/completions", None, {"prompt": "x", "model": "gpt-9"}, {}),
    ("priority < 0 without the token", "POST", "/v1/completions", None, {"prompt": "x", "priority": -5}, {}),
    ("stream not a bool", "POST", "/v1/completions", None, {"prompt": "x", "stream": "yes"}, {}),
    ("chat without messages", "POST", "/v1/chat/completions", None, {"messages": []}, {}),
    ("chat message not an object", "POST", "/v1/chat/completions", None, {"messages": ["hi"]}, {}),
    ("chat image part", "POST", "/v1/chat/completions", None,
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, {}),
    ("unknown route", "POST", "/v1/embeddings", None, {"input": "x"}, {}),
    ("admin without the token", "GET", "/admin/requests", None, None, {}),
    ("admin with a wrong token", "POST", "/admin/pause", None, None, {"Authorization": "Bearer wrong"}),
    ("admin priority not an int", "POST", "/admin/requests/cmpl-nope/priority", None,
     {"priority": "high"}, AUTH),
]


@dataclasses.dataclass
class Record:
    """One request and everything seen of it."""

    seq: int
    kind: str  # greedy, greedy-nonstream, sampled, disconnect, hostile
    started: float
    ref: int | None = None
    n: int = 1
    stream: bool = True
    chat: bool = False
    disconnect_after: int | None = None  # chunks read before the client hangs up
    request_id: str | None = None
    status: int | None = None
    error_code: str | None = None
    ended: float | None = None
    finishes: dict[int, list[str]] = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    token_ids: dict[int, list[int]] = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    text: dict[int, str] = dataclasses.field(default_factory=lambda: collections.defaultdict(str))
    errors: list[str] = dataclasses.field(default_factory=list)
    done_count: int = 0
    after_end: bool = False  # tokens (or another finish) after a finish, an error or [DONE]
    disconnected: bool = False
    admin_aborted: bool = False
    admin_touched: bool = False
    exception: str | None = None
    outcome: str = ""


# --------------------------------------------------------------------------------------- the soak


class Soak:
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

    # ------------------------------------------------------------------ faults

    async def faults_on_schedule(self, admin: httpx.AsyncClient) -> None:
        kills, scheduler_at = schedule(self.args)
        events = sorted([(t, "worker") for t in kills] + ([(scheduler_at, "scheduler")] if scheduler_at else []))
        for at, what in events:
            await asyncio.sleep(max(0.0, at - self.now()))
            if self.stopping:
                return
            await (self._kill_worker(admin) if what == "worker" else self._kill_scheduler(admin))

    async def _kill(self, role: str) -> int | None:
        for _ in range(100):  # a restart in progress: wait for the process to be there
            pid = self.server.children().get(role)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                return pid
            await asyncio.sleep(0.1)
        self.note(f"no {role} process to kill")
        return None

    async def _wait_health(self, admin: httpx.AsyncClient, route: str, want_ok: bool, timeout: float) -> float | None:
        """Seconds until ``route`` answers 200 (``want_ok``) or anything else (not ``want_ok``)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            with contextlib.suppress(httpx.HTTPError):
                if ((await admin.get(self.url + route, timeout=5)).status_code == 200) == want_ok:
                    return time.monotonic() - start
            await asyncio.sleep(0.05)
        return None

    async def _busy(self, at_least: int = 2, timeout: float = 15.0) -> None:
        """Wait (a little) for a few streams to be mid-flight, so the kill has something to hit."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.stopping:
            streaming = [r for r in self.live.values() if r.stream and r.token_ids.get(0)]
            if len(streaming) >= at_least:
                return
            await asyncio.sleep(0.05)

    async def _kill_worker(self, admin: httpx.AsyncClient) -> None:
        await self._busy()
        live = len(self.live)
        pid = await self._kill("worker")
        if pid is None:
            return
        self.worker_kills.append(self.now())
        self.faults["worker SIGKILL"] += 1
        noticed = await self._wait_health(admin, "/health", False, 10)
        back = await self._wait_health(admin, "/health", True, 120)
        self.note(f"worker pid {pid} SIGKILLed with {live} requests in flight: /health 503 after "
                  f"{_secs(noticed)}, 200 again after {_secs(back)} more")

    async def _kill_scheduler(self, admin: httpx.AsyncClient) -> None:
        await self._busy()
        live = len(self.live)
        pid = await self._kill("scheduler")
        if pid is None:
            return
        self.scheduler_kill = self.now()
        self.faults["scheduler SIGKILL"] += 1
        started = time.monotonic()
        while time.monotonic() - started < 60 and self.server.children().get("scheduler", pid) == pid:
            await asyncio.sleep(0.05)
        respawned = time.monotonic() - started
        answering = None
        while time.monotonic() - started < 120:
            # A short timeout: a query sent while no scheduler listens waits out the frontend's 5 s.
            with contextlib.suppress(httpx.HTTPError):
                if (await admin.get(f"{self.url}/admin/stats", timeout=0.5)).status_code == 200 and \
                        (await admin.get(f"{self.url}/ready")).status_code == 200:
                    answering = time.monotonic() - started
                    break
            await asyncio.sleep(0.05)
        # Streams of the old scheduler end with their error at the next pong of the new one.
        self.scheduler_back = self.now() + 5.0
        self.note(f"scheduler pid {pid} SIGKILLed with {live} requests in flight: a new one started after "
                  f"{respawned:.2f} s, answering /admin/stats after {_secs(answering)}")

    # ------------------------------------------------------------------ admin

    async def admin_actions(self, admin: httpx.AsyncClient) -> None:
        """Every ``--admin-every`` s, a control on a random live single-choice stream; every
        ``--server-pause-every`` s, the whole server paused for a moment."""
        next_server_pause = self.args.server_pause_every / 2
        while self.now() < self.duration and not self.stopping:
            await asyncio.sleep(self.rng.uniform(0.5, 1.5) * self.args.admin_every)
            if self.now() >= next_server_pause:
                next_server_pause += self.args.server_pause_every
                await self._server_pause(admin)
                continue
            targets = [r for r in self.live.values()
                       if r.request_id and r.stream and r.n == 1 and not r.admin_touched and not r.disconnected]
            if not targets:
                continue
            rec = self.rng.choice(targets)
            rec.admin_touched = True
            action = self.rng.choice(("abort", "priority", "priority", "cut-in", "pause", "pause", "reset"))
            base = f"{self.url}/admin/requests/{rec.request_id}"
            with contextlib.suppress(httpx.HTTPError):
                if action == "abort":
                    r = await admin.post(f"{base}/abort")
                    rec.admin_aborted = r.status_code == 200
                elif action in ("priority", "cut-in"):
                    body = {"priority": self.rng.choice((-2, 0, 3, 9)), "cut_in": action == "cut-in"}
                    await admin.post(f"{base}/priority", json=body)
                elif action == "pause":
                    r = await admin.post(f"{base}/pause")
                    await asyncio.sleep(self.rng.uniform(0.2, 2.0))
                    if r.status_code == 200:
                        await self._until_answered(admin, f"{base}/resume")
                else:
                    await admin.post(f"{self.url}/admin/prefix-cache/reset")
            self.faults[{"abort": "admin abort", "priority": "admin priority change", "cut-in": "admin cut-in",
                         "pause": "admin pause+resume (one request)",
                         "reset": "admin prefix-cache reset"}[action]] += 1

    async def _until_answered(self, admin: httpx.AsyncClient, url: str) -> None:
        """POST until the scheduler answers (200, or 404 when the request is gone)."""
        for _ in range(120):
            with contextlib.suppress(httpx.HTTPError):
                if (await admin.post(url)).status_code in (200, 404):
                    return
            await asyncio.sleep(0.5)
        self.note(f"no answer from {url}")

    async def _server_pause(self, admin: httpx.AsyncClient) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await admin.post(f"{self.url}/admin/pause")
        self.faults["admin pause+resume (server)"] += 1
        await asyncio.sleep(self.rng.uniform(0.5, 2.0))
        await self._until_answered(admin, f"{self.url}/admin/resume")

    # ------------------------------------------------------------------ progress

    async def progress(self) -> None:
        while not self.stopping:
            await asyncio.sleep(self.args.progress_every)
            ended = collections.Counter(classify(self, r) for r in self.records if r.ended is not None)
            print(f"[{self.now():7.1f} s] sent {len(self.records)}, in flight {len(self.live)}, "
                  f"served {ended['served']}, faults {sum(self.faults.values())}, "
                  f"lost so far {ended['lost']}", flush=True)

    # ------------------------------------------------------------------ settling

    async def settle(self, admin: httpx.AsyncClient) -> dict[str, Any]:
        """Once traffic has stopped: /admin/stats and /admin/requests until idle (SETTLE_S)."""
        await self._until_answered(admin, f"{self.url}/admin/resume")
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


def schedule(args: argparse.Namespace) -> tuple[list[float], float | None]:
    """Seconds into the load of the worker kills (every ``--worker-kill-every`` s from 30 s on, none
    in the last 15 s) and of the scheduler kill (the middle of the gap between worker kills that
    holds half-time, or ``--scheduler-kill-at``; None with ``--no-scheduler-kill``)."""
    duration, every = 60.0 * args.minutes, args.worker_kill_every
    kills: list[float] = []
    while 30.0 + every * len(kills) < duration - 15.0:
        kills.append(30.0 + every * len(kills))
    if not args.scheduler_kill:
        return kills, None
    if args.scheduler_kill_at is not None:
        return kills, float(args.scheduler_kill_at)
    edges = [0.0, *kills, duration]
    for a, b in itertools.pairwise(edges):
        if a <= duration / 2 < b:
            return kills, (a + b) / 2
    return kills, duration / 2


def _secs(value: float | None) -> str:
    return "(never)" if value is None else f"{value:.2f} s"


def classify(soak: Soak, rec: Record) -> str:
    """How a request ended: served, disconnected (by us), aborted (by us), rejected (503 while
    the engine restarts), ended by the scheduler crash, hostile-4xx, hostile-wrong,
    unexpected-error or lost."""
    if rec.kind == "hostile":
        if rec.status is not None and 400 <= rec.status < 500:
            return "hostile-4xx"
        if rec.status == 503 and rec.error_code in DEFERRED_CODES:
            return "rejected"
        return "hostile-wrong"
    if rec.disconnected:
        return "disconnected"
    if rec.status is None:
        return "lost"
    if rec.status == 503 and rec.error_code in DEFERRED_CODES:
        return "rejected"
    if rec.errors:
        # Open when the scheduler was killed, or sent before its successor took over: the new
        # scheduler never heard of it (or had no worker yet when it arrived).
        kill = soak.scheduler_kill
        by_crash = kill is not None and rec.started <= (soak.scheduler_back or float("inf")) \
            and (rec.ended or 0) >= kill
        return "scheduler-crash" if by_crash else "unexpected-error"
    if rec.status != 200:
        return "unexpected-error"
    finished = [rec.finishes.get(i) for i in range(rec.n)]
    if not all(finished):
        return "lost"
    reasons = {reason for f in finished if f for reason in f}
    if rec.stream and rec.done_count == 0:
        return "unexpected-error"  # a finish, then the stream broke off before [DONE]
    if "abort" in reasons:
        return "aborted" if rec.admin_aborted else "unexpected-error"
    return "served" if reasons <= {"length", "stop"} else "unexpected-error"


def greedy_verdict(soak: Soak, rec: Record) -> str | None:
    """None when there is nothing to compare; "match"; or what differs."""
    if rec.ref is None:
        return None
    ref = soak.refs[rec.ref]
    outcome = rec.outcome
    got_text, got_ids = rec.text.get(0, ""), rec.token_ids.get(0, [])
    if outcome == "served":
        if got_text != ref.text or (not ref.chat and got_ids != ref.token_ids):
            return f"differs: got {got_ids[:40]}... want {ref.token_ids[:40]}..."
        return "match"
    if outcome in ("disconnected", "aborted", "scheduler-crash"):
        if not ref.text.startswith(got_text) or got_ids != ref.token_ids[: len(got_ids)]:
            return f"cut-short prefix differs: got {got_ids[:40]}... want {ref.token_ids[:40]}..."
        return "prefix-match"
    return None


# --------------------------------------------------------------------------------------- main


async def run(args: argparse.Namespace, server: Server) -> int:
    soak = Soak(args, server)
    limits = httpx.Limits(max_connections=args.max_in_flight + 8, max_keepalive_connections=args.max_in_flight)
    timeout = httpx.Timeout(10.0, read=READ_TIMEOUT_S)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client, \
            httpx.AsyncClient(timeout=10.0, headers=AUTH) as admin:
        soak.t0 = time.monotonic()
        await soak.compute_references(client)
        print(f"{len(soak.refs)} greedy references computed in {soak.now():.1f} s", flush=True)
        memory_start = server.memory()
        kills, scheduler_at = schedule(args)
        print(f"load: {args.rate} requests/min, at most {args.max_in_flight} in flight, {args.minutes} min; "
              f"worker SIGKILL at {', '.join(f'{t:.0f}' for t in kills) or 'never'} s, scheduler SIGKILL at "
              f"{'never' if scheduler_at is None else f'{scheduler_at:.0f} s'}", flush=True)
        soak.t0 = time.monotonic()
        background = [asyncio.create_task(soak.faults_on_schedule(admin)),
                      asyncio.create_task(soak.admin_actions(admin)),
                      asyncio.create_task(soak.progress())]
        try:
            await soak.load(client)
        finally:
            soak.stopping = True
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
        stats = await soak.settle(admin)
        memory_end = server.memory()
        health = 0
        with contextlib.suppress(httpx.HTTPError):
            health = (await admin.get(f"{server.url}/health")).status_code
    return report(soak, stats, memory_start, memory_end, health)


def report(soak: Soak, stats: dict[str, Any], memory_start: dict[str, tuple[int, int | None]],
           memory_end: dict[str, tuple[int, int | None]], health: int) -> int:
    for rec in soak.records:
        rec.outcome = classify(soak, rec)
    outcomes = collections.Counter(r.outcome for r in soak.records)
    kinds = collections.Counter(r.kind for r in soak.records)
    ids = collections.Counter(r.request_id for r in soak.records if r.request_id)
    duplicated = [r for r in soak.records if r.after_end or any(len(f) > 1 for f in r.finishes.values())]
    duplicated += [r for r in soak.records if r.request_id and ids[r.request_id] > 1]
    verdicts = [(r, greedy_verdict(soak, r)) for r in soak.records]
    compared = [(r, v) for r, v in verdicts if v is not None]
    differing = [(r, v) for r, v in compared if v not in ("match", "prefix-match")]
    survived = [r for r, v in compared if v == "match" and any(r.started <= k <= (r.ended or 0)
                                                                for k in soak.worker_kills)]
    lost = [r for r in soak.records if r.outcome == "lost"]
    unexpected = [r for r in soak.records if r.outcome == "unexpected-error"]
    hostile_wrong = [r for r in soak.records if r.outcome == "hostile-wrong"]

    print()
    print(f"=== soak: {soak.args.minutes} min of load on {soak.server.url} (server log: {soak.server.log_path})")
    print(f"requests sent:               {len(soak.records)} ({len(soak.records) / soak.args.minutes:.0f}/min: "
          f"{', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))})")
    print(f"served (finished normally):  {outcomes['served']}")
    print(f"disconnected by the client:  {outcomes['disconnected']}")
    print(f"aborted by the admin API:    {outcomes['aborted']}")
    print(f"refused with 503 (restart):  {outcomes['rejected']}")
    print(f"ended by the scheduler crash:{outcomes['scheduler-crash']:>6}")
    crash_errors = collections.Counter(
        (r.errors[-1], "open at the kill" if r.started <= (soak.scheduler_kill or 0) else "sent after the kill")
        for r in soak.records if r.outcome == "scheduler-crash")
    for (message, when), count in sorted(crash_errors.items()):
        print(f"  {count:>4} {when}: {message!r}")
    print(f"hostile requests, 4xx:       {outcomes['hostile-4xx']}")
    print("faults injected:")
    for kind, count in sorted(soak.faults.items()):
        print(f"  {kind:<36} {count}")
    print(f"greedy outputs compared:     {sum(1 for _, v in compared if v == 'match')} whole "
          f"({len(survived)} of them lived through a worker kill), "
          f"{sum(1 for _, v in compared if v == 'prefix-match')} cut-short prefixes")
    print("must be 0:")
    figures = {
        "requests lost": len(lost),
        "requests duplicated": len(duplicated),
        "greedy outputs differing from the reference": len(differing),
        "unexpected errors": len(unexpected),
        "hostile requests not answered 4xx": len(hostile_wrong),
        "references differing alone vs batched": len(soak.reference_mismatch),
        "KV blocks used after the traffic": int(stats.get("kv_blocks_used", -1)),
        "requests running after the traffic": int(stats.get("running", -1)),
        "requests waiting after the traffic": int(stats.get("waiting", -1)),
        "requests listed by /admin/requests": int(stats.get("live_requests", -1)),
    }
    for name, value in figures.items():
        print(f"  {name:<46} {value}")
    print(f"/health at the end: {health}; scheduler internal errors: {stats.get('internal_errors')}, "
          f"malformed frames: {stats.get('malformed_frames')}, preemptions: {stats.get('preemptions')}")
    print("memory (RSS):")
    for role in ("frontend", "scheduler", "worker"):
        (pid0, rss0), (pid1, rss1) = memory_start.get(role, (0, None)), memory_end.get(role, (0, None))
        print(f"  {role:<10} start {_mib(rss0)} (pid {pid0})   end {_mib(rss1)} (pid {pid1})")
    for rec in (lost + duplicated + unexpected + hostile_wrong)[:20]:
        print(f"  ! {rec.outcome} {rec.kind} #{rec.seq} id={rec.request_id} status={rec.status} "
              f"t={rec.started:.1f}..{rec.ended} finishes={dict(rec.finishes)} errors={rec.errors[:2]} "
              f"exception={rec.exception}")
    for rec, verdict in differing[:10]:
        print(f"  ! greedy #{rec.seq} id={rec.request_id} ref {rec.ref} t={rec.started:.1f}..{rec.ended}: {verdict}")
    for line in soak.reference_mismatch:
        print(f"  ! {line}")
    failed = any(figures.values()) or health != 200
    print(f"result: {'FAIL' if failed else 'PASS'}")
    return 1 if failed else 0


def _mib(kib: int | None) -> str:
    return "   (gone)" if kib is None else f"{kib / 1024:6.1f} MiB"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="how long the load runs")
    p.add_argument("--rate", type=float, default=300.0, help="requests sent per minute (on average)")
    p.add_argument("--max-in-flight", type=int, default=24, help="most requests open at once")
    p.add_argument("--seed", type=int, default=14)
    p.add_argument("--worker-kill-every", type=float, default=120.0, help="seconds between worker SIGKILLs")
    p.add_argument("--scheduler-kill", action=argparse.BooleanOptionalAction, default=True,
                   help="SIGKILL the scheduler once")
    p.add_argument("--scheduler-kill-at", type=float, default=None, help="seconds into the load (default: mid-run)")
    p.add_argument("--admin-every", type=float, default=3.0, help="mean seconds between admin controls")
    p.add_argument("--server-pause-every", type=float, default=40.0, help="seconds between server pauses")
    p.add_argument("--progress-every", type=float, default=15.0)
    p.add_argument("--max-worker-restarts", type=int, default=None,
                   help="passed to sluice serve (default: the scheduled kills + 5)")
    p.add_argument("--serve-args", default="", help="extra flags for `sluice serve`")
    args = p.parse_args()

    restarts = args.max_worker_restarts
    if restarts is None:
        restarts = len(schedule(args)[0]) + 5
    flags = ["--model", "tiny", "--num-kv-blocks", "2048", "--max-worker-restarts", str(restarts),
             *args.serve_args.split()]
    log_path = Path(tempfile.mkdtemp(prefix="sluice-soak-")) / "server.log"
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(1))  # a SIGTERM still stops the server
    server = Server(flags, log_path)
    try:
        server.wait_ready()
        print(f"sluice serve {' '.join(flags)} ready at {server.url} (log: {log_path})", flush=True)
        return asyncio.run(run(args, server))
    finally:
        code = server.stop()
        print(f"sluice serve stopped (exit status {code})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
