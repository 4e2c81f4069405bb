"""Jump-forward through a real ``sluice serve`` (tiny model) against one started with
``--no-jump-forward``: constrained requests, concurrent, sampled and greedy, n > 1, streamed,
with a KV cache small enough that they preempt one another (recompute, and swap on a third
server), and paused and resumed midway, give the same tokens on all; the scheduler's accounting
of forced tokens (their blocks, the prefix cache, the host blocks) leaves no block held."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest
from sluice_server import SluiceServer, running_servers

pytestmark = pytest.mark.timeout(600)

ADMIN = "jump-admin"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
RECORD = {"type": "object", "additionalProperties": False, "required": ["name", "colour", "size", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "colour": {"enum": ["red", "green", "blue"]},
                         "size": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tags": {"type": "array", "items": {"enum": ["new", "old", "used"]}, "maxItems": 3}}}
PROMPTS = [[1, *((11 * i + j) % 250 + 3 for j in range(30 + 7 * i))] for i in range(6)]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SluiceServer, SluiceServer, SluiceServer]]:
    """Jump-forward on (recompute preemption), on with swap preemption, and off."""
    # 20 blocks of 16 tokens for six requests of up to ~70 + 80 tokens: preemption is certain.
    flags = ("--model", "tiny", "--admin-token", ADMIN, "--num-kv-blocks", "20", "--num-scheduler-steps", "6")
    with running_servers(flags, (*flags, "--preemption-mode", "swap"), (*flags, "--no-jump-forward"),
                         log_dir=tmp_path_factory.mktemp("jump")) as (on, swap, off):
        yield on, swap, off


async def answer(client: httpx.AsyncClient, url: str, prompt: list[int], i: int) -> list[list[int]]:
    body = {"prompt": prompt, "max_tokens": 80, "return_token_ids": True, "structured_outputs": {"json": RECORD},
            "temperature": 0 if i % 2 else 1.0, "seed": i, "n": 1 + i % 3, "stream": i % 4 == 3}
    if not body["stream"]:
        r = await client.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    ids: dict[int, list[int]] = {}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    ids.setdefault(c["index"], []).extend(c.get("token_ids") or [])
    return [ids[k] for k in sorted(ids)]


async def all_answers(url: str) -> list[list[list[int]]]:
    async with httpx.AsyncClient(timeout=300) as client:
        return list(await asyncio.gather(*(answer(client, url, p, i) for i, p in enumerate(PROMPTS))))


def stats(server: SluiceServer) -> dict:
    return httpx.get(f"{server.url}/admin/stats", headers=AUTH).json()


def test_jump_forward_gives_the_same_tokens_and_holds_no_block(
        servers: tuple[SluiceServer, SluiceServer, SluiceServer]) -> None:
    on, swap, off = servers
    want = asyncio.run(all_answers(off.url))
    assert asyncio.run(all_answers(on.url)) == want
    assert asyncio.run(all_answers(swap.url)) == want
    s_on, s_swap, s_off = stats(on), stats(swap), stats(off)
    assert s_on["preemptions"] > 0, "the cache is small enough that requests preempt one another"
    assert s_swap["swaps"] > 0
    assert s_on["jump_forward_tokens"] > 50 and s_off["jump_forward_tokens"] == 0
    assert s_on["steps"] < s_off["steps"], "fewer forward passes for the same tokens"
    for s in (s_on, s_swap, s_off):
        assert s["running"] == s["waiting"] == 0 and s["kv_blocks_used"] == 0 and s["host_blocks_used"] == 0
    metrics = httpx.get(f"{on.url}/metrics").text  # the scheduler's figures as of its last pong
    [line] = [x for x in metrics.splitlines() if x.startswith("sluice_jump_forward_tokens_total{")]
    assert float(line.split()[-1]) > 0


def test_pausing_constrained_requests_midway_changes_no_token(
        servers: tuple[SluiceServer, SluiceServer, SluiceServer]) -> None:
    on, _, off = servers
    want = asyncio.run(all_answers(off.url))

    async def paused_run() -> list[list[list[int]]]:
        run = asyncio.create_task(all_answers(on.url))
        async with httpx.AsyncClient(timeout=30) as client:
            for _ in range(3):  # paused and resumed mid-window, three times
                await asyncio.sleep(0.05)
                assert (await client.post(f"{on.url}/admin/pause", headers=AUTH)).status_code == 200
                await asyncio.sleep(0.2)
                assert (await client.post(f"{on.url}/admin/resume", headers=AUTH)).status_code == 200
        return await run

    assert asyncio.run(paused_run()) == want
    s = stats(on)
    assert s["running"] == s["waiting"] == 0 and s["kv_blocks_used"] == 0
