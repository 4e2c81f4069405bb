"""How many CPU threads the worker's forward pass uses.

The frontend and scheduler run beside the worker. When an operator is small, an OpenMP thread
that finds its core taken by them stalls every other thread at the operator's barrier
(measured on 2 cores with the 2-layer ``tiny`` model: a 64-step decode took 1.6 s with 2
threads under load, 0.1 s with 1). When operators are big, the matrix multiplies dominate and
the second core is worth its barriers: a SmolLM2-135M decode step at 64 streams took 180 ms
with both cores of a 2-core machine, 298 ms with one (the worker's forward loop, no server). So the
default is every core for models of ``ALL_CORES_FROM_PARAMS`` parameters and more, one core
fewer below. ``--worker-threads N`` overrides it; ``OMP_NUM_THREADS``, when set, wins over both.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("sluice.worker")

ALL_CORES_FROM_PARAMS = 50_000_000


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def choose_cpu_threads(requested: int, num_params: int, cores: int | None = None) -> int:
    """Threads for a model of ``num_params`` parameters: ``requested`` when given (> 0)."""
    if requested > 0:
        return requested
    cores = available_cores() if cores is None else cores
    if num_params >= ALL_CORES_FROM_PARAMS:
        return cores
    return max(1, cores - 1)


def configure_cpu_threads(device: torch.device, requested: int, num_params: int) -> None:
    """Set torch's intra-op thread count for a CPU worker, and say what was chosen and why."""
    if device.type != "cpu":
        return
    if "OMP_NUM_THREADS" in os.environ:
        log.info("CPU threads: %d (OMP_NUM_THREADS)", torch.get_num_threads())
        return
    threads = choose_cpu_threads(requested, num_params)
    torch.set_num_threads(threads)
    why = "--worker-threads" if requested > 0 else f"{available_cores()} cores, {num_params / 1e6:.0f}M parameters"
    log.info("CPU threads: %d (%s)", threads, why)
