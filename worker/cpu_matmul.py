"""How a CPU worker runs its linear layers, and in which dtype.

Linear layers are most of a decode step on a CPU (SmolLM2 at one stream: 80% of it). Two
paths, each kept because it measured faster than the plain ``F.linear`` of its dtype:

* **float32**: MKL, with each weight stored column-major (``store_weights_column_major``): a
  16-row product of SmolLM2's gate/up weight took 0.27 instead of 0.45 ms (one thread).
* **bfloat16 with packed weights**: each weight reordered once, at start-up, and the plain one
  released. Where the CPU has AVX512-BF16, into the layout of Sluice's own kernel
  (``csrc/linear_bf16.c``: 16 outputs by 2 inputs per 64 bytes, no horizontal sums, weights
  streamed once); elsewhere into oneDNN's blocked layout (``mkldnn._reorder_linear_weight``,
  multiplied by ``mkldnn._linear_pointwise``). On an AMD Zen 5 (2 threads), a SmolLM2 decode
  step with plain bfloat16 weights took 18.4 ms at 1 row, 29.9 at 16, 71 at 64 (float32: 29,
  69, 162 ms); oneDNN's packed weights made that 10.4, 21.8, 57.

``--dtype auto`` on the CPU is float32 unless the CPU has bfloat16 instructions (AVX512-BF16 or
AMX): without them oneDNN emulates bfloat16 (~4x slower than float32). With them, what wins
still depends on the CPU (on a Xeon with AVX512-BF16 and no AMX, unpacked bfloat16 measured no
faster than float32), so both paths are timed at start-up on a product of the model's own
shape (its gate/up projection at 1 and 16 rows; ~0.1 s; the fastest of alternating trials) and
bfloat16 is chosen only where it is faster at both; the figures are logged. float32 is also the exact choice: SPEC's promise of
identical greedy output however a request is batched holds exactly in float32 only.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from worker import cpu_kernels
from worker.layers import Linear

MEASURE_ROWS = (1, 16)  # a stream decoding alone, and a batch
MAX_MEASURED_OUT = 4096  # a slice of a big model's projection is shape enough, and cheap to allocate


def has_bf16_instructions() -> bool:
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def can_pack() -> bool:
    """A packed bfloat16 linear is at hand: Sluice's kernel, or oneDNN's in this torch build."""
    return cpu_kernels.has_linear_bf16(cpu_kernels.load()) or (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_layer(layer: Linear, own_kernel: bool = True) -> None:
    """``layer`` multiplies by a packed copy of its weight (Sluice's kernel where it runs, the
    input size is even and ``own_kernel``; else oneDNN); its plain weight is released (a tied
    embedding keeps its own reference, so the lookup still reads it)."""
    kernels = cpu_kernels.load()
    weight = layer.weight.detach()
    if own_kernel and cpu_kernels.has_linear_bf16(kernels) and weight.shape[1] % 2 == 0:
        layer.packed, layer.kernels = cpu_kernels.pack_linear_bf16(weight), kernels
    else:
        layer.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), MEASURE_ROWS[-1])
    layer.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)


def packed_path() -> str:
    return "Sluice's AVX512-BF16 kernel" if cpu_kernels.has_linear_bf16(cpu_kernels.load()) else "oneDNN"


@dataclasses.dataclass
class DtypeChoice:
    dtype: torch.dtype
    reason: str


TRIALS = 6  # alternating timing trials per path; the fastest trial counts


def _per_call_s(fn: Callable[[], object], budget_s: float = 0.004) -> float:
    calls, began = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - began) < budget_s or calls < 2:
        fn()
        calls += 1
    return elapsed / calls


def _fastest(a: Callable[[], object], b: Callable[[], object]) -> tuple[float, float]:
    """Per-call seconds of ``a`` and of ``b``, timed in alternating trials, each path's fastest
    trial kept: another process taking a core (servers started side by side, a test suite)
    slows some trials, and the minimum is what each path costs undisturbed, so the choice does
    not flip with the load at the moment of starting."""
    a(), b()  # first calls: kernels built, caches warm
    times_a, times_b = [], []
    for _ in range(TRIALS):
        times_a.append(_per_call_s(a))
        times_b.append(_per_call_s(b))
    return min(times_a), min(times_b)


def measure(in_features: int, out_features: int, rows: int) -> tuple[float, float]:
    """Seconds per product of ``rows`` rows by an [out, in] weight: float32 column-major (MKL),
    then bfloat16 packed (``pack_layer``)."""
    out_features = min(out_features, MAX_MEASURED_OUT)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    column_major = weight.t().contiguous().t()
    layer = Linear(in_features, out_features)
    layer.weight = nn.Parameter(weight.bfloat16(), requires_grad=False)
    pack_layer(layer)
    xb = x.bfloat16()
    with torch.inference_mode():
        return _fastest(lambda: F.linear(x, column_major), lambda: layer(xb))


def choose_dtype(hidden_size: int, intermediate_size: int, bf16_instructions: bool | None = None,
                 timer: Callable[[int, int, int], tuple[float, float]] = measure) -> DtypeChoice:
    """``--dtype auto`` on the CPU for a model of these sizes (see the module docstring)."""
    if bf16_instructions is None:
        bf16_instructions = has_bf16_instructions()
    if not bf16_instructions:
        return DtypeChoice(torch.float32, "no bfloat16 instructions on this CPU")
    if not can_pack():
        return DtypeChoice(torch.float32, "this torch build has no oneDNN packed bfloat16 linear")
    times = {rows: timer(hidden_size, 2 * intermediate_size, rows) for rows in MEASURE_ROWS}
    figures = ", ".join(f"{rows} row{'s' if rows > 1 else ''}: float32 {f * 1e6:.0f} us, bfloat16 {b * 1e6:.0f} us"
                        for rows, (f, b) in times.items())
    if all(b < f for f, b in times.values()):
        return DtypeChoice(torch.bfloat16, f"packed bfloat16 measured faster ({figures})")
    return DtypeChoice(torch.float32, f"float32 measured as fast or faster ({figures})")


def store_weights_column_major(model: nn.Module) -> None:
    """Keep every ``Linear`` weight [out, in] as the transpose of a contiguous [in, out] matrix
    (same shape, same values, other strides), so ``F.linear`` becomes a plain ``x @ W`` product,
    which MKL runs faster once a batch has rows to share a weight tile (one row costs the same
    either way). A tied embedding shares the matrix and reads its rows strided, a cost only
    prefill notices (one row per prompt token)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.weight.data = module.weight.data.t().contiguous().t()


def pack_weights(model: nn.Module) -> None:
    """Every ``Linear`` of ``model`` through ``pack_layer``."""
    for module in model.modules():
        if isinstance(module, Linear):
            pack_layer(module)


def prepare(model: nn.Module, dtype: torch.dtype) -> str:
    """Put a CPU model's linear layers on their fast path for ``dtype``; returns which."""
    if dtype == torch.float32:
        store_weights_column_major(model)
        return "float32 linears through MKL, weights column-major"
    if dtype == torch.bfloat16 and can_pack():
        pack_weights(model)
        return f"bfloat16 linears through {packed_path()}, weights packed"
    return f"{str(dtype).removeprefix('torch.')} linears through F.linear"
