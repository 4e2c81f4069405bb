"""Time and profile the worker's decode steps, no server: the runner driven in this process.

    python scripts/profile_step.py                              # SmolLM2, float32, 1 16 64 rows
    python scripts/profile_step.py --dtype float32 bfloat16     # both dtypes, interleaved
    python scripts/profile_step.py --dtype auto auto:bfloat16   # the model's dtype, with its KV cache in bfloat16 too
    python scripts/profile_step.py --rows 64 --profile          # + torch.profiler's table
    python scripts/profile_step.py --dtype bfloat16 --paths fused per-operator   # the decoder stack's two paths
    python scripts/profile_step.py --count-ops                 # Python-level calls per decode step
    python scripts/profile_step.py --dtype bfloat16 --prefill 128 512 2048   # first-chunk prefill, C kernel vs SDPA

For each dtype a worker is loaded once; every round, each (dtype, rows) cell prefills ``rows``
prompts of ``--context`` tokens (not timed) and then times ``--steps`` decode steps in plans of
``--window`` steps (multi-step, as the server runs them). A figure is the median over
``--rounds`` of the per-step time; cells are interleaved, so drift on a noisy machine hits
every cell alike. ``--count-ops`` counts the Python-level operations of a decode step (every
Python function call and every call into C: torch operators, ctypes, builtins, through
``sys.setprofile``) over one more window per cell. ``--prefill N ...`` times instead one prompt
of N tokens prefilled in one step (a first chunk), attention through the worker's own backend
(the C kernel on a CPU) and through the torch reference (gather + SDPA), interleaved.
``--paths`` times the CPU's whole-stack decoder (``fused``: one C call per
step, where it runs) against the per-operator forward, side by side. ``--profile`` prints the profiler's table of one more window per cell.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch

from protocol.config import WorkerConfig
from protocol.messages import NewRequest, SamplingParams, StepPlan
from worker.attention import SdpaBackend
from worker.cpu_threads import configure_cpu_threads
from worker.engine import Worker


class StepTimer:
    def __init__(self, model: str, dtype: str, biggest: int, context: int, steps: int, threads: int,
                 longest_prefill: int = 0) -> None:
        self.bs, self.context, self.steps = 16, context, steps
        self.per_seq = -(-(context + steps + 64) // self.bs)
        blocks = max(biggest * self.per_seq, -(-longest_prefill // self.bs)) + 1
        dtype, _, kv_cache_dtype = dtype.partition(":")  # "float32:bfloat16": --kv-cache-dtype bfloat16
        self.worker = Worker(WorkerConfig(model=model, dtype=dtype, kv_cache_dtype=kv_cache_dtype or "auto",
                                          num_kv_blocks=blocks, block_size=self.bs, log_level="warning"))
        self.worker.runner.threads = configure_cpu_threads(self.worker.device, threads, self.worker.num_params)
        self.worker.warm_up()
        self.decoder = self.worker.runner.model.cpu_decoder
        self.plan_ids = itertools.count(1)
        self.rids = itertools.count(0)

    def _prefill(self, rows: int) -> list[int]:
        runner = self.worker.runner
        params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
        rids = [next(self.rids) for _ in range(rows)]
        tables = [list(range(1 + i * self.per_seq, 1 + (i + 1) * self.per_seq)) for i in range(rows)]
        news = [NewRequest(rid, [(7 * rid + 13 * j) % 30_000 + 100 for j in range(self.context)], self.context, params)
                for rid in rids]
        for _ in runner.execute(StepPlan(next(self.plan_ids), news, rids, [self.context] * rows, tables)):
            pass
        return rids

    def _decode(self, rids: list[int], steps: int, window: int) -> None:
        runner = self.worker.runner
        done = 0
        while done < steps:
            n = min(window, steps - done)
            plan = StepPlan(next(self.plan_ids), [], rids, [1] * len(rids), [[] for _ in rids], num_steps=n)
            for _ in runner.execute(plan):
                pass
            done += n

    def prefill_ms(self, tokens: int, reference: bool) -> float:
        """One prompt of ``tokens`` tokens prefilled in one step; ``reference``: attention through
        gather + SDPA instead of the worker's own backend."""
        runner = self.worker.runner
        own = runner.attention
        if reference:
            runner.attention = SdpaBackend(self.worker.device, runner.model.config.sliding_window)
        rid = next(self.rids)
        prompt = [(7 * rid + 13 * j) % 30_000 + 100 for j in range(tokens)]
        plan = StepPlan(next(self.plan_ids), [NewRequest(rid, prompt, tokens, SamplingParams(max_tokens=1))], [rid],
                        [tokens], [list(range(1, 2 + tokens // self.bs))])
        start = time.perf_counter()
        try:
            for _ in runner.execute(plan):
                pass
            return (time.perf_counter() - start) * 1000
        finally:
            runner.forget(rid)
            runner.attention = own

    def count_ops(self, rows: int, window: int, path: str) -> float:
        """Python-level calls and C calls per decode step, over one window of ``rows`` rows."""
        self.worker.runner.model.cpu_decoder = self.decoder if path == "fused" else None
        rids = self._prefill(rows)
        self._decode(rids, window, window)
        calls = 0

        def count(frame: object, event: str, arg: object) -> None:
            nonlocal calls
            if event in ("call", "c_call"):
                calls += 1

        sys.setprofile(count)
        try:
            self._decode(rids, window, window)
        finally:
            sys.setprofile(None)
        for rid in rids:
            self.worker.runner.forget(rid)
        return calls / window

    def step_ms(self, rows: int, window: int, profile: bool, path: str = "fused") -> float:
        self.worker.runner.model.cpu_decoder = self.decoder if path == "fused" else None
        rids = self._prefill(rows)
        self._decode(rids, window, window)  # first touch of the cells it reads
        start = time.perf_counter()
        self._decode(rids, self.steps, window)
        ms = (time.perf_counter() - start) * 1000 / self.steps
        if profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                self._decode(rids, window, window)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18), file=sys.stderr)
        for rid in rids:
            self.worker.runner.forget(rid)
        return ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", nargs="+", default=["float32"],
                   help="dtypes to compare; DTYPE:KV also sets --kv-cache-dtype KV (e.g. float32:bfloat16)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, default=128, help="prompt tokens per row")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per cell")
    p.add_argument("--window", type=int, default=8, help="steps per plan")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="0: the worker's default")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--prefill", type=int, nargs="+", default=[],
                   help="time first-chunk prefills of these prompt lengths instead (own attention vs SDPA)")
    p.add_argument("--count-ops", action="store_true", help="Python-level calls per decode step instead of times")
    p.add_argument("--paths", nargs="+", default=["fused"], choices=["fused", "per-operator"],
                   help="decode steps through the whole-stack C decoder (where it runs) or operator by operator")
    args = p.parse_args()

    timers = {d: StepTimer(args.model, d, max(args.rows), args.context, args.steps, args.threads,
                           max(args.prefill, default=0)) for d in args.dtype}
    print(f"{torch.get_num_threads()} torch thread(s), context {args.context}, window {args.window}", file=sys.stderr)
    for d, timer in timers.items():
        if timer.decoder is None and "fused" in args.paths:
            print(f"{d}: no whole-stack decoder on this machine; 'fused' runs operator by operator", file=sys.stderr)
    if args.prefill:
        prefill: dict[tuple[str, int, bool], list[float]] = {}
        for _ in range(args.rounds):
            for tokens in args.prefill:
                for d, timer in timers.items():
                    for reference in (False, True):
                        prefill.setdefault((d, tokens, reference), []).append(timer.prefill_ms(tokens, reference))
        print(f"{'dtype':<10} {'tokens':>6} {'own backend':>12} {'gather+SDPA':>12}   (ms, median of {args.rounds})")
        for d, timer in timers.items():
            for tokens in args.prefill:
                own, ref = (statistics.median(prefill[(d, tokens, r)]) for r in (False, True))
                print(f"{d:<10} {tokens:>6} {own:>12.0f} {ref:>12.0f}   ({timer.worker.runner.attention.name})")
        return
    if args.count_ops:
        print(f"{'dtype':<10} {'path':<13} {'rows':>5} {'Python-level calls per decode step':>36}")
        for d, timer in timers.items():
            for rows in args.rows:
                for path in args.paths:
                    print(f"{d:<10} {path:<13} {rows:>5} {timer.count_ops(rows, args.window, path):>36,.0f}")
        return
    times: dict[tuple[str, str, int], list[float]] = {}
    for r in range(args.rounds):
        for rows in args.rows:
            for d, timer in timers.items():
                for path in args.paths:
                    last = r == args.rounds - 1
                    times.setdefault((d, path, rows), []).append(
                        timer.step_ms(rows, args.window, args.profile and last, path))
    print(f"{'dtype':<10} {'path':<13} {'rows':>5} {'ms/step':>9} {'tok/s':>8}   (median of {args.rounds})")
    for (d, path, rows), ms in sorted(times.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        med = statistics.median(ms)
        print(f"{d:<10} {path:<13} {rows:>5} {med:>9.2f} {rows * 1000 / med:>8.1f}")


if __name__ == "__main__":
    main()
