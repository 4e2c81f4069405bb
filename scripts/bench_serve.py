"""Load-generating client: output tokens/s of a running (or freshly started) ``sluice serve``.

    python scripts/bench_serve.py                      # starts `sluice serve --model tiny` itself
    python scripts/bench_serve.py --url http://127.0.0.1:8000 --concurrency 64

Sends ``--concurrency`` streaming completions at once, each ``--prompt-tokens`` token ids long and
generating exactly ``--output-tokens`` (ignore_eos), and reports output tokens/s, TTFT and
inter-token latency percentiles. With ``--bare``, also runs the worker's forward loop of the same
model at the same batch size in-process (no server, no scheduler): the ceiling, and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def _one(client: httpx.AsyncClient, url: str, prompt: list[int], n_out: int) -> tuple[float, list[float], int]:
    body = {"prompt": prompt, "max_tokens": n_out, "ignore_eos": True, "temperature": 0, "stream": True}
    start = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    stamps.append(time.perf_counter())
    ttft = stamps[0] - start
    itl = [b - a for a, b in itertools.pairwise(stamps)]
    return ttft, itl, len(stamps)


async def run_load(url: str, concurrency: int, prompt_tokens: int, output_tokens: int) -> dict[str, float]:
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        # Warm-up: one short request, so start-up costs stay out of the figures.
        await _one(client, url, [1, 2, 3], 4)
        prompts = [[1] + [(7 * i + j) % 250 + 3 for j in range(prompt_tokens - 1)] for i in range(concurrency)]
        start = time.perf_counter()
        results = await asyncio.gather(*(_one(client, url, p, output_tokens) for p in prompts))
        elapsed = time.perf_counter() - start
    tokens = sum(r[2] for r in results)
    ttfts = [r[0] for r in results]
    itls = [x for r in results for x in r[1]]
    return {
        "requests": concurrency,
        "output_tokens": tokens,
        "seconds": elapsed,
        "output_tok_per_s": tokens / elapsed,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * _pct(ttfts, 0.99),
        "itl_p50_ms": 1000 * _pct(itls, 0.5),
        "itl_p99_ms": 1000 * _pct(itls, 0.99),
    }


def bare_forward_loop(model: str, batch: int, prompt_tokens: int, output_tokens: int, steps: int = 8) -> float:
    """Output tokens/s of the worker's runner driven directly (no server, no scheduler, no
    sockets): the same prompts prefilled in one pass, then decoded ``steps`` at a time. The
    ceiling the server's figure is compared with."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from protocol.config import WorkerConfig
    from protocol.messages import NewRequest, SamplingParams, StepPlan
    from worker.process import Worker

    block_size = 16
    per_seq = -(-(prompt_tokens + output_tokens) // block_size)
    worker = Worker(WorkerConfig(model=model, num_kv_blocks=batch * per_seq + 1, block_size=block_size,
                                 log_level="warning"))
    runner = worker.runner
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    prompts = [[1] + [(7 * i + j) % 250 + 3 for j in range(prompt_tokens - 1)] for i in range(batch)]
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(batch)]
    start = time.perf_counter()
    produced = 0
    plan = StepPlan(1, [NewRequest(i, p, len(p), params) for i, p in enumerate(prompts)], list(range(batch)),
                    [prompt_tokens] * batch, tables, num_steps=steps)
    plan_id = 1
    while True:
        for out in runner.execute(plan):
            produced += len(out.token_ids)
        live = sorted(runner.seqs)
        if not live:
            break
        plan_id += 1
        plan = StepPlan(plan_id, [], live, [1] * len(live), [[] for _ in live], num_steps=steps)
    return produced / (time.perf_counter() - start)


@contextlib.contextmanager
def serving(url: str | None, model: str, flags: list[str], log: Path | None = None) -> Iterator[str]:
    """``url`` if given, else a fresh `sluice serve` on a free port, stopped afterwards (its
    output to ``log`` when given, else warnings only, to this terminal)."""
    if url is not None:
        yield url
        return
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "frontend", "serve", "--port", str(port), "--model", model,
           *(["--log-level", "warning"] if log is None else []), *flags]
    with open(log, "wb") if log is not None else contextlib.nullcontext() as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise RuntimeError(f"sluice serve exited with {proc.returncode}" + (f": see {log}" if log else ""))
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                        break
                time.sleep(0.3)
            yield url
        finally:
            proc.terminate()  # as Ctrl-C would: `sluice serve` stops its children itself
            proc.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server; default: start `sluice serve` here")
    p.add_argument("--model", default="tiny")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--bare", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure the bare forward loop in-process (the ceiling)")
    p.add_argument("--serve-args", default="", help="extra flags for `sluice serve`")
    args = p.parse_args()

    with serving(args.url, args.model, args.serve_args.split()) as url:
        served = asyncio.run(run_load(url, args.concurrency, args.prompt_tokens, args.output_tokens))
    print(f"sluice serve ({args.model}), {args.concurrency} concurrent streams, "
          f"{args.prompt_tokens} prompt / {args.output_tokens} output tokens:")
    for k, v in served.items():
        print(f"  {k:>18}: {v:,.2f}" if isinstance(v, float) else f"  {k:>18}: {v}")
    if args.bare:
        ceiling = bare_forward_loop(args.model, args.concurrency, args.prompt_tokens, args.output_tokens)
        print(f"bare forward loop, batch {args.concurrency}: {ceiling:,.2f} output tok/s")
        print(f"server / bare ratio: {served['output_tok_per_s'] / ceiling:.3f}")


if __name__ == "__main__":
    main()
