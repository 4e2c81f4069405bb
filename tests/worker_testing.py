"""Helpers for the worker tests: a hand-driven scheduler stand-in, a one-thread torch and the
tiny model's worker."""

from __future__ import annotations

import contextlib
import itertools
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from protocol.config import WorkerConfig
from protocol.messages import NewRequest, SamplingParams, StepPlan, StepTokens
from worker.engine import Worker
from worker.model.tiny import materialize_tiny
from worker.runner import ModelRunner


@contextlib.contextmanager
def one_cpu_thread() -> Iterator[None]:
    """Tiny models run fastest single-threaded, and the test machine's cores are shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tiny_worker(cache_dir: Path, block_size: int) -> Worker:
    """The built-in tiny model (made in ``cache_dir``) in float32, with 512 KV blocks."""
    return Worker(WorkerConfig(model=str(materialize_tiny(cache_dir)), num_kv_blocks=512, block_size=block_size,
                               dtype="float32"))


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


class Driver:
    """Plays the scheduler's part by hand: hands out fresh block ids from a counter (never
    reusing one), reserves blocks for multi-step look-ahead, and records every message."""

    def __init__(self, runner: ModelRunner, first_block: int = 0, drafts: int = 0, reserve: int | None = None) -> None:
        """``drafts``: plans let each row verify this many proposed tokens per step (the
        runner's ``ngram`` proposes them), with blocks reserved for ``reserve`` of them (default:
        all)."""
        self.runner = runner
        self.drafts = drafts
        self.reserve = drafts if reserve is None else reserve
        self.bs = runner.cache.block_size
        self.free = itertools.count(first_block)
        self.plan_ids = itertools.count(1)
        self.tables: dict[int, list[int]] = {}
        self.outputs: dict[int, list[int]] = defaultdict(list)
        self.messages: list[StepTokens] = []

    def plan(self, rows: Sequence[tuple[int, int]], new: Sequence[NewRequest] = (), steps: int = 1,
             forget: Sequence[int] = ()) -> list[StepTokens]:
        """Run one plan; ``rows`` are (rid, num_tokens)."""
        news = {req.rid: req for req in new}
        for rid in forget:
            self.tables.pop(rid, None)
        for rid in news:
            self.tables[rid] = []
        blocks = []
        for rid, n in rows:
            computed = news[rid].num_computed if rid in news else self.runner.seqs[rid].num_computed
            need = -(-(computed + n + steps - 1 + steps * self.reserve) // self.bs) - len(self.tables[rid])
            fresh = [next(self.free) for _ in range(max(0, need))]
            self.tables[rid] += fresh
            blocks.append(fresh)
        plan = StepPlan(next(self.plan_ids), list(new), [r for r, _ in rows], [n for _, n in rows], blocks, steps,
                        list(forget), num_draft_tokens=self.drafts)
        out = list(self.runner.execute(plan))
        # Every request the runner holds has one slot in its input batch, and no other does.
        assert sorted(self.runner.batch.slot_of) == sorted(self.runner.seqs)
        for msg in out:
            for rid, tok in zip(msg.rids, msg.token_ids, strict=True):
                self.outputs[rid].append(tok)
        self.messages += out
        return out

    def live(self) -> list[int]:
        return [rid for rid in self.tables if rid in self.runner.seqs]

    def prefill(self, prompts: dict[int, list[int]], params: SamplingParams, steps: int = 1) -> None:
        """Every prompt whole, in one plan."""
        news = [NewRequest(rid, p, len(p), params) for rid, p in prompts.items()]
        self.plan([(rid, len(p)) for rid, p in prompts.items()], news, steps)

    def decode_to_end(self, steps: int) -> None:
        """Decode plans of ``steps`` steps until every request of this driver has stopped."""
        while live := self.live():
            # (As the scheduler counts: drafts a row's last step accepted are not computed yet.)
            rows = [(rid, len(seq.token_ids) - seq.num_computed + seq.num_ahead)
                    for rid in live if (seq := self.runner.seqs[rid])]
            self.plan(rows, steps=steps)
