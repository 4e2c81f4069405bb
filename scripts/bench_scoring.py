"""What scoring prompts costs: the same prompts prefilled plainly and scored (``echo`` with
``logprobs``: every prompt token's logprob, what lm-evaluation-harness's loglikelihood tasks send).

    python scripts/bench_scoring.py                          # SmolLM2, 64 prompts of 128 tokens, batches of 8
    python scripts/bench_scoring.py --url http://127.0.0.1:8000 --prompts 256 --prompt-tokens 512

Each cell sends ``--prompts`` random token-id prompts (fresh ones each cell: no prefix-cache hit)
in completion requests of ``--batch`` prompts each, one request at a time, with ``max_tokens`` 1;
the scored cell adds ``echo`` and ``logprobs``. It reports prompt tokens/s per cell; cells are
interleaved over ``--rounds``, figures are medians, and the ratio is scored over plain. Then the
worker's peak resident memory (``/admin/stats``), which a scored chunk raises by its logits
(vocabulary x chunk tokens x 4 bytes).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import serving

ADMIN_TOKEN = "bench-scoring"


def cell(url: str, rng: random.Random, args: argparse.Namespace, scored: bool) -> float:
    prompts = [[rng.randrange(100, 30000) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
    started = time.perf_counter()
    with httpx.Client(timeout=3600) as client:
        for first in range(0, len(prompts), args.batch):
            body = {"prompt": prompts[first : first + args.batch], "max_tokens": 1, "temperature": 0}
            if scored:
                body |= {"echo": True, "logprobs": args.logprobs}
            r = client.post(f"{url}/v1/completions", json=body)
            r.raise_for_status()
            if scored:  # every prompt token scored but the first
                lp = r.json()["choices"][0]["logprobs"]["token_logprobs"]
                assert lp[0] is None and None not in lp[1:], "a prompt token without its logprob"
    return len(prompts) * args.prompt_tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server (its /admin/stats needs no token, or this script's)")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="prompts per request")
    parser.add_argument("--logprobs", type=int, default=1, help="alternatives per scored token")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(0)
    with serving(args.url, args.model, ["--admin-token", ADMIN_TOKEN]) as url:
        cell(url, rng, argparse.Namespace(**vars(args) | {"prompts": args.batch}), scored=True)  # warm-up
        plain, scored = [], []
        for i in range(args.rounds):
            plain.append(cell(url, rng, args, scored=False))
            scored.append(cell(url, rng, args, scored=True))
            print(f"round {i + 1}: plain {plain[-1]:,.0f}, scored {scored[-1]:,.0f} prompt tok/s", flush=True)
        stats = httpx.get(f"{url}/admin/stats", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()
        workers = {k: v for k, v in (stats.get("process_memory") or {}).items() if k.startswith("worker")}
    p, s = statistics.median(plain), statistics.median(scored)
    print(f"\n{args.prompts} prompts of {args.prompt_tokens} tokens, {args.batch} per request, median of "
          f"{args.rounds}: plain {p:,.0f} prompt tok/s, scored (echo + logprobs {args.logprobs}) {s:,.0f} "
          f"({s / p:.2f}x)")
    for name, memory in workers.items():
        print(f"  {name}: {memory}")


if __name__ == "__main__":
    main()
