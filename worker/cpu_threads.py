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

Cores that other processes keep busy are not counted (``BusyCores``). An OpenMP barrier waits
for its slowest thread, and a thread whose core another process holds runs only when the
scheduler gives it a slice: on a 2-core machine beside two processes that each spin a core, a
SmolLM2 Q4_1 decode step at one row took 42 ms with two threads and 25 with one (in-process,
no server; 8.4 ms quiet with two). A bounded OpenMP spin (libgomp's ``GOMP_SPINCOUNT`` 10,000,
or ``OMP_WAIT_POLICY=PASSIVE``) did not help: 119 and 36 ms. So the plan watches how much CPU
time the machine spends beyond this process's own, and gives a step at most the cores left
over (at least one); the quarter of a core that the frontend, the scheduler and a client use
beside it changes nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path

import torch

log = logging.getLogger("sluice.worker")

ALL_CORES_FROM_PARAMS = 50_000_000
BIG_STEP_TOKENS = 256


class BusyCores:
    """How many cores other processes keep busy, averaged over time: the machine's CPU time
    (``/proc/stat``: every state but idle and I/O wait; a VM's stolen time counts as taken) less
    this process's own (``/proc/self/stat``), over each ``INTERVAL_S``, smoothed. Time, not a
    count of runnable threads at a moment: read at the end of a step, that count sees the
    frontend and the scheduler at work on the step's tokens, which use a few percent of a core."""

    INTERVAL_S = 0.25
    SMOOTHING = 0.5  # of each new reading

    def __init__(self, stat: Path = Path("/proc/stat"), own: Path = Path("/proc/self/stat")) -> None:
        self.stat, self.own = stat, own
        self.others = 0.0
        self._next = 0.0
        self._last: tuple[int, int, int] | None = None  # machine busy, machine total, own (clock ticks)

    def busy(self) -> int:
        """Cores other processes keep busy, rounded."""
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.INTERVAL_S
            reading = self.read()
            if reading is not None:
                self.others += self.SMOOTHING * (reading - self.others)
        return int(self.others + 0.5)

    def read(self) -> float | None:
        """Cores used by other processes since the last read; None at the first read or where
        /proc cannot say."""
        try:
            ticks = [int(v) for v in self.stat.read_text().split("\n", 1)[0].split()[1:]]
            own_fields = self.own.read_text().rsplit(")", 1)[1].split()
            own = int(own_fields[11]) + int(own_fields[12])  # utime, stime
        except (OSError, IndexError, ValueError):
            return None
        total = sum(ticks[:8])  # user nice system idle iowait irq softirq steal (guest is in user)
        busy = total - ticks[3] - ticks[4]
        last, self._last = self._last, (busy, total, own)
        if last is None or total <= last[1]:
            return None
        elapsed = (total - last[1]) / (os.cpu_count() or 1)  # ticks of wall time (the line sums every CPU)
        return max(0.0, ((busy - last[0]) - (own - last[2])) / elapsed)


@dataclasses.dataclass
class ThreadPlan:
    small: int  # threads for steps of fewer than BIG_STEP_TOKENS tokens
    big: int
    busy: BusyCores | None = None  # None: the counts stand (--worker-threads)
    machine_cores: int = 1  # all this process may run on: other ranks of its group are "other processes" too

    def for_step(self, num_tokens: int) -> int:
        threads = self.big if num_tokens >= BIG_STEP_TOKENS else self.small
        if self.busy is not None:
            threads = max(1, min(threads, self.machine_cores - self.busy.busy()))
        return threads

    def apply(self, num_tokens: int) -> None:
        """Set torch's thread count for a step of ``num_tokens`` tokens (a no-op when it is set)."""
        threads = self.for_step(num_tokens)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def choose_cpu_threads(requested: int, num_params: int, cores: int | None = None) -> ThreadPlan:
    """Threads for a model of ``num_params`` parameters on ``cores`` (this rank's share of the
    machine's): ``requested`` when given (> 0)."""
    if requested > 0:
        return ThreadPlan(requested, requested)
    cores = available_cores() if cores is None else cores
    small = cores if num_params >= ALL_CORES_FROM_PARAMS else max(1, cores - 1)
    return ThreadPlan(small, cores, BusyCores(), max(cores, available_cores()))


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
    fewer = "; fewer while other processes keep cores busy" if plan.busy is not None and cores > 1 else ""
    if requested > cores:
        fewer = (f"; more than the {cores} cores this worker may use: the threads take turns on them and every "
                 f"barrier waits for one that is not running, so steps are slower than with {cores}")
    if plan.small == plan.big:
        log.info("CPU threads: %d (%s%s)", plan.small, why, fewer)
    else:
        log.info("CPU threads: %d, %d for steps of %d+ tokens (%s%s)", plan.small, plan.big, BIG_STEP_TOKENS, why, fewer)
    return plan
