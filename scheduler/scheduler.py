"""The scheduling core: which requests run each step, and what they cost. No torch, no sockets.

One step, under one token budget (``max_num_batched_tokens``) and ``max_num_seqs`` rows:

1. **cut-ins** — requests an operator pushed to the front are admitted first, preempting the
   fewest strictly less urgent running requests they need;
2. **decodes** — running requests with one token left to compute, most urgent first;
3. **prefills** — running requests mid-prompt, then waiting ones in the policy's order. The
   prefill budget left after decodes is split so that at least ``min_concurrent_prefills``
   prompts advance when that many exist (vLLM's feature request for concurrent partial prefills); ``long_prefill_threshold`` caps one chunk;
   the last prompt that does not fit is chunked. Admission counts only the blocks and tokens the
   prefix cache does not already hold (vLLM's proposal for prefix-cache-aware admission). A waiting request that cannot get blocks or a
   seat preempts the fewest strictly less urgent running requests, if ``priority_preemption``
   (vLLM's priority-scheduling RFC) — otherwise it waits;
4. **blocks** — if the pool runs dry for a running request, paused requests give their blocks back
   first, then the least urgent, latest-arrived running request not yet scheduled is preempted
   (``recompute`` or ``swap``, vLLM's guide to preemption and chunked prefill);
5. **multi-step** — when every row samples in this step and no admissible prompt was left out
   for lack of token budget, the plan covers ``num_scheduler_steps`` steps, with look-ahead blocks
   reserved for the extra tokens (vLLM's multi-step scheduling RFC).

Every step moves each row's computed count toward its token count; chunked prefill, prefix hits
and decode are the same rule. Tokens reported by the worker then append outputs and apply stops.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from protocol.config import SchedulerConfig
from protocol.messages import AddRequest, Finish, FinishReason, StepPlan, StepTokens, TokenBatch
from scheduler.admission import Admission
from scheduler.block_pool import BlockPool
from scheduler.grammar_gate import GrammarGate
from scheduler.plans import PlanInFlight, Plans
from scheduler.preemption import Preemptor, Recompute, Swap
from scheduler.queues import make_queue
from scheduler.request import Request, Status
from scheduler.running import RunningBatch
from scheduler.step import Step

log = logging.getLogger("sluice.scheduler")


class Scheduler:
    """The facade: requests in and out, the controls, and ``schedule()``, which builds one step
    and hands it to ``plans`` — with ``admission`` (waiting -> running), ``preemptor`` (making
    room) and ``plans`` (the plan's life) doing the parts their names say."""

    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int, max_model_len: int,
                 eos_token_ids: list[int], first_plan_id: int = 0) -> None:
        self.config = config
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.pool = BlockPool(num_blocks, enable_caching=config.enable_prefix_caching)
        host_blocks = min(config.num_host_blocks or num_blocks, num_blocks)
        self.host_pool = BlockPool(host_blocks) if config.preemption_mode == "swap" else None
        self.queue = make_queue(config.scheduling_policy)
        # A queue that ignores priorities (fcfs) has nobody outranking anybody: no one is preempted.
        self.preempts_by_priority = config.priority_preemption and self.queue.ranks_by_priority
        self.key = self.queue.key  # urgency order: smaller is more urgent
        self.running = RunningBatch(self.key, config.max_num_seqs_per_priority)
        self.paused_requests: dict[int, Request] = {}
        self.requests: dict[int, Request] = {}
        self._cut_ins: list[Request] = []
        # n > 1: choices waiting for their first sibling's prompt KV (by that sibling's rid).
        self._held: dict[int, list[Request]] = {}
        self.grammars = GrammarGate()  # constrained requests whose grammar the worker is compiling
        self.plans = Plans(config, block_size, max_model_len, tuple(eos_token_ids), self.pool, self.queue,
                           self.requests, self._held, self._release_held, self._end, first_plan_id)
        strategy = Recompute(self.pool) if self.host_pool is None else Swap(self.pool, self.host_pool)
        self.preemptor = Preemptor(self.pool, strategy, self.running, self.paused_requests, self.queue,
                                   self.plans.forget)
        self.admission = Admission(config, block_size, self.pool, self.host_pool, self.queue, self.running,
                                   self.preemptor)
        self.paused = False

    @property
    def in_flight(self) -> dict[int, PlanInFlight]:
        return self.plans.in_flight

    @property
    def num_preemptions(self) -> int:
        return self.preemptor.num_preemptions

    @property
    def num_swaps(self) -> int:
        strategy = self.preemptor.strategy
        return strategy.num_swaps if isinstance(strategy, Swap) else 0

    @property
    def last_plan_id(self) -> int:
        return self.plans.next_plan_id

    @property
    def has_work(self) -> bool:
        return not self.paused and bool(len(self.running) or len(self.queue))

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
        elif msg.output_token_ids and (msg.n != 1 or len(msg.output_token_ids) >= msg.sampling.max_tokens):
            reason = "a continued request has one choice and fewer output tokens than max_tokens"
        if reason:
            return [Finish(rid, FinishReason.ERROR, num_prompt, 0, 0, reason) for rid in rids]
        first = Request(msg)
        self.requests[first.rid] = first
        if not self.grammars.holds(first):
            self.queue.push(first)
        for choice in range(1, msg.n):
            req = Request(msg, choice)
            self.requests[req.rid] = req
            # It waits to find the first choice's prompt blocks cached (or, without caching, for
            # the first choice's prompt logprobs, which every choice reports, to be out first).
            if self.pool.enable_caching or msg.sampling.prompt_logprobs is not None:
                self._held.setdefault(first.rid, []).append(req)
            elif not self.grammars.holds(req):  # (with a grammar, it waits for it beside the first)
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
        return self._end(req, reason, message) if req is not None else None

    def finish_all(self, reason: str, message: str) -> list[Finish]:
        """End every live request (the engine failed)."""
        return [self._end(req, reason, message) for req in list(self.requests.values())]

    def _detach(self, req: Request) -> None:
        """Take ``req`` out of whichever collection holds it."""
        self.queue.remove(req.rid)
        self.grammars.remove(req)
        if req.after is not None and req in self._held.get(req.after, ()):
            self._held[req.after].remove(req)
        self.paused_requests.pop(req.rid, None)
        if req.status is Status.RUNNING:
            self.running.remove(req)
        if req in self._cut_ins:
            self._cut_ins.remove(req)

    def _end(self, req: Request, reason: str, message: str = "") -> Finish:
        """``req`` is over: out of every collection, everything it holds freed."""
        self._detach(req)
        self._release_held(req)
        if req.on_worker:
            self.plans.forget(req.rid)
        if self.host_pool is not None and req.host_blocks:
            self.host_pool.free(req.take_host_blocks())
        self.pool.free(req.finish())
        del self.requests[req.rid]
        queue_s = (req.scheduled_at - req.arrival_time) if req.scheduled_at else 0.0
        return Finish(req.rid, reason, req.num_prompt_tokens, req.num_cached_tokens, req.num_outputs, message,
                      queue_s, req.num_preemptions)

    def rids_on_worker(self) -> list[int]:
        """Requests whose state the worker holds or has yet to be told to drop."""
        return [r.rid for r in self.requests.values() if r.on_worker] + self.plans.pending_forgets()

    def forget_on_worker(self, rids: list[int]) -> None:
        """Have the next plan tell the worker to drop these requests' state."""
        for rid in rids:
            self.plans.forget(rid)

    def recompute_all(self) -> int:
        """The worker was lost with every KV block and swapped-out copy it held: each live
        request goes back in line (keeping its arrival time) to be recomputed from its prompt
        and the tokens it has already produced, so its stream simply continues. Paused requests
        stay paused. Returns how many requests were live."""
        for req in self.requests.values():
            if req.status is Status.RUNNING:
                self.running.remove(req)
            elif req.rid in self.queue:
                self.queue.remove(req.rid)
            if self.host_pool is not None and req.host_blocks:
                self.host_pool.free(req.take_host_blocks())
            if req.blocks or req.num_computed or req.on_worker:
                self.pool.free(req.drop_kv())
            if req.status is not Status.PAUSED and not self._is_held(req) and req not in self.grammars:
                req.requeue()
                self.queue.push(req)
        self.pool.reset_cache()  # the blocks' contents died with the worker
        self.grammars.worker_replaced()
        self._cut_ins.clear()
        self.plans.clear()
        return len(self.requests)

    def grammar_compiled(self, grammar_id: int) -> bool:
        """The worker compiled a grammar: the requests that waited for it join the queue.
        Returns whether any did (a new plan may then be worth making)."""
        released = self.grammars.compiled(grammar_id)
        for req in released:
            self.queue.push(req)
        return bool(released)

    def _is_held(self, req: Request) -> bool:
        return req.after is not None and req in self._held.get(req.after, ())

    # ------------------------------------------------------------------ controls

    def pause(self, rid: int) -> bool:
        """Stop scheduling ``rid``; a running request keeps its blocks (and worker state)."""
        req = self.requests.get(rid)
        if req is None or req.status is Status.PAUSED:
            return False
        self._detach(req)
        req.pause()
        self.paused_requests[rid] = req
        return True

    def resume(self, rid: int) -> bool:
        req = self.paused_requests.pop(rid, None)
        if req is None:
            return False
        if req.resume():  # its blocks were kept: it carries on where it stopped, nothing recomputed
            self.running.add(req)
        else:
            self.queue.push(req)
        return True

    def set_priority(self, rid: int, priority: int, cut_in: bool = False) -> bool:
        """A new priority, applied at once (the queue and the running batch are re-sorted);
        ``cut_in``: a waiting (or paused) request is admitted at the next step, ahead of all."""
        req = self.requests.get(rid)
        if req is None:
            return False
        if req.status is Status.PAUSED and cut_in:
            self.resume(rid)
        in_queue = rid in self.queue
        if in_queue:
            self.queue.remove(rid)
        running = req.status is Status.RUNNING
        if running:
            self.running.remove(req)
        req.set_priority(priority)
        if in_queue:
            self.queue.push(req)
            if cut_in and req not in self._cut_ins:
                self._cut_ins.append(req)
        if running:
            self.running.add(req)
        return True

    def plans_with(self, rid: int) -> list[int]:
        return self.plans.plans_with(rid)

    def summary(self, req: Request) -> dict[str, object]:
        """What the admin API shows of a request. ``in_flight``: it is in a plan the worker
        runs, so a pause or abort is still reaching the worker's next step boundary."""
        return req.summary(self.block_size) | {"in_flight": bool(self.plans.plans_with(req.rid))}

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_cache()

    # ------------------------------------------------------------------ one step

    def schedule(self) -> StepPlan | None:
        if not self.has_work:
            return None
        step = Step(self.config.max_num_batched_tokens)
        for req in list(self._cut_ins):
            self._cut_ins.remove(req)
            if req.rid in self.queue:
                self.admission.admit(req, step, step.budget, self._less_urgent_than(req))
        decodes, prefills = self._split_running(step)
        self._schedule_decodes(decodes, step)
        self._prefill(step, prefills, self._prefill_share(step.budget, len(prefills)))
        plan = self.plans.emit(step, cut_in_waiting=bool(self._cut_ins)) if step.rows else None
        if step.swapped_in_from:  # the step's swap-outs are all planned: its swap-ins' sources may go now
            assert self.host_pool is not None
            self.host_pool.free(step.swapped_in_from)
        return plan

    def _split_running(self, step: Step) -> tuple[list[Request], list[Request]]:
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

    def _schedule_decodes(self, decodes: list[Request], step: Step) -> None:
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

    def _seats_full(self, step: Step) -> bool:
        return len(step.rows) >= self.config.max_num_seqs

    def _continue(self, req: Request, n: int, step: Step) -> None:
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

    def _grow(self, req: Request, need: int, step: Step) -> bool:
        """Give running ``req`` ``need`` more blocks, preempting less urgent running requests not
        in this step if the pool is short. If even that is not enough, ``req`` is preempted
        itself and False returned."""
        if need > self.pool.num_free:  # short: only now is it worth building the victim filter
            less_urgent = self._less_urgent_than(req)
            if not self.preemptor.make_room(need, (), step, req, lambda r: not step.has(r) and less_urgent(r)):
                self.preemptor.preempt(req, step)
                return False
        req.grow(self.pool.allocate(need))
        return True

    def _prefill_share(self, budget: int, num_running_prefills: int) -> int:
        """Most tokens one prompt may take this step (vLLM's feature request for concurrent partial prefills: split across k prompts)."""
        cap = self.config.long_prefill_threshold or budget
        k = self.config.min_concurrent_prefills
        if k > 1:
            candidates = num_running_prefills + len(self.queue)
            cap = min(cap, budget // max(1, min(k, candidates)))
        return max(1, cap)

    def _prefill(self, step: Step, prefills: list[Request], share: int) -> None:
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
            if self.admission.admit(head, step, share, eligible):
                continue
            if self.admission.seat_caps and self.admission.class_full(head):
                capped.append(self.queue.pop())  # it waits for its class; the rest may go on
            else:
                admitting = False
        for req in capped:
            self.queue.push(req)

    # ------------------------------------------------------------------ the worker

    def continue_plan(self) -> StepPlan | None:
        """Async scheduling: the next window of the plan in flight, planned before its tokens
        arrive (``Plans.continue_plan``) — only when nothing else wants to run: nobody waiting,
        no cut-in, the server not paused."""
        if self.paused or len(self.queue) or self._cut_ins:
            return None
        return self.plans.continue_plan()

    def update(self, out: StepTokens, batch: TokenBatch | None = None) -> TokenBatch:
        """A step's tokens applied (``Plans.update``): what the frontends must hear."""
        return self.plans.update(out, batch)

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
            "kv_blocks_touched": self.pool.num_touched,  # ever written: on a CPU, the cache's committed memory
            "kv_usage": used / self.pool.num_blocks,
            "block_size": self.block_size,
            "running": len(self.running),
            "waiting": len(self.queue) + len(self.grammars),  # in line, or for their grammar to compile
            "waiting_for_grammar": len(self.grammars),
            "paused": len(self.paused_requests),
            "preempted": sum(1 for r in self.queue if r.status is Status.PREEMPTED),
            "server_paused": self.paused,
            "preemptions": self.num_preemptions,
            "swaps": self.num_swaps,
            "host_blocks_used": self.host_pool.num_used if self.host_pool else 0,
            "prefix_cache_queries": self.pool.queries,
            "prefix_cache_hits": self.pool.hits,
            "prefix_cache_hit_rate": self.pool.hits / self.pool.queries if self.pool.queries else 0.0,
            "steps": self.plans.num_steps_run,
            "jump_forward_tokens": self.plans.num_jumped,
            "spec_draft_tokens": sum(self.plans.num_drafted),
            "spec_accepted_tokens": sum(self.plans.num_accepted),
            "spec_drafted_by_position": list(self.plans.num_drafted),
            "spec_accepted_by_position": list(self.plans.num_accepted),
        } | ({"seats_by_priority": {str(p): n for p, n in self.running.held.items()}} if self.running.held else {})
