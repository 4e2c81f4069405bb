"""Plans: a step made into the ``StepPlan`` the worker runs, and the worker's replies made into
tokens. One place for everything a plan's life touches:

* **multi-step** (vLLM's multi-step scheduling RFC) — a plan covers ``num_scheduler_steps`` decode steps when every row
  samples and no admissible prompt was left out for lack of token budget, with look-ahead blocks
  reserved for the extra tokens;
* **async continuation** — the next decode window is planned while the current one runs
  (``continue_plan``), so the worker never waits for the scheduler between windows;
* **emission** — deltas only: new requests whole, known ones their new blocks;
* **update** — a step's tokens appended, stops applied, finished requests ended.

The plans in flight (at most two: one running, one speculative behind it) are kept with their
rows: those rows' tokens count even if the request was paused meanwhile (the worker stops it at
its next step boundary, not at once).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from protocol.config import SchedulerConfig
from protocol.messages import Finish, StepPlan, StepTokens, TokenBatch
from protocol.stop import length_reached
from scheduler.block_pool import BlockPool
from scheduler.queues import RequestQueue
from scheduler.request import Request, Status
from scheduler.step import Step


@dataclasses.dataclass(slots=True)
class PlanInFlight:
    rids: list[int]
    num_steps: int
    speculative: bool
    drafts: int = 0  # ``StepPlan.num_draft_tokens``
    steps_seen: int = 0  # steps whose tokens have arrived
    rows: frozenset[int] = frozenset()  # ``rids``, for membership

    def __post_init__(self) -> None:
        self.rows = frozenset(self.rids)


class Plans:
    """``requests`` is the scheduler's live-request table. ``held`` maps a request to the
    choices of its prompt that wait for it (n > 1); ``prompt_computed(req)`` is called when a
    plan computes the last of such a ``req``'s prompt. ``finish(req, reason)`` ends a request a
    token stopped and returns its ``Finish``."""

    def __init__(self, config: SchedulerConfig, block_size: int, max_model_len: int, eos_token_ids: tuple[int, ...],
                 pool: BlockPool, queue: RequestQueue, requests: dict[int, Request], held: dict[int, list[Request]],
                 prompt_computed: Callable[[Request], None], finish: Callable[[Request, str], Finish],
                 first_plan_id: int = 0) -> None:
        self.num_scheduler_steps = config.num_scheduler_steps
        # Speculative decoding: drafts a row may verify per step, in plans of few enough rows.
        self.num_draft_tokens = config.num_speculative_tokens if config.speculative != "none" else 0
        self.draft_max_rows = config.speculative_max_batch
        self.max_num_seqs = config.max_num_seqs
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.pool = pool
        self.queue = queue
        self.requests = requests
        self._held = held
        self._prompt_computed = prompt_computed
        self._finish = finish
        self.in_flight: dict[int, PlanInFlight] = {}
        self.next_plan_id = first_plan_id  # a core replacing another goes on from its plan ids
        self.num_steps_run = 0  # forward passes the worker reported (a window's rows may all stop early)
        self.num_jumped = 0  # tokens the worker appended by jump-forward (``StepTokens.jumped``)
        # Speculative decoding, per draft position: proposals verified, and accepted.
        self.num_drafted: list[int] = []
        self.num_accepted: list[int] = []
        self._forget: list[int] = []  # rids whose worker state must go in the next plan

    # ------------------------------------------------------------------ the worker's state

    def forget(self, rid: int) -> None:
        """Have the next plan tell the worker to drop ``rid``'s state."""
        self._forget.append(rid)

    def pending_forgets(self) -> list[int]:
        return list(self._forget)

    def plans_with(self, rid: int) -> list[int]:
        """Ids of the plans in flight that have ``rid`` as a row."""
        return [pid for pid, plan in self.in_flight.items() if rid in plan.rows]

    def clear(self) -> None:
        """The worker was lost: no plan is in flight, and the new one holds no state to drop."""
        self.in_flight.clear()
        self._forget.clear()

    # ------------------------------------------------------------------ emission

    def emit(self, step: Step, cut_in_waiting: bool) -> StepPlan:
        steps = self._num_steps(step, cut_in_waiting)
        drafts = self._drafts(len(step.rows))
        if steps > 1 or drafts:
            steps, drafts = self._reserve_lookahead(step, steps, drafts)
        rows = step.rows
        rids = [req.rid for req in rows]
        new_requests = [req.send_whole() for req in rows if not req.on_worker]
        new_blocks = []
        forget, self._forget = self._forget, []
        caching, block_size = self.pool.enable_caching, self.block_size
        queue, counts_service, held = self.queue, self.queue.counts_service, self._held
        for req, n in rows.items():
            # Most rows of most steps have no new block: that test inline, the call otherwise.
            new_blocks.append([] if req.worker_blocks == len(req.blocks) else req.unsent_blocks())
            if caching and req.num_computed % block_size + n >= block_size:  # it fills a block
                self._register_full_blocks(req, n)
            req.num_computed += n  # req.advance(n), inline: this loop runs for every row of every step
            if held and req.rid in held and req.num_computed >= req.num_prompt_tokens:
                self._prompt_computed(req)
            if counts_service:
                queue.charge(req.user, n)
        self.pool.free(step.copy_sources)  # the copies are in the plan: later plans run after them
        self.next_plan_id += 1
        self.in_flight[self.next_plan_id] = PlanInFlight(rids, steps, speculative=False, drafts=drafts)
        return StepPlan(self.next_plan_id, new_requests, rids, list(rows.values()), new_blocks, steps, forget,
                        step.swap_out, step.swap_in, step.copies, num_draft_tokens=drafts)

    def _drafts(self, num_rows: int) -> int:
        """Drafts a row may verify per step in a plan of ``num_rows`` rows: speculative decoding
        pays where a step reads the weights for few tokens; a large batch computes enough
        already, and verifying proposals would only add to it."""
        return self.num_draft_tokens if num_rows <= self.draft_max_rows else 0

    def _num_steps(self, step: Step, cut_in_waiting: bool) -> int:
        """Multi-step unless prefill work would wait for the window: a prompt still mid-prefill,
        or waiting prompts that only this step's token budget kept out. Prompts waiting for
        blocks or seats do not stop it (they could not start sooner anyway): new arrivals then
        wait at most one window, and the first step of every plan admits what fits."""
        steps = self.num_scheduler_steps
        if steps == 1 or cut_in_waiting:
            return 1
        if any(n != req.num_uncomputed for req, n in step.rows.items()):
            return 1  # a prompt is still mid-prefill: come back after one step
        if len(self.queue) and step.budget <= 0 and len(step.rows) < self.max_num_seqs:
            return 1  # more prompts fit next step
        return steps

    def _reserve_lookahead(self, step: Step, steps: int, drafts: int) -> tuple[int, int]:
        """Blocks for the tokens steps 2..n will compute; fall back to one step if they don't fit.
        A constrained row gets room for as many again: the tokens jump-forward may append; with
        speculative decoding, every row gets room for ``drafts`` more per step (the worker
        appends and drafts no more than a row's blocks hold). Returns the window's steps and
        drafts: no drafts if their room does not fit, and one step if the window's does not."""
        for window, per_step in dict.fromkeys(((steps, drafts), (steps, 0), (1, 0))):
            wants = []
            for req, n in step.rows.items():
                room = window - 1 + (window if req.sampling.grammar is not None else 0) + window * per_step
                cover = min(req.num_computed + n + room, req.max_total_tokens(self.max_model_len))
                wants.append(max(0, self._blocks_for(cover) - len(req.blocks)))
            if self.pool.can_allocate(sum(wants)):
                break
        else:
            return 1, 0
        for req, want in zip(step.rows, wants, strict=True):
            if want:
                req.grow(self.pool.allocate(want))
        return window, per_step

    def _register_full_blocks(self, req: Request, n: int) -> None:
        """Blocks that ``req``'s next ``n`` tokens fill completely become findable by later
        requests' prefixes — registered when the plan computing them is made, before their KV
        exists. That is safe: a request that finds them runs in a later plan, and the worker runs
        plans in order; a plan's first step always computes every row in full (cancels take
        effect from a step boundary, and the worker reads nothing between a plan and its first
        step), while the later steps of a window register their token only once the worker has
        reported it (``update``); requests admitted in the same step looked the cache up before
        this; and if the worker is lost first, the cache is reset with it."""
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
        tokens arrive, so the worker starts it the moment the current one ends. (The scheduler
        asks only when nothing else wants to run: nobody waiting, no cut-in, not paused.)

        Only one multi-step plan in flight qualifies. Each row is assumed to run the whole
        current window; rows that surely stop in it (max_tokens, the model length) are left out,
        and a row that stops on a token (or is aborted) meanwhile is skipped by the worker. Its
        rows advance as their tokens arrive (see ``update``)."""
        if len(self.in_flight) != 1:
            return None
        current = next(iter(self.in_flight.values()))
        steps = current.num_steps
        if steps <= 1:
            return None
        ahead = steps - current.steps_seen  # tokens each row still gets from the current plan
        drafts = self._drafts(len(current.rids))
        rows: list[Request] = []
        wants: list[int] = []
        for rid in current.rids:
            req = self.requests.get(rid)
            if req is None or req.status is not Status.RUNNING:
                continue
            known = len(req.token_ids) + ahead
            if length_reached(req.num_outputs + ahead, known, req.sampling, self.max_model_len):
                continue  # the current window's last token surely ends it
            if req.sampling.grammar is not None or current.drafts:
                # Jump-forward or accepted drafts may fill the row's blocks in the current window:
                # it may end with as many tokens as they hold, plus the one sampled last.
                known = max(known, len(req.blocks) * self.block_size + 1)
            if req.sampling.grammar is not None:
                known += steps  # room for as many forced tokens again
            cover = min(known - 1 + steps + steps * drafts, req.max_total_tokens(self.max_model_len))
            rows.append(req)
            wants.append(max(0, self._blocks_for(cover) - len(req.blocks)))
        if not rows or not self.pool.can_allocate(sum(wants)):
            return None
        new_blocks = []
        for req, want in zip(rows, wants, strict=True):
            req.grow(self.pool.allocate(want))
            new_blocks.append(req.unsent_blocks())
        self.next_plan_id += 1
        rids = [r.rid for r in rows]
        self.in_flight[self.next_plan_id] = PlanInFlight(rids, steps, speculative=True, drafts=drafts)
        return StepPlan(self.next_plan_id, [], rids, [1] * len(rows), new_blocks, steps, speculative=True,
                        num_draft_tokens=drafts)

    # ------------------------------------------------------------------ results

    def update(self, out: StepTokens, batch: TokenBatch | None = None) -> TokenBatch:
        """Apply a step's tokens: append them, apply stops, end what finished; returns what the
        frontends must hear. It is added to ``batch`` (a new one if None) as it is decided, so
        that if this raises midway, the caller still has what was done so far (finishes whose
        blocks are already free)."""
        if batch is None:
            batch = TokenBatch([], [], [], out.logprobs, prompt_logprobs=out.prompt_logprobs, embeddings=out.embeddings)
        plan = self.in_flight.get(out.plan_id)
        # A speculative plan's first step also computes a token the scheduler has not counted:
        # it was planned before the previous plan's last token arrived.
        computes_previous = out.step > 0 or (plan is not None and plan.speculative)
        rids, tokens, finished, started = batch.rids, batch.token_ids, batch.finished, batch.started
        requests, running, paused = self.requests, Status.RUNNING, Status.PAUSED  # (Enum look-ups are slow on 3.11)
        plan_rows = plan.rows if plan is not None else frozenset()
        queue, counts_service = self.queue, self.queue.counts_service
        caching, block_size = self.pool.enable_caching, self.block_size
        last_slot = block_size - 1
        eos_token_ids, max_model_len = self.eos_token_ids, self.max_model_len
        previous = None
        for rid, token in zip(out.rids, out.token_ids, strict=True):
            req = requests.get(rid)
            if req is None or not (req.status is running or (req.status is paused and rid in plan_rows)):
                continue  # finished or preempted while the plan ran: its tokens are void
            if computes_previous and rid != previous:
                # The worker computed what it reported for this row before: the token it sampled
                # last step (and any that jump-forward appended after it; a row's tokens of one
                # step come together, the sampled one first).
                n = len(req.token_ids) - req.num_computed
                if n == 1:
                    if caching and req.num_computed % block_size == last_slot:  # it fills a block
                        self._register_full_blocks(req, 1)
                elif caching:
                    self._register_full_blocks(req, n)
                req.num_computed += n  # ``Request.advance``, inline: this loop runs for every row of every step
                if counts_service:
                    queue.charge(req.user, n)
            previous = rid
            known = req.token_ids
            if len(known) + 1 < req.quiet_until and token not in req.may_stop:
                known.append(token)  # ``Request.add_output``'s quick answer, inline: it cannot stop here
                rids.append(rid)
                tokens.append(token)
                continue
            reason = req.add_output(token, eos_token_ids, max_model_len)
            rids.append(rid)  # (after the full check: a token whose check raised is not sent)
            tokens.append(token)
            # (A first output always gets the full check: ``quiet_until`` is 0 until then.)
            if len(known) == req.num_prompt_tokens + 1:
                started.append((rid, req.num_cached_tokens))
            if reason is not None:
                finished.append(self._finish(req, reason))
        self.num_steps_run += 1
        self.num_jumped += out.jumped
        if out.drafted:
            self._count_drafts(out)
        if plan is not None:
            plan.steps_seen = out.step + 1
            if out.last:
                del self.in_flight[out.plan_id]
        return batch

    def _count_drafts(self, out: StepTokens) -> None:
        """A step's speculative decoding figures."""
        while len(self.num_drafted) < len(out.drafted):
            self.num_drafted.append(0)
            self.num_accepted.append(0)
        for j, (drafted, accepted) in enumerate(zip(out.drafted, out.accepted, strict=True)):
            self.num_drafted[j] += drafted
            self.num_accepted[j] += accepted

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
