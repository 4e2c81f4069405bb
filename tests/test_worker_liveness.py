"""Liveness that means progress: a worker whose main loop is stuck inside a step (a C kernel, a
collective, a lock) while its heartbeat thread beats on is found by the plan in flight making no
progress, and is killed, restarted and its requests recomputed as after a crash — one engine,
one of two data-parallel engines, a tensor-parallel group. The stall is the worker's test-only
fault injection (``SLUICE_TEST_STALL_STEP``), not SIGSTOP, which freezes the heartbeats too.
Also the hang rule alone (``PlanClock``): a long prefill is not a hang, a stalled decode is."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from sluice_server import child_pid, running_server
from test_serve_worker_crash import SHORT, Stream, complete, wait_until
from test_worker_process import FakeScheduler

from protocol.messages import NewRequest, SamplingParams, StepPlan, StepTokens, WorkerHeartbeat
from protocol.process_identity import process_identity
from scheduler.workers import (
    COLD_FLOOR_S,
    HANG_FLOOR_S,
    LAG_S,
    PlanClock,
    Workers,
    step_work,
)
from worker.model.tiny import materialize_tiny

AUTH = {"Authorization": "Bearer t"}
STALL_S = 150  # far longer than anything here waits: only a kill ends it


# ------------------------------------------------------------------ the rule alone


def work(rows: list[tuple[int, int]]) -> float:
    """``step_work`` of a step whose rows compute (tokens, reaching context) each."""
    return step_work(sum(n for n, _ in rows), sum(n * c for n, c in rows))


def _measured(clock: PlanClock, t: float, rows: list[tuple[int, int]], busy_s: float, steps: int = 1) -> float:
    """A plan of ``rows`` ((tokens, context) each) run for ``steps`` steps of ``busy_s`` each,
    sent at ``t``; returns when it ended."""
    later = work([(1, c) for _, c in rows])
    clock.sent(work(rows), later, t)
    for i in range(steps):
        t += busy_s
        clock.step_done(busy_s, i == steps - 1, t)
    return t


def _warm_clock(t: float = 1000.0) -> tuple[PlanClock, float]:
    """A clock past its worker's first step, having measured one-row decode steps of 10 ms and
    64-row decode steps of 64 ms (1 ms a row: a batch's tokens as cheap as they come)."""
    clock = PlanClock()
    clock.new_life(t)
    t = _measured(clock, t, [(20, 20)], 0.05)
    for _ in range(20):
        t = _measured(clock, t, [(1, 100)], 0.01, steps=8)
    for _ in range(20):
        t = _measured(clock, t, [(1, 200)] * 64, 0.064, steps=8)
    assert not clock.plans and not clock.cold
    return clock, t


def _hung_after(clock: PlanClock, start: float, horizon: float) -> float | None:
    """Seconds from ``start`` to the verdict, checking every 0.05 s as the scheduler does (None:
    none within ``horizon``)."""
    for i in range(1, int(horizon / 0.05) + 1):
        if clock.overdue(start + i * 0.05) is not None:
            return i * 0.05
    return None


def test_a_long_prefill_after_cheap_batched_decodes_is_not_a_hang() -> None:
    # An 8k-token prompt in one step took 86 s on a 2-core AVX2 machine (docs/benchmarks.md):
    # the steps measured before it were batched decodes, the cheapest tokens there are.
    clock, t = _warm_clock()
    clock.sent(work([(8192, 8192)]), 0.0, t)
    assert _hung_after(clock, t, 2 * 86.0) is None
    assert clock.limit() >= 4 * 86.0, clock.limit()
    clock.step_done(86.0, True, t + 86.0)
    assert not clock.plans


def test_an_8k_prompt_in_one_step_after_its_chunks_were_measured_is_not_a_hang() -> None:
    # 2k chunks at a growing context (their cost grows with it), then a whole 8k prompt at once.
    clock, t = _warm_clock()
    for i, busy in enumerate([9.0, 12.0, 15.0, 18.0]):
        t = _measured(clock, t, [(2048, 2048 * (i + 1))], busy)
    clock.sent(work([(8192, 8192)]), 0.0, t)
    assert _hung_after(clock, t, 150.0) is None
    assert clock.limit() >= 3 * 86.0, clock.limit()


def test_the_first_prompt_of_a_worker_with_nothing_measured_is_not_a_hang() -> None:
    clock = PlanClock()
    clock.new_life(0.0)
    clock.sent(work([(8192, 8192)]), 0.0, 0.0)
    assert clock.limit() > 3600  # 20 tokens a second, each weighted by its context
    clock = PlanClock()
    clock.new_life(0.0)
    clock.sent(work([(12, 12)]), work([(1, 13)]), 0.0)  # a short first prompt: lazy start-up
    assert _hung_after(clock, 0.0, COLD_FLOOR_S - 1) is None


def test_a_stalled_decode_is_a_hang_within_seconds() -> None:
    clock, t = _warm_clock()
    clock.sent(work([(1, 120)]), work([(1, 128)]), t)
    clock.step_done(0.01, False, t + 0.01)
    clock.step_done(0.01, False, t + 0.02)  # then nothing: stuck inside its third step
    after = _hung_after(clock, t + 0.02, 30.0)
    assert after is not None and HANG_FLOOR_S <= after <= HANG_FLOOR_S + 0.1, after
    verdict = clock.overdue(t + 0.02 + after)
    assert verdict is not None and "no progress" in verdict and "limit is 5 s" in verdict
    # A batch of 64 stuck the same way: as quickly.
    clock, t = _warm_clock()
    clock.sent(work([(1, 300)] * 64), work([(1, 308)] * 64), t)
    assert _hung_after(clock, t, 30.0) == pytest.approx(HANG_FLOOR_S + 0.05)


def test_a_moving_step_count_is_progress_a_still_one_is_not() -> None:
    clock, t = _warm_clock()
    clock.heartbeat(1, 4242, 100, t)  # another rank's count, as last seen
    clock.sent(work([(1, 120)]), 0.0, t)
    hung_at = None
    for i in range(1, 400):  # checks every 0.05 s, a heartbeat every 0.5 s
        now = t + i * 0.05
        if i % 10 == 0:  # it finishes a step at 4 s (the group moved), then beats on, no further
            clock.heartbeat(1, 4242, 101 if i >= 80 else 100, now)
        if clock.overdue(now) is not None:
            hung_at = i * 0.05
            break
    assert hung_at == pytest.approx(4.0 + HANG_FLOOR_S + 0.05)
    # A restarted rank (another pid) counting from 0 is no step back: it is the new process's count.
    clock.new_life(t + 20)
    clock.heartbeat(1, 5151, 0, t + 20)
    assert clock.counts == {(1, 5151): 0}


def test_a_plan_queued_behind_the_running_one_is_timed_from_when_that_one_ends() -> None:
    clock, t = _warm_clock()
    clock.sent(work([(1, 120)]), work([(1, 121)]), t)
    clock.sent(work([(1, 128)]), work([(1, 129)]), t + 0.001)  # async scheduling: the next window
    for i in range(8):
        clock.step_done(0.5, i == 7, t + 0.5 * (i + 1))
    assert len(clock.plans) == 1 and clock.since == t + 4.0
    assert clock.overdue(t + 8.5) is None


def test_the_schedulers_own_stall_is_not_counted_against_the_worker() -> None:
    clock, t = _warm_clock()
    clock.sent(work([(1, 120)]), 0.0, t)
    assert clock.overdue(t + 1.0) is None
    assert clock.overdue(t + 1.0 + LAG_S + 6.0) is None  # the scheduler did not run for 7 s
    assert _hung_after(clock, t + 8.0, 10.0) is not None  # it did afterwards: then the worker is hung


def test_a_first_step_after_a_long_idle_gets_the_cold_floor_again() -> None:
    clock, t = _warm_clock()
    clock.sent(work([(1, 120)]), 0.0, t + 3600)
    assert clock.cold and clock.overdue(t + 3600 + HANG_FLOOR_S + 1) is None
    clock.step_done(0.01, True, t + 3600.01)
    assert not clock.cold


def test_step_work_weights_each_token_by_its_context() -> None:
    assert step_work(0, 0) == 0.0
    assert step_work(1, 0) == 1.0
    assert work([(2048, 2048)]) == 2048 * 3.0  # a 2k prompt chunk reaching 2k tokens of context
    assert work([(1, 1024)] * 4) == 8.0  # four decode rows at 1k


def test_a_pid_is_killed_only_if_it_is_the_process_the_heartbeats_described() -> None:
    workers = Workers(2, 3)
    workers.heard_process(0, os.getpid(), "another boot, another namespace, another start")
    workers.heard_process(1, 2**22 + 12345, process_identity(os.getpid()))  # no such pid
    done = workers.kill()
    assert "killed" not in done and "rank 0, 1 not running on this machine" in done, done
    assert not workers.processes


# ------------------------------------------------------------------ the worker's side


def test_heartbeats_carry_the_step_count_and_an_identity_the_scheduler_can_check(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    tiny = materialize_tiny(tmp_path_factory.mktemp("cache"))
    s = FakeScheduler(tmp_path, model=str(tiny), num_kv_blocks=16, dtype="float32")
    try:
        s.receive()  # WorkerReady
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        s.send(StepPlan(1, [NewRequest(7, [1, 40, 41], 3, params)], [7], [3], [[3]], num_steps=5))
        steps = []
        while not steps or not steps[-1].last:
            msg = s.receive()
            assert isinstance(msg, StepTokens), msg
            steps.append(msg)
        beat: Any = None
        while beat is None or beat.steps < len(steps):
            beat = s.receive(heartbeats=True)
            assert isinstance(beat, WorkerHeartbeat)
        assert beat.steps == len(steps) == 5
        assert beat.pid == s.proc.pid
        assert beat.process and beat.process == process_identity(s.proc.pid)
        assert process_identity(os.getpid()) != beat.process  # another process is not it
    finally:
        s.close()


# ------------------------------------------------------------------ through the real server


def _stall(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, step: int, rank: int | None = None) -> Path:
    """Have the server's workers stall inside their ``step``th step, once (the marker file says
    which worker did); returns the marker's path."""
    marker = tmp_path / "stalled.json"
    monkeypatch.setenv("SLUICE_TEST_STALL_STEP", f"{step}:{STALL_S}" + (f":{rank}" if rank is not None else ""))
    monkeypatch.setenv("SLUICE_TEST_STALL_ONCE", str(marker))
    return marker


def _stalled(marker: Path) -> tuple[dict[str, Any], float]:
    """Once a worker has stalled: what it wrote, and when (monotonic, about)."""
    wait_until(lambda: marker.exists() and marker.stat().st_size > 0, 120)
    return json.loads(marker.read_text()), time.monotonic()


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return None


def test_one_engine_a_worker_stuck_inside_a_step_is_killed_restarted_and_its_stream_completes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = _stall(monkeypatch, tmp_path, 20)
    with running_server("--admin-token", "t", log_dir=tmp_path) as server:
        url = server.url
        old = child_pid(server, b"worker")
        stream = Stream(url, SHORT, 300)
        who, stalled_at = _stalled(marker)
        assert who["pid"] == old and who["rank"] == 0
        reasons: list[str] = []

        def unhealthy() -> bool:
            r = httpx.get(f"{url}/health", timeout=5)
            reasons.append(r.json().get("reason", "") if r.status_code == 503 else "")
            return r.status_code == 503

        wait_until(unhealthy, 30)
        noticed = time.monotonic() - stalled_at
        assert noticed < HANG_FLOOR_S + 10, f"the stuck worker was noticed only after {noticed:.1f} s"
        assert "worker lost (no progress for" in reasons[-1], reasons[-1]
        stream.join()
        assert stream.errors == [] and stream.finish_reason == "length", (stream.errors, server.log())
        assert child_pid(server, b"worker") != old  # killed and started again
        assert stream.text == complete(url, SHORT, 300)  # recomputed: the undisturbed greedy text
        log = server.log()
        assert f"killed rank 0 (pid {old})" in log, log


def test_data_parallel_the_engine_whose_worker_is_stuck_leaves_the_rotation_and_requests_complete(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = _stall(monkeypatch, tmp_path, 20)
    with running_server("--data-parallel-size", "2", "--admin-token", "t", "--num-kv-blocks", "256",
                        log_dir=tmp_path) as server:
        url = server.url
        stream = Stream(url, SHORT, 300)
        who, stalled_at = _stalled(marker)
        engine = int(str(who["address"])[-1])

        def engine_stats() -> dict[str, Any]:
            return dict(httpx.get(f"{url}/admin/stats", headers=AUTH).json()["engines"][engine])

        seen: list[dict[str, Any]] = []

        def out_of_rotation() -> bool:
            seen[:] = [engine_stats()]
            return not seen[0]["in_rotation"]

        wait_until(out_of_rotation, HANG_FLOOR_S + 15)
        assert time.monotonic() - stalled_at < HANG_FLOOR_S + 15
        assert "worker lost (no progress for" in seen[0].get("reason", ""), seen[0]
        for i in range(3):  # the other engine serves meanwhile: nothing waits on the stuck one
            started = time.monotonic()
            assert complete(url, [1, 7 + i, 9, 11], 4)
            assert time.monotonic() - started < 10
        stream.join()
        assert stream.errors == [] and stream.finish_reason == "length", (stream.errors, server.log())
        assert stream.text == complete(url, SHORT, 300)
        wait_until(lambda: engine_stats()["in_rotation"], 60)  # its restarted worker brought it back
        assert f"killed rank 0 (pid {who['pid']})" in server.log()


@pytest.fixture(scope="module")
def kv2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from checkpoints import save_llama_checkpoint

    return save_llama_checkpoint(tmp_path_factory.mktemp("tp") / "kv2")


def test_tensor_parallel_a_rank_stuck_inside_a_step_restarts_the_whole_group(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kv2: Path) -> None:
    marker = _stall(monkeypatch, tmp_path, 20, rank=1)
    with running_server("--model", str(kv2), "--tensor-parallel-size", "2", "--admin-token", "t",
                        "--max-model-len", "512", log_dir=tmp_path) as server:
        url = server.url

        def rank_pid(rank: int) -> int:
            return child_pid(server, b"worker", f'"rank":{rank},'.encode())

        olds = [rank_pid(0), rank_pid(1)]
        stream = Stream(url, SHORT, 200)
        who, stalled_at = _stalled(marker)
        assert who["rank"] == 1 and who["pid"] == olds[1]
        wait_until(lambda: _status(f"{url}/health") == 503, 30)
        assert time.monotonic() - stalled_at < HANG_FLOOR_S + 10
        stream.join()
        assert stream.errors == [] and stream.finish_reason == "length", (stream.errors, server.log())
        assert stream.text == complete(url, SHORT, 200)
        assert rank_pid(0) != olds[0] and rank_pid(1) != olds[1]  # the group started again whole
        log = server.log()
        assert f"killed rank 0 (pid {olds[0]}), rank 1 (pid {olds[1]})" in log, log
        assert log.count("the hung worker:") == 1, log  # (not while the ranks announced themselves one by one)

