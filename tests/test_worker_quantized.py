"""Weights kept quantized: GGUF blocks read into codes, scales and mins exactly (against the
``gguf`` package's own dequantizer), packed for the quantized kernel in records as small as the
file's blocks and read back, and the kernel's
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

from worker.gguf.quants import KEPT_BITS, block_codes
from worker.kernels import cpu as cpu_kernels
from worker.kernels import quant_records
from worker.model.quantized import QuantizedWeight

LIB = cpu_kernels.load()
needs_kernel = pytest.mark.skipif(not cpu_kernels.has_quantized_linear(LIB), reason="no quantized kernel here (AVX-512 VNNI or AVX2)")


@pytest.mark.parametrize("qtype", list(KEPT_BITS))
def test_block_codes_are_the_files_weights_exactly(qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    data = _blocks(qtype, rows=24, cols=512, rng=rng)
    q = block_codes(data, qtype, (24, 512))
    assert q is not None and q.formats == (qtype.name,) and q.bits == KEPT_BITS[qtype]
    assert int(q.codes.max()) < 2**q.bits
    np.testing.assert_array_equal(q.dequantize().numpy(), quants.dequantize(data, qtype))


def test_float_types_are_not_read_as_codes() -> None:
    assert block_codes(np.zeros((4, 32), np.float32), Q.F32, (4, 32)) is None


# What each type's file holds per weight: its block's bytes over its weights.
FILE_BITS = {Q.Q4_0: 4.5, Q.Q4_1: 5.0, Q.Q5_0: 5.5, Q.Q5_1: 6.0, Q.Q8_0: 8.5, Q.Q4_K: 4.5, Q.Q5_K: 5.5, Q.Q6_K: 6.5625}


def _weight(qtype: Q | None, out: int, in_features: int, seed: int) -> QuantizedWeight:
    """A random weight of a GGUF type, read as the loader reads it; ``None``: Q4_K, Q6_K and Q8_0
    rows stacked (the float form a fused projection of mixed types takes)."""
    if qtype is None:
        parts = [_weight(t, n, in_features, seed + i) for i, (t, n) in enumerate(((Q.Q4_K, 32), (Q.Q6_K, 16), (Q.Q8_0, out - 48)))]
        return QuantizedWeight.cat(parts)
    q = block_codes(_blocks(qtype, out, in_features, np.random.default_rng(seed)), qtype, (out, in_features))
    assert q is not None
    return q


FORMS = [*KEPT_BITS, None]


@pytest.mark.parametrize("qtype", list(KEPT_BITS))
def test_records_hold_the_files_bytes(qtype: Q) -> None:
    """A decode step reads the records: they hold what the file does (the K-quants' integer
    sub-scales take a byte where the file packs them in six bits: within 3%)."""
    _, fmt = quant_records.pack(_weight(qtype, 16, 256, seed=1))
    assert FILE_BITS[qtype] <= fmt.bits_per_weight <= 1.03 * FILE_BITS[qtype], fmt


@pytest.mark.parametrize("qtype", FORMS)
def test_records_read_back_the_weight_and_any_of_its_rows(qtype: Q | None) -> None:
    w = _weight(qtype, 70, 512, seed=3)  # 70: the last 16-output block padded
    packed, fmt = quant_records.pack(w)
    assert torch.equal(quant_records.unpack(packed, fmt, 70).dequantize(), w.dequantize())
    rows = torch.tensor([69, 0, 17, 17, 33])
    assert torch.equal(quant_records.unpack(packed, fmt, 70, rows).dequantize(), w.dequantize()[rows])
    if LIB is not None:  # the C read-back a tied embedding looks its rows up with (every build has it)
        assert torch.equal(cpu_kernels.dequantize_rows(LIB, packed, fmt, 70, rows), w.dequantize()[rows])
        assert torch.equal(cpu_kernels.dequantize_rows(LIB, packed, fmt, 70, torch.arange(70)), w.dequantize())
        for outside in (70, 71, -1):  # 71: a padding row of the last block is not a row either
            with pytest.raises(IndexError):
                cpu_kernels.dequantize_rows(LIB, packed, fmt, 70, torch.tensor([0, outside]))


@pytest.mark.skipif(LIB is None, reason="no C compiler here")
def test_rows_read_back_in_c_widen_every_fp16_scale_exactly() -> None:
    """fp16 factors of every kind of value (subnormal, zero, negative zero, the largest, negative)
    widened as torch widens them, with and without mins."""
    special = torch.tensor([6e-8, 3e-5, 0.0, -0.0, 65504.0, -1.5, 0.1, -2e-6], dtype=torch.float16)
    scales = special.repeat(4).reshape(16, 2)  # [16 outputs, 2 groups of 32]
    codes = torch.randint(0, 256, (16, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for mins in (None, special.flip(0).repeat(4).reshape(16, 2)):
        w = QuantizedWeight(codes, 8, 32, scales, mins, -128.0 if mins is None else 0.0, ("test",))
        packed, fmt = quant_records.pack(w)
        got = cpu_kernels.dequantize_rows(LIB, packed, fmt, 16, torch.arange(16))
        assert torch.equal(got.view(torch.int32), w.dequantize().view(torch.int32))  # the bits, signed zeros too


def test_parts_of_different_types_stack_exactly_and_of_one_type_keep_it() -> None:
    mixed = _weight(None, 64, 512, seed=5)
    assert mixed.kind == "float" and mixed.bits == 8 and mixed.group == 16
    assert mixed.formats == ("Q4_K", "Q6_K", "Q8_0")
    parts = [_weight(t, n, 512, seed=5 + i) for i, (t, n) in enumerate(((Q.Q4_K, 32), (Q.Q6_K, 16), (Q.Q8_0, 16)))]
    assert torch.equal(mixed.dequantize(), torch.cat([p.dequantize() for p in parts]))
    same = QuantizedWeight.cat([_weight(Q.Q4_K, 32, 512, seed=1), _weight(Q.Q4_K, 16, 512, seed=2)])
    assert same.kind == "super" and same.bits == 4 and same.formats == ("Q4_K",)


@pytest.mark.parametrize("qtype", list(KEPT_BITS))
def test_columns_of_a_weight_are_its_columns(qtype: Q) -> None:
    """A row-parallel shard: on the K-quants' 256-input super-blocks they keep their form, off
    them they take the float form; exact either way."""
    w = _weight(qtype, 16, 768, seed=2)
    for start, stop in ((256, 768), (0, 128), (64, 96)):
        part = w.columns(start, stop)
        assert torch.equal(part.dequantize(), w.dequantize()[:, start:stop]), (start, stop)
        packed, fmt = quant_records.pack(part)
        assert torch.equal(quant_records.unpack(packed, fmt, 16).dequantize(), part.dequantize())


def _quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: per row and 32 inputs, dx * round(x / dx), dx = max |x| / 127."""
    blocks = x.double().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True).float().double()
    dx = (amax.float() / 127.0).double()
    # 127 / amax as one IEEE division, as the kernel computes it (torch's scalar / tensor is a
    # reciprocal then a product: one ulp off at times, which flips a code sitting on a half)
    inv = torch.where(amax > 0, (torch.full_like(amax, 127.0).float() / amax.float()).double(), torch.zeros_like(amax))
    codes = torch.round((blocks.float() * inv.float()).double())
    return (codes * dx).reshape(x.shape)


@needs_kernel
@pytest.mark.parametrize("qtype", FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_both_references_and_is_batch_invariant(qtype: Q | None, dtype: torch.dtype) -> None:
    assert LIB is not None
    out, in_features = 200, 768
    w = _weight(qtype, out, in_features, seed=7)
    packed, fmt = quant_records.pack(w)
    gen = torch.Generator().manual_seed(11)
    bias = torch.randn(out, generator=gen).to(dtype)
    x = torch.randn(13, in_features, generator=gen).to(dtype)
    y = cpu_kernels.linear_q(LIB, x, packed, bias, out, fmt)
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
        alone = cpu_kernels.linear_q(LIB, x[r : r + 1], packed, bias, out, fmt)
        assert torch.equal(alone[0], y[r])
    assert torch.equal(cpu_kernels.linear_q(LIB, x[5:], packed, bias, out, fmt), y[5:])


@needs_kernel
def test_a_long_prompts_rows_get_their_bits_in_every_chunk() -> None:
    """The kernel takes a long prompt's rows 64 at a time (a chunk's activations stay in cache):
    rows on either side of a chunk's edge, and in the last, short chunk, get what they get alone."""
    assert LIB is not None
    out, in_features = 40, 256
    packed, fmt = quant_records.pack(_weight(Q.Q4_1, out, in_features, seed=3))
    x = torch.randn(150, in_features, generator=torch.Generator().manual_seed(5))
    y = cpu_kernels.linear_q(LIB, x, packed, None, out, fmt)
    for r in (0, 63, 64, 127, 128, 149):
        assert torch.equal(cpu_kernels.linear_q(LIB, x[r : r + 1], packed, None, out, fmt)[0], y[r])
    assert torch.equal(cpu_kernels.linear_q(LIB, x[61:], packed, None, out, fmt), y[61:])


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
