"""Decode throughput and device idleness through the whole server, multi-step vs single-step.

    python scripts/bench_decode.py                    # tiny model, batches 1 16 64 256
    python scripts/bench_decode.py --batches 64 --output-tokens 64

For ``--num-scheduler-steps`` 1 and 8, starts `sluice serve` and, at each batch size, sends that
many streaming completions at once (``--prompt-tokens`` ids each, exactly ``--output-tokens``
generated). Decode throughput counts the tokens streamed between the moment every request has
its first token and the end; the worker's idle fraction over that same window comes from its
busy-time counter (``/admin/stats``). The ceiling is the bare forward loop in this process: the
worker's runner driven directly, same model, same batch, same thread count as the server's
worker, decoding 8 steps per plan. (Async scheduling overlaps multi-step windows only, so n=1 is
the plain synchronous single-step loop.) Every server stays up the whole run and
each cell is measured once per round, the rounds interleaved; a figure is the median of
``--rounds``. Then, with ``--ttft-batch`` streams decoding steadily, ``--probes`` short requests
arrive one by one and their time to first token is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
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


async def open_completion(host: str, port: int, prompt: list[int], n_out: int
                          ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """POST a streaming completion (``ignore_eos``, greedy) over a raw connection; returns it
    positioned after the status line, which must be 200."""
    body = json.dumps({"prompt": prompt, "max_tokens": n_out, "ignore_eos": True, "temperature": 0,
                       "stream": True}).encode()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\nContent-Type: "
                 b"application/json\r\nConnection: close\r\nContent-Length: " + str(len(body)).encode()
                 + b"\r\n\r\n" + body)
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"HTTP error: {status!r} {await reader.read(2000)!r}")
    return reader, writer


async def _stream(url: str, prompt: list[int], n_out: int, stamps: list[float]) -> None:
    """One streaming completion over a raw connection, appending a timestamp per token chunk.

    A deliberately thin client (no HTTP library, no JSON decoding): on 2 cores the load
    generator shares the CPU with the server, and httpx's per-chunk cost made it the
    bottleneck at 256 streams, inflating the measured idle time."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await open_completion(host, int(port), prompt, n_out)
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


class BareLoop:
    """The ceiling: the worker's runner driven directly in this process (same model, same thread
    count as the server's worker), prompts prefilled in one plan (not timed), then plans
    of ``steps`` decode steps until every sequence is done. One worker, sized for the biggest
    batch, serves every run."""

    def __init__(self, model: str, biggest: int, prompt_tokens: int, output_tokens: int, steps: int = 8) -> None:
        import torch

        from protocol.config import WorkerConfig
        from worker.cpu_threads import configure_cpu_threads
        from worker.engine import Worker

        self.block_size, self.steps = 16, steps
        self.prompt_tokens, self.output_tokens = prompt_tokens, output_tokens
        self.per_seq = -(-(prompt_tokens + output_tokens + steps) // self.block_size)
        self.worker = Worker(WorkerConfig(model=model, num_kv_blocks=biggest * self.per_seq + 1,
                                          block_size=self.block_size, log_level="warning"))
        self.worker.runner.threads = configure_cpu_threads(self.worker.device, 0, self.worker.num_params)
        self.worker.warm_up()
        self.plan_ids = itertools.count(1)
        print(f"  (bare loop: {torch.get_num_threads()} torch thread(s), as the server's worker)", file=sys.stderr)

    def decode(self, batch: int) -> float:
        from protocol.messages import NewRequest, SamplingParams, StepPlan

        runner = self.worker.runner
        params = SamplingParams(max_tokens=self.output_tokens, temperature=0.0, ignore_eos=True)
        tables = [list(range(1 + i * self.per_seq, 1 + (i + 1) * self.per_seq)) for i in range(batch)]
        news = [NewRequest(i, _prompt(i, self.prompt_tokens), self.prompt_tokens, params) for i in range(batch)]
        prefill = StepPlan(next(self.plan_ids), news, list(range(batch)), [self.prompt_tokens] * batch, tables)
        for _ in runner.execute(prefill):
            pass
        produced = 0
        start = time.perf_counter()
        while live := sorted(runner.seqs):
            plan = StepPlan(next(self.plan_ids), [], live, [1] * len(live), [[] for _ in live],
                            num_steps=self.steps)
            produced += sum(len(out.token_ids) for out in runner.execute(plan))
        return produced / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--steps", type=int, nargs="+", default=[1, 8], help="--num-scheduler-steps values")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5, help="each cell's figure is the median of this many")
    p.add_argument("--ttft-batch", type=int, default=64)
    p.add_argument("--probes", type=int, default=20)
    args = p.parse_args()

    biggest = max([*args.batches, args.ttft_batch])
    ttft_output = 512  # long enough to still be decoding while every probe arrives
    longest = args.prompt_tokens + max(args.output_tokens, ttft_output) + 8
    blocks = (biggest + args.probes + 8) * (-(-longest // 16) + 1)
    servers = {f"n={n}": ["--num-scheduler-steps", str(n)] for n in args.steps}
    served: dict[tuple[str, int], list[DecodeFigures]] = {(name, b): [] for name in servers for b in args.batches}
    bare: dict[int, list[float]] = {b: [] for b in args.batches}
    ttft: dict[str, list[float]] = {}
    with contextlib.ExitStack() as stack:
        # Every server stays up through the whole run, so that the cells of a round are measured
        # one right after another: this machine's speed drifts by tens of percent within minutes,
        # and a ratio of figures taken minutes apart would measure the drift.
        urls = {name: stack.enter_context(serving(None, args.model, [
                    *flags, "--max-num-seqs", str(max(256, biggest)), "--num-kv-blocks", str(blocks),
                    "--admin-token", ADMIN_TOKEN]))
                for name, flags in servers.items()}
        loop = BareLoop(args.model, biggest, args.prompt_tokens, args.output_tokens)
        for r in range(args.rounds):
            for batch in args.batches:
                for name, url in urls.items():
                    f = asyncio.run(decode_load(url, batch, args.prompt_tokens, args.output_tokens))
                    served[name, batch].append(f)
                    print(f"round {r + 1}: served {name} batch {batch}: {f.tok_per_s:,.0f} tok/s, "
                          f"idle {f.idle:.1%}", file=sys.stderr)
                bare[batch].append(loop.decode(batch))
                print(f"round {r + 1}: bare batch {batch}: {bare[batch][-1]:,.0f} tok/s", file=sys.stderr)
        for name, url in urls.items():
            if args.probes:
                ttft[name] = asyncio.run(ttft_probes(url, args.ttft_batch, args.prompt_tokens, ttft_output,
                                                     args.probes))

    def tok_s(name: str, b: int) -> float:
        return statistics.median(f.tok_per_s for f in served[name, b])

    def idle(name: str, b: int) -> float:
        return statistics.median(f.idle for f in served[name, b])

    def ratio(name: str, b: int, base: list[float]) -> float:
        """Median of the per-round ratios: the two figures of a round were taken seconds apart."""
        return statistics.median(f.tok_per_s / x for f, x in zip(served[name, b], base, strict=True))

    lo, hi = f"n={min(args.steps)}", f"n={max(args.steps)}"
    print(f"\nDecode throughput, {args.model}, {args.prompt_tokens} prompt / {args.output_tokens} output tokens "
          f"per request: output tokens/s while every stream decodes, and the worker's idle fraction; "
          f"medians of {args.rounds} interleaved rounds (ratios: median of the rounds' ratios)")
    print(f"{'batch':>6} |" + "".join(f" {name:>9} {'idle':>6} |" for name in servers)
          + f" {'bare':>7} | {hi + '/' + lo:>9} | {hi + '/bare':>8}")
    for b in args.batches:
        print(f"{b:>6} |" + "".join(f" {tok_s(name, b):>9,.0f} {idle(name, b):>6.1%} |" for name in servers)
              + f" {statistics.median(bare[b]):>7,.0f} |"
              + f" {ratio(hi, b, [f.tok_per_s for f in served[lo, b]]):>9.2f} | {ratio(hi, b, bare[b]):>8.2f}")
    if ttft:
        print(f"\nTTFT of {args.probes} requests arriving during steady decoding of {args.ttft_batch} streams:")
        for name, values in ttft.items():
            print(f"  {name}: p50 {1000 * statistics.median(values):.0f} ms, p99 {1000 * _pct(values, 0.99):.0f} ms")


if __name__ == "__main__":
    main()
