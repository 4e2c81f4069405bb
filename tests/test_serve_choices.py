"""``n`` > 1 through a real ``sluice serve``: n choices that share the prompt's KV blocks, in the
non-streaming body and interleaved in the stream, each naming its index; seeded choices are
reproducible; every block comes back."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from sluice_server import SluiceServer, running_server, settled_stats

TOKEN = "choices-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100] * 5  # 65 tokens: 4 full blocks


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SluiceServer]:
    with running_server("--model", "tiny", "--admin-token", TOKEN, log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


def _complete(url: str, **body: object) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "return_token_ids": True} | body, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_n_choices_share_the_prompt_and_count_it_once(server: SluiceServer) -> None:
    single = _complete(server.url, max_tokens=12, temperature=0, ignore_eos=True)
    httpx.post(f"{server.url}/admin/prefix-cache/reset", headers=AUTH)
    hits_before = httpx.get(f"{server.url}/admin/stats", headers=AUTH).json()["prefix_cache_hits"]
    out = _complete(server.url, max_tokens=12, temperature=0, ignore_eos=True, n=3)
    hits = httpx.get(f"{server.url}/admin/stats", headers=AUTH).json()["prefix_cache_hits"] - hits_before
    assert hits == 2 * 64  # choices 1 and 2 found the prompt's 4 full blocks computed by choice 0
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    want = single["choices"][0]["token_ids"]
    assert all(c["token_ids"] == want for c in out["choices"])  # greedy: three equal choices
    assert out["usage"]["prompt_tokens"] == len(PROMPT) and out["usage"]["completion_tokens"] == 36


def test_seeded_choices_differ_from_each_other_and_repeat_exactly(server: SluiceServer) -> None:
    body = {"max_tokens": 16, "temperature": 1.0, "seed": 7, "ignore_eos": True, "n": 3}
    first = [c["token_ids"] for c in _complete(server.url, **body)["choices"]]
    again = [c["token_ids"] for c in _complete(server.url, **body)["choices"]]
    assert first == again
    assert len({tuple(t) for t in first}) == 3


def test_streamed_choices_arrive_interleaved_one_token_per_chunk(server: SluiceServer) -> None:
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "n": 2,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    per_choice: dict[int, list[int]] = {0: [], 1: []}
    finishes: dict[int, str] = {}
    usage = None
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if not chunk["choices"]:
                usage = chunk["usage"]
                continue
            (choice,) = chunk["choices"]
            per_choice[choice["index"]] += choice["token_ids"]
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    assert len(per_choice[0]) == len(per_choice[1]) == 10 and per_choice[0] == per_choice[1]
    assert finishes == {0: "length", 1: "length"}
    assert usage is not None and usage["completion_tokens"] == 20


def test_chat_with_n_and_bad_n(server: SluiceServer) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "n": 2, "temperature": 0})
    assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == [0, 1]
    assert all(c["message"]["role"] == "assistant" for c in r.json()["choices"])
    for bad in (0, 1000):
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "n": bad}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_every_block_comes_back_after_choices(server: SluiceServer) -> None:
    _complete(server.url, max_tokens=8, temperature=0.8, n=4)
    stats = settled_stats(server, AUTH)
    assert stats["kv_blocks_used"] == 0 and stats["running"] == 0 and stats["waiting"] == 0
