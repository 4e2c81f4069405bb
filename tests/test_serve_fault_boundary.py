"""One request's odd output never hurts another's, through a real ``sluice serve``.

The built-in model is held by a ``choice`` grammar to write exactly the tool-call text a model
might write (a Markdown-escaped name, arguments as a JSON string, text after the call), with
``tool_choice`` auto, so the tool parser reads it as it would a model's own call. Beside those
requests, plain greedy streams run in the same batches: their text must be exactly what it is
when they run alone, and each odd request must end with calls whose arguments are valid JSON.
Before the fault boundary, the escaped name raised inside the output processor: the frontend's
output task died and every live stream ended with an error.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from sluice_server import SluiceServer, running_server

pytestmark = pytest.mark.timeout(600)

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
ODD_OUTPUTS = [
    # A Markdown habit: an escaped underscore (not a JSON escape) in the name.
    '<tool_call>\n{"name": "get\\_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    # Arguments written as a JSON string, and text after the call.
    '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n</tool_call>\nDone.',
    # Both, and a second call.
    '<tool_call>\n{"name": "get\\_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SluiceServer]:
    with running_server("--num-kv-blocks", "256", log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


def stream(server: SluiceServer, body: dict) -> list[dict]:
    body = {"model": "tiny", "max_tokens": 48, "temperature": 0, "stream": True} | body
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def plain(server: SluiceServer, i: int) -> str:
    events = stream(server, {"messages": [{"role": "user", "content": f"Count to {i}, please."}], "ignore_eos": True})
    assert all("error" not in e for e in events), events
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])


def odd(server: SluiceServer, text: str) -> list[dict]:
    return stream(server, {"messages": [{"role": "user", "content": "The weather?"}], "tools": [TOOL],
                           "max_tokens": 200, "structured_outputs": {"choice": [text]}})


def calls_of(events: list[dict]) -> list[dict]:
    """The streamed calls, put back together as OpenAI's clients do."""
    calls: dict[int, dict] = {}
    for e in events:
        for delta in (e["choices"][0]["delta"].get("tool_calls") or []) if e["choices"] else []:
            call = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
            call["name"] += delta.get("function", {}).get("name") or ""
            call["arguments"] += delta.get("function", {}).get("arguments") or ""
    return [calls[i] for i in sorted(calls)]


def test_odd_tool_text_beside_plain_streams_leaves_their_text_unchanged(server: SluiceServer) -> None:
    alone = [plain(server, i) for i in range(4)]
    with ThreadPoolExecutor(8) as pool:
        plains = [pool.submit(plain, server, i) for i in range(4)]
        odds = [pool.submit(odd, server, text) for text in ODD_OUTPUTS]
        assert [p.result() for p in plains] == alone
        results = [o.result() for o in odds]
    for text, events in zip(ODD_OUTPUTS, results, strict=True):
        assert all("error" not in e for e in events), (text, events)
        calls = calls_of(events)
        assert calls and all(c["name"] == "get_weather" for c in calls), (text, calls)
        for call in calls:
            assert isinstance(json.loads(call["arguments"]), dict), (text, call)
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert [json.loads(c["arguments"])["city"] for c in calls_of(results[2])] == ["Oslo", "Rome"]
