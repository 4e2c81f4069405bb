"""Scheduler overhead alone (no processes, no torch): microseconds per schedule() + update().

    python scripts/bench_scheduler.py                      # every scenario, median of 3 rounds
    python scripts/bench_scheduler.py --scenarios a,e --rounds 1
    python scripts/bench_scheduler.py --json sched.json    # also save the figures
    python scripts/bench_scheduler.py --prefix-caching     # every scenario with the prefix cache on
    python scripts/bench_scheduler.py --vllm-python V/bin/python   # vLLM's scheduler beside it, same run

The five workloads vLLM's V1 scheduler is timed on (block size 16, chunked prefill, max model
length 8192, one step per plan):

* a: 256 running requests (prompt 128) decoding; steady decode steps are timed.
* b: 1024 prompts of 512 tokens arrive at once (token budget 2048, 256 seats, 128 outputs each);
  steps are timed until every prompt is prefilled.
* c: b with random priorities 0-99 under the ``priority`` policy.
* d: prefix caching on, 256 prompts sharing a 1024-token prefix plus 64 tokens of their own;
  admission steps (until all are prefilled) and the decode steps after them are timed apart.
* e: 256 requests (prompt 128, 512 outputs) and half the KV blocks they need: run to completion,
  preempting (recompute).

Only schedule() and update() are timed; building requests and the worker's reply is not. Each
scenario runs ``--rounds`` times, interleaved; a figure is the median of the rounds' figures.

The ratio is against vLLM's p50 for the same workload. With ``--vllm-python`` (default
$SLUICE_VLLM_PYTHON), a Python that has vLLM 0.32 (docs/benchmarks.md: a venv for it) runs
scripts/bench_scheduler_vllm.py beside this one: vLLM's V1 scheduler driven through these same
scenarios and requests, each round running a scenario here and then there, so that the machine's
drift hits both and the ratio is of two figures from one run. Without it the ratio is against
``VLLM_P50_US``, figures measured in another run, on another machine, long ago.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from protocol.config import SchedulerConfig
from protocol.messages import AddRequest, SamplingParams, StepPlan, StepTokens
from scheduler.scheduler import Scheduler

BLOCK_SIZE = 16
MAX_MODEL_LEN = 8192
EOS = 2
OUTPUT_TOKEN = 5  # what the "worker" samples every time (never EOS; the requests ignore it anyway)
VOCAB = range(3, 32000)

# vLLM 0.32's V1 scheduler, p50 microseconds per step on this machine class (2-core VM), for the
# same five workloads: measured by the project and reported in its issue 13, in a run of its own
# on another VM (stale: --vllm-python measures them in the same run instead).
VLLM_P50_US_SOURCE = "reported in issue 13 (stored here 2026-11-23), measured on another 2-core VM"
VLLM_P50_US: dict[str, float] = {
    "a": 2041,
    "b": 2119,
    "c": 2073,
    "d-admission": 9932,
    "d-decode": 2118,
    "e": 1206,
}
TARGET_RATIO = 0.1  # issue 43's goal: at most a tenth of vLLM's p50 in every scenario

# Settings the command line imposes on every scenario (``--prefix-caching``).
FORCED_CONFIG: dict[str, object] = {}

A_DECODE_STEPS = 500
D_DECODE_STEPS = 256


# ---------------------------------------------------------------------------- the driver


class Driver:
    """A scheduler plus the least of a worker, which the scenarios step: Sluice's (``Harness``,
    below) or vLLM's (``VllmHarness`` in bench_scheduler_vllm.py). The scenarios see only this, so
    both schedulers get the same requests, phases and stop conditions."""

    def __init__(self) -> None:
        self.sampled: set[int] = set()  # rids that have sampled at least one token

    def step(self) -> int | None:
        """One schedule() + update(); their nanoseconds, or None if nothing was scheduled."""
        raise NotImplementedError

    def all_decoding(self, num_requests: int) -> bool:
        """Whether the last step ran ``num_requests`` rows of one token each."""
        raise NotImplementedError

    def unfinished(self) -> int:
        """Requests the scheduler still holds."""
        raise NotImplementedError

    def preemptions(self) -> int:
        """Preemptions so far."""
        raise NotImplementedError

    def steps_until(self, done: Callable[[], bool]) -> list[int]:
        """Step until ``done()`` (checked after each step) or nothing is left; the step times."""
        times = []
        while not done():
            ns = self.step()
            if ns is None:
                break
            times.append(ns)
        return times

    def steps(self, n: int) -> list[int]:
        times = [self.step() for _ in range(n)]
        if any(ns is None for ns in times):
            raise RuntimeError(f"the requests finished before {n} timed steps")
        return [ns for ns in times if ns is not None]


# Builds a driver from the scenario's configuration (Sluice's; vLLM's driver translates it), its KV
# cache size in blocks and its requests.
MakeDriver = Callable[[SchedulerConfig, int, list[AddRequest]], Driver]


class Harness(Driver):
    """Sluice's scheduler. Its worker knows how many tokens each row still has to compute, which
    is all it takes to know which rows sample a token at a step (those whose prompt, or
    recomputed context, is then complete)."""

    def __init__(self, config: SchedulerConfig, num_blocks: int, requests: list[AddRequest]) -> None:
        super().__init__()
        self.sched = Scheduler(config, num_blocks, BLOCK_SIZE, MAX_MODEL_LEN, [EOS])
        for msg in requests:
            refused = self.sched.add(msg)
            if refused:
                raise SystemExit(f"request {msg.rid} refused: {refused[0].message}")
        self.left: dict[int, int] = {}  # rid -> tokens the worker has yet to compute
        self.last_plan: StepPlan | None = None

    def step(self) -> int | None:
        """One schedule() + update(); their nanoseconds, or None if nothing was scheduled."""
        t0 = time.perf_counter_ns()
        plan = self.sched.schedule()
        t1 = time.perf_counter_ns()
        self.last_plan = plan
        if plan is None:
            if self.sched.has_work:
                raise RuntimeError("the scheduler has work but scheduled nothing")
            return None
        rids = self._run(plan)
        reply = StepTokens(plan.plan_id, 0, rids, [OUTPUT_TOKEN] * len(rids), True)
        t2 = time.perf_counter_ns()
        self.sched.update(reply)
        t3 = time.perf_counter_ns()
        return (t1 - t0) + (t3 - t2)

    def _run(self, plan: StepPlan) -> list[int]:
        """The rows that sample this step, as the worker would find them."""
        left = self.left
        for rid in plan.forget:
            left.pop(rid, None)
        for new in plan.new_requests:
            left[new.rid] = len(new.token_ids) - new.num_computed
        sampling = []
        for rid, n in zip(plan.rids, plan.num_tokens, strict=True):
            left[rid] -= n
            if left[rid] < 0:
                raise RuntimeError(f"rid {rid} was scheduled past its tokens")
            if left[rid] == 0:
                sampling.append(rid)
                left[rid] = 1  # the sampled token is computed at its next step
        self.sampled.update(sampling)
        return sampling

    def all_decoding(self, num_requests: int) -> bool:
        plan = self.last_plan
        return plan is not None and len(plan.rids) == num_requests and all(n == 1 for n in plan.num_tokens)

    def unfinished(self) -> int:
        return len(self.sched.requests)

    def preemptions(self) -> int:
        return self.sched.num_preemptions


# ---------------------------------------------------------------------------- workloads


def config(**overrides: object) -> SchedulerConfig:
    base: dict[str, object] = dict(max_num_batched_tokens=2048, max_num_seqs=256, num_scheduler_steps=1,
                                   async_scheduling=False, scheduling_policy="fcfs",
                                   enable_prefix_caching=False, preemption_mode="recompute")
    return SchedulerConfig(**(base | overrides | FORCED_CONFIG))  # type: ignore[arg-type]


def request(rid: int, prompt: list[int], max_tokens: int, priority: int = 0) -> AddRequest:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return AddRequest(rid, f"bench-{rid}", prompt, sampling, priority, "", 0.0)  # all arrive at once


def unique_requests(n: int, prompt_len: int, max_tokens: int, rng: random.Random,
                    priorities: bool = False) -> list[AddRequest]:
    return [request(rid, rng.choices(VOCAB, k=prompt_len), max_tokens, rng.randrange(100) if priorities else 0)
            for rid in range(n)]


def blocks_needed(requests: list[AddRequest]) -> int:
    """KV blocks for every request at its longest, with no prefix shared."""
    return sum(-(-(len(r.prompt_token_ids) + r.sampling.max_tokens) // BLOCK_SIZE) for r in requests)


def scenario_a(rng: random.Random, make: MakeDriver) -> dict[str, list[int]]:
    warmup = 64  # steps enough to admit all 256 prompts (16 per step under a 2048-token budget)
    requests = unique_requests(256, 128, warmup + A_DECODE_STEPS + 16, rng)
    h = make(config(), blocks_needed(requests), requests)
    h.steps_until(lambda: h.all_decoding(len(requests)))
    return {"a": h.steps(A_DECODE_STEPS)}


def _prefill_all(requests: list[AddRequest], cfg: SchedulerConfig, make: MakeDriver) -> list[int]:
    h = make(cfg, blocks_needed(requests), requests)
    return h.steps_until(lambda: len(h.sampled) == len(requests))


def scenario_b(rng: random.Random, make: MakeDriver) -> dict[str, list[int]]:
    return {"b": _prefill_all(unique_requests(1024, 512, 128, rng), config(), make)}


def scenario_c(rng: random.Random, make: MakeDriver) -> dict[str, list[int]]:
    requests = unique_requests(1024, 512, 128, rng, priorities=True)
    return {"c": _prefill_all(requests, config(scheduling_policy="priority"), make)}


def scenario_d(rng: random.Random, make: MakeDriver) -> dict[str, list[int]]:
    prefix = rng.choices(VOCAB, k=1024)
    requests = [request(rid, prefix + rng.choices(VOCAB, k=64), D_DECODE_STEPS + 16) for rid in range(256)]
    h = make(config(enable_prefix_caching=True), blocks_needed(requests), requests)
    admission = h.steps_until(lambda: len(h.sampled) == len(requests))
    return {"d-admission": admission, "d-decode": h.steps(D_DECODE_STEPS)}


def scenario_e(rng: random.Random, make: MakeDriver) -> dict[str, list[int]]:
    requests = unique_requests(256, 128, 512, rng)
    h = make(config(), blocks_needed(requests) // 2, requests)
    times = h.steps_until(lambda: False)
    if h.unfinished():
        raise RuntimeError(f"{h.unfinished()} requests left unfinished")
    if not h.preemptions():
        raise RuntimeError("half the KV cache the requests need, and no preemption")
    return {"e": times}


SCENARIOS: dict[str, Callable[[random.Random, MakeDriver], dict[str, list[int]]]] = {
    "a": scenario_a,
    "b": scenario_b,
    "c": scenario_c,
    "d": scenario_d,
    "e": scenario_e,
}


# ---------------------------------------------------------------------------- figures


@dataclass
class Figures:
    """One phase's figures, a dict per round (see ``summarize``), and its wall seconds over all
    rounds."""

    rounds: list[dict[str, float]] = field(default_factory=list)
    wall_s: float = 0.0

    def median(self, key: str) -> float:
        return statistics.median(r[key] for r in self.rounds)

    def medians(self) -> dict[str, object]:
        """The medians over rounds, and the rounds themselves (what --json keeps)."""
        figures: dict[str, object] = {"steps": int(self.median("steps"))}
        figures.update({f"p{q}_us": self.median(f"p{q}_us") for q in (50, 90, 99)})
        return figures | {"wall_s": self.wall_s, "rounds": self.rounds}


def summarize(times_ns: list[int]) -> dict[str, float]:
    """One phase's figures in one run: p50/p90/p99 microseconds per step, and its steps."""
    ordered = sorted(times_ns)
    return {f"p{q}_us": percentile(ordered, q) / 1e3 for q in (50, 90, 99)} | {"steps": len(ordered)}


def percentile(ordered: list[int], q: int) -> float:
    """Nearest-rank percentile of a sorted, non-empty list."""
    rank = max(1, -(-q * len(ordered) // 100))
    return float(ordered[rank - 1])


def record(figures: dict[str, Figures], phases: dict[str, dict[str, float]], wall_s: float) -> None:
    """Add one run of a scenario: its phases' figures, and its wall time shared among them."""
    for phase, run in phases.items():
        fig = figures.setdefault(phase, Figures())
        fig.rounds.append(run)
        fig.wall_s += wall_s / len(phases)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """No warnings while timing (every preemption logs one), and a clean heap to start from."""
    logging.disable(logging.WARNING)
    gc.collect()
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def run_scenario(name: str, seed: int, make: MakeDriver) -> tuple[dict[str, dict[str, float]], float]:
    """One run of a scenario on the scheduler ``make`` builds: its phases' figures, and its wall
    seconds (setup included)."""
    start = time.perf_counter()
    with quiet():
        phases = SCENARIOS[name](random.Random(seed), make)
    return {phase: summarize(times) for phase, times in phases.items()}, time.perf_counter() - start


# ---------------------------------------------------------------------------- vLLM's side


class VllmSide:
    """vLLM's scheduler: scripts/bench_scheduler_vllm.py --serve, run by a Python that has vLLM and
    kept for the whole run (importing vLLM takes seconds). A line of JSON per scenario run goes to
    its stdin, a line of figures comes back on its stdout; its stderr is ours, for its errors."""

    def __init__(self, python: str, prefix_caching: bool) -> None:
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_scheduler_vllm.py")
        argv = [python, script, "--serve"] + (["--prefix-caching"] if prefix_caching else [])
        self.python = python
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        except OSError as e:
            raise SystemExit(f"--vllm-python {python}: {e}") from e
        self.version: str = self._read()["vllm"]  # it says so once vLLM is imported

    def run(self, name: str, seed: int) -> tuple[dict[str, dict[str, float]], float]:
        """One run of a scenario, as ``run_scenario``."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"scenario": name, "seed": seed}) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        return reply["phases"], reply["wall_s"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"vLLM's side ({self.python}) exited with status {self.proc.wait()}; "
                             "its error is above")
        return json.loads(line)

    def close(self) -> None:
        """End its input, on which it exits; kill it if it does not."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------------------- the run


def measure(names: list[str], rounds: int, seed: int,
            vllm: VllmSide | None) -> tuple[dict[str, Figures], dict[str, Figures]]:
    """Sluice's figures and vLLM's (empty without it). Each round runs every scenario on Sluice's
    scheduler and then on vLLM's: whatever slows the machine meanwhile slows both alike."""
    ours: dict[str, Figures] = {}
    theirs: dict[str, Figures] = {}
    for _ in range(rounds):
        for name in names:
            record(ours, *run_scenario(name, seed, Harness))
            if vllm is not None:
                record(theirs, *vllm.run(name, seed))
    return ours, theirs


def report(ours: dict[str, Figures], theirs: dict[str, Figures],
           vllm_version: str | None) -> dict[str, dict[str, object]]:
    same_run = vllm_version is not None
    vllm_cols = f"{'vLLM steps':>10} {'vLLM p50':>9} {'vLLM p99':>9}" if same_run else f"{'vLLM p50':>9}"
    print(f"{'scenario':<12} {'steps':>6} {'p50 us':>9} {'p90 us':>9} {'p99 us':>9} {vllm_cols} "
          f"{'ratio':>6} {'target':>6} {'wall s':>7}")
    out: dict[str, dict[str, object]] = {}
    for phase, fig in ours.items():
        row = fig.medians()
        vllm_row: dict[str, object] | None
        p50 = fig.median("p50_us")
        if same_run:
            them = theirs[phase]
            vllm_p50, vllm_row = them.median("p50_us"), them.medians()
            cols = f"{int(them.median('steps')):>10} {vllm_p50:>9,.0f} {them.median('p99_us'):>9,.0f}"
        else:
            vllm_p50, vllm_row = VLLM_P50_US[phase], None
            cols = f"{vllm_p50:>9,.0f}"
        ratio = p50 / vllm_p50
        mark = "" if ratio <= TARGET_RATIO else "  > target"
        print(f"{phase:<12} {row['steps']:>6} {p50:>9,.0f} {fig.median('p90_us'):>9,.0f} "
              f"{fig.median('p99_us'):>9,.0f} {cols} {ratio:>6.2f} {TARGET_RATIO:>6.2f} {fig.wall_s:>7.1f}{mark}")
        out[phase] = row | {"vllm_p50_us": vllm_p50, "vllm_same_run": same_run, "ratio": ratio,
                            "target": TARGET_RATIO, "vllm": vllm_row}
    if same_run:
        print(f"(medians over rounds; vLLM = vLLM {vllm_version}'s V1 scheduler on the same requests in this "
              f"run, round by round after ours;\n ratio = p50 / vLLM p50, target <= {TARGET_RATIO} (issue 43); "
              f"wall s = our whole run of the phase, setup included, all rounds)")
    else:
        print(f"(medians over rounds; ratio = p50 / vLLM 0.32's p50, target <= {TARGET_RATIO} (issue 43); "
              f"wall s = the phase's whole run, setup included, all rounds)\n"
              f"vLLM p50 is stale: {VLLM_P50_US_SOURCE}, not in this run; "
              f"run with --vllm-python for a same-run ratio")
    return out


def cpu_model() -> str:
    """The CPU's model line, as /proc/cpuinfo names it."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    return "unknown"


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, of: a,b,c,d,e")
    p.add_argument("--rounds", type=int, default=3, help="runs of each scenario; figures are medians")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="also write the figures here")
    p.add_argument("--prefix-caching", action="store_true",
                   help="turn the prefix cache on in every scenario (a, b, c, e then pay for hashing their blocks, "
                        "with no hits); vLLM's side too with --vllm-python, while the stored vLLM figures are "
                        "those of the usual configuration")
    p.add_argument("--vllm-python", metavar="PATH", default=os.environ.get("SLUICE_VLLM_PYTHON") or None,
                   help="a Python that has vLLM 0.32: its V1 scheduler runs the same scenarios in this run, "
                        "for a same-run ratio (default: $SLUICE_VLLM_PYTHON; without either, the ratio is "
                        "against stale figures)")
    args = p.parse_args()
    if args.prefix_caching:
        FORCED_CONFIG["enable_prefix_caching"] = True
    names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown or not names or args.rounds < 1:
        p.error(f"--scenarios takes some of {','.join(SCENARIOS)}; --rounds must be >= 1")
    # What the figures were measured on, and how busy it was: figures from a busy machine are noise.
    host = {"cpu": cpu_model(), "cores": os.cpu_count(), "load_average_start": load_average()}
    print(f"cpu: {host['cpu']}, {host['cores']} cores; load average at start {host['load_average_start']} "
          "(1, 5, 15 min)", flush=True)
    vllm = None
    if args.vllm_python:
        print(f"vLLM's side: {args.vllm_python} (importing vLLM takes a while) ...", end=" ", flush=True)
        vllm = VllmSide(args.vllm_python, args.prefix_caching)
        print(f"vLLM {vllm.version}", flush=True)
    try:
        ours, theirs = measure(names, args.rounds, args.seed, vllm)
    finally:
        if vllm is not None:
            vllm.close()
    results = report(ours, theirs, vllm.version if vllm else None)
    host["load_average_end"] = load_average()
    print(f"load average at the end {host['load_average_end']}")
    if args.json:
        source = {"python": args.vllm_python, "version": vllm.version} if vllm else {"stale": VLLM_P50_US_SOURCE}
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "seed": args.seed, "prefix_caching": args.prefix_caching,
                       "target_ratio": TARGET_RATIO, "vllm": source} | host | {"scenarios": results},
                      f, indent=2)


if __name__ == "__main__":
    main()
