"""Paged attention backends, one module each, behind one interface (``base``):

* ``sdpa`` — torch: gather each row's context from the paged cache, then
  ``scaled_dot_product_attention``; every device and dtype. The reference, and the fallback.
* ``cpu_paged`` — on the CPU in float32 or bfloat16: a C kernel attends decode rows and prefill
  chunks alike, reading the cache in place (a token's output the same bits in either).
* ``flashinfer`` — on CUDA where ``flashinfer`` is installed and supports the model: its paged
  decode and prefill kernels.

``select_backend`` picks one at start-up from what each supports and logs which runs and why the
better ones do not: a note where the model is outside what a backend has kernels for, a warning
where an installed FlashInfer is a version whose API Sluice does not call as it expects.
"""

from __future__ import annotations

import logging

import torch

from worker.attention.base import AttentionBackend, AttentionMetadata
from worker.attention.cpu_paged import CpuPagedBackend
from worker.attention.sdpa import SdpaBackend
from worker.kernels import cpu as cpu_kernels

__all__ = ["AttentionBackend", "AttentionMetadata", "CpuPagedBackend", "SdpaBackend", "select_backend"]

log = logging.getLogger("sluice.worker")


def select_backend(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                   block_size: int, sliding_window: int | None = None, softcap: float = 0.0) -> AttentionBackend:
    """CUDA: FlashInfer where it is installed and supports the model. CPU: the C decode kernel
    where it builds and supports the model. Elsewhere, and as the fallback: ``sdpa``."""
    backend: AttentionBackend | None = None
    why_not = ""
    level = logging.INFO
    if device.type == "cuda" and softcap:
        why_not = "FlashInfer is not planned with attention logit soft-capping here (Gemma 2)"
    elif device.type == "cuda":
        from worker.attention.flashinfer import (  # imports nothing of flashinfer's until asked
            FlashInferBackend,
            Refused,
        )

        made = FlashInferBackend.create(device, dtype, num_heads, num_kv_heads, head_dim, sliding_window)
        if isinstance(made, str):
            why_not = made
            level = logging.WARNING if isinstance(made, Refused) else logging.INFO
        else:
            backend = made
    elif device.type == "cpu":
        why_not = cpu_kernels.unsupported(dtype, num_heads, num_kv_heads, head_dim, block_size) or ""
        kernel = None if why_not else cpu_kernels.load()
        if kernel is not None:
            backend = CpuPagedBackend(kernel, device, sliding_window, softcap)
        elif not why_not:
            why_not = "the C kernels could not be built here"
    layers = f" ({sliding_window}-token window)" if sliding_window else ""  # Gemma 3: one line per kind of layer
    if backend is None:
        backend = SdpaBackend(device, sliding_window, softcap)
        if why_not:
            log.log(level, "attention backend%s: %s, because %s", layers, backend.name, why_not)
            return backend
    log.info("attention backend%s: %s", layers, backend.name)
    return backend
