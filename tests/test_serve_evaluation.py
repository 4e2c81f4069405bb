"""What evaluation harnesses (lm-evaluation-harness's ``local-completions``) send to
``/v1/completions``, through a real ``sluice serve``: a batch of prompts in one request, texts or
token ids, answered as the same requests one at a time would be."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from sluice_server import SluiceServer, running_server

TOKEN = "evaluation-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SluiceServer]:
    with running_server("--model", "tiny", "--admin-token", TOKEN, log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


def _complete(url: str, **body: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"temperature": 0, "ignore_eos": True} | body, timeout=120)


def _assert_every_block_comes_back(server: SluiceServer) -> None:
    deadline = time.monotonic() + 30
    stats = httpx.get(f"{server.url}/admin/stats", headers=AUTH).json()
    while (stats["kv_blocks_used"] or stats["running"]) and time.monotonic() < deadline:
        time.sleep(0.1)
        stats = httpx.get(f"{server.url}/admin/stats", headers=AUTH).json()
    assert stats["kv_blocks_used"] == 0 and stats["running"] == 0 and stats["waiting"] == 0


def _ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.mark.parametrize("prompts", [["Hello there", "The sky is", "1 2 3"], [[1, 72, 101], [1, 84] * 9, [5]]],
                         ids=["texts", "token-ids"])
def test_a_batch_of_prompts_answers_as_one_request_per_prompt(server: SluiceServer, prompts: list) -> None:
    alone = [_ok(_complete(server.url, prompt=p, max_tokens=6, n=2, return_token_ids=True)) for p in prompts]
    batch = _ok(_complete(server.url, prompt=prompts, max_tokens=6, n=2, return_token_ids=True))
    # Prompt p's choice j is index p * n + j, in order, with what that prompt alone answers.
    assert [c["index"] for c in batch["choices"]] == list(range(2 * len(prompts)))
    for p, single in enumerate(alone):
        for j in range(2):
            got, want = batch["choices"][2 * p + j], single["choices"][j]
            assert (got["text"], got["token_ids"], got["prompt_token_ids"]) == \
                (want["text"], want["token_ids"], want["prompt_token_ids"])
    assert batch["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in alone)
    assert batch["usage"]["completion_tokens"] == 2 * 6 * len(prompts)
    _assert_every_block_comes_back(server)


@pytest.mark.parametrize(("prompt", "param"), [
    (["fine", ""], "prompt[1]"),
    (["fine", 7], "prompt[1]"),
    ([[1, 2], [3, -4]], "prompt[1]"),
    ([[1, 2], [3, 10**6]], "prompt[1]"),
    ([[1, 2], []], "prompt[1]"),
    ([[1, 2], [[3]]], "prompt[1]"),
    (["x"] * 1025, "prompt"),
])
def test_a_bad_prompt_in_a_batch_is_a_400_naming_it(server: SluiceServer, prompt: list, param: str) -> None:
    r = _complete(server.url, prompt=prompt, max_tokens=2)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert _ok(_complete(server.url, prompt="still serving", max_tokens=2))["choices"][0]["finish_reason"] == "length"


def test_a_stream_of_several_prompts_is_refused_and_one_prompt_in_a_list_streams(server: SluiceServer) -> None:
    r = _complete(server.url, prompt=["a", "b"], max_tokens=2, stream=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    r = _complete(server.url, prompt=[[1, 72, 101]], max_tokens=2, stream=True)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
