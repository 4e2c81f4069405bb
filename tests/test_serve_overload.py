"""Request bodies over ``--max-request-body`` get 413 before they are buffered, declared or
chunked, and the server serves on. (Beyond ``--max-queued-requests``: test_serve_load.)"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from sluice_server import SluiceServer, running_server

LIMIT = 4096


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SluiceServer]:
    with running_server("--max-request-body", str(LIMIT),
                        log_dir=tmp_path_factory.mktemp("overload")) as s:
        yield s


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

