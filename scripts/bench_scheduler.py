"""Scheduler overhead alone (no processes, no torch): schedule() + update() per step.

    python scripts/bench_scheduler.py --running 256

Fills the batch with ``--running`` requests of ``--prompt`` tokens, then times decode steps with
every request decoding one token, and prints microseconds per step (vLLM's V1 scheduler is
reported at ~2,000 us per step for 256 running requests on this machine class).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from protocol.config import SchedulerConfig
from protocol.messages import AddRequest, SamplingParams, StepTokens
from scheduler.scheduler import Scheduler


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", type=int, default=256)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=500)
    args = p.parse_args()
    logging.disable(logging.WARNING)
    config = SchedulerConfig(num_scheduler_steps=1, max_num_batched_tokens=args.running * args.prompt,
                             max_num_seqs=args.running)
    sched = Scheduler(config, args.running * (args.prompt + args.steps) // 16 + args.running, 16, 8192, [2])
    for i in range(args.running):
        prompt = [(i * 7 + j) % 300 + 3 for j in range(args.prompt)]
        sched.add(AddRequest(i, str(i), prompt, SamplingParams(max_tokens=args.steps + 10, ignore_eos=True), 0, "",
                             float(i)))
    plan = sched.schedule()
    assert plan is not None
    sched.update(StepTokens(plan.plan_id, 0, plan.rids, [5] * len(plan.rids), True))
    start = time.perf_counter()
    for _ in range(args.steps):
        plan = sched.schedule()
        assert plan is not None and len(plan.rids) == args.running
        sched.update(StepTokens(plan.plan_id, 0, plan.rids, [5] * len(plan.rids), True))
    per_step = (time.perf_counter() - start) / args.steps
    print(f"{args.running} running requests: {per_step * 1e6:,.0f} us per step (schedule + update), "
          f"{per_step * 1e6 / args.running:.1f} us per request")


if __name__ == "__main__":
    main()
