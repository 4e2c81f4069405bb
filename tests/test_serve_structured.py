"""Structured output through a real ``sluice serve`` on the default model (SmolLM2): JSON schemas,
regexes, choices and grammars held by the grammar engine on the logits, greedy and sampled,
n > 1, streamed, inside multi-step windows; the official client's ``parse()``; neighbours left
alone; and every way a constraint can be wrong is a 400 naming it."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field
from sluice_server import SluiceServer

pytestmark = pytest.mark.timeout(900)

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "languages": {"type": "array", "items": {"enum": ["en", "fr", "de"]},
                                                         "maxItems": 3}},
          "required": ["name", "age", "languages"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a famous scientist as JSON."}]


@pytest.fixture(scope="module")
def server(smollm2_server: SluiceServer) -> SluiceServer:
    return smollm2_server  # shared with the other modules that serve SmolLM2 so (conftest.py)


def chat(server: SluiceServer, **body: object) -> dict:
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 120} | body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_json_schema_holds_for_greedy_sampled_and_several_choices(server: SluiceServer) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    greedy = chat(server, response_format=fmt, temperature=0)
    sampled = chat(server, response_format=fmt, temperature=1.0, seed=7, n=4)
    for choice in greedy["choices"] + sampled["choices"]:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
    assert len({c["message"]["content"] for c in sampled["choices"]}) > 1, "four samples, not one answer"


def test_a_streamed_constrained_answer_is_the_same_json(server: SluiceServer) -> None:
    body = {"messages": ASK, "max_tokens": 120, "temperature": 0, "stream": True,
            "structured_outputs": {"json": PERSON}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    jsonschema.validate(json.loads(text), PERSON)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert text == chat(server, structured_outputs={"json": PERSON}, temperature=0)["choices"][0]["message"]["content"]


def test_regex_choice_and_grammar(server: SluiceServer) -> None:
    phone = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "prompt": "Call me at", "max_tokens": 20, "temperature": 0.8, "seed": 1,
        "structured_outputs": {"regex": r"\(\d{3}\) \d{3}-\d{4}"}}).json()
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", phone["choices"][0]["text"]), phone
    answer = chat(server, messages=[{"role": "user", "content": "Is the sky blue?"}], guided_choice=["yes", "no"])
    assert answer["choices"][0]["message"]["content"] in ("yes", "no")
    gbnf = 'root ::= "The answer is " num "."\nnum ::= [1-9] [0-9]?'
    arithmetic = chat(server, messages=[{"role": "user", "content": "What is 6 times 7?"}], temperature=0,
                      structured_outputs={"grammar": gbnf})
    assert re.fullmatch(r"The answer is [1-9][0-9]?\.", arithmetic["choices"][0]["message"]["content"]), arithmetic


def test_a_constraint_cut_by_max_tokens_says_length(server: SluiceServer) -> None:
    cut = chat(server, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
               max_tokens=5, temperature=0)
    assert cut["choices"][0]["finish_reason"] == "length"  # not claimed valid: it is cut


def test_the_openai_client_parses_into_a_pydantic_model(server: SluiceServer) -> None:
    from openai import OpenAI

    class City(BaseModel):  # bounded: greedy decoding of a 135M model may otherwise write digits forever
        name: str = Field(max_length=30)
        country: str = Field(max_length=30)
        population_millions: int = Field(ge=0, le=100)

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    done = client.beta.chat.completions.parse(model="smollm2", temperature=0, max_tokens=200, response_format=City,
                                              messages=[{"role": "user", "content": "Describe Paris as JSON."}])
    city = done.choices[0].message.parsed
    assert isinstance(city, City) and city.name, done


def test_constrained_neighbours_leave_a_greedy_answer_unchanged(server: SluiceServer) -> None:
    plain = {"messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 40, "temperature": 0}
    alone = chat(server, **plain)["choices"][0]["message"]["content"]

    async def together() -> str:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            neighbours = [client.post("/v1/chat/completions", json={
                "messages": ASK, "max_tokens": 80, "temperature": 0.7, "seed": i,
                "structured_outputs": {"json": PERSON}}) for i in range(6)]
            answers = await asyncio.gather(client.post("/v1/chat/completions", json=plain), *neighbours)
        assert all(a.status_code == 200 for a in answers)
        return str(answers[0].json()["choices"][0]["message"]["content"])

    assert asyncio.run(together()) == alone


BAD = [
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": {"type": "object", "not": {"type": "string"}}}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": {"type": "nothing"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"yaml": "a"}}, "structured_outputs.yaml"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": json.loads("{" + '"type":"object","properties":{"a":{' * 200 + '"type":"string"' + "}}" * 200
                                + "}")}, "guided_json"),
    ({"guided_choice": ["a"], "ignore_eos": True}, "ignore_eos"),
    ({"guided_choice": ["a"], "min_tokens": 2}, "min_tokens"),
]


@pytest.mark.parametrize(("fields", "param"), BAD, ids=[p for _, p in BAD])
def test_a_constraint_that_cannot_be_used_is_a_400_naming_it(server: SluiceServer, fields: dict, param: str) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 4} | fields, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "still", "max_tokens": 2},
                      timeout=60).status_code == 200


def test_a_schema_built_to_explode_the_compiler_is_refused_or_served_within_the_limit(server: SluiceServer) -> None:
    """10,000 enum entries and a huge minItems: either compiled within the limits (llguidance's
    lazy lexer takes both in milliseconds) or a clear 400 — the next request is served either way."""
    for schema in ({"enum": [f"value-{i}" for i in range(10_000)]},
                   {"type": "array", "items": {"type": "string"}, "minItems": 1_000_000}):
        r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "prompt": "x", "max_tokens": 8, "guided_json": schema})
        assert r.status_code in (200, 400), r.text
        if r.status_code == 400:
            assert r.json()["error"]["param"] == "guided_json"
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "still", "max_tokens": 2},
                      timeout=60).status_code == 200
