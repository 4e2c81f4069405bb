"""Weights kept quantized: GGUF blocks read into codes, scales and mins exactly (against the
``gguf`` package's own dequantizer), packed for the VNNI kernel and read back, and the kernel's
products against two references: the same arithmetic in float64 (activations quantized per 32
inputs as the kernel quantizes them: equal to float32 rounding) and the dequantize-then-matmul
product (within the 8-bit activations' error, stated below). A row's result does not depend on
its batch. Skipped where the kernel cannot run (no AVX-512 VNNI)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants
from test_gguf import _blocks

from worker.gguf.quants import CODE_BITS, block_codes
from worker.kernels import cpu as cpu_kernels
from worker.model.quantized import QuantizedWeight

LIB = cpu_kernels.load()
needs_kernel = pytest.mark.skipif(not cpu_kernels.has_quantized_linear(LIB), reason="no AVX-512 VNNI kernel here")


@pytest.mark.parametrize("qtype", list(CODE_BITS))
def test_block_codes_are_the_files_weights_exactly(qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    data = _blocks(qtype, rows=24, cols=512, rng=rng)
    q = block_codes(data, qtype, (24, 512))
    assert q is not None and q.formats == (qtype.name,)
    assert int(q.codes.max()) < 2 ** {4: 4, 8: 8}[q.bits]
    np.testing.assert_array_equal(q.dequantize().numpy(), quants.dequantize(data, qtype))


def test_types_without_the_form_are_not_read() -> None:
    rng = np.random.default_rng(3)
    assert block_codes(_blocks(Q.Q6_K, rows=4, cols=256, rng=rng), Q.Q6_K, (4, 256)) is None
    assert block_codes(np.zeros((4, 32), np.float32), Q.F32, (4, 32)) is None


def _weight(out: int, in_features: int, bits: int, seed: int) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (out, in_features), dtype=torch.uint8, generator=g)
    scales = torch.rand(out, in_features // 32, generator=g) * 0.02
    mins = -torch.rand(out, in_features // 32, generator=g) * 0.1 * (2**bits) * 0.01
    return QuantizedWeight(codes, scales, mins, bits, ("test",))


@pytest.mark.parametrize("bits", [4, 8])
def test_packing_reads_back_the_weight_and_any_of_its_rows(bits: int) -> None:
    w = _weight(70, 96, bits, seed=bits)  # 70: the last 16-output block padded
    packed = cpu_kernels.pack_quantized(w.codes, w.scales, w.mins, bits)
    assert torch.equal(cpu_kernels.unpack_quantized(packed, 70, bits), w.dequantize())
    rows = torch.tensor([69, 0, 17, 17, 33])
    assert torch.equal(cpu_kernels.unpack_quantized(packed, 70, bits, rows), w.dequantize()[rows])


def _quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: per row and 32 inputs, dx * round(x / dx), dx = max |x| / 127."""
    blocks = x.double().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True).float().double()
    dx = (amax.float() / 127.0).double()
    inv = torch.where(amax > 0, (127.0 / amax.float()).double(), torch.zeros_like(amax))
    codes = torch.round((blocks.float() * inv.float()).double())
    return (codes * dx).reshape(x.shape)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_both_references_and_is_batch_invariant(bits: int, dtype: torch.dtype) -> None:
    assert LIB is not None
    out, in_features = 200, 576
    w = _weight(out, in_features, bits, seed=7 + bits)
    packed = cpu_kernels.pack_quantized(w.codes, w.scales, w.mins, bits)
    bias = torch.randn(out).to(dtype)
    x = torch.randn(13, in_features).to(dtype)
    y = cpu_kernels.linear_q(LIB, x, packed, bias, out, bits)
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
        alone = cpu_kernels.linear_q(LIB, x[r : r + 1], packed, bias, out, bits)
        assert torch.equal(alone[0], y[r])
    assert torch.equal(cpu_kernels.linear_q(LIB, x[5:], packed, bias, out, bits), y[5:])
