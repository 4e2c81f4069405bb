"""What the hostile-input tests share: their one server, the bodies' building blocks (``Raw``
bytes, ``emit``, the JSON values of every kind, malformed ones included, and whole bodies broken
in every way) and the checks every answer must pass (``post``, ``check``).

test_serve_hostile attacks the OpenAI routes, test_serve_hostile_admin the admin routes; both use
the session's one server (conftest's ``hostile_served``, started by ``hostile_server``), and the
admin file's last checks (the server healthy, holding nothing, logging no traceback, answering as
before) run after both: pytest takes the files in name order.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, settings
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


@contextlib.contextmanager
def hostile_server(log_dir: Path) -> Iterator[Served]:
    """A tiny-model server with an admin token, and a client for it; ``greedy_ids``: what it
    answered to ``GREEDY`` before any hostile input."""
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


# A valid body for each OpenAI route (one token): the fields' tests change them, and whole
# bodies are cut from them.
BODIES = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 1},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
}


def as_raw(data: bytes) -> Raw:
    return Raw(data, repr(data) if len(data) <= 80 else f"{data[:60]!r}... ({len(data)} bytes)")


def whole_bodies(utf8: bool = False) -> st.SearchStrategy[tuple[Raw, bool]]:
    """(body, surely bad): bodies broken as a whole rather than in one field; ``utf8``: none of
    them with invalid UTF-8."""
    valid = st.sampled_from(sorted(BODIES)).map(lambda p: emit(BODIES[p]))
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
    # a valid body is the last choice: with odd content types (test_serve_hostile), still served
    return st.one_of(bad.map(lambda b: (as_raw(b), True)), valid.map(lambda b: (as_raw(b), False)))


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
