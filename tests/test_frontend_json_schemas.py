"""How the frontend reads a JSON schema before the grammar engine compiles it: objects that list
their properties are closed to others (as vLLM's default engine and OpenAI's strict schemas read
them), wherever they sit in the schema, unless the schema says otherwise.

Before: a plain Pydantic model's schema (no ``additionalProperties``) let a small model add keys
of its own after the listed ones until ``max_tokens``; the official client's ``parse()`` then
raised ``LengthFinishReasonError``."""

from __future__ import annotations

import json

import llguidance
from pydantic import BaseModel

from frontend.structured import closed, constraint_of


class Address(BaseModel):
    city: str


class Person(BaseModel):
    name: str
    home: Address
    past: list[Address]


def test_every_object_with_properties_is_closed_wherever_it_sits() -> None:
    schema = closed(Person.model_json_schema())  # Address sits in $defs, reached by $ref twice
    assert schema["additionalProperties"] is False
    assert schema["$defs"]["Address"]["additionalProperties"] is False
    nested = closed({"type": "object", "properties": {"a": {"anyOf": [
        {"type": "object", "properties": {"b": {"type": "array", "items": {"type": "object", "properties": {"c": {}}}}}},
        {"type": "null"}]}}})
    branch = nested["properties"]["a"]["anyOf"][0]
    assert branch["additionalProperties"] is False
    assert branch["properties"]["b"]["items"]["additionalProperties"] is False


def test_what_a_schema_says_of_other_keys_is_kept() -> None:
    for own in ({"additionalProperties": True}, {"additionalProperties": {"type": "integer"}},
                {"patternProperties": {"^x_": {}}}, {"unevaluatedProperties": False}):
        schema = {"type": "object", "properties": {"a": {}}} | own
        assert closed(schema) == schema
    assert closed({"type": "object"}) == {"type": "object"}  # json_object: any object
    parts = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert closed(parts) == parts  # each branch lists only part of the keys


def test_the_compiled_grammar_refuses_a_key_the_schema_does_not_list() -> None:
    c = constraint_of(None, {"json": Person.model_json_schema()}, {})
    assert c is not None
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))
    ok = json.dumps({"name": "Ada", "home": {"city": "London"}, "past": []})
    extra = json.dumps({"name": "Ada", "home": {"city": "London"}, "past": [], "age": 36})
    assert _accepts(tokenizer, c.grammar, ok)
    assert not _accepts(tokenizer, c.grammar, extra)


class _ByteTokenizer:
    """256 one-byte tokens and an end-of-sequence: enough to walk a grammar byte by byte."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]

    def __call__(self, s: bytes) -> list[int]:
        return list(s)


def _accepts(tokenizer: llguidance.LLTokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    return matcher.consume_tokens(list(text.encode())) and matcher.consume_token(256) and matcher.is_accepting()
