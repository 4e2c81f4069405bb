"""The OpenAI-compatible API through a real ``sluice serve`` (tiny model, real processes)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from sluice_server import SluiceServer, running_server

ADMIN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SluiceServer]:
    log_dir: Path = tmp_path_factory.mktemp("serve-api")
    with running_server("--admin-token", ADMIN, "--num-kv-blocks", "256", log_dir=log_dir) as s:
        yield s


def complete(server: SluiceServer, **body: object) -> httpx.Response:
    body.setdefault("model", "tiny")
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def test_health_ready_models(server: SluiceServer) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/ready").json()["status"] == "ready"
    models = httpx.get(f"{server.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


def test_completion_has_id_header_usage_and_length_finish(server: SluiceServer) -> None:
    r = complete(server, prompt="Hello there", max_tokens=8, temperature=0, ignore_eos=True, return_token_ids=True)
    assert r.status_code == 200, r.text
    body = r.json()
    assert r.headers["X-Request-Id"] == body["id"]
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == 8
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["prompt_tokens"] == len(choice["prompt_token_ids"])
    assert "cached_tokens" in body["usage"]["prompt_tokens_details"]


def test_greedy_is_deterministic_and_prompt_ids_equal_text(server: SluiceServer) -> None:
    a = complete(server, prompt="The fox", max_tokens=12, temperature=0, ignore_eos=True, return_token_ids=True)
    ids = a.json()["choices"][0]["prompt_token_ids"]
    b = complete(server, prompt=ids, max_tokens=12, temperature=0, ignore_eos=True, return_token_ids=True)
    assert a.json()["choices"][0]["token_ids"] == b.json()["choices"][0]["token_ids"]
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]


def test_openai_client_streams_completion_and_chat(server: SluiceServer) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(model="tiny", prompt="Once", max_tokens=10, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True},
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) == 10  # one chunk per token
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi!"}],
                                          max_tokens=6, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True})
    chat_chunks = list(chat)
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert chat_chunks[-1].choices[0].finish_reason == "length"

    full = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi!"}],
                                          max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    streamed_text = "".join(c.choices[0].delta.content or "" for c in chat_chunks)
    assert full.choices[0].message.content == streamed_text
    assert full.usage is not None and full.usage.completion_tokens == 6


def test_stop_string_ends_with_stop(server: SluiceServer) -> None:
    first = complete(server, prompt="abc", max_tokens=24, temperature=0, ignore_eos=True).json()
    text = first["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if not stop.strip():
        pytest.skip("generated text has no usable stop string")  # pragma: no cover - random weights
    r = complete(server, prompt="abc", max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["text"] == text[: text.index(stop)]


def test_a_stop_string_finish_reports_the_cached_prompt_tokens(server: SluiceServer) -> None:
    """The frontend ends a stop-string match itself, before the scheduler's finish arrives:
    the prefix cache's share of the prompt must still be in its usage (it said 0)."""
    prompt = list(range(300, 340))  # 40 tokens: two full blocks to find cached the second time
    first = complete(server, prompt=prompt, max_tokens=24, temperature=0, ignore_eos=True).json()
    text = first["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if not stop.strip():
        pytest.skip("generated text has no usable stop string")  # pragma: no cover - random weights
    for stream in (False, True):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                "stop": [stop], "stream": stream, "stream_options": {"include_usage": True} if stream else None}
        if stream:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: {")]
            usage = chunks[-1]["usage"]
            assert any(c["choices"] and c["choices"][0]["finish_reason"] == "stop" for c in chunks)
        else:
            done = complete(server, **body).json()
            usage = done["usage"]
            assert done["choices"][0]["finish_reason"] == "stop"
        assert usage["prompt_tokens_details"]["cached_tokens"] == 32, usage


def test_chat_without_max_tokens_gets_what_the_kv_cache_holds(server: SluiceServer) -> None:
    """The KV cache (256 blocks, 4096 tokens) is smaller than the context (8192): a chat request
    that sets no max_tokens gets what fits, as vLLM gives what the context holds (a 400 blaming
    max_tokens, which it never set, before)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # the first chunk arrived; leaving aborts the rest
    refused = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "x " * 4100}]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages", refused.text


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 2, 10**6]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, -2]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "min_tokens": 9, "max_tokens": 3}, 400, "min_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": [5] * 9000}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [5] * 8000, "max_tokens": 500}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop_token_ids": [99999]}, 400, "stop_token_ids"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),  # > KV cache
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "priority": -1}, 403, "priority"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"content": "no role"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hello"}, 400, "messages"),
    # Never half-accepted: a field or role the template cannot render is named, not dropped.
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "human", "content": "hi"}]}, 400,
     "messages[0].role"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny"}]}, 400, "messages[2].tool_call_id"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "function", "name": "w", "content": "x"}]},
     400, "messages[0].role"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "w"}}, {"type": "function", "function": {"name": "w"}}]},
     400, "tools[1].function.name"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "w"}}],
                              "tool_choice": {"type": "function", "function": {"name": "v"}}}, 400, "tool_choice"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x", "colour": "red"}]},
     400, "messages[0].colour"),
    ("/tokenize", {"model": "tiny", "messages": [{"role": "human", "content": "hi"}]}, 400, "messages[0].role"),
    ("/v1/nothing-here", {}, 404, None),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
def test_bad_input_gets_openai_error_and_server_keeps_serving(
    server: SluiceServer, path: str, body: object, status: int, param: str | None
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server.url}{path}", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    ok = complete(server, prompt="still serving", max_tokens=2)
    assert ok.status_code == 200


def test_negative_priority_with_admin_token_is_allowed(server: SluiceServer) -> None:
    r = httpx.post(f"{server.url}/v1/completions", headers=AUTH,
                   json={"model": "tiny", "prompt": "urgent", "max_tokens": 2, "priority": -5})
    assert r.status_code == 200, r.text


def test_admin_stats_requires_token(server: SluiceServer) -> None:
    assert httpx.get(f"{server.url}/admin/stats").status_code == 401
    assert httpx.get(f"{server.url}/admin/stats", headers={"Authorization": "Bearer wrong"}).status_code == 403
    assert httpx.get(f"{server.url}/admin/stats", headers=AUTH).status_code == 200


async def _stream_then_disconnect(url: str, tokens_before_leaving: int) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        body = {"model": "tiny", "prompt": "long story", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen >= tokens_before_leaving:
                        break  # leaving the block closes the connection mid-stream


async def _mixed_load(url: str) -> None:
    async with httpx.AsyncClient(timeout=120) as client:
        finished = [
            client.post(f"{url}/v1/completions",
                        json={"model": "tiny", "prompt": f"p{i}", "max_tokens": 20, "ignore_eos": True})
            for i in range(6)
        ]
        stopped = [
            client.post(f"{url}/v1/completions",
                        json={"model": "tiny", "prompt": "s", "max_tokens": 200, "stop": [" ", "e", "a"]})
            for _ in range(3)
        ]
        leavers = [_stream_then_disconnect(url, 3 + i) for i in range(4)]
        results = await asyncio.gather(*finished, *stopped, *leavers)
        for r in results[: len(finished) + len(stopped)]:
            assert r.status_code == 200, r.text


def test_every_kv_block_is_free_after_finished_aborted_and_disconnected(server: SluiceServer) -> None:
    asyncio.run(_mixed_load(server.url))
    stats: dict[str, object] = {}
    for _ in range(100):  # aborts travel asynchronously: give them a moment to land
        stats = httpx.get(f"{server.url}/admin/stats", headers=AUTH).json()
        if stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_blocks_used"] == 0:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert stats["running"] == 0 and stats["waiting"] == 0, stats
    assert stats["kv_blocks_used"] == 0, stats


def test_logprobs_completion_and_chat(server: SluiceServer) -> None:
    r = complete(server, prompt="The fox", max_tokens=5, temperature=0, ignore_eos=True, logprobs=3,
                 return_token_ids=True).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    for sampled, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert len(top) == 3 and sampled <= 0.0
        assert abs(sampled - max(top.values())) < 1e-5  # greedy: the sampled token is the top one
    assert lp["text_offset"][0] == 0

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert content is not None and len(content) == 4
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0.0 for c in content)
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=4, temperature=0, logprobs=True, stream=True,
                                            extra_body={"ignore_eos": True})
    streamed = [c for chunk in stream for c in (chunk.choices[0].logprobs.content or [])
                if chunk.choices and chunk.choices[0].logprobs]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-5)


def test_tokenize_and_detokenize_round_trip_and_match_what_completions_compute(server: SluiceServer) -> None:
    """/tokenize gives the ids /v1/completions computes for the same prompt (BOS included), its
    count and the model length; /detokenize gives the text back; chat messages tokenize as the
    chat endpoint renders them; bad input is a 400 naming the field."""
    texts = ["Hello there", "naïve café 日本語 🎉", "  spaced\n\nlines\t"]
    for text in texts:
        tok = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "prompt": text}).json()
        done = complete(server, prompt=text, max_tokens=1, return_token_ids=True).json()
        assert tok["tokens"] == done["choices"][0]["prompt_token_ids"]
        assert tok["count"] == len(tok["tokens"]) == done["usage"]["prompt_tokens"]
        assert tok["max_model_len"] == 8192
        bare = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
        assert bare["tokens"] == tok["tokens"][1:]  # the tiny model's BOS is the only special token added
        back = httpx.post(f"{server.url}/detokenize", json={"model": "tiny", "tokens": bare["tokens"]}).json()
        assert back == {"prompt": text}
    messages = [{"role": "user", "content": "What is two plus two?"}]
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()
    answered = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert chat["count"] == answered["usage"]["prompt_tokens"]
    for path, body, param in [("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
                              ("/tokenize", {"promt": "a"}, "promt"),
                              ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens")]:
        r = httpx.post(f"{server.url}{path}", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
    assert httpx.post(f"{server.url}/tokenize", json={"model": "other", "prompt": "a"}).status_code == 404


def test_vllm_text_options_stop_strings_kept_special_tokens_shown_and_template_variables(server: SluiceServer) -> None:
    """vLLM's include_stop_str_in_output, skip_special_tokens and chat_template_kwargs."""
    body = {"prompt": "The fox", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    free = complete(server, **body).json()["choices"][0]["text"]
    stop = free[8:11]
    cut = free.index(stop)
    kept = complete(server, **body, stop=[stop], include_stop_str_in_output=True).json()["choices"][0]
    dropped = complete(server, **body, stop=[stop]).json()["choices"][0]
    assert (kept["text"], dropped["text"]) == (free[: cut + len(stop)], free[:cut])
    assert kept["finish_reason"] == dropped["finish_reason"] == "stop"
    # A special token the model is pushed to write: its text shows only when asked for.
    bos = httpx.get(f"{server.url}/tokenizer_info", timeout=30).json()["bos_token"]
    bos_id = httpx.post(f"{server.url}/tokenize", json={"prompt": bos, "add_special_tokens": False},
                        timeout=30).json()["tokens"][0]
    forced = body | {"max_tokens": 3, "logit_bias": {str(bos_id): 100}}
    assert complete(server, **forced).json()["choices"][0]["text"] == ""
    assert complete(server, **forced, skip_special_tokens=False).json()["choices"][0]["text"] == bos * 3
    # The template's own variables: without the generation prompt, the conversation is shorter.
    messages = [{"role": "user", "content": "hi"}]
    count = {flag: httpx.post(f"{server.url}/tokenize", json={
        "messages": messages, "chat_template_kwargs": {"add_generation_prompt": flag}}, timeout=30).json()["count"]
        for flag in (True, False)}
    assert count[False] < count[True]
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={
        "messages": messages, "max_tokens": 2, "chat_template_kwargs": {"add_generation_prompt": False}}, timeout=60)
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == count[False]
