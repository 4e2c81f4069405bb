"""Heartbeats on silent streams that every client skips, through a real ``sluice serve``.

The server is paused while streams wait for their first token, so each stream sees several
heartbeats (``--sse-keepalive 1``) before any event. Three readers then must see the whole
answer: the official ``openai`` client; a reader that reads lines; and a reader that works as
``vllm bench serve``'s does (each network read stripped of surrounding whitespace, skipped if
nothing is left, appended to a buffer split on blank lines, a buffer that is one whole
``data:`` event dispatched at once). With the old heartbeat, an SSE comment, that last reader
glued the comment to the next event and parsed nothing after it: at 64 streams queued past the
threshold, 63 of 64 requests "failed" in the benchmark.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from sluice_server import SluiceServer, running_servers

pytestmark = pytest.mark.timeout(600)

ADMIN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
PAUSED_S = 3.5  # several heartbeats' worth of silence
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[SluiceServer]]:
    """Heartbeats every second, and none: started side by side."""
    with running_servers(("--sse-keepalive", "1", "--admin-token", ADMIN, "--num-kv-blocks", "512"),
                         ("--sse-keepalive", "0", "--admin-token", ADMIN, "--num-kv-blocks", "64"),
                         log_dir=tmp_path_factory.mktemp("logs")) as started:
        yield started


@pytest.fixture(scope="module")
def server(servers: list[SluiceServer]) -> SluiceServer:
    return servers[0]


class BenchReader:
    """An SSE reader that works as ``vllm bench serve``'s: every network read is stripped and,
    if anything is left, added to a buffer; events are split off at blank lines, and a buffer
    that is one whole ``data:`` event (complete JSON, or [DONE]) is taken at once."""

    def __init__(self) -> None:
        self.buffer = ""
        self.events: list[str] = []

    def read(self, chunk: bytes) -> None:
        text = chunk.strip().decode()
        if not text:
            return
        self.buffer += text
        while "\n\n" in self.buffer:
            event, self.buffer = self.buffer.split("\n\n", 1)
            if event.strip():
                self.events.append(event.strip())
        if self.buffer.startswith("data: "):
            body = self.buffer.removeprefix("data: ").strip()
            try:
                if body != "[DONE]":
                    json.loads(body)
            except ValueError:
                return  # not whole yet
            self.events.append(self.buffer.strip())
            self.buffer = ""

    def tokens(self) -> tuple[int, bool]:
        """How many token events it parsed, and whether it saw [DONE] (comments it skips)."""
        data = [e.removeprefix("data: ") for e in self.events if not e.startswith(":")]
        chunks = [json.loads(d) for d in data if d != "[DONE]"]
        return sum(1 for c in chunks if c.get("choices")), "[DONE]" in data


def paused_for(server: SluiceServer, seconds: float) -> threading.Thread:
    """Pause the whole server now and resume it after ``seconds``, in the background."""
    assert httpx.post(f"{server.url}/admin/pause", headers=AUTH).status_code == 200

    def resume() -> None:
        time.sleep(seconds)
        assert httpx.post(f"{server.url}/admin/resume", headers=AUTH).status_code == 200

    thread = threading.Thread(target=resume)
    thread.start()
    return thread


def test_64_streams_queued_past_the_heartbeat_all_complete_in_a_bench_style_reader(server: SluiceServer) -> None:
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}

    async def one(client: httpx.AsyncClient) -> tuple[int, bool, bytes]:
        reader, raw = BenchReader(), b""
        async with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for chunk in r.aiter_raw():
                raw += chunk
                reader.read(chunk)
        return (*reader.tokens(), raw)

    async def run() -> list[tuple[int, bool, bytes]]:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=100)) as client:
            return await asyncio.gather(*(one(client) for _ in range(64)))

    resumer = paused_for(server, PAUSED_S)
    results = asyncio.run(run())
    resumer.join()
    assert all(raw.startswith(b"\n") for _, _, raw in results), "every stream waited through heartbeats"
    complete = [done and tokens == MAX_TOKENS for tokens, done, _ in results]
    assert all(complete), f"{complete.count(False)} of 64 streams did not parse to the end"


def test_the_official_client_and_a_line_reader_read_through_heartbeats(server: SluiceServer) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    resumer = paused_for(server, PAUSED_S)
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=MAX_TOKENS, stream=True, extra_body={"ignore_eos": True})
    deltas = [c for c in stream if c.choices]
    resumer.join()
    assert sum(1 for c in deltas if c.choices[0].delta.content is not None) >= MAX_TOKENS - 1
    assert deltas[-1].choices[0].finish_reason == "length"

    resumer = paused_for(server, PAUSED_S)
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120,
                      json={"prompt": "Hi", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}) as r:
        lines = list(r.iter_lines())
    resumer.join()
    events = [line for line in lines if line.startswith("data: {")]
    assert len(events) == MAX_TOKENS and lines.count("data: [DONE]") == 1
    assert all(line == "" or line.startswith("data: ") for line in lines), "nothing else on the wire"


def test_no_heartbeats_when_turned_off(servers: list[SluiceServer]) -> None:
    s = servers[1]
    resumer = paused_for(s, PAUSED_S)
    with httpx.stream("POST", f"{s.url}/v1/completions", timeout=120,
                      json={"prompt": "Hi", "max_tokens": 2, "stream": True}) as r:
        raw = b"".join(r.iter_raw())
    resumer.join()
    assert raw.startswith(b"data: {"), "the first bytes are the first event"
