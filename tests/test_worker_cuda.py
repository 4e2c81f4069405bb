"""The worker on CUDA in half precision (bfloat16 and float16), where FlashInfer attends: GPU-only,
skipped without a CUDA device (scripts/gpu_checks.sh runs them with the parity tests on cuda).

The checkpoints have head size 64, which FlashInfer has kernels for: a GQA group of 2 (its decode
kernel on CUDA cores) and of 6 (on tensor cores). A step mixing a decode, a chunk after a cached
prefix and a new prompt, and a decode-only step, give the logits the torch path (gather + SDPA)
gives on the same cache; greedy windows give the same tokens with and without the one-step lag
and in windows of 1 or 8; the first logits track transformers' float32 ones.
"""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import pytest
import torch
from checkpoints import save_llama_checkpoint
from worker_testing import Driver, greedy

from protocol.config import WorkerConfig
from worker.attention import AttentionBackend, SdpaBackend
from worker.engine import Worker
from worker.runner import ModelRunner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SHAPES = {"gqa2": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2),
          "gqa6": dict(hidden_size=384, intermediate_size=512, num_attention_heads=6, num_key_value_heads=1)}
PROMPTS = {0: [1, *range(10, 50)], 1: [1, *range(60, 82)], 2: [1, *(t % 300 + 3 for t in range(16))]}


@pytest.fixture(scope="module", params=list(SHAPES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", **SHAPES[request.param])


@pytest.fixture(scope="module", params=["bfloat16", "float16"])
def worker(request: pytest.FixtureRequest, checkpoint: Path) -> Worker:
    w = Worker(WorkerConfig(model=str(checkpoint), device="cuda", dtype=request.param, num_kv_blocks=256,
                            block_size=16, log_level="warning"))
    name = w.runner.attention.name
    if not name.startswith("flashinfer") and importlib.util.find_spec("flashinfer") is not None:
        pytest.fail(f"flashinfer is installed but the worker attends with {name}: see the selection log line")
    return w


def _logits(worker: Worker, backend: AttentionBackend, tables: list[list[int]], starts: list[int], lengths: list[int],
            ids: list[int]) -> torch.Tensor:
    runner = worker.runner
    ends = list(itertools.accumulate(lengths))
    meta = backend.build(runner.cache, tables, starts, lengths, [e - 1 for e in ends])
    with torch.inference_mode():
        return runner.model(torch.tensor(ids, device=runner.device), meta).float().cpu()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cosine.min() > 0.999, cosine


def test_flashinfer_attends_as_the_torch_path_in_mixed_and_decode_steps(worker: Worker) -> None:
    if not worker.runner.attention.name.startswith("flashinfer"):
        pytest.skip("flashinfer is not installed: the worker attends with the torch path")
    own = worker.runner.attention
    sdpa = SdpaBackend(worker.device, worker.runner.model.config.sliding_window)
    tables = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    # Rows 0 and 1 prefill part of their prompts (the cache then holds them for both backends).
    _logits(worker, own, tables[:2], [0, 0], [40, 20], PROMPTS[0][:40] + PROMPTS[1][:20])
    # A decode (row 0), a chunk after a cached prefix (row 1) and a new prompt (row 2): prefill wrapper.
    mixed = (tables, [40, 20, 0], [1, 3, 17], [PROMPTS[0][40], *PROMPTS[1][20:23], *PROMPTS[2]])
    _close(_logits(worker, own, *mixed), _logits(worker, sdpa, *mixed))
    # Every row one token: the decode wrapper.
    decode = (tables, [41, 23, 17], [1, 1, 1], [5, 6, 7])
    _close(_logits(worker, own, *decode), _logits(worker, sdpa, *decode))


@pytest.mark.parametrize("steps", [1, 8])
def test_greedy_windows_give_the_same_tokens_with_and_without_the_lag(worker: Worker, steps: int) -> None:
    outputs = []
    for lag in (0, 1):
        r = worker.runner
        d = Driver(ModelRunner(r.model, r.cache, r.device, 2048, list(r.eos_token_ids), finalize_lag=lag), 10)
        d.prefill(PROMPTS, greedy(24), steps)
        d.decode_to_end(steps)
        outputs.append(dict(d.outputs))
    assert outputs[0] == outputs[1]
    assert all(len(out) == 24 for out in outputs[0].values())


def test_the_first_logits_track_transformers_float32(worker: Worker, checkpoint: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompt = PROMPTS[0]
    own = worker.runner.attention
    runner = worker.runner
    meta = own.build(runner.cache, [[1, 2, 3]], [0], [len(prompt)], list(range(len(prompt))))
    with torch.inference_mode():
        got = runner.model(torch.tensor(prompt, device=runner.device), meta).float().cpu()
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    _close(got, want)
