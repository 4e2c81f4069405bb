"""``/v1/responses`` through the real server on the default model (SmolLM2), with the client
libraries that speak it unchanged: the ``openai`` client (create, stream, tools, ``text.format``,
stored responses), langchain-openai (``use_responses_api=True``), pydantic-ai
(``OpenAIResponsesModel``: an agent with a tool, structured output) and litellm
(``responses()``). Bad input is a 4xx in OpenAI's shape, the server keeps serving, and every KV
block comes back."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import NotFoundError, OpenAI
from pydantic import BaseModel
from sluice_server import SluiceServer, running_server, settled_stats

pytestmark = pytest.mark.timeout(600)

ADMIN = {"Authorization": "Bearer responses-test"}
MODEL = "smollm2"
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SluiceServer]:
    store = tmp_path_factory.mktemp("store") / "responses.sqlite3"
    with running_server("--model", MODEL, "--dtype", "auto", "--num-kv-blocks", "256", "--admin-token",
                        ADMIN["Authorization"].split()[1], "--responses-store", f"sqlite:{store}",
                        log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: SluiceServer) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _events(server: SluiceServer, body: dict) -> list[dict]:
    """The raw SSE events of a streamed response, ``event:`` line checked against ``type``."""
    events = []
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body | {"stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: "):]
            elif line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                assert event["type"] == kind
                events.append(event)
    return events


def test_create_answers_in_openai_shape(server: SluiceServer, client: OpenAI) -> None:
    r = client.responses.with_raw_response.create(model=MODEL, instructions="Answer in one short sentence.",
                                                  input="What is the capital of France?", max_output_tokens=40,
                                                  temperature=0, metadata={"case": "plain"})
    response = r.parse()
    assert r.headers["x-request-id"] == response.id and response.id.startswith("resp_")
    assert response.object == "response" and response.model == MODEL
    assert response.status in ("completed", "incomplete")
    assert "Paris" in response.output_text
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert response.usage is not None and response.usage.output_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.instructions == "Answer in one short sentence." and response.metadata == {"case": "plain"}
    cut = client.responses.create(model=MODEL, input="Count from one to fifty in words.", max_output_tokens=5)
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens" and cut.usage.output_tokens == 5


def test_stream_events_in_order(server: SluiceServer, client: OpenAI) -> None:
    events = _events(server, {"model": MODEL, "input": "Say hello in five words.", "max_output_tokens": 30,
                              "temperature": 0})
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert len(deltas) > 3 and all(deltas)  # token by token, no empty deltas
    final = events[-1]["response"]
    text = final["output"][0]["content"][0]["text"]
    assert "".join(deltas) == text == events[-4]["text"] and text
    assert final["usage"]["output_tokens"] >= len(deltas)
    # The openai client's own stream helper reads the same stream into the same response.
    with client.responses.stream(model=MODEL, input="Say hello in five words.", max_output_tokens=200,
                                 temperature=0) as stream:
        streamed = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        done = stream.get_final_response()
    assert done.status == "completed" and done.output_text == streamed


def test_tool_call_and_its_result_continue_a_stored_conversation(server: SluiceServer, client: OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False, temperature=0)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and json.loads(call.arguments)["city"]
    assert first.status == "completed"
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER],
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": json.dumps({"weather": "sunny", "celsius": 24})}],
                                     max_output_tokens=60, temperature=0)
    assert second.previous_response_id == first.id and second.output_text
    # The whole conversation crossed: the second prompt holds the first question and the result.
    assert second.usage.input_tokens > first.usage.input_tokens
    # Streamed: the call as typed events, its arguments' deltas adding up to the done event's.
    events = _events(server, {"model": MODEL, "input": "What is the weather in Rome?", "tools": [WEATHER],
                              "tool_choice": {"type": "function", "name": "get_weather"}, "temperature": 0,
                              "store": False})
    added = next(e for e in events if e["type"] == "response.output_item.added")
    assert added["item"]["type"] == "function_call" and added["item"]["name"] == "get_weather"
    fragments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == fragments and json.loads(fragments)["city"]
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["store"] is False
    with pytest.raises(NotFoundError):
        client.responses.retrieve(events[-1]["response"]["id"])


class Country(BaseModel):
    name: str
    capital: str


def test_text_format_json_schema(client: OpenAI) -> None:
    parsed = client.responses.parse(model=MODEL, input="France: give its name and its capital.", text_format=Country,
                                    temperature=0, max_output_tokens=100)
    assert isinstance(parsed.output_parsed, Country) and parsed.output_parsed.capital
    plain = client.responses.create(model=MODEL, input="Describe Paris as JSON.", temperature=0,
                                    text={"format": {"type": "json_object"}}, max_output_tokens=120)
    if plain.status == "completed":
        assert isinstance(json.loads(plain.output_text), dict)


def test_stored_responses_read_and_deleted(server: SluiceServer, client: OpenAI) -> None:
    made = client.responses.create(model=MODEL, input="Name one color.", max_output_tokens=10)
    got = client.responses.retrieve(made.id)
    assert got.id == made.id and got.output_text == made.output_text and got.usage == made.usage
    deleted = httpx.delete(f"{server.url}/v1/responses/{made.id}")
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    for missing in (httpx.get(f"{server.url}/v1/responses/{made.id}"),
                    httpx.post(f"{server.url}/v1/responses", json={"input": "hi", "previous_response_id": made.id})):
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert httpx.delete(f"{server.url}/v1/responses/{made.id}").status_code == 404


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "output": "sunny"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "call_nobody_made", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, "input[0].role"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "hi", "temprature": 0.5}, "temprature"),
    ({"input": "hi", "model": "gpt-5"}, "model"),
    ({"input": "word " * 9000}, "input"),
    ({"input": "hi", "max_output_tokens": 100_000}, "max_output_tokens"),
    ({"input": []}, "input"),
])
def test_bad_input_is_a_clear_4xx(server: SluiceServer, body: dict, param: str) -> None:
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"], error


def test_client_libraries_unchanged(server: SluiceServer) -> None:
    """langchain-openai, pydantic-ai and litellm, each on its Responses API path."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key="unused", use_responses_api=True,
                     max_tokens=40, temperature=0, max_retries=0)
    assert "Paris" in llm.invoke("What is the capital of France? One word.").text
    assert "".join(chunk.text for chunk in llm.stream("Say hello.")).strip()

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return "sunny"

    calls = llm.bind_tools([get_weather], tool_choice="required").invoke("What is the weather in Paris?").tool_calls
    assert calls and calls[0]["name"] == "get_weather" and calls[0]["args"]["city"]

    from pydantic_ai import Agent
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    @dataclasses.dataclass
    class WeatherFirst(AbstractCapability):  # type: ignore[type-arg]
        """pydantic-ai's way to make the first step call a tool (tool_choice allowed_tools, required);
        left to choose, the 135M model answers without it."""

        def get_model_settings(self) -> Any:
            return lambda ctx: {"tool_choice": ["weather"]} if ctx.run_step == 1 else {}

    async def agents() -> tuple[str, Country, list[str]]:
        model = OpenAIResponsesModel(MODEL, provider=OpenAIProvider(base_url=f"{server.url}/v1", api_key="unused"))
        asked: list[str] = []
        agent = Agent(model, capabilities=[WeatherFirst()], model_settings={"max_tokens": 80, "temperature": 0})

        @agent.tool_plain
        def weather(city: str) -> str:
            """Get the current weather in a city."""
            asked.append(city)
            return "sunny, 24 degrees"

        answer = (await agent.run("What is the weather in Paris?")).output
        country = (await Agent(model, output_type=Country, model_settings={"max_tokens": 100, "temperature": 0})
                   .run("France: its name and capital.")).output
        return answer, country, asked

    answer, country, asked = asyncio.run(agents())
    assert "Paris" in asked and answer and country.capital

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    for provider in ("openai", "hosted_vllm"):
        reply = litellm.responses(model=f"{provider}/{MODEL}", input="Say hello.", api_base=f"{server.url}/v1",
                                  api_key="unused", max_output_tokens=20)
        assert reply.output[0].content[0].text


def test_every_block_back_and_still_serving(server: SluiceServer, client: OpenAI) -> None:
    """After everything above (streams, calls, refusals, a client gone mid-stream); the admin API
    lists a live response with its endpoint."""
    with httpx.stream("POST", f"{server.url}/v1/responses", timeout=60,
                      json={"input": "Write a long story.", "stream": True, "max_output_tokens": 500}) as r:
        for line in r.iter_lines():
            if "output_text.delta" in line:
                live = httpx.get(f"{server.url}/admin/requests", headers=ADMIN).json()["data"]
                assert [e["endpoint"] for e in live if e["id"] == r.headers["x-request-id"]] == ["/v1/responses"]
                break  # hang up mid-stream
    assert client.responses.create(model=MODEL, input="Say yes.", max_output_tokens=5).output_text
    stats = settled_stats(server, ADMIN)
    assert stats["kv_blocks_used"] == 0 and stats["running"] == 0, stats


def test_a_stored_conversation_continues_after_a_restart(tmp_path: pytest.TempPathFactory) -> None:
    """The store is a file: a new server on it continues what the old one answered; a stored
    response of another model is refused by name."""
    store = tmp_path / "responses.sqlite3"
    flags = ("--responses-store", f"sqlite:{store}", "--num-kv-blocks", "64")
    with running_server(*flags, log_dir=tmp_path) as first:
        made = httpx.post(f"{first.url}/v1/responses", json={"input": "Hello", "max_output_tokens": 4}).json()
    with running_server(*flags, log_dir=tmp_path) as second:
        again = httpx.get(f"{second.url}/v1/responses/{made['id']}")
        assert again.status_code == 200 and again.json() == made
        more = httpx.post(f"{second.url}/v1/responses", json={"input": "And again", "max_output_tokens": 4,
                                                               "previous_response_id": made["id"]})
        assert more.status_code == 200, more.text
        assert more.json()["usage"]["input_tokens"] > made["usage"]["input_tokens"] + 4
        from frontend.responses_store import ResponseStore, StoredResponse

        other = ResponseStore(store)
        other.put(StoredResponse("resp_other", "another-model", made["created_at"], made, []))
        other.close()
        refused = httpx.post(f"{second.url}/v1/responses", json={"input": "x", "previous_response_id": "resp_other"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "previous_response_id"
        assert "another-model" in refused.json()["error"]["message"]
