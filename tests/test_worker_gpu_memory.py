"""KV cache sizing on CUDA from a profiling run: the arithmetic, the largest step it profiles (run
here on the CPU through the real runner), and, where there is a GPU, the whole sizing."""

from __future__ import annotations

import pytest
import torch

from protocol.config import ConfigError, WorkerConfig
from worker.engine import Worker
from worker.gpu_memory import MemoryProfile, cuda_kv_blocks, kv_budget, largest_step, profiling_plan
from worker.kv_cache import KVCache
from worker.model.tiny import materialize_tiny
from worker.runner import ModelRunner

GIB = 2**30


def test_the_budget_is_the_share_less_weights_activations_and_cudas_own() -> None:
    profile = MemoryProfile(total=80 * GIB, allocated=16 * GIB, activation_peak=3 * GIB, non_torch=GIB)
    assert kv_budget(profile, 0.9) == int(72 * GIB) - 20 * GIB
    assert kv_budget(profile, 0.2) < 0  # what the caller refuses, naming the figures


def test_the_largest_step_spreads_the_token_budget_over_the_seats_every_row_sampling() -> None:
    assert largest_step(2048, 256, 4096, 16) == (256, 8, 1)
    assert largest_step(2048, 4, 4096, 16) == (4, 512, 32)
    assert largest_step(8192, 1, 1000, 16) == (1, 999, 63)  # one row, cut to the model's length
    assert largest_step(3, 256, 4096, 16) == (3, 1, 1)


def test_the_profiling_step_runs_through_the_real_runner_and_leaves_nothing() -> None:
    worker = Worker(WorkerConfig(model=str(materialize_tiny()), dtype="float32", num_kv_blocks=8, log_level="warning"))
    model, cfg = worker.runner.model, worker.runner.model.config
    rows, per_row, blocks = largest_step(96, 5, worker.max_model_len, 16)
    trial = KVCache(cfg.num_layers, rows * blocks + 1, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                    worker.device)
    runner = ModelRunner(model, trial, worker.device, worker.max_model_len, cfg.eos_token_ids, 8)
    steps = list(runner.execute(profiling_plan(rows, per_row, blocks)))
    assert len(steps) == 1 and steps[0].last and len(steps[0].rids) == rows  # every row sampled
    assert not runner.seqs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_worker_sizes_its_cache_from_the_profile() -> None:
    worker = Worker(WorkerConfig(model=str(materialize_tiny()), device="cuda", gpu_memory_utilization=0.5,
                                 log_level="warning"))
    _free, total = torch.cuda.mem_get_info()
    assert torch.cuda.memory_allocated() <= 0.5 * total + 64 * 2**20
    assert worker.info.num_kv_blocks > 0
    with pytest.raises(ConfigError, match="no room for the KV cache"):
        cuda_kv_blocks(torch.device("cuda"), 1e-6, 1 << 20, lambda n: worker.runner.cache, lambda c, p: True,
                       64, 4, 128, 16)


def test_a_cuda_device_always_carries_its_index(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.cuda.set_device refuses an index-less "cuda", which is what --device auto resolved to.
    from worker.model.loader import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert resolve_device("auto") == torch.device("cuda", 3)
    assert resolve_device("cuda") == torch.device("cuda", 3)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")
