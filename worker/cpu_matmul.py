"""How a CPU worker runs its linear layers, and in which dtype.

Linear layers are most of a decode step on a CPU (SmolLM2 at one stream: 80% of it). Each path
below was kept because it measured faster than the plain ``F.linear`` of its dtype:

* **Sluice's kernel** (``csrc/linear.c``), float32 on CPUs with AVX-512, bfloat16 on those with
  AVX512-BF16 too: each weight packed once, at start-up, as 16 outputs by 1 (float32) or 2
  (bfloat16) inputs per 64 bytes, the plain weight released; no horizontal sums, weights
  streamed once, and a row's result independent of its batch.
* Without the kernel, **bfloat16** weights are packed for oneDNN (``mkldnn._reorder_linear_weight``,
  multiplied by ``mkldnn._linear_pointwise``), and **float32** ones go to MKL stored column-major
  (a 16-row product of SmolLM2's gate/up weight: 0.27 instead of 0.45 ms, one thread).

On an AMD Zen 5 (2 threads), SmolLM2 decode steps at 1 / 16 / 64 rows took 29 / 69 / 162 ms in
float32 through MKL and 18.4 / 29.9 / 71 ms in bfloat16 through ``F.linear``; oneDNN's packed
bfloat16 made those 10.4 / 21.8 / 57 ms, and the rest of the worker's kernels plus this one
7.0 / 15.4 / 41.

``--dtype auto`` on the CPU is float32 unless the CPU has bfloat16 instructions (AVX512-BF16 or
AMX): without them oneDNN emulates bfloat16 (~4x slower than float32). With them, what wins
still depends on the CPU (on a Xeon with AVX512-BF16 and no AMX, unpacked bfloat16 measured no
faster than float32), so both paths are timed at start-up on a product of the model's own
shape (its gate/up projection at 1 and 16 rows; ~0.1 s; the fastest of alternating trials) and
bfloat16 is chosen only where it is faster at both; the figures are logged. float32 is also the
exact choice: SPEC's promise of identical greedy output however a request is batched holds
exactly in float32 only.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
from torch import nn

from worker import cpu_kernels
from worker.layers import Linear

MEASURE_ROWS = (1, 16)  # a stream decoding alone, and a batch
MAX_MEASURED_OUT = 4096  # a slice of a big model's projection is shape enough, and cheap to allocate


def has_bf16_instructions() -> bool:
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def can_pack() -> bool:
    """A packed bfloat16 linear is at hand: Sluice's kernel, or oneDNN's in this torch build."""
    return cpu_kernels.has_linear(cpu_kernels.load(), torch.bfloat16) or (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_layer(layer: Linear, own_kernel: bool = True) -> None:
    """Put ``layer`` on its fast path (see the module docstring): Sluice's kernel where it runs
    for the weight's dtype (bfloat16: an even input size too) and ``own_kernel``; else oneDNN's
    packed bfloat16 or MKL's column-major float32. A packed layer's plain weight is released (a
    tied embedding keeps its own reference, so the lookup still reads it)."""
    kernels = cpu_kernels.load()
    weight = layer.weight.detach()
    even = weight.shape[1] % 2 == 0 or weight.dtype != torch.bfloat16
    if own_kernel and cpu_kernels.has_linear(kernels, weight.dtype) and even:
        layer.packed, layer.kernels = cpu_kernels.pack_linear(weight), kernels
    elif weight.dtype == torch.bfloat16:
        layer.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), MEASURE_ROWS[-1])
    else:
        layer.weight.data = weight.t().contiguous().t()  # column-major: MKL's faster layout
        return
    layer.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)


def path(dtype: torch.dtype) -> str:
    """Which path ``pack_layer`` takes for ``dtype``, in words."""
    if cpu_kernels.has_linear(cpu_kernels.load(), dtype):
        return f"{str(dtype).removeprefix('torch.')} linears through Sluice's AVX-512 kernel, weights packed"
    if dtype == torch.bfloat16:
        return "bfloat16 linears through oneDNN, weights packed"
    return "float32 linears through MKL, weights column-major"


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
    """Seconds per product of ``rows`` rows by an [out, in] weight, float32 then bfloat16, each
    on its ``pack_layer`` path."""
    out_features = min(out_features, MAX_MEASURED_OUT)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    layers = []
    for dtype in (torch.float32, torch.bfloat16):
        layer = Linear(in_features, out_features)
        layer.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
        pack_layer(layer)
        layers.append(layer)
    xb = x.bfloat16()
    with torch.inference_mode():
        return _fastest(lambda: layers[0](x), lambda: layers[1](xb))


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
    not_faster = [f"{rows} row{'s' if rows > 1 else ''}" for rows, (f, b) in times.items() if b >= f]
    if not not_faster:
        return DtypeChoice(torch.bfloat16, f"packed bfloat16 measured faster ({figures})")
    # Named by size: bfloat16 may have been faster at one and not the other, and the line must
    # not say float32 was faster where its own figures say otherwise.
    return DtypeChoice(torch.float32, f"packed bfloat16 was not faster at {' and '.join(not_faster)} ({figures})")


def prepare(model: nn.Module, dtype: torch.dtype) -> str:
    """Put a CPU model's linear layers on their fast path for ``dtype``; returns which."""
    if dtype == torch.float32 or (dtype == torch.bfloat16 and can_pack()):
        for module in model.modules():
            if isinstance(module, Linear):
                pack_layer(module)
        return path(dtype)
    return f"{str(dtype).removeprefix('torch.')} linears through F.linear"
