"""Greedy parity with ``transformers`` through a real ``sluice serve --model <checkpoint dir>``,
for each family (Llama, Qwen2, Qwen3, Mistral, Qwen3-MoE, Qwen2-MoE, OLMoE): each prompt alone, all four batched together, and
prefilled in chunks. The servers also show the start-up defaults: the model's own length limit,
and a KV cache sized from ``--kv-cache-memory`` and logged."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from checkpoints import (
    hf_greedy,
    save_llama_checkpoint,
    save_mistral,
    save_olmoe,
    save_qwen2,
    save_qwen2_moe,
    save_qwen3,
    save_qwen3_moe,
)
from sluice_server import SluiceServer, started_server

NEW_TOKENS = 40
# Lengths 5..70 with a budget of 32 tokens per step: the two longer prompts prefill in chunks.
PROMPTS = [[1, *range(10, 14)], [1, *range(20, 36)], [1, *range(40, 79)], [1, *(t % 300 + 3 for t in range(69))]]


FAMILIES: dict[str, Callable[[Path], Path]] = {
    "llama": save_llama_checkpoint, "qwen2": save_qwen2, "qwen3": save_qwen3, "mistral": save_mistral,
    "qwen3_moe": save_qwen3_moe, "qwen2_moe": save_qwen2_moe, "olmoe": save_olmoe}
MAX_POSITIONS = {"llama": 512, "qwen2": 256, "qwen3": 256, "mistral": 256, "qwen3_moe": 256, "qwen2_moe": 256,
                 "olmoe": 256}  # what the checkpoints' configs say


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def checkpoint(family: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return FAMILIES[family](tmp_path_factory.mktemp(family) / "ckpt")


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> list[list[int]]:
    return hf_greedy(checkpoint, PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def starting(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SluiceServer]:
    # No --max-model-len and no --num-kv-blocks: both come from the model and the memory budget.
    flags = ["--model", str(checkpoint), "--max-num-batched-tokens", "32", "--kv-cache-memory", "4MiB"]
    with started_server(*flags, log_dir=tmp_path_factory.mktemp("parity-logs")) as s:
        yield s


@pytest.fixture(scope="module")
def server(starting: SluiceServer, expected: list[list[int]]) -> SluiceServer:
    """Ready; transformers computes ``expected`` here while it starts."""
    starting.wait_ready()
    return starting


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


def test_model_length_and_kv_cache_size_come_from_the_model_and_memory(server: SluiceServer, family: str) -> None:
    models = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    assert models[0]["max_model_len"] == MAX_POSITIONS[family]
    # 2 layers x 2 KV heads x 16 dims x 16 tokens x (K, V) x 4 bytes = 8 KiB a block: 512 in 4 MiB.
    logged = re.search(r"KV cache: (\d+) blocks x 16 tokens", server.log())
    assert logged is not None and int(logged.group(1)) == 512
