"""Weights kept quantized: GGUF blocks read into codes, scales and mins exactly (against the
``gguf`` package's own dequantizer), packed for the quantized kernel and read back, and the kernel's
products against two references: the same arithmetic in float64 (activations quantized per 32
inputs as the kernel quantizes them: equal to float32 rounding) and the dequantize-then-matmul
product (within the 8-bit activations' error, stated below). A row's result does not depend on
its batch. Skipped where the kernel cannot run (neither AVX-512 VNNI nor AVX2). The AVX2 build of
the kernel runs these tests too, and matches the VNNI build bit for bit
(``tests/test_worker_kernels_portable.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants
from test_gguf import _blocks

from worker.gguf.quants import KEPT_LAYOUT, block_codes
from worker.kernels import cpu as cpu_kernels
from worker.model.quantized import QuantizedWeight

LIB = cpu_kernels.load()
needs_kernel = pytest.mark.skipif(not cpu_kernels.has_quantized_linear(LIB), reason="no quantized kernel here (AVX-512 VNNI or AVX2)")


@pytest.mark.parametrize("qtype", list(KEPT_LAYOUT))
def test_block_codes_are_the_files_weights_exactly(qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    data = _blocks(qtype, rows=24, cols=512, rng=rng)
    q = block_codes(data, qtype, (24, 512))
    assert q is not None and q.formats == (qtype.name,) and q.layout == KEPT_LAYOUT[qtype]
    assert int(q.codes.max()) < (16 if q.layout == 4 else 256)
    np.testing.assert_array_equal(q.dequantize().numpy(), quants.dequantize(data, qtype))


def test_float_types_are_not_read_as_codes() -> None:
    assert block_codes(np.zeros((4, 32), np.float32), Q.F32, (4, 32)) is None


def _weight(out: int, in_features: int, layout: int, seed: int) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    group = 16 if layout == 16 else 32
    codes = torch.randint(0, 16 if layout == 4 else 256, (out, in_features), dtype=torch.uint8, generator=g)
    scales = torch.rand(out, in_features // group, generator=g) * (0.02 if layout == 4 else 0.002)
    mins = -torch.rand(out, in_features // group, generator=g) * 0.1
    return QuantizedWeight(codes, scales, mins, layout, ("test",))


@pytest.mark.parametrize("layout", [4, 8, 16])
def test_packing_reads_back_the_weight_and_any_of_its_rows(layout: int) -> None:
    w = _weight(70, 96, layout, seed=layout)  # 70: the last 16-output block padded
    packed = cpu_kernels.pack_quantized(w)
    assert torch.equal(cpu_kernels.unpack_quantized(packed, 70, layout), w.dequantize())
    rows = torch.tensor([69, 0, 17, 17, 33])
    assert torch.equal(cpu_kernels.unpack_quantized(packed, 70, layout, rows), w.dequantize()[rows])


def test_parts_in_different_layouts_stack_into_the_widest_exactly() -> None:
    parts = [_weight(32, 64, 4, seed=1), _weight(16, 64, 16, seed=2), _weight(16, 64, 8, seed=3)]
    stacked = QuantizedWeight.cat(parts)
    assert stacked.layout == 16 and stacked.formats == ("test",)
    assert torch.equal(stacked.dequantize(), torch.cat([p.dequantize() for p in parts]))


def _quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: per row and 32 inputs, dx * round(x / dx), dx = max |x| / 127."""
    blocks = x.double().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True).float().double()
    dx = (amax.float() / 127.0).double()
    inv = torch.where(amax > 0, (127.0 / amax.float()).double(), torch.zeros_like(amax))
    codes = torch.round((blocks.float() * inv.float()).double())
    return (codes * dx).reshape(x.shape)


@needs_kernel
@pytest.mark.parametrize("layout", [4, 8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_both_references_and_is_batch_invariant(layout: int, dtype: torch.dtype) -> None:
    assert LIB is not None
    out, in_features = 200, 576
    w = _weight(out, in_features, layout, seed=7 + layout)
    packed = cpu_kernels.pack_quantized(w)
    bias = torch.randn(out).to(dtype)
    x = torch.randn(13, in_features).to(dtype)
    y = cpu_kernels.linear_q(LIB, x, packed, bias, out, layout)
    assert y.dtype == dtype and y.shape == (13, out)
    # Same arithmetic in float64: only float32 rounding (and bfloat16's at the store) apart.
    exact = _quantized_activations(x) @ w.dequantize().double().t() + bias.double()
    scale = exact.abs().max().item()
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3  # bfloat16: the output's own rounding
    assert (y.double() - exact).abs().max().item() <= tolerance * scale
    # Dequantize, then multiply: the 8-bit activations cost at most 2% of the largest output.
    plain = x.double() @ w.dequantize().double().t() + bias.double()
    assert (y.double() - plain).abs().max().item() <= 0.02 * scale
    # Each row alone gets the bits it got in the batch of 13 (and in a batch of 8 + 5).
    for r in (0, 7, 12):
        alone = cpu_kernels.linear_q(LIB, x[r : r + 1], packed, bias, out, layout)
        assert torch.equal(alone[0], y[r])
    assert torch.equal(cpu_kernels.linear_q(LIB, x[5:], packed, bias, out, layout), y[5:])


def test_named_dtypes_say_what_they_cost_at_start_up() -> None:
    from worker import cpu_isa
    from worker.engine import dtype_caveats

    cpu = torch.device("cpu")
    assert dtype_caveats("auto", torch.bfloat16, cpu, ["Q4_1"]) == []
    assert dtype_caveats("float32", torch.float32, cpu, []) == []
    [dequantized] = dtype_caveats("float32", torch.float32, cpu, ["Q4_1", "Q8_0"])
    assert "Q4_1, Q8_0 weights are dequantized to float32" in dequantized and "--dtype auto" in dequantized
    assert any("float16 on a CPU" in line for line in dtype_caveats("float16", torch.float16, cpu, []))
    emulated = any("without bfloat16 instructions" in line for line in dtype_caveats("bfloat16", torch.bfloat16, cpu, []))
    assert emulated == (not cpu_isa.has_bf16_instructions())
