"""The worker's CPU thread plan: every core for big models and big steps, one fewer for the
small steps of small models, --worker-threads for every step; no more threads than the cores
other processes leave free; applied per step by the runner."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
import torch

from worker.cpu_threads import BIG_STEP_TOKENS, BusyCores, ThreadPlan, choose_cpu_threads


def _counts(plan: ThreadPlan) -> tuple[int, int, bool]:
    return plan.small, plan.big, plan.busy is not None


def test_the_plan_follows_the_model_size_the_flag_and_the_cores() -> None:
    assert _counts(choose_cpu_threads(0, 135_000_000, cores=2)) == (2, 2, True)
    assert _counts(choose_cpu_threads(0, 3_000_000, cores=2)) == (1, 2, True)
    assert _counts(choose_cpu_threads(0, 3_000_000, cores=1)) == (1, 1, True)
    assert _counts(choose_cpu_threads(3, 3_000_000, cores=2)) == (3, 3, False)  # the flag stands, load or not


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


class FakeProc:
    """/proc/stat's cpu line and /proc/self/stat, advanced by hand (ticks of ``cpus`` CPUs)."""

    def __init__(self, tmp: Path, cpus: int = 2) -> None:
        self.cpus = cpus
        self.stat, self.own = tmp / "stat", tmp / "self-stat"
        self.busy = self.total = self.ours = 0
        self.write()

    def write(self) -> None:
        idle = self.total - self.busy
        # user nice system idle iowait irq softirq steal guest guest_nice: busy split over user and steal
        self.stat.write_text(f"cpu  {self.busy - 5} 0 0 {idle - 5} 5 0 0 5 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\n")
        self.own.write_text(f"42 (py (worker) x) R 1 2 3 4 5 6 7 8 9 10 {self.ours - 2} 2 0 0 20 0 9 0\n")

    def run(self, seconds: float, machine_cores: float, our_cores: float) -> None:
        self.total += int(100 * seconds * self.cpus)  # os.cpu_count() is patched to self.cpus
        self.busy += int(100 * seconds * machine_cores)
        self.ours += int(100 * seconds * our_cores)
        self.write()


def _busy(fake: FakeProc, monkeypatch: pytest.MonkeyPatch) -> BusyCores:
    monkeypatch.setattr("os.cpu_count", lambda: fake.cpus)
    busy = BusyCores(fake.stat, fake.own)
    busy.INTERVAL_S = 0.0
    return busy


def test_busy_cores_are_the_cpu_time_not_ours(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeProc(tmp_path)
    busy = _busy(fake, monkeypatch)
    assert busy.read() is None  # nothing to compare with yet
    fake.run(1.0, machine_cores=1.25, our_cores=1.0)  # the frontend and a client beside us: a quarter of a core
    assert busy.read() == pytest.approx(0.25)
    fake.run(1.0, machine_cores=2.0, our_cores=0.0)
    assert busy.read() == pytest.approx(2.0)
    busy = _busy(fake, monkeypatch)
    seen = []
    for _ in range(8):
        fake.run(0.5, machine_cores=2.0, our_cores=1.0)  # one other core busy, steadily
        seen.append(busy.busy())
    assert seen[0] == 0 and seen[-1] == 1 and seen == sorted(seen)  # smoothed: a steady load within a few reads
    assert BusyCores(tmp_path / "missing", fake.own).read() is None


def test_a_step_gets_no_more_threads_than_the_free_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeProc(tmp_path)
    plan = ThreadPlan(2, 2, _busy(fake, monkeypatch), machine_cores=2)
    for _ in range(8):
        fake.run(0.5, machine_cores=1.3, our_cores=1.0)
        assert plan.for_step(1) == 2  # a light load takes no thread away
    for _ in range(8):
        fake.run(0.5, machine_cores=2.0, our_cores=0.5)
        threads = plan.for_step(BIG_STEP_TOKENS)
    assert threads == 1  # at least one, however busy


def _spin() -> None:
    while True:
        pass


def test_a_process_spinning_a_core_is_seen() -> None:
    """The real /proc: another process that spins is one busy core (or more, on a busy machine)."""
    spinner = multiprocessing.Process(target=_spin, daemon=True)
    spinner.start()
    try:
        busy = BusyCores()
        busy.INTERVAL_S = 0.0
        deadline = time.monotonic() + 30
        while busy.busy() < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert busy.busy() >= 1
    finally:
        spinner.kill()
        spinner.join()


def test_ranks_sharing_a_machine_do_not_take_each_others_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two tensor-parallel ranks on 16 cores plan 8 threads each; each sees the other's 8 busy
    cores, which leaves its own 8 (a plan that counted only its share would have dropped to 1)."""
    fake = FakeProc(tmp_path, cpus=16)
    monkeypatch.setattr("worker.cpu_threads.available_cores", lambda: 16)
    plan = choose_cpu_threads(0, 135_000_000, cores=8)
    assert plan.busy is not None
    plan.busy = _busy(fake, monkeypatch)
    for _ in range(8):
        fake.run(0.5, machine_cores=16.0, our_cores=8.0)
        threads = plan.for_step(1)
    assert threads == 8
