"""Through a real ``sluice serve``: greedy outputs stay identical to undisturbed runs under
recompute preemption, swap preemption, pause/resume, cut-in and prefix-cache hits."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from sluice_server import SluiceServer, running_servers

ADMIN = "sched-admin"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
PROMPTS = [[1, *((7 * i + j) % 250 + 3 for j in range(40))] for i in range(6)]
NEW = 60


async def generate(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int = NEW,
                   priority: int = 0) -> dict:
    r = await client.post(f"{url}/v1/completions", headers=AUTH, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, "priority": priority,
    })
    assert r.status_code == 200, r.text
    return r.json()


async def undisturbed(url: str, prompts: list[list[int]], max_tokens: int = NEW) -> list[list[int]]:
    async with httpx.AsyncClient(timeout=120) as client:
        return [(await generate(client, url, p, max_tokens))["choices"][0]["token_ids"] for p in prompts]


async def concurrent(url: str, prompts: list[list[int]]) -> list[list[int]]:
    async with httpx.AsyncClient(timeout=300) as client:
        out = await asyncio.gather(*(generate(client, url, p) for p in prompts))
    return [o["choices"][0]["token_ids"] for o in out]


def stats(server: SluiceServer) -> dict:
    return httpx.get(f"{server.url}/admin/stats", headers=AUTH).json()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SluiceServer]]:
    """Every server the tests below use, started side by side."""
    # 24 blocks of 16 tokens; six requests of 41 + 60 tokens need 42: preemption is certain.
    small = ("--admin-token", ADMIN, "--num-kv-blocks", "24", "--max-num-batched-tokens", "256")
    flags = {"recompute": (*small, "--preemption-mode", "recompute"),
             "swap": (*small, "--preemption-mode", "swap"),
             "cut-in": ("--admin-token", ADMIN, "--max-num-seqs", "1", "--no-priority-preemption",
                        "--num-kv-blocks", "64"),
             "seats": ("--admin-token", ADMIN, "--max-num-seqs", "2", "--max-num-seqs-per-priority", "5:1")}
    with running_servers(*flags.values(), log_dir=tmp_path_factory.mktemp("sched")) as started:
        yield dict(zip(flags, started, strict=True))


@pytest.fixture(scope="module")
def recompute_server(servers: dict[str, SluiceServer]) -> SluiceServer:
    return servers["recompute"]


@pytest.fixture(scope="module")
def swap_server(servers: dict[str, SluiceServer]) -> SluiceServer:
    return servers["swap"]


def test_recompute_preemption_keeps_greedy_outputs(recompute_server: SluiceServer) -> None:
    want = asyncio.run(undisturbed(recompute_server.url, PROMPTS))
    httpx.post(f"{recompute_server.url}/admin/prefix-cache/reset", headers=AUTH)
    before = stats(recompute_server)["preemptions"]
    assert asyncio.run(concurrent(recompute_server.url, PROMPTS)) == want
    assert stats(recompute_server)["preemptions"] > before
    assert stats(recompute_server)["kv_blocks_used"] == 0


def test_swap_preemption_keeps_greedy_outputs(swap_server: SluiceServer) -> None:
    want = asyncio.run(undisturbed(swap_server.url, PROMPTS))
    assert asyncio.run(concurrent(swap_server.url, PROMPTS)) == want
    s = stats(swap_server)
    assert s["swaps"] > 0 and s["host_blocks_used"] == 0 and s["kv_blocks_used"] == 0


def test_prefix_cache_hit_reports_cached_tokens_and_same_output(recompute_server: SluiceServer) -> None:
    prompt = [1, *range(100, 150)]  # 51 tokens: 3 full blocks can be cached

    async def twice() -> tuple[dict, dict]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await generate(client, recompute_server.url, prompt, 20), await generate(
                client, recompute_server.url, prompt, 20)

    first, second = asyncio.run(twice())
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]


async def _wait_state(client: httpx.AsyncClient, url: str, request_id: str, state: str,
                      settled: bool = False) -> dict:
    """Wait for ``state``; with ``settled``, also for the request to be out of the worker's plan."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r = await client.get(f"{url}/admin/requests/{request_id}", headers=AUTH)
        if r.status_code == 200 and r.json()["state"] == state and not (settled and r.json()["in_flight"]):
            return r.json()
        await asyncio.sleep(0.05)
    raise AssertionError(f"{request_id} never reached state {state}")


def test_pause_and_resume_keep_greedy_output(recompute_server: SluiceServer) -> None:
    url = recompute_server.url
    prompt = PROMPTS[0]
    want = asyncio.run(undisturbed(url, [prompt], 200))[0]

    async def paused_run() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"prompt": prompt, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True, "stream": True}
            tokens: list[int] = []
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                request_id = r.headers["X-Request-Id"]
                lines = r.aiter_lines()
                async for line in lines:
                    if line.startswith("data: {"):
                        tokens += httpx.Response(200, content=line[6:]).json()["choices"][0]["token_ids"]
                    if len(tokens) >= 10:
                        break
                await client.post(f"{url}/admin/requests/{request_id}/pause", headers=AUTH)
                # Paused at once; tokens of the plan in flight count until the worker's next step.
                info = await _wait_state(client, url, request_id, "paused", settled=True)
                assert info["kv_blocks"] > 0  # kept while memory allows
                frozen = info["output_tokens"]
                await asyncio.sleep(0.5)
                again = await _wait_state(client, url, request_id, "paused")
                assert again["output_tokens"] == frozen  # nothing is decoded while paused
                await client.post(f"{url}/admin/requests/{request_id}/resume", headers=AUTH)
                async for line in lines:
                    if line.startswith("data: {"):
                        tokens += httpx.Response(200, content=line[6:]).json()["choices"][0]["token_ids"]
            return tokens

    assert asyncio.run(paused_run()) == want


def test_cut_in_runs_next_and_everyone_keeps_their_output(servers: dict[str, SluiceServer]) -> None:
    server = servers["cut-in"]
    url = server.url
    long_prompt, short_prompt = PROMPTS[1], PROMPTS[2]
    want_long, want_short = asyncio.run(undisturbed(url, [long_prompt, short_prompt], 150))

    async def scenario() -> tuple[list[int], list[int], list[str]]:
        done: list[str] = []
        async with httpx.AsyncClient(timeout=120) as client:
            async def run(name: str, prompt: list[int], priority: int) -> list[int]:
                out = await generate(client, url, prompt, 150, priority)
                done.append(name)
                return out["choices"][0]["token_ids"]

            long_task = asyncio.create_task(run("long", long_prompt, 0))
            for _ in range(200):  # wait until the long one holds the only seat
                running = (await client.get(f"{url}/admin/requests", headers=AUTH)).json()["data"]
                if any(r["state"] == "running" for r in running):
                    break
                await asyncio.sleep(0.01)
            short_task = asyncio.create_task(run("short", short_prompt, 5))
            listing: list[dict] = []
            for _ in range(200):
                listing = (await client.get(f"{url}/admin/requests", headers=AUTH)).json()["data"]
                if any(r["priority"] == 5 and r["state"] == "waiting" for r in listing):
                    break
                await asyncio.sleep(0.02)
            short_id = next(r["id"] for r in listing if r["priority"] == 5)
            r = await client.post(f"{url}/admin/requests/{short_id}/priority", headers=AUTH,
                                  json={"priority": -1, "cut_in": True})
            assert r.status_code == 200, r.text
            return await long_task, await short_task, done

    got_long, got_short, order = asyncio.run(scenario())
    assert order == ["short", "long"]  # the cut-in finished first, though it came second
    assert got_long == want_long and got_short == want_short
    assert stats(server)["preemptions"] >= 1


def test_urgent_request_takes_a_seat_and_batch_class_keeps_to_its_cap(servers: dict[str, SluiceServer]) -> None:
    # Two seats, priority >= 5 capped at one of them. Issue 13, defect 1: with every seat held by
    # running decodes, a more urgent arrival waited for a whole long request to finish.
    server = servers["seats"]
    url = server.url

    def state(request_id: str) -> dict:
        return httpx.get(f"{url}/admin/requests/{request_id}", headers=AUTH).json()

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            long = {"prompt": PROMPTS[0], "max_tokens": 3000, "ignore_eos": True, "stream": True}
            streams, ids = [], []
            for priority in (5, 5, 3):  # batch, batch (capped: waits), then an interactive one
                r = await client.send(client.build_request(
                    "POST", f"{url}/v1/completions", json=long | {"priority": priority}), stream=True)
                streams.append(r)
                ids.append(r.headers["X-Request-Id"])
                await asyncio.sleep(0.3)
            batch, capped, interactive = ids
            assert state(capped)["state"] == "waiting"  # its class's one seat is taken
            assert state(interactive)["state"] == "running"
            assert stats(server)["seats_by_priority"] == {"5": 1}
            started = time.monotonic()
            urgent = await generate(client, url, PROMPTS[1], max_tokens=8, priority=1)
            assert urgent["usage"]["completion_tokens"] == 8
            assert time.monotonic() - started < 30  # not after the 3000-token streams
            assert state(batch)["preemptions"] >= 1  # the least urgent gave its seat
            assert state(interactive)["preemptions"] == 0
            for request_id in ids:
                httpx.post(f"{url}/admin/requests/{request_id}/abort", headers=AUTH)
            for r in streams:
                await r.aread()
                await r.aclose()

    asyncio.run(scenario())
    time.sleep(0.5)
    s = stats(server)
    assert s["running"] == s["waiting"] == 0 and s["kv_blocks_used"] == 0
