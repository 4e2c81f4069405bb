"""A required or named tool choice through a real ``sluice serve`` on a random Qwen3 whose tokenizer
has ``<tool_call>`` and ``</tool_call>`` as added tokens that are not special, as Qwen2.5's and
Qwen3's have them. llguidance counts every added token as special: a grammar that spelled the tag
as a string let the model pick the tag's token and then refused it, so the answer ended after
one token. The grammar names the tags as tokens; random weights write what it allows."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from checkpoints import save_qwen3, with_tags
from sluice_server import SluiceServer, running_server

pytestmark = pytest.mark.timeout(300)

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "note": {"type": "string", "maxLength": 6}},
    "required": ["a", "note"]}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is two and two?"}]
# Short: the model's context is 256 tokens, and its tokenizer writes most text byte by byte.
TEMPLATE = ("{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SluiceServer]:
    path = with_tags(save_qwen3(tmp_path_factory.mktemp("qwen3")), ('<tool_call>', '</tool_call>'), TEMPLATE)
    with running_server("--model", str(path), "--num-kv-blocks", "64",
                        log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


def chat(server: SluiceServer, **body: object) -> dict:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"messages": ASK, "tools": [ADD, NOW], "max_tokens": 80, "temperature": 0} | body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_required_choice_writes_the_tags_as_tokens_and_is_a_parsed_call(server: SluiceServer) -> None:
    answer = chat(server, tool_choice="required", parallel_tool_calls=False, return_token_ids=True)
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] in ("add", "now")
    arguments = json.loads(call["function"]["arguments"])
    if call["function"]["name"] == "add":
        assert set(arguments) == {"a", "note"} and 0 <= arguments["a"] <= 99
    # The tags' own tokens (329 and 330), then EOS, which the grammar allows once the call is whole.
    ids = choice["token_ids"]
    assert (ids[0], ids[-2:], ids.count(329), ids.count(330)) == (329, [330, 2], 1, 1)


def test_a_named_choice_streams_its_call(server: SluiceServer) -> None:
    body = {"messages": ASK, "tools": [ADD, NOW], "max_tokens": 80, "temperature": 0, "stream": True,
            "tool_choice": {"type": "function", "function": {"name": "add"}}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [tc["function"]["name"] for tc in calls if "id" in tc] == ["add"]
    arguments = json.loads("".join(tc["function"]["arguments"] for tc in calls))
    assert set(arguments) == {"a", "note"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_the_responses_api_gets_the_same_call(server: SluiceServer) -> None:
    tool = {"type": "function", "name": "add", "parameters": ADD["function"]["parameters"]}  # type: ignore[index]
    r = httpx.post(f"{server.url}/v1/responses", timeout=60, json={
        "input": "What is two and two?", "tools": [tool], "tool_choice": "required", "parallel_tool_calls": False,
        "max_output_tokens": 80, "temperature": 0})
    assert r.status_code == 200, r.text
    (call,) = r.json()["output"]
    assert (call["type"], call["name"], set(json.loads(call["arguments"]))) == ("function_call", "add", {"a", "note"})
