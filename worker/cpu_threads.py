"""How many CPU threads the worker's forward pass uses, per step.

The frontend and scheduler run beside the worker. When an operator is small, an OpenMP thread
that finds its core taken by them stalls every other thread at the operator's barrier
(measured on 2 cores with the 2-layer ``tiny`` model: a 64-step decode took 1.6 s with 2
threads under load, 0.1 s with 1; served decode at 16 and 64 streams was still 1.1-1.3x faster
with one thread). When operators are big, the matrix multiplies dominate and the second core is
worth its barriers: a SmolLM2-135M decode step at 64 streams took 180 ms with both cores of a
2-core machine, 298 ms with one (the worker's forward loop, no server), and a prefill step is
big for any model (``tiny`` serving mixed prompts of 32-512 tokens: 1.43x the output tokens/s
with both cores).

So models of ``ALL_CORES_FROM_PARAMS`` parameters and more use every core for every step;
smaller ones use one core fewer for their small steps and every core for steps that compute
``BIG_STEP_TOKENS`` tokens or more (``ThreadPlan``). ``--worker-threads N`` sets N for every
step; ``OMP_NUM_THREADS``, when set, wins over both. The k ranks of a tensor-parallel group
started on one machine take a k-th of its cores each (ranks on separate machines: pass
``--worker-threads``).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

log = logging.getLogger("sluice.worker")

ALL_CORES_FROM_PARAMS = 50_000_000
BIG_STEP_TOKENS = 256


@dataclasses.dataclass(frozen=True)
class ThreadPlan:
    small: int  # threads for steps of fewer than BIG_STEP_TOKENS tokens
    big: int

    def for_step(self, num_tokens: int) -> int:
        return self.big if num_tokens >= BIG_STEP_TOKENS else self.small

    def apply(self, num_tokens: int) -> None:
        """Set torch's thread count for a step of ``num_tokens`` tokens (a no-op when it is set)."""
        threads = self.for_step(num_tokens)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def choose_cpu_threads(requested: int, num_params: int, cores: int | None = None) -> ThreadPlan:
    """Threads for a model of ``num_params`` parameters: ``requested`` when given (> 0)."""
    if requested > 0:
        return ThreadPlan(requested, requested)
    cores = available_cores() if cores is None else cores
    if num_params >= ALL_CORES_FROM_PARAMS:
        return ThreadPlan(cores, cores)
    return ThreadPlan(max(1, cores - 1), cores)


def configure_cpu_threads(device: torch.device, requested: int, num_params: int, ranks: int = 1) -> ThreadPlan | None:
    """Set torch's intra-op thread count for a CPU worker (one of ``ranks`` tensor-parallel ranks
    sharing the machine's cores), and say what was chosen and why; returns the plan the runner
    follows per step (None: leave the count as it is)."""
    if device.type != "cpu":
        return None
    if "OMP_NUM_THREADS" in os.environ:
        log.info("CPU threads: %d (OMP_NUM_THREADS)", torch.get_num_threads())
        return None
    cores = max(1, available_cores() // ranks)
    plan = choose_cpu_threads(requested, num_params, cores)
    torch.set_num_threads(plan.small)
    share = f" of {available_cores()} for {ranks} ranks" if ranks > 1 else ""
    why = "--worker-threads" if requested > 0 else f"{cores} cores{share}, {num_params / 1e6:.0f}M parameters"
    if plan.small == plan.big:
        log.info("CPU threads: %d (%s)", plan.small, why)
    else:
        log.info("CPU threads: %d, %d for steps of %d+ tokens (%s)", plan.small, plan.big, BIG_STEP_TOKENS, why)
    return plan
