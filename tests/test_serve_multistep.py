"""Multi-step decoding through a real ``sluice serve --num-scheduler-steps 8``: tokens still
stream one SSE chunk each, greedy output equals single-step output, a stop falling mid-window
emits nothing past it, and aborts mid-window give every block back."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import pytest
from sluice_server import SluiceServer, running_servers

TOKEN = "multistep-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[SluiceServer]]:
    """Eight steps a plan, and one (the reference), started side by side."""
    with running_servers(("--model", "tiny", "--num-scheduler-steps", "8", "--admin-token", TOKEN),
                         ("--model", "tiny", "--num-scheduler-steps", "1"),
                         log_dir=tmp_path_factory.mktemp("logs")) as started:
        yield started


@pytest.fixture(scope="module")
def server(servers: list[SluiceServer]) -> SluiceServer:
    return servers[0]


def _stream_chunks(url: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    return chunks


def test_a_64_token_stream_arrives_as_64_chunks_of_one_token(server: SluiceServer) -> None:
    body = {"prompt": PROMPT, "max_tokens": 64, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    chunks = [c for c in _stream_chunks(server.url, body) if c["choices"]]
    assert len(chunks) == 64
    assert all(len(c["choices"][0]["token_ids"]) == 1 for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def _greedy_ids(url: str, max_tokens: int, **extra: object) -> list[int]:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True} | extra
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


def test_stops_falling_mid_window_emit_nothing_past_them(servers: list[SluiceServer]) -> None:
    server, single = servers
    reference = _greedy_ids(single.url, 40, ignore_eos=True)
    assert _greedy_ids(server.url, 40, ignore_eos=True) == reference  # n=8 equals n=1
    assert _greedy_ids(server.url, 13, ignore_eos=True) == reference[:13]  # max_tokens mid-window
    stop = reference[11]
    cut = reference.index(stop) + 1
    r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
        "stop_token_ids": [stop]})
    assert r.json()["choices"][0]["token_ids"] == reference[:cut]
    assert r.json()["choices"][0]["finish_reason"] == "stop"


def test_aborts_mid_window_return_every_block(server: SluiceServer) -> None:
    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            async def disconnect_after(n: int) -> None:
                body = {"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "stream": True}
                async with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                    seen = 0
                    async for line in r.aiter_lines():
                        seen += line.startswith("data: {")
                        if seen >= n:
                            return  # leaving the block closes the stream: the server aborts

            await asyncio.gather(*(disconnect_after(3 + 5 * i) for i in range(8)))

    asyncio.run(scenario())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = httpx.get(f"{server.url}/admin/stats", headers=AUTH).json()
        if stats["kv_blocks_used"] == 0 and stats["running"] == 0:
            break
        time.sleep(0.1)
    assert stats["kv_blocks_used"] == 0 and stats["running"] == 0 and stats["waiting"] == 0
