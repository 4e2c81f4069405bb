"""The default model end to end: ``sluice serve --model smollm2`` gives exactly the greedy tokens
``transformers`` gives when it loads the same GGUF file, for chat prompts alone and batched, and
answers a real question."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from sluice_server import SluiceServer, running_server

from worker.model.loader import smollm2_path

pytestmark = pytest.mark.timeout(900)

QUESTIONS = [
    "Write a short poem about the sea.",
    "Explain in a few sentences how a bicycle works.",
    "List five fruits and say one thing about each.",
    "What should I pack for a weekend of hiking?",
]
NEW_TOKENS = 40  # min_tokens = max_tokens: every answer is exactly this long, EOS held back


@pytest.fixture(scope="module")
def server(smollm2_server: SluiceServer) -> SluiceServer:
    return smollm2_server  # shared with the other modules that serve SmolLM2 so (conftest.py)


@pytest.fixture(scope="module")
def expected(smollm2_hf_tokenizer: Any) -> dict[str, list[int]]:
    """transformers' greedy continuation of each chat prompt, from the same GGUF file."""
    import gguf
    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    tokenizer = smollm2_hf_tokenizer
    with pytest.MonkeyPatch.context() as patch:
        # transformers builds gguf's tensor-name table again for each of the model's 397 modules
        # (a third of its load); the table depends on the architecture and the depth alone.
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    out = {}
    with torch.inference_mode():
        for q in QUESTIONS:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                return_dict=False)
            generated = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                       do_sample=False)
            out[q] = generated[0, len(ids):].tolist()
    return out


async def _chat(client: httpx.AsyncClient, url: str, question: str) -> list[int]:
    r = await client.post(f"{url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": question}], "temperature": 0, "max_tokens": NEW_TOKENS,
        "min_tokens": NEW_TOKENS, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


def test_each_chat_prompt_alone_matches_transformers(server: SluiceServer, expected: dict[str, list[int]]) -> None:
    async def run() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            for q in QUESTIONS:
                assert await _chat(client, server.url, q) == expected[q], q

    asyncio.run(run())


def test_batched_chat_prompts_match_transformers(server: SluiceServer, expected: dict[str, list[int]]) -> None:
    async def run() -> list[list[int]]:
        async with httpx.AsyncClient(timeout=300) as client:
            return list(await asyncio.gather(*(_chat(client, server.url, q) for q in QUESTIONS)))

    assert asyncio.run(run()) == [expected[q] for q in QUESTIONS]


def test_the_capital_of_france_is_paris(server: SluiceServer) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}], "temperature": 0,
        "max_tokens": 32})
    assert r.status_code == 200
    answer = r.json()["choices"][0]["message"]["content"]
    assert "Paris" in answer, answer
    assert r.json()["choices"][0]["finish_reason"] == "stop"  # ended on <|im_end|>, not by length


def test_models_lists_smollm2(server: SluiceServer, tmp_path: Path) -> None:
    data = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in data] == ["smollm2"] and data[0]["max_model_len"] == 8192


def test_bfloat16_answers_sensibly_with_logits_close_to_float32(tmp_path: Path) -> None:
    """``--dtype bfloat16`` (auto's choice on CPUs with AVX512-BF16/AMX): the README's question
    still gets Paris through the server, and a chat prompt's logits stay within the stated
    tolerance of float32's: cosine similarity > 0.99 at every position, same argmax at the last."""
    from protocol.config import WorkerConfig
    from worker.engine import Worker

    with running_server("--model", "smollm2", "--dtype", "bfloat16", "--num-kv-blocks", "64",
                        log_dir=tmp_path) as s:
        r = httpx.post(f"{s.url}/v1/chat/completions", timeout=300, json={
            "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}], "temperature": 0,
            "max_tokens": 32})
        assert r.status_code == 200
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
    from tokenizers import Tokenizer

    from worker.attention import SdpaBackend

    logits = []
    for dtype in ("float32", "bfloat16"):
        w = Worker(WorkerConfig(model="smollm2", num_kv_blocks=16, dtype=dtype))
        ids = Tokenizer.from_str(w.info.tokenizer_json).encode(QUESTIONS[1]).ids
        meta = SdpaBackend(w.device).build(w.runner.cache, [list(range(16))], [0], [len(ids)], list(range(len(ids))))
        with torch.inference_mode():
            logits.append(w.runner.model(torch.tensor(ids, device=w.device), meta).cpu())
    full, half = logits
    assert torch.nn.functional.cosine_similarity(full, half, dim=-1).min() > 0.99
    assert full[-1].argmax() == half[-1].argmax()
