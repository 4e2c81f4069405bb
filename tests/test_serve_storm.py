"""Issue 14, "Disconnect storm": many concurrent streams through one real ``sluice serve``, a third
of them hanging up at random points. Every other stream still gets all its tokens and its finish,
every request is gone from the scheduler afterwards with its KV blocks freed, and the frontend's
memory does not grow from one storm to the next."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from sluice_server import SluiceServer, running_server

TOKEN = "storm-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# The issue asks for 1,000 concurrent streams, and 1,000 fit: on the 2-core CI machine one storm
# of 1,000 took 5-9 s and the whole test (start-up, warm-up storm, storm) 14-24 s over ten runs,
# well under the 2 minutes it may take. All open at once: --max-num-seqs STREAMS seats them all.
STREAMS = 1000
MAX_TOKENS = 16
DISCONNECT_SHARE = 3  # one stream in DISCONNECT_SHARE hangs up
SETTLE_S = 10.0


@dataclass
class Outcome:
    hang_up_after: int | None  # chunks read before closing the response; None = read to the end
    status: int = 0
    token_ids: list[int] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    usage_tokens: int | None = None
    errors: list[str] = field(default_factory=list)
    done: bool = False  # [DONE] seen


def _plan(seed: int) -> list[int | None]:
    """Which streams hang up, and after how many chunks (0 = as soon as the headers arrive)."""
    rng = random.Random(seed)
    quitters = set(rng.sample(range(STREAMS), STREAMS // DISCONNECT_SHARE))
    return [rng.randrange(MAX_TOKENS) if i in quitters else None for i in range(STREAMS)]


def _prompt(i: int) -> list[int]:
    # Distinct prompts, so the prefix cache does not make most of them free.
    return [1, *((7 * i + 13 * j) % 500 + 3 for j in range(6))]


async def _one(client: httpx.AsyncClient, url: str, i: int, outcome: Outcome) -> None:
    body = {"prompt": _prompt(i), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    chunks = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        outcome.status = r.status_code
        if r.status_code != 200:
            return
        if outcome.hang_up_after == 0:
            return  # leaving the block closes the connection: the server sees a disconnect
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                outcome.done = True
                continue
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            if "error" in data:
                outcome.errors.append(data["error"]["message"])
                continue
            if data.get("usage") is not None:
                outcome.usage_tokens = data["usage"]["completion_tokens"]
            for choice in data["choices"]:
                outcome.token_ids += choice.get("token_ids") or []
                if choice.get("finish_reason") is not None:
                    outcome.finish_reasons.append(choice["finish_reason"])
            chunks += 1
            if chunks == outcome.hang_up_after:
                return


async def _storm(url: str, seed: int) -> list[Outcome]:
    outcomes = [Outcome(k) for k in _plan(seed)]
    # One connection per stream, all open at once: nothing waits in httpx's pool queue.
    limits = httpx.Limits(max_connections=STREAMS, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        await asyncio.gather(*(_one(client, url, i, o) for i, o in enumerate(outcomes)))
    return outcomes


def _check(outcomes: list[Outcome]) -> None:
    assert [o.status for o in outcomes] == [200] * STREAMS
    for i, o in enumerate(outcomes):
        if o.hang_up_after is not None:
            continue
        assert o.errors == [], (i, o.errors)
        assert len(o.token_ids) == MAX_TOKENS, (i, len(o.token_ids))
        assert o.finish_reasons == ["length"], (i, o.finish_reasons)
        assert o.usage_tokens == MAX_TOKENS, (i, o.usage_tokens)
        assert o.done, i


def _settled(server: SluiceServer) -> dict:
    """/admin/stats once nothing is running or waiting and every block is free (up to SETTLE_S)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        stats = httpx.get(f"{server.url}/admin/stats", headers=AUTH, timeout=10).json()
        live = httpx.get(f"{server.url}/admin/requests", headers=AUTH, timeout=10).json()["data"]
        idle = stats["running"] == stats["waiting"] == stats["kv_blocks_used"] == 0 and live == []
        if idle or time.monotonic() > deadline:
            assert stats["running"] == 0 and stats["waiting"] == 0, stats
            assert stats["kv_blocks_used"] == 0, stats
            assert live == [], live[:5]
            return dict(stats)
        time.sleep(0.1)


def _finished(server: SluiceServer, reason: str) -> float:
    """The frontend's count of requests that ended with ``reason`` (abort: the stream was cut short)."""
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "sluice_request_success_total" and sample.labels["finished_reason"] == reason:
                return sample.value
    return 0.0


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_a_disconnect_storm_leaves_no_request_block_or_memory_behind(tmp_path: Path) -> None:
    flags = ("--admin-token", TOKEN, "--max-num-seqs", str(STREAMS), "--num-kv-blocks", str(4 * STREAMS))
    with running_server(*flags, log_dir=tmp_path) as server:
        # Warm-up: a storm of the same size first. The frontend's allocators (pymalloc arenas,
        # malloc's heap, uvloop's and zmq's buffers, the JSON decoders) grow to their high-water
        # mark in the first storm and keep that memory; only growth past it would be a leak.
        started = time.monotonic()
        _check(asyncio.run(_storm(server.url, seed=1)))
        _settled(server)
        warm_rss = _rss_kib(server.proc.pid)
        warm_s = time.monotonic() - started

        aborted_before = _finished(server, "abort")
        outcomes = asyncio.run(_storm(server.url, seed=2))
        _check(outcomes)
        _settled(server)
        rss = _rss_kib(server.proc.pid)
        aborted = _finished(server, "abort") - aborted_before
        print(f"storm of {STREAMS}: warm-up {warm_s:.1f} s, storm {time.monotonic() - started - warm_s:.1f} s, "
              f"{aborted:.0f} streams cut short, frontend RSS {warm_rss} KiB -> {rss} KiB")
        # The storm is real: the streams that hang up as soon as their headers arrive are cut
        # short before their first token (a thousand prompts queue up); most of the others too.
        assert aborted >= sum(1 for o in outcomes if o.hang_up_after == 0), aborted
        assert rss <= warm_rss * 1.10, f"frontend RSS grew from {warm_rss} KiB to {rss} KiB"
