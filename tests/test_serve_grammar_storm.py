"""A storm of new grammars beside a plain stream, through a real ``sluice serve`` (tiny model).

Sixteen requests arrive at once, each held to a JSON schema never seen before (an ``anyOf`` of
many objects and a large enum: tens of milliseconds to compile each). They wait in the scheduler
while the worker compiles their grammars (``/admin/stats`` counts them as waiting for their
grammar), and every one is then served a document that follows its schema; a plain greedy
stream running through it all gives exactly its text alone. The figure (the plain stream's
inter-token p99 beside the storm against alone) is ``scripts/bench_grammar_storm.py``'s.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest
from sluice_server import SluiceServer, running_server

sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
from bench_grammar_storm import expensive_schema

pytestmark = pytest.mark.timeout(600)
ADMIN = "storm"
AUTH = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SluiceServer]:
    with running_server("--admin-token", ADMIN, "--num-kv-blocks", "512",
                        log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


async def plain(client: httpx.AsyncClient, url: str) -> str:
    body = {"prompt": "Once upon a time", "max_tokens": 96, "temperature": 0, "ignore_eos": True}
    r = await client.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


async def constrained(client: httpx.AsyncClient, url: str, i: int) -> None:
    schema = expensive_schema(i)
    body = {"prompt": f"Record {i}:", "max_tokens": 200, "temperature": 0, "structured_outputs": {"json": schema}}
    r = await client.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(choice["text"]), schema)
    else:  # cut by max_tokens: a prefix of a valid document
        assert choice["finish_reason"] == "length" and choice["text"].startswith('{"kind": "kind_')


def test_sixteen_new_schemas_are_all_served_and_a_plain_stream_beside_them_is_unchanged(server: SluiceServer) -> None:
    waited: list[int] = []

    async def run() -> tuple[str, str]:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=32)) as client:
            alone = await plain(client, server.url)
            stream = asyncio.ensure_future(plain(client, server.url))
            storm = asyncio.gather(*(constrained(client, server.url, 1000 + i) for i in range(16)))
            while not storm.done():
                stats = (await client.get(f"{server.url}/admin/stats", headers=AUTH)).json()
                waited.append(int(stats.get("waiting_for_grammar", 0)))
                await asyncio.sleep(0.02)
            await storm
            return alone, await stream

    alone, beside = asyncio.run(run())
    assert beside == alone
    assert max(waited) > 0, "constrained requests waited for their grammars in the scheduler"
    final = httpx.get(f"{server.url}/admin/stats", headers=AUTH).json()
    assert final["waiting_for_grammar"] == 0 and final["kv_blocks_used"] == 0
