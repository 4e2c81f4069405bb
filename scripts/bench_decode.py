"""Decode throughput and device idleness through the whole server, multi-step vs single-step.

    python scripts/bench_decode.py                    # tiny model, batches 1 16 64 256
    python scripts/bench_decode.py --batches 64 --output-tokens 64

For ``--num-scheduler-steps`` 1 and 8, starts `sluice serve` and, at each batch size, sends that
many streaming completions at once (``--prompt-tokens`` ids each, exactly ``--output-tokens``
generated). Decode throughput counts the tokens streamed between the moment every request has
its first token and the end; the worker's idle fraction over that same window comes from its
busy-time counter (``/admin/stats``). The ceiling is the bare forward loop in this process: the
worker's runner driven directly, same model, same batch, same thread count as the server's
worker, decoding 8 steps per plan (best of three runs). Then, with ``--ttft-batch`` streams decoding steadily,
``--probes`` short requests arrive one by one and their time to first token is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import httpx

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_serve import _pct, serving

ADMIN_TOKEN = "bench-decode"
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
TOKEN_CHUNK = b'data: {"id"'  # each token chunk starts so (the usage chunk is not requested)


def _prompt(i: int, n: int) -> list[int]:
    return [1] + [(7 * i + j) % 250 + 3 for j in range(n - 1)]


@dataclass
class DecodeFigures:
    tok_per_s: float
    idle: float


async def _stream(url: str, prompt: list[int], n_out: int, stamps: list[float]) -> None:
    """One streaming completion over a raw connection, appending a timestamp per token chunk.

    A deliberately thin client (no HTTP library, no JSON decoding): on 2 cores the load
    generator shares the CPU with the server, and httpx's per-chunk cost made it the
    bottleneck at 256 streams, inflating the measured idle time."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": prompt, "max_tokens": n_out, "ignore_eos": True, "temperature": 0,
                       "stream": True}).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\nContent-Type: "
                 b"application/json\r\nConnection: close\r\nContent-Length: " + str(len(body)).encode()
                 + b"\r\n\r\n" + body)
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"HTTP error: {status!r} {await reader.read(2000)!r}")
    tail = b""
    while chunk := await reader.read(65536):
        data = tail + chunk
        found = data.count(TOKEN_CHUNK)
        if found:
            now = time.perf_counter()
            stamps.extend([now] * found)
        tail = data[-len(TOKEN_CHUNK) + 1 :]  # a marker split across two reads is counted once
    writer.close()


def _busy_s(url: str) -> float:
    return float(httpx.get(f"{url}/admin/stats", headers=AUTH, timeout=10).json()["worker_busy_s_total"])


async def decode_load(url: str, batch: int, prompt_tokens: int, output_tokens: int) -> DecodeFigures:
    await _stream(url, [1, 2, 3], 4, [])  # warm-up
    stamps: list[list[float]] = [[] for _ in range(batch)]
    tasks = [asyncio.create_task(_stream(url, _prompt(i, prompt_tokens), output_tokens, stamps[i]))
             for i in range(batch)]
    # The decode window opens when every stream has its first token.
    while not all(stamps):
        await asyncio.sleep(0.005)
    opened = time.perf_counter()
    busy0 = await asyncio.to_thread(_busy_s, url)
    await asyncio.gather(*tasks)
    closed = time.perf_counter()
    busy1 = await asyncio.to_thread(_busy_s, url)
    decoded = sum(1 for s in stamps for t in s if t > opened)
    wall = closed - opened
    return DecodeFigures(decoded / wall, max(0.0, 1.0 - (busy1 - busy0) / wall))


async def ttft_probes(url: str, batch: int, prompt_tokens: int, output_tokens: int, probes: int) -> list[float]:
    """TTFT of ``probes`` requests arriving one at a time while ``batch`` streams decode."""
    stamps: list[list[float]] = [[] for _ in range(batch)]
    tasks = [asyncio.create_task(_stream(url, _prompt(i, prompt_tokens), output_tokens, stamps[i]))
             for i in range(batch)]
    while not all(stamps):
        await asyncio.sleep(0.005)
    ttfts = []
    for k in range(probes):
        probe: list[float] = []
        sent = time.perf_counter()
        await _stream(url, _prompt(10_000 + k, prompt_tokens), 1, probe)
        ttfts.append(probe[0] - sent)
        await asyncio.sleep(0.05 + 0.013 * k)  # arrive at varied points of the window
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return ttfts


def bare_decode(model: str, batch: int, prompt_tokens: int, output_tokens: int, steps: int = 8) -> float:
    """Decode tokens/s of the worker's runner driven directly: prompts prefilled in one plan
    (not timed), then plans of ``steps`` decode steps until every sequence is done."""
    import torch

    from protocol.config import WorkerConfig
    from protocol.messages import NewRequest, SamplingParams, StepPlan
    from worker.engine import Worker
    from worker.process import configure_cpu_threads

    block_size = 16
    per_seq = -(-(prompt_tokens + output_tokens + steps) // block_size)
    worker = Worker(WorkerConfig(model=model, num_kv_blocks=batch * per_seq + 1, block_size=block_size,
                                 log_level="warning"))
    configure_cpu_threads(worker.device)
    worker.warm_up()
    runner = worker.runner
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(batch)]
    news = [NewRequest(i, _prompt(i, prompt_tokens), prompt_tokens, params) for i in range(batch)]
    for _ in runner.execute(StepPlan(1, news, list(range(batch)), [prompt_tokens] * batch, tables)):
        pass
    produced, plan_id = 0, 1
    start = time.perf_counter()
    while live := sorted(runner.seqs):
        plan_id += 1
        plan = StepPlan(plan_id, [], live, [1] * len(live), [[] for _ in live], num_steps=steps)
        produced += sum(len(out.token_ids) for out in runner.execute(plan))
    elapsed = time.perf_counter() - start
    print(f"  (bare loop, batch {batch}: {torch.get_num_threads()} torch thread(s), as the server's worker)",
          file=sys.stderr)
    return produced / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--steps", type=int, nargs="+", default=[1, 8], help="--num-scheduler-steps values")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--ttft-batch", type=int, default=64)
    p.add_argument("--probes", type=int, default=20)
    args = p.parse_args()

    biggest = max([*args.batches, args.ttft_batch])
    ttft_output = 512  # long enough to still be decoding while every probe arrives
    longest = args.prompt_tokens + max(args.output_tokens, ttft_output) + 8
    blocks = (biggest + args.probes + 8) * (-(-longest // 16) + 1)
    served: dict[tuple[int, int], DecodeFigures] = {}
    ttft: dict[int, list[float]] = {}
    for steps in args.steps:
        flags = ["--num-scheduler-steps", str(steps), "--max-num-seqs", str(max(256, biggest)),
                 "--num-kv-blocks", str(blocks), "--admin-token", ADMIN_TOKEN]
        with serving(None, args.model, flags) as url:
            for batch in args.batches:
                served[steps, batch] = asyncio.run(decode_load(url, batch, args.prompt_tokens, args.output_tokens))
                f = served[steps, batch]
                print(f"served n={steps} batch {batch}: {f.tok_per_s:,.0f} tok/s, idle {f.idle:.1%}", file=sys.stderr)
            ttft[steps] = asyncio.run(ttft_probes(url, args.ttft_batch, args.prompt_tokens, ttft_output,
                                                  args.probes))
    # The ceiling: the best of three bare runs (this machine's noise is a few percent either way).
    bare = {b: max(bare_decode(args.model, b, args.prompt_tokens, args.output_tokens) for _ in range(3))
            for b in args.batches}

    lo, hi = min(args.steps), max(args.steps)
    print(f"\nDecode throughput, {args.model}, {args.prompt_tokens} prompt / {args.output_tokens} output tokens "
          f"per request (output tokens/s while every stream decodes; idle = worker idle fraction)")
    head = f"{'batch':>6} |" + "".join(f" {'n=' + str(s):>9} {'idle':>6} |" for s in args.steps)
    print(head + f" {'bare':>9} | n={hi}/n={lo} | n={hi}/bare")
    for b in args.batches:
        row = f"{b:>6} |" + "".join(f" {served[s, b].tok_per_s:>9,.0f} {served[s, b].idle:>6.1%} |"
                                    for s in args.steps)
        print(row + f" {bare[b]:>9,.0f} | {served[hi, b].tok_per_s / served[lo, b].tok_per_s:>7.2f} | "
              f"{served[hi, b].tok_per_s / bare[b]:>6.2f}")
    print(f"\nTTFT of {args.probes} requests arriving during steady decoding of {args.ttft_batch} streams:")
    for s in args.steps:
        print(f"  n={s}: p50 {1000 * statistics.median(ttft[s]):.0f} ms, p99 {1000 * _pct(ttft[s], 0.99):.0f} ms")


if __name__ == "__main__":
    main()
