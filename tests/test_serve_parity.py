"""Greedy parity with ``transformers`` through a real ``sluice serve --model <checkpoint dir>``:
each prompt alone, all four batched together, and prefilled in chunks."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from checkpoints import hf_greedy, save_llama_checkpoint
from sluice_server import SluiceServer, running_server

NEW_TOKENS = 40
# Lengths 5..70 with a budget of 32 tokens per step: the two longer prompts prefill in chunks.
PROMPTS = [[1, *range(10, 14)], [1, *range(20, 36)], [1, *range(40, 79)], [1, *(t % 300 + 3 for t in range(69))]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama_checkpoint(tmp_path_factory.mktemp("llama") / "ckpt")


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> list[list[int]]:
    return hf_greedy(checkpoint, PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SluiceServer]:
    flags = ["--model", str(checkpoint), "--max-num-batched-tokens", "32", "--num-kv-blocks", "64"]
    with running_server(*flags, log_dir=tmp_path_factory.mktemp("parity-logs")) as s:
        yield s


async def _generate(url: str, prompt: list[int]) -> list[int]:
    async with httpx.AsyncClient(timeout=120) as client:
        # No "model": the served name is the checkpoint's directory, and the field is optional.
        r = await client.post(f"{url}/v1/completions", json={
            "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True,
        })
        assert r.status_code == 200, r.text
        ids: list[int] = r.json()["choices"][0]["token_ids"]
        return ids


def test_each_prompt_alone_matches_transformers(server: SluiceServer, expected: list[list[int]]) -> None:
    for prompt, want in zip(PROMPTS, expected, strict=True):
        assert asyncio.run(_generate(server.url, prompt)) == want


def test_batched_prompts_match_transformers(server: SluiceServer, expected: list[list[int]]) -> None:
    async def all_at_once() -> list[list[int]]:
        return list(await asyncio.gather(*(_generate(server.url, p) for p in PROMPTS)))

    assert asyncio.run(all_at_once()) == expected
