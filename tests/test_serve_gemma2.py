"""Gemma 2 through a real ``sluice serve --model <dir>`` (a random checkpoint whose attention
scores are soft-capped low enough to change them): the prompt's logprobs, scored in chunks by
the C kernels, are ``transformers``' (and not what they would be without the cap), and greedy
ids equal ``transformers``' for prompts alone and batched."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from checkpoints import hf_greedy, hf_prompt_logprobs, save_gemma2
from sluice_server import SluiceServer, running_server

PROMPT = [1, *(t % 300 + 3 for t in range(39))]  # 40 tokens: 3 chunks of 16, past the 6-token window
PROMPTS = [[1, *range(10, 14)], PROMPT, [1, *range(40, 79)]]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_gemma2(tmp_path_factory.mktemp("gemma2") / "ckpt")


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SluiceServer]:
    with running_server("--model", str(checkpoint), "--max-num-batched-tokens", "16",
                        log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


def test_prompt_logprobs_are_transformers_soft_capped_ones(server: SluiceServer, checkpoint: Path,
                                                           tmp_path: Path) -> None:
    r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["logprobs"]["token_logprobs"][1 : len(PROMPT)]
    want, _ = hf_prompt_logprobs(checkpoint, PROMPT, 1)
    assert got == pytest.approx(want, abs=2e-4)
    uncapped = tmp_path / "uncapped"  # the same weights, the cap left out: what a missing cap would give
    shutil.copytree(checkpoint, uncapped)
    config = json.loads((uncapped / "config.json").read_text())
    (uncapped / "config.json").write_text(json.dumps(config | {"attn_logit_softcapping": None}))
    without, _ = hf_prompt_logprobs(uncapped, PROMPT, 1)
    assert max(abs(a - b) for a, b in zip(got, without, strict=True)) > 0.05


def test_greedy_ids_alone_and_batched_are_transformers(server: SluiceServer, checkpoint: Path) -> None:
    async def generate(client: httpx.AsyncClient, prompt: list[int]) -> list[int]:
        r = await client.post(f"{server.url}/v1/completions", json={
            "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        return list(r.json()["choices"][0]["token_ids"])

    async def run() -> tuple[list[list[int]], list[list[int]]]:
        async with httpx.AsyncClient(timeout=120) as client:
            alone = [await generate(client, p) for p in PROMPTS]
            return alone, list(await asyncio.gather(*(generate(client, p) for p in PROMPTS)))

    want = hf_greedy(checkpoint, PROMPTS, NEW_TOKENS)
    alone, batched = asyncio.run(run())
    assert alone == want and batched == want
