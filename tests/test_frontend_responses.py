"""The Responses API's parts alone: ``input`` items read as chat messages, the event stream a
renderer writes, and the store's bounds."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from frontend.errors import APIError
from frontend.responses_input import (
    chat_tool_choice,
    chat_tools,
    input_messages,
    output_messages,
    response_format,
)
from frontend.responses_render import ResponsesRenderer
from frontend.responses_store import ResponseStore, StoredResponse, parse_spec
from frontend.tools import tool_use


def test_input_items_become_one_conversation() -> None:
    history = [{"role": "user", "content": "weather in Paris?"}]
    items = [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
        {"role": "user", "content": "thanks"},
    ]
    messages = input_messages(items, history)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool", "user"]
    assert messages[1]["content"] == "Let me look."
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[3] == {"role": "tool", "tool_call_id": "c2", "content": "noon"}
    assert history == [{"role": "user", "content": "weather in Paris?"}]  # not modified
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("items", "param"), [
    ([{"type": "function_call_output", "call_id": "nobody", "output": "x"}], "input[0].call_id"),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id"),
    ([{"type": "web_search_call", "id": "ws_1"}], "input[0].type"),
    (["just a string"], "input[0]"),
    ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], "input[0].content[0].type"),
])
def test_input_items_refused_by_name(items: list, param: str) -> None:
    with pytest.raises(APIError) as e:
        input_messages(items)
    assert e.value.status == 400 and e.value.param == param


def test_tools_and_formats_in_chat_shape() -> None:
    tools = chat_tools([{"type": "function", "name": "f", "parameters": {"type": "object"}},
                        {"type": "function", "name": "g"}])
    assert tools is not None and tools[0] == {"type": "function", "function": {"name": "f",
                                                                               "parameters": {"type": "object"}}}
    assert chat_tool_choice({"type": "function", "name": "g"}, tools)[1] == {"type": "function",
                                                                            "function": {"name": "g"}}
    kept, mode = chat_tool_choice({"type": "allowed_tools", "mode": "required",
                                   "tools": [{"type": "function", "name": "g"}]}, tools)
    assert mode == "required" and [t["function"]["name"] for t in kept or []] == ["g"]
    with pytest.raises(APIError):
        chat_tools([{"type": "file_search"}])
    assert response_format({"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}) == \
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert response_format(None) is None


class _Choice:
    index, text_offset, first_chunk, prompt_logprobs = 0, 0, True, None


def _parse(stream: bytes) -> list[dict]:
    events = []
    for block in stream.decode().split("\n\n"):
        if block:
            kind, data = block.split("\n")
            event = json.loads(data.removeprefix("data: "))
            assert kind == f"event: {event['type']}"
            events.append(event)
    return events


def test_a_stream_with_text_then_a_call() -> None:
    """Numbered events in order, whitespace before the call makes no message, and the last event
    holds the whole response (the one given to ``finished``)."""
    use = tool_use([{"type": "function", "function": {"name": "f"}}], "auto", True)
    done: list[dict] = []
    renderer = ResponsesRenderer("resp_x", 1, "m", {}, use, done.append)
    choice = _Choice()
    pieces = ["Sure", ".", "\n", '<tool_call>\n{"name": "f", "arguments": {"a"', ": 1}}\n</tool_call>"]
    out = b"".join(renderer.chunk(choice, p, [0], [None], None, None) for p in pieces)
    out += renderer.chunk(choice, "\n", [0], [None], "stop", None)
    out += renderer.usage_chunk({"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9,
                                 "prompt_tokens_details": {"cached_tokens": 0}})
    events = _parse(out)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds.count("response.output_item.added") == 2 and kinds.count("response.output_item.done") == 2
    assert kinds[-1] == "response.completed"
    final = events[-1]["response"]
    assert final == done[0] and final["usage"]["output_tokens"] == 6
    message, call = final["output"]
    assert message["content"][0]["text"] == "Sure."
    assert call["type"] == "function_call" and json.loads(call["arguments"]) == {"a": 1}
    args_done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert args_done["arguments"] == deltas == call["arguments"]


def test_plain_tokens_and_a_failure() -> None:
    renderer = ResponsesRenderer("resp_y", 1, "m", {}, None)
    choice = _Choice()
    out = renderer.token(choice, "") + renderer.token(choice, "Hel") + renderer.token(choice, "lo")
    out += renderer.error("the engine failed", "engine_error")
    events = _parse(out)
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                           "response.content_part.added", "response.output_text.delta",
                                           "response.output_text.delta", "response.failed"]
    assert [e["sequence_number"] for e in events] == list(range(7))
    assert events[-1]["response"]["error"] == {"code": "engine_error", "message": "the engine failed"}


def test_store_bounds_and_specs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_spec("none") is None and parse_spec(f"sqlite:{tmp_path}/a.db") == tmp_path / "a.db"
    with pytest.raises(ValueError):
        parse_spec("postgres://x")
    monkeypatch.setattr("frontend.responses_store.PRUNE_EVERY", 1)  # a prune at every put
    store = ResponseStore(tmp_path / "r.sqlite3", max_count=3, max_age_s=3600)
    now = time.time()
    for i in range(6):
        store.put(StoredResponse(f"r{i}", "m", now - 7200 if i == 0 else now + i, {"output": [], "i": i}, []))
    store.close()

    async def read() -> list[str]:
        again = ResponseStore(tmp_path / "r.sqlite3", max_count=3, max_age_s=3600)
        found = [rid for rid in (f"r{i}" for i in range(6)) if await again.get(rid) is not None]
        assert await again.delete("r5") and not await again.delete("r5")
        again.close()
        return found

    assert asyncio.run(read()) == ["r3", "r4", "r5"]  # r0 was too old, r1 and r2 the oldest beyond 3
    assert output_messages([{"type": "message", "content": [{"type": "output_text", "text": "hi"}]},
                            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]) == \
        [{"role": "assistant", "content": "hi",
          "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
