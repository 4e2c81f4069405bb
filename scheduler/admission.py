"""Admission: a waiting request becomes a running one with its first chunk in a step.

It counts only what the prefix cache does not already hold (vLLM's proposal for prefix-cache-aware admission): the blocks beyond its
cached prefix, and its uncached tokens against the step's budget. A fully cached prompt computes
only its last token, into a copy of its last cached block. A swapped-out request gets device
blocks and its host copy moved back in. If a seat, budget or blocks are short, it may preempt the
running requests ``eligible`` says it outranks — the fewest that do, and only if the admission
then surely succeeds. Seat caps per priority class (``--max-num-seqs-per-priority``) bind here.
"""

from __future__ import annotations

from collections.abc import Callable

from protocol.config import SchedulerConfig
from scheduler.block_pool import BlockPool
from scheduler.preemption import Preemptor
from scheduler.queues import RequestQueue
from scheduler.request import Request
from scheduler.running import RunningBatch
from scheduler.step import Step


class Admission:
    def __init__(self, config: SchedulerConfig, block_size: int, pool: BlockPool, host_pool: BlockPool | None,
                 queue: RequestQueue, running: RunningBatch, preemptor: Preemptor) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.seat_caps: dict[int, int] = dict(config.max_num_seqs_per_priority)  # min priority -> seats
        self.block_size = block_size
        self.pool = pool
        self.host_pool = host_pool
        self.queue = queue
        self.running = running
        self.preemptor = preemptor

    def admit(self, req: Request, step: Step, share: int, eligible: Callable[[Request], bool] | None) -> bool:
        """Move waiting ``req`` to running with a first chunk of at most ``share`` tokens.
        ``eligible`` says which running requests it may preempt for a seat, token budget or
        blocks (None: none). Nobody is preempted unless the admission then surely succeeds."""
        pool, block_size = self.pool, self.block_size
        hit: list[int] = []
        if req.is_swapped:
            cached = req.num_computed
        else:
            hit = req.cached_prefix(pool, block_size) if pool.enable_caching else []
            cached = len(hit) * block_size
        cow = not req.is_swapped and cached >= len(req.token_ids)  # all cached: compute the last token
        if cow:
            cached = len(req.token_ids) - 1
        victims = self.seat_victims(req, step, eligible)
        if victims is None:
            return False
        budget = step.budget + sum(step.tokens_of(v) for v in victims)
        n = min(len(req.token_ids) - cached, budget, share)
        if n <= 0:
            return False
        # Prefix hits are taken, not allocated: blocks among them that are free now (or that a
        # victim frees) do not count towards the free blocks the rest needs. A fully cached
        # prompt keeps all but its last hit, whose block is copied (so held for the step too).
        keep = hit[:-1] if cow else hit
        need = -(-(cached + n) // block_size) - len(keep)
        preemptor = self.preemptor
        short_of_blocks = need > preemptor.free_outside(hit)  # preempting seat victims only adds room
        if short_of_blocks and (eligible is None or not preemptor.could_free(need, hit, eligible)):
            return False
        for victim in victims:
            preemptor.preempt(victim, step)
        if short_of_blocks and not preemptor.make_room(need, hit, step, req, eligible or (lambda r: False)):
            raise AssertionError(f"request {req.request_id}: admission checked feasible, then short of blocks")
        self.queue.remove(req.rid)
        pool.take(hit)
        new = pool.allocate(need)
        if cow:
            step.copies.append((hit[-1], new[0]))
            step.copy_sources.append(hit[-1])
        if req.is_swapped:
            assert self.host_pool is not None
            step.swap_in.extend(zip(req.host_blocks, new, strict=False))
            step.swapped_in_from.extend(req.take_host_blocks())  # freed once the step is planned
        else:
            pool.record_lookup(len(req.token_ids), cached)
        req.admit(keep + new, cached)
        self.running.add(req)
        step.add(req, n)
        return True

    def seat_victims(self, req: Request, step: Step,
                     eligible: Callable[[Request], bool] | None) -> list[Request] | None:
        """The running requests ``req`` must preempt for a batch seat, a seat of its priority
        class and some token budget: least urgent first, the fewest that do. ``[]`` if none is
        needed, None if no eligible set suffices."""
        max_seqs = self.max_num_seqs
        rows, running, budget = len(step.rows), len(self.running), step.budget
        caps = {p: cap for p, cap in self.seat_caps.items() if req.priority >= p}
        held = {p: self.running.held[p] for p in caps}

        def short() -> bool:
            return (rows >= max_seqs or running >= max_seqs or budget <= 0
                    or any(held[p] >= cap for p, cap in caps.items()))

        if not short():
            return []
        if eligible is None:
            return None
        victims: list[Request] = []
        for r in reversed(self.running):
            if not short():
                break
            if not eligible(r):
                # Each ``eligible`` is "less urgent than" in an order ``running`` is sorted by
                # (the priority class leads the key of every policy that preempts by class), so
                # the eligible requests are a tail of ``running``: none is left before this one.
                break
            in_step = step.has(r)
            helps = (running >= max_seqs or (in_step and (rows >= max_seqs or budget <= 0))
                     or any(held[p] >= cap and r.priority >= p for p, cap in caps.items()))
            if not helps:
                continue
            victims.append(r)
            running -= 1
            if in_step:
                rows -= 1
                budget += step.tokens_of(r)
            for p in caps:
                held[p] -= r.priority >= p
        return None if short() else victims

    def class_full(self, req: Request) -> bool:
        """Does a seat cap of ``req``'s priority class hold it back?"""
        held = self.running.held
        return any(req.priority >= p and held[p] >= cap for p, cap in self.seat_caps.items())
