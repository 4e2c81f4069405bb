"""Hostile input to the admin routes of a real ``sluice serve`` (tiny model): strangers with
every wrong token, request ids no request has (percent-encoded text, NUL, invalid UTF-8, 5000
characters), broken bodies, and every wrong priority body for a live (paused) request. Each answer
must be a 4xx in OpenAI's error shape, never a 5xx; afterwards — after test_serve_hostile's attacks
on the OpenAI routes too, on the same server — the server must still be healthy, hold no request,
log no traceback, and answer a greedy request token for token as it did before.
"""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hostile import (
    ADMIN,
    AUTH,
    DEEP,
    GREEDY,
    NOT_JSON,
    NOT_UTF8,
    PROPERTY,
    Raw,
    Served,
    anything_utf8,
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
    """The session's hostile server (conftest), shared with test_serve_hostile."""
    return hostile_served


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
