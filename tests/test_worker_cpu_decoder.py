"""The CPU's whole-stack decoder (one C call per decode step) against the per-operator forward:
the same logits and the same cache contents, bit for bit, in float32 and bfloat16, for Llama with
GQA, Qwen2 (q/k/v bias, tied embeddings), Qwen3 (q/k norms per head) and Mistral (a sliding
window), rows of different context lengths on shuffled blocks, one row and many. Every other
family the decoder has no stage for steps aside, and the start-up log says why."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from checkpoints import (
    save_gemma3,
    save_llama_checkpoint,
    save_mistral,
    save_mixtral,
    save_phi3,
    save_qwen2,
    save_qwen3,
    save_qwen3_moe,
)

from protocol.config import WorkerConfig
from worker.engine import Worker
from worker.kernels import cpu as cpu_kernels

BS = 16


def _dtypes() -> list[torch.dtype]:
    lib = cpu_kernels.load()
    return [d for d in (torch.float32, torch.bfloat16) if cpu_kernels.has_linear(lib, d)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("decoder")
    return {"llama": save_llama_checkpoint(root / "llama"), "qwen2": save_qwen2(root / "qwen2"),
            "qwen3": save_qwen3(root / "qwen3"), "mistral": save_mistral(root / "mistral")}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("rows", [1, 7])
def test_the_whole_stack_decoder_gives_the_per_operator_forwards_bits(checkpoints: dict[str, Path], arch: str,
                                                                       rows: int) -> None:
    dtypes = _dtypes()
    if not dtypes:
        pytest.skip("no packed linear kernel on this CPU (AVX-512), or no C compiler")
    # and a float32 model over a bfloat16 cache (--kv-cache-dtype bfloat16)
    cases = [(dtype, "auto") for dtype in dtypes] + [(torch.float32, "bfloat16")] * (torch.float32 in dtypes)
    for dtype, kv_cache_dtype in cases:
        name = str(dtype).removeprefix("torch.") + ("" if kv_cache_dtype == "auto" else f", {kv_cache_dtype} cache")
        worker = Worker(WorkerConfig(model=str(checkpoints[arch]), dtype=str(dtype).removeprefix("torch."),
                                     kv_cache_dtype=kv_cache_dtype, num_kv_blocks=64, block_size=BS,
                                     log_level="warning"))
        runner, model = worker.runner, worker.runner.model
        assert model.cpu_decoder is not None, f"{arch} {name}: the whole-stack decoder does not run"
        cache = runner.cache
        gen = torch.Generator().manual_seed(rows)
        for layer in (*cache.keys, *cache.values):  # an earlier context, finite values in every slot
            layer.copy_(torch.randn(layer.shape, generator=gen).to(layer.dtype))
        rng = random.Random(rows)
        blocks = list(range(1, cache.num_blocks))
        rng.shuffle(blocks)
        contexts = [rng.randrange(1, 90) for _ in range(rows)]
        tables = []
        for n in contexts:
            need = n // BS + 1
            tables.append(blocks[:need])
            blocks = blocks[need:]
        ids = torch.tensor([rng.randrange(3, 300) for _ in range(rows)])
        meta = runner.attention.build(cache, tables, contexts, [1] * rows, list(range(rows)))
        assert meta.decode_only() is not None
        before = [t.clone() for t in (*cache.keys, *cache.values)]
        decoder = model.cpu_decoder
        with torch.inference_mode():
            fused = model(ids, meta)
            fused_cache = [t.clone() for t in (*cache.keys, *cache.values)]
            for t, saved in zip((*cache.keys, *cache.values), before, strict=True):
                t.copy_(saved)
            model.cpu_decoder = None
            per_operator = model(ids, meta)
            model.cpu_decoder = decoder
        assert torch.equal(fused, per_operator), f"{arch} {name}: logits differ"
        for got, want in zip(fused_cache, (*cache.keys, *cache.values), strict=True):
            assert torch.equal(got, want), f"{arch} {name}: the cache differs"
        assert not torch.equal(fused_cache[0], before[0])  # the step wrote its keys
        assert cache.dtype == (torch.bfloat16 if kv_cache_dtype == "bfloat16" else dtype)


def test_the_per_operator_rotation_is_torchs(checkpoints: dict[str, Path]) -> None:
    """The C rotation both paths share equals torch's x * cos + rotate_half(x) * sin, bit for bit,
    in float32 and bfloat16, on strided rows (q and k are columns of the qkv product)."""
    from worker.model.layers import apply_rotary

    lib = cpu_kernels.load()
    if lib is None:
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(3)
    positions = torch.tensor([0, 5, 77, 300, 1023])
    head_dim = 64
    angles = torch.outer(torch.arange(1024, dtype=torch.float32), 1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim))
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    for dtype in (torch.float32, torch.bfloat16):
        qkv = torch.randn(5, 9 * head_dim, generator=gen).to(dtype)
        x = qkv[:, : 6 * head_dim].view(5, 6, head_dim)
        want = apply_rotary(x, cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype))
        cpu_kernels.rope(lib, x, positions, cos, sin)
        assert torch.equal(x, want), dtype
        assert torch.equal(qkv[:, 6 * head_dim :], qkv[:, 6 * head_dim :].clone())


def test_the_c_silu_matches_torchs_within_rounding() -> None:
    lib = cpu_kernels.load()
    if lib is None:
        pytest.skip("no C compiler")
    gate_up = torch.randn(5, 2 * 200, generator=torch.Generator().manual_seed(4)) * 6
    want = torch.nn.functional.silu(gate_up[:, :200]) * gate_up[:, 200:]
    torch.testing.assert_close(cpu_kernels.silu_mul(lib, gate_up, 200), want, rtol=1e-6, atol=1e-6)
    bf = gate_up.bfloat16()
    want_bf = torch.nn.functional.silu(bf[:, :200]).mul_(bf[:, 200:])
    torch.testing.assert_close(cpu_kernels.silu_mul(lib, bf, 200), want_bf, rtol=1e-2, atol=1e-2)


STEPS_ASIDE = {
    "mixtral": (save_mixtral, "no stage for a mixture of experts"),
    "qwen3_moe": (save_qwen3_moe, "no stage for a mixture of experts"),
    "gemma3": (save_gemma3, "no stages for Gemma's norms"),
    "phi4_mini": (lambda p: save_phi3(p, 0.75), "rotates part of each"),
}


@pytest.mark.parametrize("family", list(STEPS_ASIDE))
def test_a_family_the_decoder_cannot_run_goes_operator_by_operator_and_says_why(
        family: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    if not _dtypes():
        pytest.skip("no packed linear kernel on this CPU (AVX-512), or no C compiler")
    save, why = STEPS_ASIDE[family]
    with caplog.at_level("INFO", logger="sluice.worker"):
        worker = Worker(WorkerConfig(model=str(save(tmp_path / family)), dtype="float32", num_kv_blocks=16,
                                     block_size=BS))
    assert worker.runner.model.cpu_decoder is None
    assert any("decode steps run operator by operator" in r.getMessage() and why in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
