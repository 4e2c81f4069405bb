"""How a CPU worker runs its linear layers, and in which dtype.

Linear layers are most of a decode step on a CPU (SmolLM2 at one stream: 80% of it). Each path
below was kept because it measured faster than the plain ``F.linear`` of its dtype:

* **Sluice's kernel** (``csrc/linear.c``), float32 and bfloat16 on CPUs with AVX-512 or AVX2
  (bfloat16 by vdpbf16ps with AVX512-BF16, else widened to float32 in registers): each weight
  packed once, at start-up, as 16 outputs by 1 (float32) or 2 (bfloat16) inputs per 64 bytes,
  the plain weight released; no horizontal sums, weights streamed once, and a row's result
  independent of its batch.
* **Weights kept quantized** (a GGUF file's blocks, ``worker/model/quantized.py``) are packed for
  Sluice's quantized kernel (``csrc/linear_q.c``: AVX-512 VNNI, else AVX2), whatever the activations' dtype: only that kernel
  reads them, so a model keeps them only where it runs (``worker/engine.py``).
* Without the kernel, **bfloat16** weights are packed for oneDNN (``mkldnn._reorder_linear_weight``,
  multiplied by ``mkldnn._linear_pointwise``) where oneDNN has a bfloat16 path (AVX-512; it
  raises on an AVX2 CPU), and **float32** ones go to MKL stored column-major (a 16-row product of
  SmolLM2's gate/up weight: 0.27 instead of 0.45 ms, one thread).

On an AMD Zen 5 (2 threads), SmolLM2 decode steps at 1 / 16 / 64 rows took 29 / 69 / 162 ms in
float32 through MKL and 18.4 / 29.9 / 71 ms in bfloat16 through ``F.linear``; oneDNN's packed
bfloat16 made those 10.4 / 21.8 / 57 ms, and the rest of the worker's kernels plus this one
7.0 / 15.4 / 41.

``--dtype auto`` on the CPU is bfloat16 where the CPU has bfloat16 instructions (AVX512-BF16 or
AMX) and a packed bfloat16 linear is at hand, float32 elsewhere (without the instructions
bfloat16 is float32 arithmetic on widened values, which only reads fewer bytes). It is decided
from the hardware, never from a timing: a start-up measurement under load is noise (seen: "1 row: float32 7259 us, bfloat16
7961 us" on a CPU where bfloat16 is 1.7x faster undisturbed), so two identical servers could
pick different dtypes, and a worker restarted after a crash could come back in another
precision than the one its recomputed streams were generated in. float32 stays the exact
choice: SPEC's promise of identical greedy output however a request is batched holds exactly in
float32 only (``--dtype float32``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from protocol.heap import return_freed_memory
from worker import cpu_isa
from worker.kernels import cpu as cpu_kernels
from worker.kernels import quant_records
from worker.model.layers import Linear

PACKED_FOR_ROWS = 16  # the batch size oneDNN's packed layout is chosen for

def onednn_bf16() -> bool:
    """oneDNN's packed bfloat16 linear is in this torch build and has a path on this CPU."""
    return cpu_isa.has_avx512() and torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight")


def can_pack() -> bool:
    """A packed bfloat16 linear is at hand: Sluice's kernel, or oneDNN's."""
    return cpu_kernels.has_linear(cpu_kernels.load(), torch.bfloat16) or onednn_bf16()


def pack_layer(layer: Linear, own_kernel: bool = True) -> None:
    """Put ``layer`` on its fast path (see the module docstring): Sluice's kernel where it runs
    for the weight's dtype (bfloat16: an even input size too) and ``own_kernel``; else oneDNN's
    packed bfloat16 or MKL's column-major float32. A packed layer's plain weight is released (a
    tied embedding keeps its own reference, so the lookup still reads it)."""
    kernels = cpu_kernels.load()
    if layer.quantized is not None:  # kept quantized: only Sluice's kernel reads it
        q = layer.quantized
        assert cpu_kernels.has_quantized_linear(kernels), "weights are kept quantized only where the kernel runs"
        layer.packed, layer.quant_format = quant_records.pack(q)
        layer.kernels = kernels
        layer.quantized = None
        del q
        return_freed_memory()  # the unpacked codes: else the next weight's packing grows the heap beside them
        return
    weight = layer.weight.detach()
    even = weight.shape[1] % 2 == 0 or weight.dtype != torch.bfloat16
    if own_kernel and cpu_kernels.has_linear(kernels, weight.dtype) and even:
        layer.packed, layer.kernels = cpu_kernels.pack_linear(weight), kernels
    elif weight.dtype == torch.bfloat16 and onednn_bf16():
        layer.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACKED_FOR_ROWS)
    elif weight.dtype == torch.bfloat16:
        return  # F.linear
    else:
        layer.weight.data = weight.t().contiguous().t()  # column-major: MKL's faster layout
        return
    layer.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)


def path(dtype: torch.dtype) -> str:
    """Which path ``pack_layer`` takes for ``dtype``, in words."""
    isa = cpu_kernels.linear_instructions(cpu_kernels.load(), dtype)
    if isa is not None:
        return f"{str(dtype).removeprefix('torch.')} linears through Sluice's kernel ({isa}), weights packed"
    if dtype == torch.bfloat16:
        return "bfloat16 linears through oneDNN, weights packed" if onednn_bf16() else "bfloat16 linears through F.linear"
    return "float32 linears through MKL, weights column-major"


@dataclasses.dataclass
class DtypeChoice:
    dtype: torch.dtype
    reason: str


def choose_dtype(bf16_instructions: bool | None = None) -> DtypeChoice:
    """``--dtype auto`` on the CPU, from the hardware alone (see the module docstring)."""
    if bf16_instructions is None:
        bf16_instructions = cpu_isa.has_bf16_instructions()
    if not bf16_instructions:
        return DtypeChoice(torch.float32, "no bfloat16 instructions on this CPU")
    if not can_pack():
        return DtypeChoice(torch.float32, "this torch build has no packed bfloat16 linear")
    return DtypeChoice(torch.bfloat16, "the CPU has bfloat16 instructions")


def quantized_bytes(model: nn.Module) -> int:
    """The bytes of the quantized linears' packed records (a decode step reads each once)."""
    return sum(m.packed.numel() for m in model.modules()
               if isinstance(m, Linear) and m.quant_format is not None and m.packed is not None)


def prepare(model: nn.Module, dtype: torch.dtype) -> str:
    """Put a CPU model's linear layers on their fast path for ``dtype``; returns which."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    # weights kept quantized may be packed already, as the load read them (load_model's pack)
    formats = ", ".join(dict.fromkeys(f for m in linears for f in m.kept_formats))
    kept = sum(bool(m.kept_formats) for m in linears)
    for layer in linears:
        if layer.packed is None and (layer.quantized is not None or dtype in (torch.float32, torch.bfloat16)):
            pack_layer(layer)
    if kept:
        dense = len(linears) - kept
        rest = f"; {dense} others: {path(dtype)}" if dense else ""
        isa = cpu_kernels.quantized_instructions(cpu_kernels.load())
        return (f"{kept} kept quantized ({formats}) through Sluice's {isa} kernel, activations "
                f"{str(dtype).removeprefix('torch.')}{rest}")
    if dtype in (torch.float32, torch.bfloat16):
        return path(dtype)
    return f"{str(dtype).removeprefix('torch.')} linears through F.linear"
