"""``--kv-cache-dtype bfloat16`` under a float32 model, served: SmolLM2 in float32 with its cache
in bfloat16 (half the memory per token). ``/v1/models`` says which dtype each holds; each greedy
answer is the same whatever the batch; and at every one of its tokens the float32 model over a
float32 cache, fed the same text, picks the same token or one within ``NEAR_TIE`` of it (keys and
values rounded to bfloat16 may tip a near-tie), at most one token in ``MAX_TIPPED``. A mix the
kernels do not read (a float32 cache under a bfloat16 model) is refused at start-up in one line."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from near_ties import chat_prompt, greedy_ids, tipped_near_ties
from sluice_server import SluiceServer, started_server

from protocol.config import WorkerConfig, to_json
from worker.engine import Worker
from worker.kernels import cpu as cpu_kernels

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: the kernels cannot be built here")]

QUESTIONS = [
    "Write a short poem about the sea.",
    "Explain in a few sentences how a bicycle works.",
    "What is the capital of France?",
    "Describe a cat in two sentences.",
]
NEW_TOKENS = 24
NEAR_TIE = 0.5  # logits
MAX_TIPPED = 8  # at most one token in eight a tipped near-tie


@pytest.fixture(scope="module")
def starting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SluiceServer]:
    with started_server("--model", "smollm2", "--dtype", "float32", "--kv-cache-dtype", "bfloat16",
                        "--num-kv-blocks", "128", log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


@pytest.fixture(scope="module")
def reference() -> Worker:
    return Worker(WorkerConfig(model="smollm2", num_kv_blocks=40, dtype="float32"))


@pytest.fixture(scope="module")
def server(starting: SluiceServer, reference: Worker) -> SluiceServer:
    """Ready; the reference loads here while it starts."""
    starting.wait_ready()
    return starting


def test_models_says_the_caches_dtype(server: SluiceServer) -> None:
    model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]
    assert model["dtype"] == "float32" and model["kv_cache_dtype"] == "bfloat16"
    assert "KV cache: 128 blocks x 16 tokens = 2048 tokens, 45.0 MiB of bfloat16" in server.log()


def test_greedy_answers_agree_with_a_float32_cache_but_at_near_ties_in_any_batch(server: SluiceServer,
                                                                                 reference: Worker) -> None:
    prompts = [chat_prompt(reference, q) for q in QUESTIONS]

    async def run() -> tuple[list[list[int]], list[list[int]]]:
        async with httpx.AsyncClient(timeout=300) as client:
            alone = [await greedy_ids(client, server.url, p, NEW_TOKENS) for p in prompts]
            together = list(await asyncio.gather(*(greedy_ids(client, server.url, p, NEW_TOKENS) for p in prompts)))
            return alone, together

    alone, together = asyncio.run(run())
    assert together == alone  # a row's result does not depend on its batch
    tipped = sum(tipped_near_ties(reference, prompt, answer, NEAR_TIE, repr(question))
                 for question, prompt, answer in zip(QUESTIONS, prompts, alone, strict=True))
    assert tipped <= len(QUESTIONS) * NEW_TOKENS // MAX_TIPPED, f"{tipped} near-ties tipped"


def test_a_mix_the_kernels_do_not_read_is_refused_in_one_line() -> None:
    config = WorkerConfig(model="tiny", dtype="bfloat16", kv_cache_dtype="float32", address="ipc:///tmp/sluice-unused")
    done = subprocess.run([sys.executable, "-m", "worker", "--config", to_json(config)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode != 0
    assert "--kv-cache-dtype float32 with a bfloat16 model on cpu" in done.stderr
    assert "Traceback" not in done.stderr
