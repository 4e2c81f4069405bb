"""Handing freed heap memory back to the system after a burst of allocations.

glibc keeps freed memory below its mmap threshold in the heap and returns only the heap's top on
its own. Loading a model makes and frees hundreds of MB of tensors (a GGUF file's unpacked codes,
the parts of a fused projection, each weight before it is packed): without a trim a quantized
SmolLM2 worker held 374 MiB of freed heap after load, and its load peaked 120 MiB higher than it
needs to (each packed weight allocated beside freed ones the heap kept). Building a tokenizer
from its JSON leaves 20 to 25 MiB of freed heap behind, in the frontend and in the worker."""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def return_freed_memory() -> None:
    """Give the heap's free pages back to the system (``malloc_trim``); a no-op without glibc."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
