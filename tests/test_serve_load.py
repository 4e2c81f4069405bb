"""Bursts and overload through a real ``sluice serve``: every accepted request ends exactly once,
overload is a 503 with Retry-After, and every KV block comes back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from sluice_server import SluiceServer, running_servers

TOKEN = "load-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def _burst(url: str, n: int) -> list[httpx.Response]:
    # All n are sent at once, over 256 connections. The semaphore keeps httpx's own pool queue
    # empty: its request assignment is quadratic in queued requests, and with 1000 of them
    # queued the client, not the server, took most of a minute.
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    in_flight = asyncio.Semaphore(256)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def one(i: int) -> httpx.Response:
            async with in_flight:
                return await client.post(f"{url}/v1/completions", json={
                    "prompt": [1, 5 + i % 200, 9], "max_tokens": 3, "ignore_eos": True, "user": f"u{i % 7}"})

        return list(await asyncio.gather(*(one(i) for i in range(n))))


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[SluiceServer]]:
    """Both tests' servers, started side by side."""
    with running_servers(("--admin-token", TOKEN, "--num-kv-blocks", "512"),
                         ("--admin-token", TOKEN, "--num-kv-blocks", "64", "--max-queued-requests", "2"),
                         log_dir=tmp_path_factory.mktemp("load")) as started:
        yield started


def test_a_burst_of_a_thousand_requests_all_finish_once(servers: list[SluiceServer]) -> None:
    server = servers[0]
    responses = asyncio.run(_burst(server.url, 1000))
    assert [r.status_code for r in responses] == [200] * 1000
    ids = {r.json()["id"] for r in responses}
    assert len(ids) == 1000  # no duplicate, none lost
    assert all(r.json()["usage"]["completion_tokens"] == 3 for r in responses)
    deadline = time.monotonic() + 30
    stats = httpx.get(f"{server.url}/admin/stats", headers=AUTH).json()
    while stats["kv_blocks_used"] and time.monotonic() < deadline:
        time.sleep(0.1)
        stats = httpx.get(f"{server.url}/admin/stats", headers=AUTH).json()
    assert stats["kv_blocks_used"] == 0 and stats["running"] == 0 and stats["waiting"] == 0


def test_beyond_max_queued_requests_new_ones_get_503_with_retry_after(servers: list[SluiceServer]) -> None:
    server = servers[1]
    httpx.post(f"{server.url}/admin/pause", headers=AUTH)  # nothing runs: requests queue up

    async def scenario() -> tuple[list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"prompt": "queued", "max_tokens": 2}
            queued = [asyncio.create_task(client.post(f"{server.url}/v1/completions", json=body))
                      for _ in range(2)]
            await asyncio.sleep(1.0)
            rejected = await client.post(f"{server.url}/v1/completions", json=body)
            await client.post(f"{server.url}/admin/resume", headers=AUTH)
            return [await t for t in queued], rejected

    queued, rejected = asyncio.run(scenario())
    assert rejected.status_code == 503 and rejected.headers["Retry-After"] == "1"
    assert rejected.json()["error"]["code"] == "overloaded"
    assert [r.status_code for r in queued] == [200, 200]
