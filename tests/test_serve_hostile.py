"""Hostile input through a real ``sluice serve`` (tiny model): property-based tests over the whole
JSON API, the completions, chat and admin routes.

Bodies with the wrong type in every field, numbers out of range (huge, negative, ``NaN``,
``Infinity``, ``1e999``), nesting thousands of levels deep, invalid UTF-8, huge ``n`` /
``max_tokens`` / ``stop`` / ``logit_bias`` / prompts, unknown fields, odd content types, empty
and non-object bodies. Every answer must arrive within ``TIMEOUT_S``, never be a 5xx, be a 4xx in
OpenAI's error shape where the input is bad (naming the field when one field is to blame), and
afterwards the server must still be healthy, hold no request, log no traceback, and answer a
greedy request token for token as it did before. One server for the whole file.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sluice_server import SluiceServer, running_server

ADMIN = "hostile-admin-token"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
TIMEOUT_S = 30.0
VOCAB = 512  # the tiny model's vocabulary
CONTEXT = 8192  # and its context
GREEDY = {"prompt": "The hostile fox", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
          "return_token_ids": True}

PROPERTY = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclass
class Served:
    server: SluiceServer
    client: httpx.Client
    greedy_ids: list[int] = field(default_factory=list)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    log_dir: Path = tmp_path_factory.mktemp("serve-hostile")
    # 256 KV blocks (4096 tokens): a chat request without max_tokens asks for the whole context
    # and is refused, so no example can start a long generation by leaving max_tokens out.
    with running_server("--admin-token", ADMIN, "--num-kv-blocks", "256", log_dir=log_dir) as server, \
            httpx.Client(base_url=server.url, timeout=TIMEOUT_S,
                         limits=httpx.Limits(max_keepalive_connections=0)) as client:
        # No keep-alive: each example gets a fresh connection, as a stranger's request would.
        r = client.post("/v1/completions", json=GREEDY)
        assert r.status_code == 200, r.text
        yield Served(server, client, r.json()["choices"][0]["token_ids"])


# ------------------------------------------------------------------------------------ bodies


@dataclass(frozen=True)
class Raw:
    """Bytes written into the body as they are: tokens JSON lacks, invalid UTF-8, deep nesting."""

    data: bytes
    label: str

    def __repr__(self) -> str:
        return f"Raw({self.label})"


def emit(value: Any) -> bytes:
    """``value`` as JSON bytes, with ``Raw`` pieces (values or keys) written verbatim."""
    raws: list[Raw] = []

    def placeholder(raw: Any) -> str:
        assert isinstance(raw, Raw)
        raws.append(raw)
        return f"\0raw{len(raws) - 1}\0"

    try:  # json.dumps is fast on giant lists; Raw values go in as placeholders
        out = json.dumps(value, default=placeholder).encode()
    except TypeError:  # a Raw key
        return _emit_slowly(value)
    for i, raw in enumerate(raws):
        out = out.replace(f'"\\u0000raw{i}\\u0000"'.encode(), raw.data, 1)
    return out


def _emit_slowly(value: Any) -> bytes:
    if isinstance(value, Raw):
        return value.data
    if isinstance(value, dict):
        return b"{" + b",".join(_emit_slowly(k) + b":" + _emit_slowly(v) for k, v in value.items()) + b"}"
    if isinstance(value, list):
        return b"[" + b",".join(_emit_slowly(v) for v in value) + b"]"
    return json.dumps(value).encode()


def deep(depth: int, opener: bytes = b"[") -> Raw:
    inner = b"[" * depth + b"]" * depth if opener == b"[" else b'{"a":' * depth + b"1" + b"}" * depth
    return Raw(inner, f"{opener.decode()}*{depth}")


# Not JSON at all: the body is malformed wherever they appear (a 400 that may name no field).
NOT_UTF8 = [Raw(b'"\xff\xfe"', "invalid UTF-8"), Raw(b'"x\xc3"', "truncated UTF-8"),
            Raw(b'"\xed\xa0\x80"', "UTF-8 surrogate")]
NOT_JSON = [Raw(b"NaN", "NaN"), Raw(b"Infinity", "Infinity"), Raw(b"-Infinity", "-Infinity"), *NOT_UTF8,
            Raw(b'"\\ud800"', "lone surrogate escape"), Raw(b"01", "leading zero"), Raw(b"[1,]", "trailing comma"),
            Raw(b"'x'", "single quotes"), Raw(b"undefined", "undefined")]
DEEP = [deep(1_000), deep(10_000), deep(100_000), deep(10_000, b"{")]

# Small valid counts stay small (no example may start a long generation); the rest are hostile.
INTS = [-(2**64), -(2**63) - 1, -(2**63), -(2**31) - 1, -(2**31), -1, 0, 1, 2, 3, 20, 21, 129,
        2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, 10**30, -(10**30), 10**400]
FLOATS = [0.5, -0.5, 1.5, 1e-320, -1e-320, 1e300, -1e300, 2.0**63, 100.5, -2.5]
STRINGS = ["", "0", "1", "-1", "NaN", "true", "null", "tiny", "x" * 300, "\u0000", "\U0001f4a5" * 3, "{{ 7*7 }}",
           "<|assistant|>", "</s>"]
OUT_OF_RANGE_NUMBER = Raw(b"1e999", "1e999")

scalars = st.one_of(st.none(), st.booleans(), st.sampled_from(INTS), st.sampled_from(FLOATS),
                    st.sampled_from(STRINGS), st.text(max_size=12))
KINDS = {
    "null": st.none(),
    "bool": st.booleans(),
    "int": st.sampled_from(INTS),
    "float": st.one_of(st.sampled_from(FLOATS), st.just(OUT_OF_RANGE_NUMBER)),
    "str": st.one_of(st.sampled_from(STRINGS), st.text(max_size=12)),
    "list": st.lists(scalars, max_size=4),
    "object": st.dictionaries(st.text(max_size=8), scalars, max_size=4),
}
# Any JSON value, valid for some field or not, the malformed ones included.
anything_utf8 = st.one_of(*KINDS.values(), st.sampled_from([raw for raw in NOT_JSON if raw not in NOT_UTF8]),
                          st.sampled_from(DEEP), st.lists(st.one_of(scalars, st.lists(scalars, max_size=2)), max_size=3))
anything = st.one_of(anything_utf8, st.sampled_from(NOT_UTF8))


def wrong_kind(accepted: set[str]) -> st.SearchStrategy[Any]:
    """A value of a JSON kind the field does not take (``1e999`` counts as a float)."""
    if "float" in accepted:
        accepted = accepted | {"int"}
    return st.one_of(*(strategy for kind, strategy in KINDS.items() if kind not in accepted))


def ints_outside(lo: int | None, hi: int | None) -> st.SearchStrategy[int]:
    parts = []
    if lo is not None:
        parts += [st.integers(max_value=lo - 1), st.sampled_from([lo - 1, lo - 2**64, -(10**30)])]
    if hi is not None:
        parts += [st.integers(min_value=hi + 1), st.sampled_from([hi + 1, hi + 2**64, 10**30])]
    return st.one_of(*parts)


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

ROUTES = {
    "/v1/completions": ({"prompt": "hi", "max_tokens": 1}, COMPLETION_KINDS, COMPLETION_BAD),
    "/v1/chat/completions": ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, CHAT_KINDS,
                             CHAT_BAD),
}
route_names = st.sampled_from(sorted(ROUTES))


# ------------------------------------------------------------------------------------ checks


def post(served: Served, path: str, content: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    headers = {"Content-Type": "application/json"} if headers is None else headers
    started = time.monotonic()
    try:
        r = served.client.post(path, content=content, headers=headers)
    except httpx.TimeoutException:
        pytest.fail(f"no answer within {TIMEOUT_S} s to {content[:300]!r}")
    except httpx.TransportError as e:
        pytest.fail(f"{type(e).__name__} ({e}) for {content[:300]!r}: the server dropped the connection")
    assert time.monotonic() - started < TIMEOUT_S
    return r


def check(r: httpx.Response, *, statuses: set[int] | None = None, params: set[str | None] | None = None) -> None:
    """No 5xx; a 4xx in OpenAI's error shape (status in ``statuses`` and param in ``params`` when
    given); a 200 a well-formed answer."""
    context = f"{r.status_code} {r.text[:500]} for {r.request.content[:300]!r}"
    assert r.status_code < 500, context
    if statuses is not None:
        assert r.status_code in statuses, context
    if r.status_code >= 400:
        assert r.headers["content-type"].startswith("application/json"), context
        body = r.json()
        assert set(body) == {"error"}, context
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, context
        assert isinstance(error["message"], str) and error["message"], context
        assert error["type"] != "server_error", context
        assert error["param"] is None or isinstance(error["param"], str), context
        if params is not None:
            assert error["param"] in params, context
        return
    assert r.status_code == 200, context
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", context
        for event in events[:-1]:
            assert "error" not in json.loads(event), context
        return
    if r.request.url.path.startswith("/v1/"):
        assert r.json()["choices"], context


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


def as_raw(data: bytes) -> Raw:
    return Raw(data, repr(data) if len(data) <= 80 else f"{data[:60]!r}... ({len(data)} bytes)")


def whole_bodies(utf8: bool = False) -> st.SearchStrategy[tuple[Raw, bool]]:
    """(body, surely bad): bodies broken as a whole rather than in one field; ``utf8``: none of
    them with invalid UTF-8."""
    valid = st.sampled_from(sorted(ROUTES)).map(lambda p: emit(ROUTES[p][0]))
    not_utf8 = st.one_of(
        st.binary(min_size=1, max_size=40).map(lambda b: b + b"\xff"),
        # a valid body with a byte no UTF-8 text can hold spliced in
        st.tuples(valid, st.integers(0, 10**6), st.sampled_from([b"\x80", b"\xbf", b"\xc3", b"\xe2\x82", b"\xf0\x9f",
                                                                  b"\xf8", b"\xff"]))
        .map(lambda t: t[0][: t[1] % len(t[0])] + t[2] + t[0][t[1] % len(t[0]):]))
    bad = st.one_of(
        st.just(b""),
        st.sampled_from([b"null", b"[]", b"1", b'"x"', b"true", b"[{}]", b"{}", b"[1,2]"]),
        st.sampled_from(DEEP).map(lambda raw: raw.data),
        st.sampled_from([raw for raw in NOT_JSON if not (utf8 and raw in NOT_UTF8)]).map(lambda raw: raw.data),
        st.text(max_size=40).map(str.encode),
        # a valid body cut short, or with junk after it
        st.tuples(valid, st.integers(0, 10**6)).map(lambda t: t[0][: t[1] % len(t[0])]),
        st.tuples(valid, st.sampled_from([b"x", b"}", b"\x00", b" {}", b"\n]"])).map(lambda t: t[0] + t[1]),
        *([] if utf8 else [not_utf8]),
    )
    # a valid body is the last choice: with the odd content types below, still served
    return st.one_of(bad.map(lambda b: (as_raw(b), True)), valid.map(lambda b: (as_raw(b), False)))


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


# ------------------------------------------------------------------------------------ admin routes


ADMIN_ROUTES = [("GET", "/admin/stats"), ("GET", "/admin/requests"), ("GET", "/admin/requests/{id}"),
                ("POST", "/admin/requests/{id}/abort"), ("POST", "/admin/requests/{id}/priority"),
                ("POST", "/admin/requests/{id}/pause"), ("POST", "/admin/requests/{id}/resume"),
                ("POST", "/admin/pause"), ("POST", "/admin/resume"), ("POST", "/admin/prefix-cache/reset")]
SERVER_WIDE = {"/admin/pause", "/admin/resume"}  # not sent with the token: they would stall the tests
# One path segment each (percent-encoded text; NUL and invalid UTF-8 as they are).
request_ids = st.one_of(st.text(min_size=1, max_size=30).filter(lambda t: t not in (".", ".."))
                        .map(lambda t: urllib.parse.quote(t, safe="")),
                        st.sampled_from(["cmpl-", "x" * 5000, "%00", "%ff%fe", "%C3", "cmpl-%0A"]))
bad_tokens = st.one_of(st.none(), st.sampled_from(
    ["", "Bearer", "Basic " + ADMIN, f"Bearer {ADMIN}x", f"Bearer {ADMIN[:-1]}", f"bearer  {ADMIN[1:]}",
     "Bearer " + "x" * 10_000, f"{ADMIN}"]),
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40).map(str.strip))


@PROPERTY
@given(route=st.sampled_from(ADMIN_ROUTES), request_id=request_ids, token=bad_tokens, with_token=st.booleans(),
       body=whole_bodies().map(lambda t: t[0]))
def test_admin_routes_refuse_strangers_and_unknown_ids(served: Served, route: tuple[str, str], request_id: str,
                                                       token: str | None, with_token: bool, body: Raw) -> None:
    method, template = route
    path = template.replace("{id}", request_id)
    if with_token and template in SERVER_WIDE:
        with_token = False
    headers = AUTH if with_token else {} if token is None else {"Authorization": token}
    try:
        r = served.client.request(method, path, headers=headers, content=body.data)
    except httpx.TransportError as e:
        pytest.fail(f"{type(e).__name__} ({e}) for {method} {path}")
    if not with_token:
        check(r, statuses={401, 403})
    elif "{id}" in template:
        check(r, statuses={404}, params={"request_id", None})  # nobody has this id
    else:
        check(r, statuses={200})


@dataclass
class Held:
    """A live request, paused, that the admin tests can address."""

    request_id: str
    thread: threading.Thread
    done: threading.Event


@contextlib.contextmanager
def holding(served: Served) -> Iterator[Held]:
    ready = threading.Event()
    done = threading.Event()
    box: dict[str, str] = {}

    def consume() -> None:
        body = {"prompt": "held", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{served.server.url}/v1/completions", json=body, timeout=120) as r:
                box["id"] = r.headers["X-Request-Id"]
                ready.set()
                for _ in r.iter_lines():
                    if done.is_set():
                        break
        except httpx.HTTPError:
            pass  # the assertions are the tests'; this thread only keeps the request alive

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    if not ready.wait(30):
        pytest.fail("the request to hold did not start")
    held = Held(box["id"], thread, done)
    try:
        pause(served, held)
        yield held
    finally:
        served.client.post(f"/admin/requests/{held.request_id}/abort", headers=AUTH)
        done.set()
        thread.join(30)


@pytest.fixture(scope="module")
def held(served: Served) -> Iterator[Held]:
    with holding(served) as h:
        yield h


def pause(served: Served, held: Held) -> None:
    r = served.client.post(f"/admin/requests/{held.request_id}/pause", headers=AUTH)
    if r.status_code != 200:
        pytest.fail(f"pause: {r.status_code} {r.text}")


def priority_bodies() -> st.SearchStrategy[tuple[Raw, bool]]:
    """(body, valid): ``{"priority": int32, "cut_in": bool}`` and every way to get it wrong."""
    valid = st.fixed_dictionaries({"priority": st.integers(-(2**31), 2**31 - 1)},
                                  optional={"cut_in": st.booleans()})
    invalid = st.one_of(
        st.fixed_dictionaries({"priority": st.one_of(wrong_kind({"int"}), ints_outside(-(2**31), 2**31 - 1),
                                                     st.sampled_from(DEEP))}),
        st.fixed_dictionaries({"priority": st.just(0), "cut_in": st.one_of(
            wrong_kind({"bool"}), st.sampled_from([raw for raw in NOT_JSON if raw not in NOT_UTF8]))}),
        st.fixed_dictionaries({"priority": st.just(0)}).flatmap(  # an unknown field, however deep
            lambda d: st.tuples(st.text(max_size=8).filter(lambda k: k not in ("priority", "cut_in")), anything_utf8)
            .map(lambda kv: d | {kv[0]: kv[1]})),
        st.dictionaries(st.sampled_from(["cut_in", "Priority", "prio"]), st.booleans(), max_size=2),  # no priority
    )
    # No invalid UTF-8 here: in a key it is still a 500 (test_admin_priority_invalid_utf8_key).
    return st.one_of(valid.map(lambda d: (Raw(emit(d), repr(d)), True)),
                     invalid.map(lambda d: (Raw(emit(d), repr(d)), False)),
                     whole_bodies(utf8=True).map(lambda t: (t[0], False)))


@PROPERTY
@given(body=priority_bodies())
def test_admin_priority_bodies(served: Served, held: Held, body: tuple[Raw, bool]) -> None:
    content, valid = body[0].data, body[1]
    r = post(served, f"/admin/requests/{held.request_id}/priority", content, AUTH)
    check(r, statuses={200} if valid else {400})
    if valid:
        assert r.json()["status"] == "applied"
        pause(served, held)  # cut_in runs a paused request again


# ------------------------------------------------------------------------------------ afterwards


def test_after_all_that_the_server_is_healthy_and_serves_as_before(served: Served, held: Held) -> None:
    assert served.client.post(f"/admin/requests/{held.request_id}/abort", headers=AUTH).status_code == 200
    assert served.server.proc.poll() is None
    assert served.client.get("/health").status_code == 200
    r = served.client.post("/v1/completions", json=GREEDY)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    assert r.json()["choices"][0]["token_ids"] == served.greedy_ids  # nothing leaked into sampling
    stats: dict[str, Any] = {}
    for _ in range(100):  # aborts land asynchronously
        stats = served.client.get("/admin/stats", headers=AUTH).json()
        if stats["running"] == stats["waiting"] == stats["paused"] == stats["kv_blocks_used"] == 0:
            break
        time.sleep(0.1)
    assert stats["running"] == stats["waiting"] == stats["paused"] == stats["kv_blocks_used"] == 0, stats
    assert stats["internal_errors"] == 0, stats
    log = served.server.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-8000:]


def test_admin_priority_invalid_utf8_key(served: Served) -> None:
    # An invalid UTF-8 field name raised UnicodeDecodeError past msgspec's DecodeError: a 500.
    with holding(served) as held:
        r = served.client.post(f"/admin/requests/{held.request_id}/priority", content=b'{"\xff": 1}',
                               headers=AUTH)
    check(r, statuses={400})
