"""Making room in the KV cache: paused requests give their blocks back first, then running ones
are preempted, least urgent and latest arrived first (vLLM's guide to preemption and chunked prefill).

How a preempted request gives up its KV is a strategy (``--preemption-mode``): ``Recompute``
frees its blocks and computes its tokens again when it next runs; ``Swap`` copies its blocks to
host memory and back (falling back to recompute where that cannot apply). A preempted request
keeps its place in line (its arrival time), so it resumes before later arrivals of its priority.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from scheduler.block_pool import BlockPool
from scheduler.queues import RequestQueue
from scheduler.request import Request, Status
from scheduler.running import RunningBatch
from scheduler.step import Step

log = logging.getLogger("sluice.scheduler")


class Recompute:
    """The request's blocks are freed; prompt and outputs are computed again when it next runs."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    def evict(self, req: Request, step: Step, settled: bool) -> str:
        self.pool.free(req.preempt())
        return "recompute"


class Swap(Recompute):
    """The request's blocks are copied to host memory (the worker does it before the step's
    forward pass) and back when it resumes. Only KV that is ``settled`` is swapped: a request
    already in this step (perhaps swapped in by it) is recomputed instead, since the step's copies
    run before its forward pass; so is one whose copy does not fit in host memory, and one still
    scoring its prompt (its scores so far live in the worker's state of it, which a swap-in
    rebuilds: it must compute every prompt position again)."""

    def __init__(self, pool: BlockPool, host_pool: BlockPool) -> None:
        super().__init__(pool)
        self.host_pool = host_pool
        self.num_swaps = 0

    def evict(self, req: Request, step: Step, settled: bool) -> str:
        if not (settled and self.host_pool.can_allocate(len(req.blocks))) or req.sampling.every_position:
            return super().evict(req, step, settled)
        host_blocks = self.host_pool.allocate(len(req.blocks))
        step.swap_out.extend(zip(req.blocks, host_blocks, strict=True))
        self.pool.free(req.swap_out(host_blocks))
        self.num_swaps += 1
        return "swap"


class Preemptor:
    """Frees blocks for whoever needs them, taking them from ``paused`` and ``running``; a
    preempted request goes back to ``queue``. ``forget(rid)``: the worker must drop that
    request's state in the next plan."""

    def __init__(self, pool: BlockPool, strategy: Recompute, running: RunningBatch, paused: dict[int, Request],
                 queue: RequestQueue, forget: Callable[[int], None]) -> None:
        self.pool = pool
        self.strategy = strategy
        self.running = running
        self.paused = paused
        self.queue = queue
        self.forget = forget
        self.num_preemptions = 0

    def free_outside(self, keep: list[int] | tuple[()]) -> int:
        """Free blocks an allocation can use: those not among the prefix hits ``keep``."""
        return self.pool.num_free - self.pool.num_free_among(keep) if keep else self.pool.num_free

    def could_free(self, need: int, keep: list[int], eligible: Callable[[Request], bool]) -> bool:
        """Would preempting every eligible running request (and reclaiming paused ones) free
        ``need`` blocks outside ``keep``? Checked first, so nobody is preempted for an admission
        that fails."""
        keep_set = set(keep)
        freeable = self.free_outside(keep)
        for r in (*self.running, *self.paused.values()):
            if r.status is Status.PAUSED or eligible(r):
                freeable += sum(1 for b in r.blocks if self.pool.ref_count(b) == 1 and b not in keep_set)
        return freeable >= need

    def make_room(self, need: int, keep: list[int] | tuple[()], step: Step, beneficiary: Request,
                  eligible: Callable[[Request], bool]) -> bool:
        """Free blocks until ``need`` can be allocated besides ``keep``: paused requests first,
        then the least urgent eligible running requests. False if that is not enough."""
        while need > self.free_outside(keep):
            paused = next((r for r in self.paused.values() if r.blocks), None)
            if paused is not None:
                self.release_paused(paused)
                continue
            victim = next((r for r in reversed(self.running) if r is not beneficiary and eligible(r)), None)
            if victim is None:
                return False
            self.preempt(victim, step)
        return True

    def release_paused(self, req: Request) -> None:
        """Memory is short: a paused request gives its blocks back and will recompute on resume."""
        if req.on_worker:
            self.forget(req.rid)
        self.pool.free(req.drop_kv())

    def preempt(self, req: Request, step: Step) -> None:
        settled = not step.has(req) and req.num_computed > 0
        self.running.remove(req)
        step.drop(req)
        if req.on_worker:
            self.forget(req.rid)
        mode = self.strategy.evict(req, step, settled)
        self.queue.push(req)
        self.num_preemptions += 1
        log.warning(
            "request %s preempted (%s) for lack of KV cache blocks or batch seats; %d preemptions so far. "
            "This costs throughput and latency: raise --num-kv-blocks / --kv-cache-memory, or lower "
            "--max-num-seqs / --max-num-batched-tokens.", req.request_id, mode, self.num_preemptions)
