"""The worker's CPU thread plan: every core for big models and big steps, one fewer for the
small steps of small models, --worker-threads for every step; applied per step by the runner."""

from __future__ import annotations

import torch

from worker.cpu_threads import BIG_STEP_TOKENS, ThreadPlan, choose_cpu_threads


def test_the_plan_follows_the_model_size_the_flag_and_the_cores() -> None:
    assert choose_cpu_threads(0, 135_000_000, cores=2) == ThreadPlan(2, 2)
    assert choose_cpu_threads(0, 3_000_000, cores=2) == ThreadPlan(1, 2)
    assert choose_cpu_threads(0, 3_000_000, cores=1) == ThreadPlan(1, 1)
    assert choose_cpu_threads(3, 3_000_000, cores=2) == ThreadPlan(3, 3)


def test_a_step_gets_the_threads_its_size_calls_for() -> None:
    before = torch.get_num_threads()
    plan = ThreadPlan(1, 2)
    try:
        plan.apply(BIG_STEP_TOKENS - 1)
        assert torch.get_num_threads() == 1
        plan.apply(BIG_STEP_TOKENS)
        assert torch.get_num_threads() == 2
        plan.apply(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
