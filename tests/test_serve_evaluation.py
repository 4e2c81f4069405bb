"""What evaluation harnesses (lm-evaluation-harness's ``local-completions``) send to
``/v1/completions``, through a real ``sluice serve``: a batch of prompts in one request, texts or
token ids, answered as the same requests one at a time would be; and ``echo`` with ``logprobs``,
which scores every prompt token (checked against ``transformers``), however the prompt is
chunked, cached or shared by choices."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from checkpoints import hf_prompt_logprobs, save_llama_checkpoint
from prometheus_client.parser import text_string_to_metric_families
from sluice_server import SluiceServer, running_servers, settled_stats

TOKEN = "evaluation-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama_checkpoint(tmp_path_factory.mktemp("llama") / "ckpt")


@pytest.fixture(scope="module")
def servers(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[SluiceServer]]:
    """The tiny model's server and the Llama checkpoint's, started side by side."""
    # A 32-token step budget for the checkpoint: the prompt is prefilled in three chunks, each scoring its part.
    with running_servers(("--model", "tiny", "--admin-token", TOKEN),
                         ("--model", str(checkpoint), "--max-num-batched-tokens", "32", "--admin-token", TOKEN),
                         log_dir=tmp_path_factory.mktemp("logs")) as started:
        yield started


@pytest.fixture(scope="module")
def server(servers: list[SluiceServer]) -> SluiceServer:
    return servers[0]


def _complete(url: str, **body: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"temperature": 0, "ignore_eos": True} | body, timeout=120)


def _assert_every_block_comes_back(server: SluiceServer) -> None:
    stats = settled_stats(server, AUTH)
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


def test_a_batch_makes_at_most_1024_choices(server: SluiceServer) -> None:
    r = _complete(server.url, prompt=["x"] * 9, max_tokens=2, n=128)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert len(_ok(_complete(server.url, prompt=["x"] * 8, max_tokens=1, n=128))["choices"]) == 1024


def _stream(url: str, body: dict) -> tuple[dict[int, list[int]], dict[int, str], list[dict], str]:
    """A stream's token ids and finish reason by choice index, its usage chunks, and its text."""
    ids: dict[int, list[int]] = {}
    finishes: dict[int, str] = {}
    usage: list[dict] = []
    with httpx.stream("POST", f"{url}/v1/completions", json={"temperature": 0, "ignore_eos": True} | body,
                      timeout=120) as r:
        assert r.status_code == 200
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                usage.append(chunk["usage"])
            for choice in chunk["choices"]:
                ids.setdefault(choice["index"], []).extend(choice["token_ids"])
                if choice["finish_reason"] is not None:
                    finishes[choice["index"]] = choice["finish_reason"]
    return ids, finishes, usage, text


def test_a_batch_of_prompts_streams_its_choices_interleaved_then_one_usage_and_done(server: SluiceServer) -> None:
    prompts = [[1, 72, 101], [1, 84] * 9, [5, 6, 7, 8]]
    httpx.post(f"{server.url}/admin/prefix-cache/reset", headers=AUTH)
    whole = _ok(_complete(server.url, prompt=prompts, max_tokens=40, n=2, return_token_ids=True))
    httpx.post(f"{server.url}/admin/prefix-cache/reset", headers=AUTH)  # the same cached_tokens
    ids, finishes, usage, text = _stream(server.url, {
        "prompt": prompts, "max_tokens": 40, "n": 2, "return_token_ids": True, "stream": True,
        "stream_options": {"include_usage": True}})
    assert ids == {c["index"]: c["token_ids"] for c in whole["choices"]}
    assert finishes == {i: "length" for i in range(6)}
    assert usage == [whole["usage"]]
    assert text.count("data: [DONE]") == 1 and text.rstrip().endswith("data: [DONE]")
    # Streamed as they come: the prompts' tokens interleave instead of one prompt after another
    # (40 tokens take five windows of 8 steps; the other prompts join by the second).
    order = [json.loads(line[6:])["choices"][0]["index"] for line in text.splitlines()
             if line.startswith("data: {") and json.loads(line[6:])["choices"]]
    assert order.index(4) < len(order) - 1 - order[::-1].index(0)
    _assert_every_block_comes_back(server)


def _aborted(server: SluiceServer) -> float:
    """The frontend's count of requests that ended aborted."""
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "sluice_request_success_total" and sample.labels["finished_reason"] == "abort":
                return sample.value
    return 0.0


def test_a_client_that_leaves_a_batch_stream_aborts_every_prompt(server: SluiceServer) -> None:
    before = _aborted(server)
    body = {"prompt": [[1, 72, 101], [5, 6, 7]], "max_tokens": 400, "stream": True, "temperature": 0,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # and hang up
    _assert_every_block_comes_back(server)
    assert _aborted(server) - before == 2


# ------------------------------------------------------------------------------------ echo


PROMPT = [1, *(t % 300 + 3 for t in range(69))]  # 70 tokens: three chunks of a 32-token step


@pytest.fixture(scope="module")
def llama(servers: list[SluiceServer]) -> SluiceServer:
    return servers[1]


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(llama: SluiceServer, checkpoint: Path) -> None:
    # What lm-evaluation-harness sends for a loglikelihood request: a batch of token-id prompts.
    body = {"prompt": [PROMPT, PROMPT[:9]], "max_tokens": 1, "logprobs": 3, "echo": True, "temperature": 0,
            "seed": 1234}
    out = _ok(_complete(llama.url, **body))
    for choice, prompt in zip(out["choices"], [PROMPT, PROMPT[:9]], strict=True):
        want, want_top = hf_prompt_logprobs(checkpoint, prompt, 3)
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompt) + 1  # the prompt's tokens, then the one generated
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1 : len(prompt)] == pytest.approx(want, abs=1e-4)
        for top, values, token, logprob in zip(lp["top_logprobs"][1 : len(prompt)], want_top, lp["tokens"][1:],
                                               lp["token_logprobs"][1:], strict=False):
            # The three most likely, and the prompt's own token (OpenAI's legacy rule: up to logprobs + 1).
            assert sorted(top.values(), reverse=True)[:3] == pytest.approx(values, abs=1e-4)
            assert top[token] == logprob and len(top) == (3 if logprob >= values[-1] - 1e-5 else 4)
        # The generated token's logprob follows, as without echo; the text starts with the prompt's.
        alone = _ok(_complete(llama.url, prompt=prompt, max_tokens=1, logprobs=3, temperature=0))["choices"][0]
        assert lp["token_logprobs"][-1] == pytest.approx(alone["logprobs"]["token_logprobs"][0], abs=1e-5)
        prompt_text = httpx.post(f"{llama.url}/detokenize", json={"tokens": prompt}, timeout=30).json()["prompt"]
        assert choice["text"] == prompt_text + alone["text"]
        offsets = lp["text_offset"]
        assert offsets == sorted(offsets) and offsets[len(prompt)] == len(prompt_text)


def test_echoed_logprobs_ignore_the_prefix_cache_and_every_choice_reports_them(llama: SluiceServer) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "logprobs": 0, "echo": True, "temperature": 0}
    first = _ok(_complete(llama.url, **body))
    # The same prompt again: its blocks are cached, but every position's logits are needed.
    again = _ok(_complete(llama.url, **body, n=2))
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    want = first["choices"][0]["logprobs"]["token_logprobs"][: len(PROMPT)]
    for choice in again["choices"]:
        assert choice["logprobs"]["token_logprobs"][: len(PROMPT)] == pytest.approx(want, abs=1e-5)
        lp = choice["logprobs"]
        # logprobs 0: no alternatives, only the token itself (OpenAI's legacy rule).
        assert all(top == {token: logprob} for top, token, logprob in
                   zip(lp["top_logprobs"][1:], lp["tokens"][1:], lp["token_logprobs"][1:], strict=True))
    _assert_every_block_comes_back(llama)


def test_echo_streams_the_prompt_in_each_choice_first_chunk(llama: SluiceServer) -> None:
    body = {"prompt": PROMPT[:20], "max_tokens": 4, "logprobs": 1, "echo": True, "temperature": 0, "n": 2,
            "stream": True}
    whole = _ok(_complete(llama.url, **body | {"stream": False}))
    texts: dict[int, str] = {0: "", 1: ""}
    logprobs: dict[int, list[float | None]] = {0: [], 1: []}
    with httpx.stream("POST", f"{llama.url}/v1/completions", json={"temperature": 0, "ignore_eos": True} | body,
                      timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[len("data: "):])["choices"][0]
                texts[choice["index"]] += choice["text"]
                if choice["logprobs"] is not None:
                    logprobs[choice["index"]] += choice["logprobs"]["token_logprobs"]
    for i in (0, 1):
        assert texts[i] == whole["choices"][i]["text"]
        assert logprobs[i] == pytest.approx(whole["choices"][i]["logprobs"]["token_logprobs"], abs=1e-5)


def test_echo_goes_on_past_a_window_and_scores_a_one_token_prompt(llama: SluiceServer) -> None:
    # 40 tokens: later plans decode the row again (no prompt position left to score); a prompt
    # of one token has nothing to score at all.
    for prompt in (PROMPT[:5], PROMPT[:1]):
        body = {"prompt": prompt, "max_tokens": 40, "logprobs": 2, "echo": True, "temperature": 0}
        out = _ok(_complete(llama.url, **body))
        lp = out["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(prompt) + 40 and out["usage"]["completion_tokens"] == 40
        assert lp["token_logprobs"][0] is None and None not in lp["token_logprobs"][1:]
    assert _ok(_complete(llama.url, prompt=PROMPT, max_tokens=2))["choices"][0]["finish_reason"] == "length"


def test_vllm_prompt_logprobs_rank_each_prompt_token_on_both_endpoints(llama: SluiceServer, checkpoint: Path) -> None:
    want, want_top = hf_prompt_logprobs(checkpoint, PROMPT, 2)
    out = _ok(_complete(llama.url, prompt=PROMPT, max_tokens=2, prompt_logprobs=2, n=2))
    for choice in out["choices"]:
        scored = choice["prompt_logprobs"]
        assert len(scored) == len(PROMPT) and scored[0] is None
        for token, position, logprob, top in zip(PROMPT[1:], scored[1:], want, want_top, strict=True):
            mine = position[str(token)]
            assert mine["logprob"] == pytest.approx(logprob, abs=1e-4)
            # Its rank counts the tokens more likely than it; the two most likely are ranks 1 and 2.
            assert (mine["rank"] == 1) == (logprob >= top[0] - 1e-5)
            ranked = sorted(position.values(), key=lambda e: e["rank"])
            assert [e["rank"] for e in ranked[:2]] == [1, 2]
            assert [e["logprob"] for e in ranked[:2]] == pytest.approx(top, abs=1e-4)
    assert "prompt_logprobs" not in _ok(_complete(llama.url, prompt=PROMPT, max_tokens=1))["choices"][0]
    # Both shapes at once: each keeps its own count of alternatives.
    both = _ok(_complete(llama.url, prompt=PROMPT, max_tokens=1, prompt_logprobs=3, echo=True, logprobs=1))
    choice = both["choices"][0]
    assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"][1:])
    assert all(3 <= len(position) <= 4 for position in choice["prompt_logprobs"][1:])
    # Chat: the rendered conversation's tokens, scored, at the top of the answer (vLLM's place).
    messages = [{"role": "user", "content": "Hello there"}]
    chat = httpx.post(f"{llama.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 2,
                                                                  "prompt_logprobs": 0}, timeout=60).json()
    ids = httpx.post(f"{llama.url}/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
    assert len(chat["prompt_logprobs"]) == len(ids) and chat["prompt_logprobs"][0] is None
    assert all(list(p) == [str(t)] for t, p in zip(ids[1:], chat["prompt_logprobs"][1:], strict=True))
    # Streamed: in each choice's first chunk.
    with httpx.stream("POST", f"{llama.url}/v1/completions", json={"prompt": PROMPT[:9], "max_tokens": 3,
                                                                   "prompt_logprobs": 1, "stream": True},
                      timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert len(chunks[0]["choices"][0]["prompt_logprobs"]) == 9
    assert all("prompt_logprobs" not in c["choices"][0] for c in chunks[1:])


def test_a_text_prompt_is_echoed_as_given_without_the_bos_the_server_added(server: SluiceServer) -> None:
    # The built-in tiny model puts BOS before a prompt, as sentencepiece models do.
    out = _ok(_complete(server.url, prompt="Hello there", max_tokens=2, echo=True, logprobs=0))["choices"][0]
    alone = _ok(_complete(server.url, prompt="Hello there", max_tokens=2))["choices"][0]
    assert out["text"] == "Hello there" + alone["text"]
    lp = out["logprobs"]
    bos = httpx.get(f"{server.url}/tokenizer_info", timeout=30).json()["bos_token"]
    assert lp["tokens"][0] == bos and lp["text_offset"][:2] == [0, 0]  # scored, but no text of its own
    assert lp["text_offset"][-2] == len("Hello there")  # the first generated token's place in the text


def test_echo_without_logprobs_returns_the_prompt_text_and_scores_nothing(llama: SluiceServer) -> None:
    prompt_text = httpx.post(f"{llama.url}/detokenize", json={"tokens": PROMPT}, timeout=30).json()["prompt"]
    out = _ok(_complete(llama.url, prompt=PROMPT, max_tokens=3, echo=True))
    alone = _ok(_complete(llama.url, prompt=PROMPT, max_tokens=3))
    assert out["choices"][0]["text"] == prompt_text + alone["choices"][0]["text"]
    assert out["choices"][0]["logprobs"] is None
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # nothing to score: the cache serves it


def test_tokenizer_info_lets_a_client_tokenize_through_the_server(server: SluiceServer) -> None:
    """lm-evaluation-harness's remote tokenizer: it finds the special tokens and the template
    here, and reads each special token's id back through ``/tokenize``."""
    info = httpx.get(f"{server.url}/tokenizer_info", timeout=30).json()
    model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]
    assert info["model_max_length"] == model["max_model_len"] and info["chat_template"]
    for name in ("bos_token", "eos_token"):
        r = httpx.post(f"{server.url}/tokenize", json={"prompt": info[name], "add_special_tokens": False}, timeout=30)
        ids = r.json()["tokens"]
        assert len(ids) == 1
        back = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
        assert back == info[name]
