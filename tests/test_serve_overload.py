"""Request bodies over ``--max-request-body`` get 413 before they are buffered, declared or
chunked, and the server serves on. (Beyond ``--max-queued-requests``: test_serve_load.)"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from sluice_server import SluiceServer, running_servers

AUTH = {"Authorization": "Bearer t"}
LIMIT = 4096


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SluiceServer]]:
    """Every server the tests below use, started side by side."""
    flags = {"body": ("--max-request-body", str(LIMIT)),
             "stall": ("--admin-token", "t", "--client-stall-timeout", "2"),
             "deadline": ("--admin-token", "t", "--request-timeout", "1.5")}
    with running_servers(*flags.values(), log_dir=tmp_path_factory.mktemp("overload")) as started:
        yield dict(zip(flags, started, strict=True))


@pytest.fixture(scope="module")
def server(servers: dict[str, SluiceServer]) -> SluiceServer:
    return servers["body"]


def big_body() -> bytes:
    return json.dumps({"prompt": "x" * (LIMIT + 100), "max_tokens": 2}).encode()


def test_a_body_over_the_cap_is_413_declared_or_chunked(server: SluiceServer) -> None:
    url = f"{server.url}/v1/completions"
    declared = httpx.post(url, content=big_body(), headers={"Content-Type": "application/json"})
    body = big_body()
    chunked = httpx.post(url, content=iter([body[:1000], body[1000:3000], body[3000:]]),
                         headers={"Content-Type": "application/json"})  # no Content-Length: chunked
    for r in (declared, chunked):
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "request_too_large" and "--max-request-body" in r.json()["error"]["message"]
    ok = httpx.post(url, json={"prompt": "fine", "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3



def test_a_client_that_stops_reading_is_dropped_without_slowing_others(servers: dict[str, SluiceServer]) -> None:
    server = servers["stall"]
    # A client that sends its request and never reads: a small receive window, and chunks
    # made large (20 logprobs a token) so the server's socket buffers surely fill.
    body = json.dumps({"prompt": "x", "max_tokens": 8000, "ignore_eos": True, "stream": True,
                       "logprobs": 20}).encode()
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect(("127.0.0.1", server.port))
    stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    try:
        stats = lambda: httpx.get(f"{server.url}/admin/stats", headers=AUTH).json()  # noqa: E731
        deadline = time.monotonic() + 30
        while stats()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        # Others are served as usual meanwhile.
        started = time.monotonic()
        ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "y", "max_tokens": 16, "ignore_eos": True},
                        timeout=30)
        assert ok.status_code == 200 and time.monotonic() - started < 5
        # The stalled stream is dropped and its request aborted: its KV blocks come back.
        deadline = time.monotonic() + 30
        while (s := stats())["running"] + s["waiting"] > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert s["running"] == s["waiting"] == 0 and s["kv_blocks_used"] == 0, s
        assert "read nothing for 2 s: stream dropped" in server.log()
        assert "without completing response" not in server.log()
    finally:
        stalled.close()


def test_request_timeout_ends_a_request_with_abort_and_says_why(servers: dict[str, SluiceServer]) -> None:
    server = servers["deadline"]
    url = f"{server.url}/v1/completions"
    long = {"prompt": "x", "max_tokens": 8000, "ignore_eos": True}
    started = time.monotonic()
    with httpx.stream("POST", url, json=long | {"stream": True}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert time.monotonic() - started < 10
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])["choices"][0]
    assert last["finish_reason"] == "abort" and "--request-timeout" in last["abort_reason"], last
    whole = httpx.post(url, json=long, timeout=60).json()["choices"][0]
    assert whole["finish_reason"] == "abort" and "1.5 s" in whole["abort_reason"], whole
    quick = httpx.post(url, json={"prompt": "y", "max_tokens": 4, "ignore_eos": True}).json()["choices"][0]
    assert quick["finish_reason"] == "length" and "abort_reason" not in quick
    stats = httpx.get(f"{server.url}/admin/stats", headers=AUTH).json()
    assert stats["running"] == stats["waiting"] == 0 and stats["kv_blocks_used"] == 0
