"""The scheduling core: which requests run each step, and what they cost. No torch, no sockets.

One step, under one token budget (``max_num_batched_tokens``) and ``max_num_seqs`` rows:

1. **decodes** — running requests with one token left to compute, most urgent first;
2. **prefills** — running requests mid-prompt, then waiting ones admitted in queue order. The
   prefill budget left after decodes is split so that at least ``min_concurrent_prefills``
   prompts advance when that many exist, each chunk is capped by ``long_prefill_threshold``,
   and the last prompt that does not fit is chunked;
3. **blocks** — each row gets the blocks its new tokens need; if the pool runs dry for a running
   request, the least urgent, latest-arrived running request not yet scheduled is preempted
   (recompute: blocks freed, back to the waiting queue with its original arrival time);
4. **multi-step** — when every row samples in this step and nobody waits, the plan covers
   ``num_scheduler_steps`` steps, with look-ahead blocks reserved for the extra tokens.

Every step moves each row's computed count toward its token count; chunked prefill and decode
are the same rule. Tokens reported by the worker then append outputs and apply stop rules.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging

from protocol.config import SchedulerConfig
from protocol.messages import AddRequest, Finish, FinishReason, NewRequest, StepPlan, StepTokens, TokenBatch
from scheduler.block_pool import BlockPool
from scheduler.queues import WaitingQueue
from scheduler.request import Request, Status

log = logging.getLogger("sluice.scheduler")

PREEMPTION_WARNING_EVERY = 50


@dataclasses.dataclass
class _Row:
    req: Request
    num_tokens: int
    new_blocks: list[int]


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int, max_model_len: int,
                 eos_token_ids: list[int]) -> None:
        self.config = config
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.pool = BlockPool(num_blocks)
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []  # sorted by urgency: the queue's key
        self.requests: dict[int, Request] = {}
        self._forget: list[int] = []  # rids whose worker state must go in the next plan
        self._next_plan_id = 0
        self.paused = False
        self.num_preemptions = 0
        self.num_steps_run = 0

    # ------------------------------------------------------------------ requests in and out

    def add(self, msg: AddRequest) -> Finish | None:
        """Queue a request, or return its error finish if it can never run here."""
        req = Request(msg)
        total = req.num_prompt_tokens + msg.sampling.max_tokens
        reason = None
        if total > self.max_model_len:
            reason = f"prompt + max_tokens = {total} exceeds the max model length {self.max_model_len}"
        elif self._blocks_for(min(total, self.max_model_len)) > self.pool.num_blocks:
            reason = (f"needs {self._blocks_for(total)} KV blocks, the cache has {self.pool.num_blocks}; "
                      f"raise --num-kv-blocks or lower max_tokens")
        elif msg.rid in self.requests:
            reason = f"duplicate request rid {msg.rid}"
        if reason:
            return Finish(msg.rid, FinishReason.ERROR, req.num_prompt_tokens, 0, 0, reason)
        self.requests[req.rid] = req
        self.waiting.push(req)
        return None

    def abort(self, rid: int) -> Finish | None:
        req = self.requests.get(rid)
        if req is None:
            return None
        self.waiting.remove(rid)
        if req.status is Status.RUNNING:
            self.running.remove(req)
        return self._finish(req, FinishReason.ABORT)

    def _finish(self, req: Request, reason: str, message: str = "") -> Finish:
        self.pool.free(req.finish(reason))
        del self.requests[req.rid]
        if req.on_worker:
            self._forget.append(req.rid)
        return Finish(req.rid, reason, req.num_prompt_tokens, 0, req.num_outputs, message)

    def finish_all(self, reason: str, message: str) -> list[Finish]:
        """End every live request (the engine failed)."""
        finishes = [self._finish(req, reason, message) for req in list(self.requests.values())]
        self.running.clear()
        self.waiting = WaitingQueue(self.config.scheduling_policy)
        return finishes

    @property
    def has_work(self) -> bool:
        return not self.paused and bool(self.running or len(self.waiting))

    # ------------------------------------------------------------------ one step

    def schedule(self) -> StepPlan | None:
        if not self.has_work:
            return None
        budget = self.config.max_num_batched_tokens
        rows: list[_Row] = []
        scheduled: set[int] = set()
        decodes = [r for r in self.running if r.num_uncomputed == 1]
        prefills = [r for r in self.running if r.num_uncomputed > 1]
        for req in decodes:
            if budget == 0 or len(rows) >= self.config.max_num_seqs:
                break
            if req.status is Status.RUNNING and self._reserve(req, 1, rows, scheduled):
                rows.append(_Row(req, 1, []))
                scheduled.add(req.rid)
                budget -= 1
        share = self._prefill_share(budget, prefills)
        for req in prefills:
            if budget == 0 or len(rows) >= self.config.max_num_seqs or req.status is not Status.RUNNING:
                continue
            n = min(req.num_uncomputed, budget, share)
            if self._reserve(req, n, rows, scheduled):
                rows.append(_Row(req, n, []))
                scheduled.add(req.rid)
                budget -= n
        budget = self._admit(budget, share, rows, scheduled)
        if not rows:
            return None
        return self._emit(rows)

    def _prefill_share(self, budget: int, prefills: list[Request]) -> int:
        """Most tokens one prompt may take this step (seed 000: split across k prompts)."""
        cap = self.config.long_prefill_threshold or budget
        k = self.config.min_concurrent_prefills
        if k > 1:
            candidates = len(prefills) + len(self.waiting)
            cap = min(cap, max(1, budget // max(1, min(k, candidates))))
        return max(1, cap)

    def _admit(self, budget: int, share: int, rows: list[_Row], scheduled: set[int]) -> int:
        while budget > 0 and len(rows) < self.config.max_num_seqs and len(self.waiting):
            req = self.waiting.peek()
            assert req is not None
            n = min(req.num_uncomputed, budget, share)
            need = self._blocks_for(req.num_computed + n) - len(req.blocks)
            if not self.pool.can_allocate(need):
                break  # admission never preempts running work (priority preemption comes later)
            self.waiting.pop()
            req.blocks.extend(self.pool.allocate(need))
            req.status = Status.RUNNING
            bisect.insort(self.running, req, key=self.waiting.key)
            rows.append(_Row(req, n, []))
            scheduled.add(req.rid)
            budget -= n
        return budget

    def _reserve(self, req: Request, n: int, rows: list[_Row], scheduled: set[int]) -> bool:
        """Blocks for ``req`` to compute ``n`` more tokens, preempting less urgent unscheduled
        requests if the pool runs dry. False if ``req`` itself had to be preempted."""
        need = self._blocks_for(req.num_computed + n) - len(req.blocks)
        while not self.pool.can_allocate(need):
            victim = next((r for r in reversed(self.running) if r.rid not in scheduled and r is not req), None)
            if victim is None:
                self._preempt(req)
                return False
            self._preempt(victim)
        if need > 0:
            req.blocks.extend(self.pool.allocate(need))
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        if req.on_worker:
            self._forget.append(req.rid)
        self.pool.free(req.reset_for_recompute())
        self.waiting.push(req)
        self.num_preemptions += 1
        if self.num_preemptions == 1 or self.num_preemptions % PREEMPTION_WARNING_EVERY == 0:
            log.warning(
                "request %s preempted (recompute) for lack of KV cache blocks; %d preemptions so far. "
                "This costs throughput and latency: raise --num-kv-blocks / --kv-cache-memory, or lower "
                "--max-num-seqs / --max-num-batched-tokens.", req.request_id, self.num_preemptions)

    def _num_steps(self, rows: list[_Row]) -> int:
        steps = self.config.num_scheduler_steps
        if steps == 1 or len(self.waiting):
            return 1
        if any(row.num_tokens != row.req.num_uncomputed for row in rows):
            return 1  # a prompt is still mid-prefill: come back after one step
        return steps

    def _reserve_lookahead(self, rows: list[_Row], steps: int) -> int:
        """Blocks for the tokens steps 2..n will compute; fall back to one step if they don't fit."""
        wants = []
        for row in rows:
            req = row.req
            cover = min(req.num_computed + row.num_tokens + steps - 1, req.max_total_tokens(self.max_model_len))
            wants.append(max(0, self._blocks_for(cover) - len(req.blocks)))
        if not self.pool.can_allocate(sum(wants)):
            return 1
        for row, want in zip(rows, wants, strict=True):
            if want:
                row.req.blocks.extend(self.pool.allocate(want))
        return steps

    def _emit(self, rows: list[_Row]) -> StepPlan:
        steps = self._num_steps(rows)
        if steps > 1:
            steps = self._reserve_lookahead(rows, steps)
        new_requests, rids, num_tokens, new_blocks = [], [], [], []
        forget, self._forget = self._forget, []
        for row in rows:
            req = row.req
            if not req.on_worker:
                new_requests.append(NewRequest(req.rid, list(req.token_ids), req.num_prompt_tokens, req.sampling))
                req.on_worker = True
                req_sent = 0
            else:
                req_sent = req.worker_blocks
            rids.append(req.rid)
            num_tokens.append(row.num_tokens)
            new_blocks.append(req.blocks[req_sent:])
            req.worker_blocks = len(req.blocks)
            req.advance(row.num_tokens)
        self._next_plan_id += 1
        self.num_steps_run += steps
        return StepPlan(self._next_plan_id, new_requests, rids, num_tokens, new_blocks, steps, forget)

    # ------------------------------------------------------------------ results

    def update(self, out: StepTokens) -> TokenBatch:
        rids, tokens, finished = [], [], []
        for rid, token in zip(out.rids, out.token_ids, strict=True):
            req = self.requests.get(rid)
            if req is None or req.status is not Status.RUNNING:
                continue  # finished or preempted while the plan ran: its tokens are void
            if out.step > 0:
                req.advance(1)  # the worker computed the token it sampled last step
            req.append_token(token)
            rids.append(rid)
            tokens.append(token)
            reason = req.check_stop(self.eos_token_ids, self.max_model_len)
            if reason is not None:
                self.running.remove(req)
                finished.append(self._finish(req, reason))
        return TokenBatch(rids, tokens, finished)

    # ------------------------------------------------------------------ helpers

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def stats(self) -> dict[str, object]:
        used = self.pool.num_used
        return {
            "kv_blocks_total": self.pool.num_blocks,
            "kv_blocks_free": self.pool.num_free,
            "kv_blocks_used": used,
            "kv_usage": used / self.pool.num_blocks,
            "block_size": self.block_size,
            "running": len(self.running),
            "waiting": len(self.waiting),
            "paused": self.paused,
            "preemptions": self.num_preemptions,
            "steps": self.num_steps_run,
        }
