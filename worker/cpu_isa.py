"""Which x86 instruction sets Sluice's CPU code may use: the CPU's own, or fewer when told.

Sluice's C kernels are compiled for an instruction-set level, and its Python side picks dtypes
and paths by what the CPU can do (bfloat16 instructions, oneDNN's packed bfloat16). Both ask
here, so that one setting makes the whole worker act as a smaller CPU would:

* ``native`` (the default): everything this CPU has (``-march=native``);
* ``avx2``: x86-64-v3, what most laptops, desktops and AMD Zen 2/3 servers have: AVX2, FMA,
  F16C, no AVX-512, no bfloat16 instructions (``-march=x86-64-v3``);
* ``x86-64``: the baseline every x86-64 CPU has, SSE2 only (``-march=x86-64``): the portable
  loops.

The level is ``SLUICE_CPU_ISA`` when set; else ``avx2`` where torch's own kernels are capped at
AVX2 (``ATEN_CPU_CAPABILITY=avx2``) and ``x86-64`` where they are capped below it (``default``),
so that torch and Sluice never disagree about the CPU they run on. To run as an AVX2-only CPU
would on an AVX-512 machine, cap oneDNN and MKL too: ``MKL_ENABLE_INSTRUCTIONS=AVX2
ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`` (the CI runs the worker's tests so).
"""

from __future__ import annotations

import functools
import os
import platform

import torch

LEVELS = {"native": "-march=native", "avx2": "-march=x86-64-v3", "x86-64": "-march=x86-64"}
_FROM_ATEN = {"avx2": "avx2", "default": "x86-64"}


@functools.cache
def level() -> str:
    """The level in force (see the module docstring); a bad ``SLUICE_CPU_ISA`` is a ValueError."""
    named = os.environ.get("SLUICE_CPU_ISA", "").strip().lower()
    if named:
        if named not in LEVELS:
            raise ValueError(f"SLUICE_CPU_ISA={named!r}: expected one of {', '.join(LEVELS)}")
        return named
    return _FROM_ATEN.get(os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower(), "native")


def march_flag() -> str:
    """The compiler's -march for Sluice's kernels (off x86, the CPU's own)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return "-march=native" if platform.machine() != "aarch64" else "-mcpu=native"
    return LEVELS[level()]


def has_bf16_instructions() -> bool:
    """bfloat16 dot-product instructions (AVX512-BF16 or AMX) at this level."""
    if level() != "native":
        return False
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def has_avx512() -> bool:
    """AVX-512 at this level (oneDNN's packed bfloat16 path needs AVX512-BW at least)."""
    return level() == "native" and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
