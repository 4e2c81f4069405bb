"""Hostile input to the OpenAI routes of a real ``sluice serve`` (tiny model): property-based tests
over the whole JSON API of the completions and chat routes.

Bodies with the wrong type in every field, numbers out of range (huge, negative, ``NaN``,
``Infinity``, ``1e999``), nesting thousands of levels deep, invalid UTF-8, huge ``n`` /
``max_tokens`` / ``stop`` / ``logit_bias`` / prompts, unknown fields, odd content types, empty
and non-object bodies. Every answer must arrive within ``TIMEOUT_S``, never be a 5xx, and be a 4xx
in OpenAI's error shape where the input is bad (naming the field when one field is to blame). The
server is the session's one hostile server (tests/hostile.py): test_serve_hostile_admin attacks
its admin routes next, then checks that it is still healthy and serves as before.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import pytest
from hostile import (
    BODIES,
    CONTEXT,
    KINDS,
    NOT_JSON,
    OUT_OF_RANGE_NUMBER,
    PROPERTY,
    VOCAB,
    Raw,
    Served,
    anything,
    check,
    emit,
    ints_outside,
    post,
    whole_bodies,
    wrong_kind,
)
from hypothesis import given
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def served(hostile_served: Served) -> Served:
    """The session's hostile server (conftest), shared with test_serve_hostile_admin."""
    return hostile_served


# ------------------------------------------------------------------------------------ fields


def floats_outside(lo: float, hi: float, *, lo_open: bool = False) -> st.SearchStrategy[Any]:
    # (nextafter: -0.0 is not below 0.0)
    below = st.floats(max_value=lo if lo_open else math.nextafter(lo, -math.inf), allow_nan=False,
                      allow_infinity=False)
    above = st.floats(min_value=hi, exclude_min=True, allow_nan=False, allow_infinity=False)
    return st.one_of(below, above, st.just(OUT_OF_RANGE_NUMBER), st.just(Raw(b"-1e999", "-1e999")),
                     ints_outside(int(lo) if lo == int(lo) and not lo_open else None, int(hi)))


# field -> JSON kinds it takes (a wrong kind is a 400 naming it)
SAMPLING_KINDS: dict[str, set[str]] = {
    # The sampling fields a model may give defaults for take null as unset (OpenAI's spec makes
    # temperature and top_p nullable): the model's default, else OpenAI's, applies.
    "model": {"str", "null"}, "max_tokens": {"int", "null"}, "temperature": {"float", "null"},
    "top_p": {"float", "null"}, "top_k": {"int", "null"}, "min_tokens": {"int"}, "seed": {"int", "null"}, "stop": {"str", "list", "null"},
    "stop_token_ids": {"list", "null"}, "ignore_eos": {"bool"}, "n": {"int"}, "stream": {"bool"},
    "stream_options": {"object", "null"}, "priority": {"int"}, "user": {"str", "null"},
    "presence_penalty": {"float"}, "frequency_penalty": {"float"}, "repetition_penalty": {"float", "null"},
    "min_p": {"float", "null"}, "logit_bias": {"object", "null"}, "return_token_ids": {"bool"},
    "prompt_logprobs": {"int", "null"}, "skip_special_tokens": {"bool"}, "include_stop_str_in_output": {"bool"},
    "response_format": {"object", "null"}, "structured_outputs": {"object", "null"},
    "guided_json": {"object", "str", "bool", "null"}, "guided_regex": {"str", "null"},
    "guided_choice": {"list", "null"}, "guided_grammar": {"str", "null"},
}
COMPLETION_KINDS = SAMPLING_KINDS | {"prompt": {"str", "list"}, "echo": {"bool"}, "suffix": {"str", "null"},
                                     "logprobs": {"int", "null"}}
CHAT_KINDS = SAMPLING_KINDS | {"messages": {"list"}, "max_completion_tokens": {"int", "null"},
                               "logprobs": {"bool"}, "top_logprobs": {"int", "null"}, "tools": {"list", "null"},
                               "tool_choice": {"str", "object", "null"}, "parallel_tool_calls": {"bool", "null"},
                               "chat_template_kwargs": {"object", "null"}}

bad_ids = st.one_of(st.integers(min_value=VOCAB), st.integers(max_value=-1))
# field -> values out of its range (each a 4xx naming the field, alone in a valid body)
SAMPLING_BAD: dict[str, st.SearchStrategy[Any]] = {
    "model": st.text(min_size=1, max_size=300).filter(lambda s: s != "tiny"),
    "max_tokens": ints_outside(1, CONTEXT),
    "temperature": floats_outside(0.0, 100.0),
    "top_p": floats_outside(0.0, 1.0, lo_open=True),
    "top_k": ints_outside(-1, None),
    "min_tokens": ints_outside(0, 1),  # the base body's max_tokens is 1
    "seed": ints_outside(-(2**63), 2**63 - 1),
    "stop": st.one_of(st.integers(65, 3000).map(lambda k: ["s"] * k),
                      st.lists(st.one_of(st.integers(), st.none(), st.lists(st.text(max_size=2))),
                               min_size=1, max_size=3)),
    "stop_token_ids": st.one_of(st.lists(bad_ids, min_size=1, max_size=3),
                                st.integers(1025, 5000).map(lambda k: [1] * k)),
    "n": ints_outside(1, 128),
    "stream_options": st.dictionaries(st.just("include_usage"), wrong_kind({"bool"}), min_size=1),
    "priority": st.one_of(ints_outside(-(2**31), 2**31 - 1), st.integers(-(2**31), -1)),  # < 0: 403
    "user": st.integers(257, 5000).map(lambda k: "u" * k),
    "presence_penalty": floats_outside(-2.0, 2.0),
    "frequency_penalty": floats_outside(-2.0, 2.0),
    "repetition_penalty": floats_outside(0.0, 10.0, lo_open=True),
    "min_p": floats_outside(0.0, 1.0),
    "prompt_logprobs": ints_outside(0, 20),
    "logit_bias": st.one_of(
        st.integers(1025, 4000).map(lambda k: {"0" * (i // VOCAB) + str(i % VOCAB): 1 for i in range(k)}),
        st.dictionaries(st.one_of(st.sampled_from(["", "-1", "+1", " 7", "7 ", "1.5", "1e3", "0x10", "1_0",
                                                   "\u00b2", "\u0663", "512", "99999999999999999999", "a"]),
                                  st.integers(VOCAB, 10**30).map(str)),
                        st.just(1), min_size=1, max_size=3),
        st.dictionaries(st.sampled_from(["0", "1", "511"]),
                        st.one_of(floats_outside(-100.0, 100.0), wrong_kind({"float"})), min_size=1)),
}
BAD_BATCH_ITEM = {"text": "a prompt is a string or token ids"}
COMPLETION_BAD = SAMPLING_BAD | {
    "prompt": st.one_of(st.just(""), st.just([]), st.lists(bad_ids, min_size=1, max_size=4),
                        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4).map(lambda ids: [*ids, -1]),
                        # A batch (a list of texts or of token-id lists) with one bad prompt in it.
                        st.lists(st.text(min_size=1, max_size=3), max_size=3).map(lambda ps: [*ps, ""]),
                        st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=2), max_size=2).map(
                            lambda ps: [*ps, BAD_BATCH_ITEM]),
                        st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=2), max_size=2).map(
                            lambda ps: [*ps, [1, VOCAB]])),
    "suffix": st.text(min_size=1, max_size=10),
    "logprobs": ints_outside(0, 20),
}
BAD_SCHEMAS = st.sampled_from([
    {"type": "string", "pattern": "(unclosed"}, {"type": "nonsense"}, {"$ref": "#/nowhere"},
    {"type": "object", "properties": {"x": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["x"]},
    {"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 1}, [], 7])
SAMPLING_BAD |= {
    # Constraints that cannot be used: each a 400 naming the field (or a part of it).
    "response_format": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["xml", "", "json"])}),
        st.just({"type": "json_schema"}), st.just({"type": "json_schema", "json_schema": {"name": "x"}}),
        BAD_SCHEMAS.map(lambda schema: {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})),
    "structured_outputs": st.one_of(
        BAD_SCHEMAS.map(lambda schema: {"json": schema}),
        st.sampled_from([{"regex": "(a"}, {"regex": "[z-a]"}, {"choice": []}, {"choice": [1, 2]}, {"grammar": 5},
                         {"grammar": 'root ::= "a" missing'}, {"regex": "a", "choice": ["a"]}, {"xml": "a"},
                         {"json_object": True, "regex": "a"}])),
    "guided_json": BAD_SCHEMAS,
    "guided_regex": st.sampled_from(["(a", "a{2,1}", "*a", "a)", "[z-a]"]),
    "guided_choice": st.sampled_from([[], [1], ["a", None]]),
    "guided_grammar": st.sampled_from(["root ::= undefined", "start: x", 'root ::= "a" | | (']),
}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CHAT_BAD = SAMPLING_BAD | {
    "tools": st.one_of(
        st.lists(st.sampled_from([{"type": "function"}, {"type": "retrieval", "function": {"name": "f"}},
                                  {"type": "function", "function": {"name": ""}},
                                  {"type": "function", "function": {"name": "x" * 65}},
                                  {"type": "function", "function": {"name": "a b"}},
                                  {"type": "function", "function": {"name": "f", "parameters": [1]}}, 7]),
                 min_size=1, max_size=3),
        st.integers(2, 5).map(lambda k: [TOOL] * k)),  # one tool named again
    "tool_choice": st.one_of(st.sampled_from(["required", "any", "", {"type": "function"},
                                              {"type": "function", "function": {"name": "f"}}]),
                             st.text(max_size=8).filter(lambda t: t not in ("none", "auto"))),

    "messages": st.one_of(
        st.just([]),
        st.lists(st.fixed_dictionaries({"content": st.text(max_size=5)}), min_size=1, max_size=2),  # no role
        st.lists(st.fixed_dictionaries({"role": wrong_kind({"str"}), "content": st.just("x")}), min_size=1, max_size=2),
        st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": wrong_kind({"str", "list", "null"})}),
                 min_size=1, max_size=2),
        st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(
            st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["image_url", "audio", ""])}),
                      st.fixed_dictionaries({"type": st.just("text"), "text": wrong_kind({"str"})}),
                      st.fixed_dictionaries({"type": wrong_kind({"str"}), "text": st.just("x")}),
                      KINDS["int"], KINDS["str"]), min_size=1, max_size=3)}), min_size=1, max_size=2),
        st.lists(wrong_kind({"object"}), min_size=1, max_size=3)),
    "max_completion_tokens": ints_outside(1, CONTEXT),
    "top_logprobs": ints_outside(0, 20),
}


ROUTES = {  # path -> (a valid body, its fields' kinds, their bad values)
    "/v1/completions": (BODIES["/v1/completions"], COMPLETION_KINDS, COMPLETION_BAD),
    "/v1/chat/completions": (BODIES["/v1/chat/completions"], CHAT_KINDS, CHAT_BAD),
}
route_names = st.sampled_from(sorted(ROUTES))


# ------------------------------------------------------------------------------------ OpenAI routes


@PROPERTY
@given(path=route_names, data=st.data())
def test_a_wrong_kind_in_any_field_is_a_400_naming_a_wrong_field(served: Served, path: str, data: st.DataObject) -> None:
    base, kinds, _ = ROUTES[path]
    fields = data.draw(st.lists(st.sampled_from(sorted(kinds)), min_size=1, max_size=3, unique=True))
    body = dict(base) | {name: data.draw(wrong_kind(kinds[name]), label=name) for name in fields}
    check(post(served, path, emit(body)), statuses={400}, params=set(fields))


@PROPERTY
@given(path=route_names, data=st.data())
def test_a_value_out_of_range_is_a_4xx_naming_the_field(served: Served, path: str, data: st.DataObject) -> None:
    base, _, bad = ROUTES[path]
    name = data.draw(st.sampled_from(sorted(bad)))
    body = dict(base) | {name: data.draw(bad[name], label=name)}
    statuses = {404} if name == "model" else {400, 403} if name == "priority" else {400}
    r = post(served, path, emit(body))
    check(r, statuses=statuses)
    param = r.json()["error"]["param"]
    assert param == name or param.startswith((f"{name}.", f"{name}[")), f"{param} for {body}"


@PROPERTY
@given(path=route_names, data=st.data())
def test_any_value_in_any_field_known_or_not_is_served_or_refused_cleanly(
    served: Served, path: str, data: st.DataObject
) -> None:
    base, kinds, _ = ROUTES[path]
    names = st.one_of(st.sampled_from(sorted(kinds)), st.text(max_size=10),
                      st.just(Raw(b'"\xff"', "invalid UTF-8 key")))
    changes = data.draw(st.dictionaries(names, anything, min_size=1, max_size=4))
    body = dict(base) | changes
    malformed = any(isinstance(v, Raw) and v in NOT_JSON for v in changes.values()) or \
        any(isinstance(k, Raw) for k in changes)
    check(post(served, path, emit(body)), statuses={400} if malformed else {200, 400, 403, 404})


content_types = st.one_of(st.none(), st.sampled_from([
    "application/json", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
    "application/json; charset=utf-16", "application/json; charset=latin-1", "", "*/*", "application/xml",
    "application/json\tjunk"]))


@PROPERTY
@given(path=route_names, body=whole_bodies(), content_type=content_types)
def test_broken_bodies_and_odd_content_types_are_4xx(served: Served, path: str, body: tuple[Raw, bool],
                                                     content_type: str | None) -> None:
    content, bad = body[0].data, body[1]
    headers = {} if content_type is None else {"Content-Type": content_type}
    r = post(served, path, content, headers)
    check(r, statuses={400} if bad else {200, 400})
    if not bad:
        # The body is a valid request for one of the routes: on its own route it is served.
        assert r.status_code == 200 or content != emit(ROUTES[path][0]), r.text


GIANTS: dict[str, Callable[[int, int], tuple[dict[str, Any], str]]] = {
    # kind -> (size, fill) -> (a body with one enormous part, the field it must be refused for)
    "prompt text": lambda size, fill: ({"prompt": "hostile " * size}, "prompt"),
    "prompt ids": lambda size, fill: ({"prompt": [fill] * size}, "prompt"),
    "prompt ids, one negative": lambda size, fill: ({"prompt": [*[fill % VOCAB] * size, -fill - 1]}, "prompt"),
    # (short enough for the KV cache: its check comes first)
    "prompt ids, one past the vocabulary": lambda size, fill: ({"prompt": [*[1] * min(size, 4000), VOCAB + fill]},
                                                               "prompt"),
    "stop list": lambda size, fill: ({"prompt": "hi", "stop": [str(i) for i in range(65 + size)]}, "stop"),
    "stop ids": lambda size, fill: ({"prompt": "hi", "stop_token_ids": [fill % VOCAB] * (1025 + size)},
                                    "stop_token_ids"),
    "logit_bias": lambda size, fill: ({"prompt": "hi", "logit_bias": {str(i): 1.0 for i in range(1025 + size)}},
                                      "logit_bias"),
    "user": lambda size, fill: ({"prompt": "hi", "user": "u" * (257 + size)}, "user"),
    "n": lambda size, fill: ({"prompt": "hi", "n": 10 ** (3 + fill % 40)}, "n"),
    "max_tokens": lambda size, fill: ({"prompt": "hi", "max_tokens": 10 ** (4 + fill % 40)}, "max_tokens"),
    "messages": lambda size, fill: ({"messages": [{"role": "user", "content": "hostile hostile "}] * (size // 4)},
                                    "messages"),
    "message text": lambda size, fill: ({"messages": [{"role": "user", "content": "hostile " * size}]}, "messages"),
}


@pytest.mark.parametrize("size", [9_000, 20_000, 100_000, 1_000_000])  # 9,000 "hostile "s: tokenized
@pytest.mark.parametrize("kind", sorted(GIANTS))
def test_giant_parts_are_refused_quickly(served: Served, kind: str, size: int) -> None:
    body, param = GIANTS[kind](size, size * 7919 % 10**6)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    raw = emit(body | {"max_tokens": body.get("max_tokens", 1)})  # (the client's own encoding is not timed)
    started = time.monotonic()
    r = post(served, path, raw)
    check(r, statuses={400}, params={param})
    # Refused by its size, not after seconds of tokenizing or a pass over every element in Python.
    assert time.monotonic() - started < 5.0, (kind, size)


def test_huge_but_legal_parts_are_served(served: Served) -> None:
    """At the limits: each is a 200, quickly."""
    bodies = [
        {"prompt": "hi", "stop": ["\U0001f4a5" * 100_000] + ["s"] * 63},  # 64 stops, one enormous
        {"prompt": "hi", "stop_token_ids": list(range(VOCAB)) * 2},  # 1024 ids, each twice
        {"prompt": "hi", "logit_bias": {"0" * (i // VOCAB) + str(i % VOCAB): -1.0 for i in range(1024)}},  # "7", "07"
        {"prompt": "hi", "n": 128},
        {"prompt": "hi", "top_k": 2**63, "seed": -(2**63)},  # top_k beyond the vocabulary is no top_k
        {"prompt": "hi", "top_k": 10**30, "temperature": 100, "top_p": 1e-300, "min_p": 1.0},
        {"prompt": [VOCAB - 1] * 4000},  # near the KV cache (4096 tokens)
        {"prompt": "hi", "user": "u" * 256, "min_tokens": 1, "repetition_penalty": 1e-300},
    ]
    for body in bodies:
        started = time.monotonic()
        r = post(served, "/v1/completions", emit(body | {"max_tokens": 1}))
        check(r, statuses={200})
        assert time.monotonic() - started < 15.0, body


