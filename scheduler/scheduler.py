"""The scheduling core: which requests run each step, and what they cost. No torch, no sockets.

One step, under one token budget (``max_num_batched_tokens``) and ``max_num_seqs`` rows:

1. **cut-ins** — requests an operator pushed to the front are admitted first, preempting the
   fewest strictly less urgent running requests they need;
2. **decodes** — running requests with one token left to compute, most urgent first;
3. **prefills** — running requests mid-prompt, then waiting ones in the policy's order. The
   prefill budget left after decodes is split so that at least ``min_concurrent_prefills``
   prompts advance when that many exist (seed 000); ``long_prefill_threshold`` caps one chunk;
   the last prompt that does not fit is chunked. Admission counts only the blocks and tokens the
   prefix cache does not already hold (seed 003). A waiting request that cannot get blocks or a
   seat preempts the fewest strictly less urgent running requests, if ``priority_preemption``
   (seed 001) — otherwise it waits;
4. **blocks** — if the pool runs dry for a running request, paused requests give their blocks back
   first, then the least urgent, latest-arrived running request not yet scheduled is preempted
   (``recompute`` or ``swap``, seed 004);
5. **multi-step** — when every row samples in this step and no admissible prompt was left out
   for lack of token budget, the plan covers ``num_scheduler_steps`` steps, with look-ahead blocks
   reserved for the extra tokens (seed 002).

Every step moves each row's computed count toward its token count; chunked prefill, prefix hits
and decode are the same rule. Tokens reported by the worker then append outputs and apply stops.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections.abc import Callable

from protocol.config import SchedulerConfig
from protocol.messages import (
    AddRequest,
    Finish,
    FinishReason,
    NewRequest,
    StepPlan,
    StepTokens,
    TokenBatch,
)
from protocol.stop import length_reached
from scheduler.block_pool import BlockPool
from scheduler.queues import make_queue
from scheduler.request import Request, Status

log = logging.getLogger("sluice.scheduler")


class _Step:
    """One step's plan in the making: its rows, the token budget they leave, and the block moves
    the worker makes before the forward pass. ``rows`` maps each row's request to the tokens it
    computes, in the order scheduled: membership, a row's tokens and dropping a row are O(1)."""

    __slots__ = ("budget", "copies", "copy_sources", "rows", "swap_in", "swap_out")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.rows: dict[Request, int] = {}
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.copies: list[tuple[int, int]] = []
        # Copy-on-write sources held for the step: the worker copies after its swap-ins, so a
        # source another admission could allocate (as a swap-in target) must stay taken.
        self.copy_sources: list[int] = []

    def add(self, req: Request, num_tokens: int) -> None:
        self.rows[req] = num_tokens
        self.budget -= num_tokens

    def has(self, req: Request) -> bool:
        return req in self.rows

    def tokens_of(self, req: Request) -> int:
        return self.rows.get(req, 0)

    def drop(self, req: Request) -> None:
        self.budget += self.rows.pop(req, 0)


@dataclasses.dataclass(slots=True)
class _PlanInFlight:
    rids: list[int]
    num_steps: int
    speculative: bool
    steps_seen: int = 0  # steps whose tokens have arrived


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int, max_model_len: int,
                 eos_token_ids: list[int], first_plan_id: int = 0) -> None:
        self.config = config
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.pool = BlockPool(num_blocks, enable_caching=config.enable_prefix_caching)
        host_blocks = min(config.num_host_blocks or num_blocks, num_blocks)
        self.host_pool = BlockPool(host_blocks) if config.preemption_mode == "swap" else None
        self.queue = make_queue(config.scheduling_policy)
        # fcfs ignores priorities: a waiting request preempts nobody there.
        self.preempts_by_priority = config.priority_preemption and config.scheduling_policy != "fcfs"
        self.seat_caps: dict[int, int] = dict(config.max_num_seqs_per_priority)  # min priority -> seats
        self.key = self.queue.key  # urgency order: smaller is more urgent
        self.running: list[Request] = []  # sorted by ``key``
        self.paused_requests: dict[int, Request] = {}
        self.requests: dict[int, Request] = {}
        self._cut_ins: list[Request] = []
        # n > 1: choices waiting for their first sibling's prompt KV (by that sibling's rid).
        self._held: dict[int, list[Request]] = {}
        self._forget: list[int] = []  # rids whose worker state must go in the next plan
        # Plans sent and not finished (at most two: one running, one speculative behind it),
        # with their rows. Those rows' tokens count even if they were paused meanwhile: the
        # worker stops them at its next step boundary, not at once.
        self.in_flight: dict[int, _PlanInFlight] = {}
        self._next_plan_id = first_plan_id  # a core replacing another goes on from its plan ids
        self.paused = False
        self.num_preemptions = 0
        self.num_swaps = 0
        self.num_steps_run = 0

    # ------------------------------------------------------------------ requests in and out

    def add(self, msg: AddRequest) -> list[Finish]:
        """Queue the request's ``msg.n`` choices; returns their error finishes if they can never
        run here (then none is queued)."""
        num_prompt = len(msg.prompt_token_ids)
        total = num_prompt + msg.sampling.max_tokens
        rids = range(msg.rid, msg.rid + msg.n)
        reason = None
        if total > self.max_model_len:
            reason = f"prompt + max_tokens = {total} exceeds the max model length {self.max_model_len}"
        elif self._blocks_for(total) > self.pool.num_blocks:
            reason = (f"needs {self._blocks_for(total)} KV blocks, the cache has {self.pool.num_blocks}; "
                      f"raise --num-kv-blocks or lower max_tokens")
        elif any(rid in self.requests for rid in rids):
            reason = f"duplicate request rid {msg.rid}"
        if reason:
            return [Finish(rid, FinishReason.ERROR, num_prompt, 0, 0, reason) for rid in rids]
        first = Request(msg)
        self.requests[first.rid] = first
        self.queue.push(first)
        for choice in range(1, msg.n):
            req = Request(msg, choice)
            self.requests[req.rid] = req
            if self.pool.enable_caching:  # it waits to find the first choice's prompt blocks cached
                self._held.setdefault(first.rid, []).append(req)
            else:
                self.queue.push(req)
        return []

    def _release_held(self, req: Request) -> None:
        """``req``'s prompt is computed (or it is gone): the choices waiting on it may start,
        finding its full prompt blocks in the prefix cache."""
        for held in self._held.pop(req.rid, []):
            self.queue.push(held)

    def abort(self, rid: int, reason: str = FinishReason.ABORT, message: str = "") -> Finish | None:
        """End a live request now (a client or an operator aborted it; ``reason`` ERROR: the
        engine could not go on with it); None if it is not live."""
        req = self.requests.get(rid)
        if req is None:
            return None
        self._detach(req)
        return self._finish(req, reason, message)

    @property
    def last_plan_id(self) -> int:
        return self._next_plan_id

    def rids_on_worker(self) -> list[int]:
        """Requests whose state the worker holds or has yet to be told to drop."""
        return [r.rid for r in self.requests.values() if r.on_worker] + self._forget

    def forget_on_worker(self, rids: list[int]) -> None:
        """Have the next plan tell the worker to drop these requests' state."""
        self._forget.extend(rids)

    def _detach(self, req: Request) -> None:
        """Take ``req`` out of whichever collection holds it."""
        self.queue.remove(req.rid)
        if req.after is not None and req in self._held.get(req.after, ()):
            self._held[req.after].remove(req)
        self.paused_requests.pop(req.rid, None)
        if req.status is Status.RUNNING:
            self.running.remove(req)
        if req in self._cut_ins:
            self._cut_ins.remove(req)

    def _finish(self, req: Request, reason: str, message: str = "") -> Finish:
        self._release_held(req)
        if req.on_worker:
            self._forget.append(req.rid)
        if self.host_pool is not None and req.host_blocks:
            self.host_pool.free(req.host_blocks)
            req.host_blocks = []
        self.pool.free(req.finish(reason))
        del self.requests[req.rid]
        queue_s = (req.scheduled_at - req.arrival_time) if req.scheduled_at else 0.0
        return Finish(req.rid, reason, req.num_prompt_tokens, req.num_cached_tokens, req.num_outputs, message,
                      queue_s, req.num_preemptions)

    def finish_all(self, reason: str, message: str) -> list[Finish]:
        """End every live request (the engine failed)."""
        finishes = []
        for req in list(self.requests.values()):
            self._detach(req)
            finishes.append(self._finish(req, reason, message))
        return finishes

    def recompute_all(self) -> int:
        """The worker was lost with every KV block and swapped-out copy it held: each live
        request goes back in line (keeping its arrival time) to be recomputed from its prompt
        and the tokens it has already produced, so its stream simply continues. Paused requests
        stay paused. Returns how many requests were live."""
        for req in self.requests.values():
            paused = req.status is Status.PAUSED
            if req.status is Status.RUNNING:
                self.running.remove(req)
            elif req.rid in self.queue:
                self.queue.remove(req.rid)
            if self.host_pool is not None and req.host_blocks:
                self.host_pool.free(req.host_blocks)
                req.host_blocks = []
            if req.blocks or req.num_computed or req.on_worker:
                self.pool.free(req.reset_for_recompute())
            if paused:
                req.status = Status.PAUSED
            elif not self._is_held(req):
                req.status = Status.PREEMPTED if req.num_outputs else Status.WAITING
                self.queue.push(req)
        self.pool.reset_cache()  # the blocks' contents died with the worker
        self._cut_ins.clear()
        self._forget.clear()  # the new worker holds no state to drop
        self.in_flight.clear()
        return len(self.requests)

    def _is_held(self, req: Request) -> bool:
        return req.after is not None and req in self._held.get(req.after, ())

    @property
    def has_work(self) -> bool:
        return not self.paused and bool(self.running or len(self.queue))

    # ------------------------------------------------------------------ controls

    def pause(self, rid: int) -> bool:
        """Stop scheduling ``rid``; a running request keeps its blocks (and worker state)."""
        req = self.requests.get(rid)
        if req is None or req.status is Status.PAUSED:
            return False
        self._detach(req)
        req.status = Status.PAUSED
        self.paused_requests[rid] = req
        return True

    def resume(self, rid: int) -> bool:
        req = self.paused_requests.pop(rid, None)
        if req is None:
            return False
        if req.blocks:  # kept: carry on where it stopped, nothing recomputed
            req.status = Status.RUNNING
            bisect.insort(self.running, req, key=self.key)
        else:
            req.status = Status.PREEMPTED if req.num_outputs or req.is_swapped else Status.WAITING
            self.queue.push(req)
        return True

    def set_priority(self, rid: int, priority: int, cut_in: bool = False) -> bool:
        req = self.requests.get(rid)
        if req is None:
            return False
        if req.status is Status.PAUSED and cut_in:
            self.resume(rid)
        in_queue = rid in self.queue
        if in_queue:
            self.queue.remove(rid)
        if req.status is Status.RUNNING:
            self.running.remove(req)
        req.priority = priority
        if in_queue:
            self.queue.push(req)
            if cut_in and req not in self._cut_ins:
                req.cut_in = True
                self._cut_ins.append(req)
        if req.status is Status.RUNNING:
            bisect.insort(self.running, req, key=self.key)
        return True

    def plans_with(self, rid: int) -> list[int]:
        """Ids of the plans in flight that have ``rid`` as a row."""
        return [pid for pid, plan in self.in_flight.items() if rid in plan.rids]

    def summary(self, req: Request) -> dict[str, object]:
        """What the admin API shows of a request. ``in_flight``: it is in a plan the worker
        runs, so a pause or abort is still reaching the worker's next step boundary."""
        return req.summary(self.block_size) | {"in_flight": bool(self.plans_with(req.rid))}

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_cache()

    # ------------------------------------------------------------------ one step

    def schedule(self) -> StepPlan | None:
        if not self.has_work:
            return None
        step = _Step(self.config.max_num_batched_tokens)
        for req in list(self._cut_ins):
            self._cut_ins.remove(req)
            req.cut_in = False
            if req.rid in self.queue:
                self._admit(req, step, step.budget, self._less_urgent_than(req))
        decodes, prefills = self._split_running(step)
        self._schedule_decodes(decodes, step)
        self._prefill(step, prefills, self._prefill_share(step.budget, len(prefills)))
        if not step.rows:
            return None
        return self._emit(step)

    def _split_running(self, step: _Step) -> tuple[list[Request], list[Request]]:
        """The running requests not yet in ``step``, in urgency order: those with one token left
        to compute (decodes) and those with more (prefills, or recomputes)."""
        decodes, prefills = [], []
        rows = step.rows
        for req in self.running:
            if req in rows:
                continue
            uncomputed = len(req.token_ids) - req.num_computed
            if uncomputed == 1:
                decodes.append(req)
            elif uncomputed > 1:
                prefills.append(req)
        return decodes, prefills

    def _schedule_decodes(self, decodes: list[Request], step: _Step) -> None:
        """One token for each request in ``decodes``, most urgent first. This loop runs for every
        decoding request at every step, and most of them (a seat and budget left, room left in
        the last block) need only their row: that case is ``_continue``'s, done inline."""
        running, max_seqs, block_size = Status.RUNNING, self.config.max_num_seqs, self.block_size
        rows = step.rows
        for req in decodes:
            if step.budget <= 0 or len(rows) >= max_seqs:
                return  # nobody else gets a row either
            if req.status is running and req.num_computed < len(req.blocks) * block_size:
                step.add(req, 1)
            else:
                self._continue(req, 1, step)  # a new block, perhaps preempting; or not running

    def _less_urgent_than(self, req: Request) -> Callable[[Request], bool]:
        key = self.key(req)
        return lambda other: self.key(other) > key

    @staticmethod
    def _outranked_by(req: Request) -> Callable[[Request], bool]:
        """Whom a waiting request may preempt: running requests of a strictly less urgent
        priority class. Not arrival order: two requests of one class never displace each other
        (under ``fair``, the queue's order among them is by service, which must not thrash)."""
        priority = req.priority
        return lambda other: other.priority > priority

    def _seats_full(self, step: _Step) -> bool:
        return len(step.rows) >= self.config.max_num_seqs

    def _continue(self, req: Request, n: int, step: _Step) -> None:
        """Schedule ``n`` more tokens of a running request, preempting to make room if it needs
        blocks the pool does not have."""
        if req.status is not Status.RUNNING or self._seats_full(step):
            return
        n = min(n, step.budget)
        if n == 0:
            return
        need = self._blocks_for(req.num_computed + n) - len(req.blocks)
        if need > 0 and not self._grow(req, need, step):
            return
        step.add(req, n)

    def _grow(self, req: Request, need: int, step: _Step) -> bool:
        """Give running ``req`` ``need`` more blocks, preempting less urgent running requests not
        in this step if the pool is short. If even that is not enough, ``req`` is preempted
        itself and False returned."""
        if need > self.pool.num_free:  # short: only now is it worth building the victim filter
            less_urgent = self._less_urgent_than(req)
            if not self._make_room(need, (), step, req, lambda r: not step.has(r) and less_urgent(r)):
                self._preempt(req, step)
                return False
        req.blocks.extend(self.pool.allocate(need))
        return True

    def _prefill_share(self, budget: int, num_running_prefills: int) -> int:
        """Most tokens one prompt may take this step (seed 000: split across k prompts)."""
        cap = self.config.long_prefill_threshold or budget
        k = self.config.min_concurrent_prefills
        if k > 1:
            candidates = num_running_prefills + len(self.queue)
            cap = min(cap, budget // max(1, min(k, candidates)))
        return max(1, cap)

    def _prefill(self, step: _Step, prefills: list[Request], share: int) -> None:
        """Running prompts mid-prefill and waiting requests, most urgent first: a long prompt
        being prefilled in chunks does not hold off a more urgent arrival until it is done.

        Admission is head-of-line (a later arrival never overtakes a request waiting for room),
        except past a request its priority class's seat cap holds back: that one waits aside."""
        capped: list[Request] = []
        i, admitting = 0, True
        while True:
            head = self.queue.peek() if admitting else None
            if i < len(prefills) and (head is None or self.key(prefills[i]) <= self.key(head)):
                req = prefills[i]
                i += 1
                self._continue(req, min(req.num_uncomputed, share), step)
                continue
            if head is None:
                break
            eligible = self._outranked_by(head) if self.preempts_by_priority else None
            if self._admit(head, step, share, eligible):
                continue
            if self.seat_caps and self._class_full(head):
                capped.append(self.queue.pop())  # it waits for its class; the rest may go on
            else:
                admitting = False
        for req in capped:
            self.queue.push(req)

    def _admit(self, req: Request, step: _Step, share: int,
               eligible: Callable[[Request], bool] | None) -> bool:
        """Move a waiting request to running with its first chunk. ``eligible`` says which running
        requests it may preempt for a seat, token budget or blocks (None: none). Nobody is
        preempted unless the admission then surely succeeds."""
        hit: list[int] = []
        if req.is_swapped:
            cached = req.num_computed
        else:
            hit = req.cached_prefix(self.pool, self.block_size) if self.pool.enable_caching else []
            cached = len(hit) * self.block_size
        cow = not req.is_swapped and cached >= len(req.token_ids)  # all cached: compute the last token
        if cow:
            cached = len(req.token_ids) - 1
        victims = self._seat_victims(req, step, eligible)
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
        need = self._blocks_for(cached + n) - len(keep)
        short_of_blocks = need > self._free_outside(hit)  # preempting seat victims only adds room
        if short_of_blocks and (eligible is None or not self._could_free(need, hit, eligible)):
            return False
        for victim in victims:
            self._preempt(victim, step)
        if short_of_blocks and not self._make_room(need, hit, step, req, eligible or (lambda r: False)):
            raise AssertionError(f"request {req.request_id}: admission checked feasible, then short of blocks")
        self.queue.remove(req.rid)
        self.pool.take(hit)
        new = self.pool.allocate(need)
        if cow:
            step.copies.append((hit[-1], new[0]))
            step.copy_sources.append(hit[-1])
        if req.is_swapped:
            assert self.host_pool is not None
            step.swap_in.extend(zip(req.host_blocks, new, strict=False))
            self.host_pool.free(req.host_blocks)
            req.host_blocks = []
        else:
            self.pool.record_lookup(len(req.token_ids), cached)
            if req.num_preemptions == 0:
                req.num_cached_tokens = cached
        req.blocks = keep + new
        req.num_computed = cached
        if req.scheduled_at is None:
            req.scheduled_at = time.time()
        req.status = Status.RUNNING
        bisect.insort(self.running, req, key=self.key)
        step.add(req, n)
        return True

    def _seat_victims(self, req: Request, step: _Step,
                      eligible: Callable[[Request], bool] | None) -> list[Request] | None:
        """The running requests ``req`` must preempt for a batch seat, a seat of its priority
        class (``--max-num-seqs-per-priority``) and some token budget: least urgent first, the
        fewest that do. ``[]`` if none is needed, None if no eligible set suffices."""
        max_seqs = self.config.max_num_seqs
        rows, running, budget = len(step.rows), len(self.running), step.budget
        caps = {p: cap for p, cap in self.seat_caps.items() if req.priority >= p}
        held = {p: self._seats_held(p) for p in caps}

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

    def _class_full(self, req: Request) -> bool:
        """Does a seat cap of ``req``'s priority class hold it back?"""
        return any(req.priority >= p and self._seats_held(p) >= cap for p, cap in self.seat_caps.items())

    def _seats_held(self, min_priority: int) -> int:
        """Running requests in the capped class ``priority >= min_priority``."""
        return sum(1 for r in self.running if r.priority >= min_priority)

    # ------------------------------------------------------------------ making room

    def _free_outside(self, keep: list[int] | tuple[()]) -> int:
        """Free blocks an allocation can use: those not among the prefix hits ``keep``."""
        return self.pool.num_free - self.pool.num_free_among(keep) if keep else self.pool.num_free

    def _could_free(self, need: int, keep: list[int], eligible: Callable[[Request], bool]) -> bool:
        """Would preempting every eligible running request (and reclaiming paused ones) free
        ``need`` blocks outside ``keep``? Checked first, so nobody is preempted for an admission
        that fails."""
        keep_set = set(keep)
        freeable = self._free_outside(keep)
        for r in (*self.running, *self.paused_requests.values()):
            if r.status is Status.PAUSED or eligible(r):
                freeable += sum(1 for b in r.blocks if self.pool.ref_count(b) == 1 and b not in keep_set)
        return freeable >= need

    def _make_room(self, need: int, keep: list[int] | tuple[()], step: _Step, beneficiary: Request,
                   eligible: Callable[[Request], bool]) -> bool:
        """Free blocks until ``need`` can be allocated besides ``keep``: paused requests first,
        then the least urgent eligible running requests. False if that is not enough."""
        while need > self._free_outside(keep):
            paused = next((r for r in self.paused_requests.values() if r.blocks), None)
            if paused is not None:
                self._release_paused(paused)
                continue
            victim = next((r for r in reversed(self.running) if r is not beneficiary and eligible(r)), None)
            if victim is None:
                return False
            self._preempt(victim, step)
        return True

    def _release_paused(self, req: Request) -> None:
        """Memory is short: a paused request gives its blocks back and will recompute on resume."""
        if req.on_worker:
            self._forget.append(req.rid)
        self.pool.free(req.reset_for_recompute())
        req.status = Status.PAUSED

    def _preempt(self, req: Request, step: _Step) -> None:
        # Swap only KV that is settled: a request already in this step (perhaps swapped in by
        # it) is recomputed instead, since the step's copies run before its forward pass.
        swappable = not step.has(req) and req.num_computed > 0
        self.running.remove(req)
        step.drop(req)
        if step.copies:  # a copy into its blocks must not land in their next owner's
            mine = set(req.blocks)
            step.copies = [(src, dst) for src, dst in step.copies if dst not in mine]
        if req.on_worker:
            self._forget.append(req.rid)
        host = self.host_pool
        if host is not None and swappable and host.can_allocate(len(req.blocks)):
            host_blocks = host.allocate(len(req.blocks))
            step.swap_out.extend(zip(req.blocks, host_blocks, strict=True))
            self.pool.free(req.swap_out(host_blocks))
            self.num_swaps += 1
            mode = "swap"
        else:
            self.pool.free(req.reset_for_recompute())
            mode = "recompute"
        self.queue.push(req)
        self.num_preemptions += 1
        log.warning(
            "request %s preempted (%s) for lack of KV cache blocks or batch seats; %d preemptions so far. "
            "This costs throughput and latency: raise --num-kv-blocks / --kv-cache-memory, or lower "
            "--max-num-seqs / --max-num-batched-tokens.", req.request_id, mode, self.num_preemptions)

    # ------------------------------------------------------------------ the plan

    def _num_steps(self, step: _Step) -> int:
        """Multi-step unless prefill work would wait for the window: a prompt still mid-prefill,
        or waiting prompts that only this step's token budget kept out. Prompts waiting for
        blocks or seats do not stop it (they could not start sooner anyway): new arrivals then
        wait at most one window, and the first step of every plan admits what fits."""
        steps = self.config.num_scheduler_steps
        if steps == 1 or self._cut_ins:
            return 1
        if any(n != req.num_uncomputed for req, n in step.rows.items()):
            return 1  # a prompt is still mid-prefill: come back after one step
        if len(self.queue) and step.budget <= 0 and not self._seats_full(step):
            return 1  # more prompts fit next step
        return steps

    def _reserve_lookahead(self, step: _Step, steps: int) -> int:
        """Blocks for the tokens steps 2..n will compute; fall back to one step if they don't fit."""
        wants = []
        for req, n in step.rows.items():
            cover = min(req.num_computed + n + steps - 1, req.max_total_tokens(self.max_model_len))
            wants.append(max(0, self._blocks_for(cover) - len(req.blocks)))
        if not self.pool.can_allocate(sum(wants)):
            return 1
        for req, want in zip(step.rows, wants, strict=True):
            if want:
                req.blocks.extend(self.pool.allocate(want))
        return steps

    def _emit(self, step: _Step) -> StepPlan:
        steps = self._num_steps(step)
        if steps > 1:
            steps = self._reserve_lookahead(step, steps)
        rows = step.rows
        rids = [req.rid for req in rows]
        new_requests = [self._new_request(req) for req in rows if not req.on_worker]
        new_blocks = []
        forget, self._forget = self._forget, []
        caching, block_size = self.pool.enable_caching, self.block_size
        held = self._held
        counts_service = self.queue.counts_service
        for req, n in rows.items():
            new_blocks.append(req.blocks[req.worker_blocks :])
            req.worker_blocks = len(req.blocks)
            if caching and req.num_computed % block_size + n >= block_size:  # it fills a block
                self._register_full_blocks(req, n)
            req.num_computed += n
            if held and req.rid in held and req.num_computed >= req.num_prompt_tokens:
                self._release_held(req)
            if counts_service:
                self.queue.charge(req.user, n)
        self.pool.free(step.copy_sources)  # the copies are in the plan: later plans run after them
        self._next_plan_id += 1
        self.num_steps_run += steps
        self.in_flight[self._next_plan_id] = _PlanInFlight(rids, steps, speculative=False)
        return StepPlan(self._next_plan_id, new_requests, rids, list(rows.values()), new_blocks, steps, forget,
                        step.swap_out, step.swap_in, step.copies)

    @staticmethod
    def _new_request(req: Request) -> NewRequest:
        """What the worker (re)builds ``req`` from: everything known so far."""
        req.on_worker = True
        req.worker_blocks = 0
        # Not copied: the plan is encoded as soon as it is made, before any token is appended.
        return NewRequest(req.rid, req.token_ids, req.num_prompt_tokens, req.sampling, req.num_computed)

    def _register_full_blocks(self, req: Request, n: int) -> None:
        """Blocks this step fills completely become findable by later requests' prefixes."""
        if not self.pool.enable_caching:
            return
        block_size = self.block_size
        first = req.num_computed // block_size
        last = min(req.num_computed + n, len(req.token_ids)) // block_size
        if last > first:
            links = req.block_links(first, last, block_size)
            for i, link in enumerate(links, first):
                self.pool.register(req.blocks[i], link, req.block_keys[i])

    def continue_plan(self) -> StepPlan | None:
        """Async scheduling: the next decode window of the plan in flight, made before its
        tokens arrive, so the worker starts it the moment the current one ends.

        Only a pure continuation qualifies: one multi-step plan in flight, nobody waiting, no
        cut-in, server not paused. Each row is assumed to run the whole current window; rows
        that surely stop in it (max_tokens, the model length) are left out, and a row that stops
        on a token (or is aborted) meanwhile is skipped by the worker. Its rows advance as
        their tokens arrive (see ``update``)."""
        if len(self.in_flight) != 1 or self.paused or len(self.queue) or self._cut_ins:
            return None
        current = next(iter(self.in_flight.values()))
        steps = current.num_steps
        if steps <= 1:
            return None
        ahead = steps - current.steps_seen  # tokens each row still gets from the current plan
        rows: list[Request] = []
        wants: list[int] = []
        for rid in current.rids:
            req = self.requests.get(rid)
            if req is None or req.status is not Status.RUNNING:
                continue
            known = len(req.token_ids) + ahead
            if length_reached(req.num_outputs + ahead, known, req.sampling, self.max_model_len):
                continue  # the current window's last token surely ends it
            cover = min(known - 1 + steps, req.max_total_tokens(self.max_model_len))
            rows.append(req)
            wants.append(max(0, self._blocks_for(cover) - len(req.blocks)))
        if not rows or not self.pool.can_allocate(sum(wants)):
            return None
        new_blocks = []
        for req, want in zip(rows, wants, strict=True):
            req.blocks.extend(self.pool.allocate(want))
            new_blocks.append(req.blocks[req.worker_blocks :])
            req.worker_blocks = len(req.blocks)
        self._next_plan_id += 1
        self.num_steps_run += steps
        rids = [r.rid for r in rows]
        self.in_flight[self._next_plan_id] = _PlanInFlight(rids, steps, speculative=True)
        return StepPlan(self._next_plan_id, [], rids, [1] * len(rows), new_blocks, steps, speculative=True)

    # ------------------------------------------------------------------ results

    def update(self, out: StepTokens, batch: TokenBatch | None = None) -> TokenBatch:
        """Apply a step's tokens: append them, apply stops, free what finished; returns what the
        frontends must hear. It is added to ``batch`` (a new one if None) as it is decided, so
        that if this raises midway, the caller still has what was done so far (finishes whose
        blocks are already free)."""
        if batch is None:
            batch = TokenBatch([], [], [], out.logprobs)
        plan = self.in_flight.get(out.plan_id)
        # A speculative plan's first step also computes a token the scheduler has not counted:
        # it was planned before the previous plan's last token arrived.
        computes_previous = out.step > 0 or (plan is not None and plan.speculative)
        rids, tokens, finished, started = batch.rids, batch.token_ids, batch.finished, batch.started
        requests, running = self.requests, Status.RUNNING  # (an Enum member lookup is slow on 3.11)
        eos_token_ids, max_model_len = self.eos_token_ids, self.max_model_len
        for rid, token in zip(out.rids, out.token_ids, strict=True):
            req = requests.get(rid)
            if req is None or not (req.status is running
                                   or (req.status is Status.PAUSED and plan is not None and rid in plan.rids)):
                continue  # finished or preempted while the plan ran: its tokens are void
            if computes_previous:
                self._register_full_blocks(req, 1)
                req.advance(1)  # the worker computed the token it sampled last step
                if self.queue.counts_service:
                    self.queue.charge(req.user, 1)
            reason = req.add_output(token, eos_token_ids, max_model_len)
            rids.append(rid)
            tokens.append(token)
            if len(req.token_ids) == req.num_prompt_tokens + 1:
                started.append((rid, req.num_cached_tokens))
            if reason is not None:
                self._detach(req)
                finished.append(self._finish(req, reason))
        if plan is not None:
            plan.steps_seen = out.step + 1
            if out.last:
                del self.in_flight[out.plan_id]
        return batch

    # ------------------------------------------------------------------ helpers

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def stats(self) -> dict[str, object]:
        used = self.pool.num_used
        return {
            "kv_blocks_total": self.pool.num_blocks,
            "kv_blocks_free": self.pool.num_free,
            "kv_blocks_used": used,
            "kv_blocks_cached": self.pool.num_cached_free,
            "kv_usage": used / self.pool.num_blocks,
            "block_size": self.block_size,
            "running": len(self.running),
            "waiting": len(self.queue),
            "paused": len(self.paused_requests),
            "preempted": sum(1 for r in self.queue if r.status is Status.PREEMPTED),
            "server_paused": self.paused,
            "preemptions": self.num_preemptions,
            "swaps": self.num_swaps,
            "host_blocks_used": self.host_pool.num_used if self.host_pool else 0,
            "prefix_cache_queries": self.pool.queries,
            "prefix_cache_hits": self.pool.hits,
            "prefix_cache_hit_rate": self.pool.hits / self.pool.queries if self.pool.queries else 0.0,
            "steps": self.num_steps_run,
        } | ({"seats_by_priority": {str(p): self._seats_held(p) for p in self.seat_caps}} if self.seat_caps else {})
