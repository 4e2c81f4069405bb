"""A multi-step decode on the worker's runner in this process, for the device checks of
``scripts/gpu_checks.sh``: run under PyTorch's stream sanitizer, compute-sanitizer and nsys.

    python scripts/gpu_decode.py                                  # SmolLM2, bfloat16, 64 greedy rows
    python scripts/gpu_decode.py --rows 16 --steps 32 --mixed     # every sampling path in one batch
    python scripts/gpu_decode.py --rows 64 --constrained 1        # one row held to a grammar
    python scripts/gpu_decode.py --device cpu --dtype float32 --model tiny --rows 4 --steps 8 --mixed
    python scripts/gpu_decode.py --rows 8 --mixed --speculative ngram     # proposals verified in the windows
    python scripts/gpu_decode.py --rows 8 --mixed --speculative draft     # the model drafting for itself

Each row prefills ``--context`` tokens (one plan), then the rows decode ``--steps`` steps in plans
of ``--window`` steps: multi-step windows, and on CUDA the one-step-behind read of each step's
ids, as the server runs them. ``--mixed`` gives the rows, in turn: greedy; seeded top-p; penalised
(repetition and frequency); greedy with logprobs; held to a grammar (a regular expression of
letters and spaces). ``--constrained N`` holds the first N rows to that grammar and leaves the
rest greedy (a constrained row makes its batch read every step's ids at once: the device waits
for the host between steps). The decode runs twice from the same prompts and seeds, and the
script fails unless both runs give the same tokens (greedy and seeded rows: the device path is
deterministic for a fixed batch). With ``--profile-range`` the second run alone is bracketed by
``cudaProfilerStart``/``Stop``, for ``nsys profile --capture-range=cudaProfilerApi``: a trace of
decode steps only, not of loading and prefill. Prints the attention backend and decode tokens/s.
``--speculative ngram`` or ``draft`` (the model as its own draft) runs the same decode with
proposals verified in every step (4 at most), and prints how many were accepted.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import llguidance
import torch

from protocol.config import WorkerConfig
from protocol.messages import NewRequest, SamplingParams, StepPlan
from worker.engine import Worker

GRAMMAR = llguidance.LLMatcher.grammar_from_regex(r"[a-z ]{1,2000}")
BLOCK_SIZE = 16


def row_params(i: int, steps: int, mixed: bool, constrained: int) -> SamplingParams:
    base = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    kind = i % 5 if mixed else (4 if i < constrained else 0)
    if kind == 1:
        return SamplingParams(max_tokens=steps + 1, temperature=0.9, top_p=0.9, seed=1000 + i, ignore_eos=True)
    if kind == 2:
        return SamplingParams(max_tokens=steps + 1, temperature=0.8, top_k=40, seed=2000 + i, ignore_eos=True,
                              repetition_penalty=1.2, frequency_penalty=0.3)
    if kind == 3:
        return SamplingParams(max_tokens=steps + 1, temperature=0.0, logprobs=5, ignore_eos=True)
    if kind == 4:
        # EOS banned to the end: the row stays held to the grammar (EOS would end it).
        return SamplingParams(max_tokens=steps + 1, min_tokens=steps + 1, temperature=0.0, ignore_eos=True,
                              grammar=GRAMMAR)
    return base


def decode(worker: Worker, args: argparse.Namespace, first_rid: int,
           profile: bool) -> tuple[list[list[int]], float, int]:
    """One run: prefill every row, decode, forget them; the tokens of each row, decode tok/s and
    the proposals accepted."""
    runner = worker.runner
    per_row = blocks_per_row(args)
    rids = list(range(first_rid, first_rid + args.rows))
    news = [NewRequest(rid, [1] + [(7 * i + 13 * j) % 400 + 3 for j in range(args.context - 1)], args.context,
                       row_params(i, args.steps, args.mixed, args.constrained))
            for i, rid in enumerate(rids)]
    tables = [list(range(1 + i * per_row, 1 + (i + 1) * per_row)) for i in range(args.rows)]
    plan_ids = itertools.count(first_rid * 1000 + 1)
    outputs: dict[int, list[int]] = {rid: [] for rid in rids}
    drafts = DRAFTS if args.speculative != "none" else 0
    accepted = 0

    def run(plan: StepPlan) -> None:
        nonlocal accepted
        for msg in runner.execute(plan):
            for rid, token in zip(msg.rids, msg.token_ids, strict=True):
                outputs[rid].append(token)
            accepted += sum(msg.accepted)

    run(StepPlan(next(plan_ids), news, rids, [args.context] * args.rows, tables))
    sync(worker.device)
    if profile:
        torch.cuda.profiler.start()
    start = time.perf_counter()
    done = 0
    while done < args.steps:
        n = min(args.window, args.steps - done)
        live = [rid for rid in rids if rid in runner.seqs]
        if not live:  # (speculation: every row reached its length early)
            break
        # (The scheduler's count: drafts a row's last step accepted are not computed for it yet.)
        rows = [(rid, len(seq.token_ids) - seq.num_computed + seq.num_ahead) for rid in live
                if (seq := runner.seqs[rid])]
        run(StepPlan(next(plan_ids), [], [r for r, _ in rows], [k for _, k in rows], [[] for _ in rows], num_steps=n,
                     num_draft_tokens=drafts))
        done += n
    sync(worker.device)
    seconds = time.perf_counter() - start
    if profile:
        torch.cuda.profiler.stop()
    for rid in rids:
        runner.forget(rid)
    return [outputs[rid] for rid in rids], args.rows * args.steps / seconds, accepted


DRAFTS = 4  # most proposed tokens a row verifies per step, with --speculative


def blocks_per_row(args: argparse.Namespace) -> int:
    """A row's blocks: its prompt, its outputs, a window's look-ahead and, with speculation,
    room for every step's proposals."""
    room = args.window * DRAFTS if args.speculative != "none" else 0
    return -(-(args.context + args.steps + args.window + 1 + room) // BLOCK_SIZE)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--context", type=int, default=96, help="prompt tokens per row")
    p.add_argument("--steps", type=int, default=64, help="decode steps after the prefill")
    p.add_argument("--window", type=int, default=8, help="steps per plan")
    p.add_argument("--mixed", action="store_true", help="every sampling path in the batch")
    p.add_argument("--constrained", type=int, default=0, help="rows held to a grammar (without --mixed)")
    p.add_argument("--profile-range", action="store_true", help="cudaProfilerStart/Stop around the second decode")
    p.add_argument("--speculative", default="none", choices=["none", "ngram", "draft"],
                   help="proposals verified in every step: prompt lookup, or the model as its own draft")
    args = p.parse_args()

    per_row = blocks_per_row(args)
    worker = Worker(WorkerConfig(model=args.model, device=args.device, dtype=args.dtype, block_size=BLOCK_SIZE,
                                 num_kv_blocks=args.rows * per_row + 1, log_level="warning",
                                 speculative=args.speculative, num_speculative_tokens=DRAFTS,
                                 speculative_model=args.model if args.speculative == "draft" else ""))
    worker.warm_up()
    print(f"{args.model} on {worker.device} in {args.dtype}: attention {worker.runner.attention.name}; "
          f"{args.rows} rows{' (mixed sampling)' if args.mixed else ''}"
          f"{f', {args.constrained} constrained' if args.constrained and not args.mixed else ''}, "
          f"{args.steps} steps in windows of {args.window}", flush=True)
    first, _, _ = decode(worker, args, 1, profile=False)
    second, rate, accepted = decode(worker, args, 1 + args.rows,
                                    profile=args.profile_range and worker.device.type == "cuda")
    print(f"decode: {rate:,.0f} tokens/s ({args.rows} rows)"
          + (f"; {accepted} proposals accepted" if args.speculative != "none" else ""))
    if args.speculative != "none" and not accepted:
        raise SystemExit("--speculative: no proposal was accepted")
    differ = [i for i, (a, b) in enumerate(zip(first, second, strict=True)) if a != b]
    if differ or any(len(out) != args.steps + 1 for out in first):
        raise SystemExit(f"the two runs differ: rows {differ[:10]} (lengths {[len(o) for o in first[:10]]})")
    print("both runs gave the same tokens")


if __name__ == "__main__":
    main()
