"""SmolLM2-135M-Instruct through `sluice serve` next to transformers' `generate`, same GGUF file,
same prompts, same run.

    python scripts/bench_smollm2.py                       # concurrency 1 16 64, 128 in / 128 out
    python scripts/bench_smollm2.py --concurrency 16 --output-tokens 64

Prints the server's start-up time (process start to ``/ready``) and the worker's own load time,
the worker's resident memory, then output tokens/s for each concurrency: the server with that
many streaming requests at once, and transformers generating the same prompts as one batch
(float32, greedy, every sequence exactly ``--output-tokens`` long on both sides).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_decode import _stream
from bench_serve import _free_port


def _prompts(n: int, length: int) -> list[list[int]]:
    """Token ids of ordinary vocabulary entries (no special tokens), different per request."""
    return [[(1_000 + 37 * i + 101 * j) % 48_000 + 100 for j in range(length)] for i in range(n)]


def _rss_mib(pid: int, field: str = "VmRSS") -> float:
    """Resident memory now (VmRSS) or at its peak so far (VmHWM), from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(rf"{field}:\s+(\d+) kB", status)
    return int(match.group(1)) / 1024 if match else float("nan")


async def _served(url: str, prompts: list[list[int]], output_tokens: int) -> float:
    stamps: list[list[float]] = [[] for _ in prompts]
    start = time.perf_counter()
    await asyncio.gather(*(_stream(url, p, output_tokens, s) for p, s in zip(prompts, stamps, strict=True)))
    produced = sum(len(s) for s in stamps)
    return produced / (time.perf_counter() - start)


def _load_transformers() -> object:
    import torch
    from transformers import AutoModelForCausalLM

    from worker.loader import smollm2_path

    path = smollm2_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)


def _transformers(model: object, prompts: list[list[int]], output_tokens: int) -> float:
    import torch

    ids = torch.tensor(prompts)
    with torch.inference_mode():
        model.generate(ids[:1, :8], max_new_tokens=4, do_sample=False)  # type: ignore[attr-defined]
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_tokens,  # type: ignore[attr-defined]
                             min_new_tokens=output_tokens, do_sample=False)
        elapsed = time.perf_counter() - start
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--transformers", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args()

    most = max(args.concurrency)
    blocks = most * (-(-(args.prompt_tokens + args.output_tokens + 16) // 16)) + 64
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open("/tmp/sluice-bench-smollm2.log", "wb")  # noqa: SIM115 - closed below
    began = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "frontend", "serve", "--model", "smollm2", "--port", str(port),
                             "--num-kv-blocks", str(blocks)], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    served: dict[int, float] = {}
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"sluice serve exited; see {log.name}")
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        ready_s = time.perf_counter() - began
        worker = int(subprocess.run(["pgrep", "-f", "-n", "-g", str(proc.pid), "worker --config"],
                                    capture_output=True, text=True).stdout.split()[0])
        asyncio.run(_served(url, _prompts(1, 8), 4))  # warm-up
        for c in args.concurrency:
            served[c] = asyncio.run(_served(url, _prompts(c, args.prompt_tokens), args.output_tokens))
            print(f"served, {c} streams: {served[c]:,.1f} tok/s", file=sys.stderr)
        rss, peak = _rss_mib(worker), _rss_mib(worker, "VmHWM")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    load = re.search(r"as \w+ in ([\d.]+) s", Path(log.name).read_text())
    print(f"\nSmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32), {args.prompt_tokens} prompt / "
          f"{args.output_tokens} output tokens per request")
    print(f"  start-up to /ready: {ready_s:.1f} s (worker load of the GGUF file: "
          f"{load.group(1) if load else '?'} s); worker RSS {rss:,.0f} MiB (peak {peak:,.0f}) with a "
          f"{blocks}-block KV cache")
    import torch

    began = time.perf_counter()
    model = _load_transformers() if args.transformers else None
    if model is not None:
        print(f"  transformers from_pretrained(gguf_file=...): {time.perf_counter() - began:.1f} s")
    all_threads = torch.get_num_threads()
    # transformers twice: with the one thread Sluice's worker computes on (the other core is the
    # frontend's and scheduler's), and with every core, as a plain `generate` would run.
    print(f"  {'concurrency':>11} | {'sluice tok/s':>12} | {'hf, 1 thread':>12} | ratio | "
          f"{f'hf, {all_threads} threads':>13} | ratio")
    for c in args.concurrency:
        theirs = []
        for threads in (1, all_threads):
            torch.set_num_threads(threads)
            prompts = _prompts(c, args.prompt_tokens)
            theirs.append(_transformers(model, prompts, args.output_tokens) if model else float("nan"))
        print(f"  {c:>11} | {served[c]:>12,.1f} | {theirs[0]:>12,.1f} | {served[c] / theirs[0]:5.2f} | "
              f"{theirs[1]:>13,.1f} | {served[c] / theirs[1]:5.2f}")


if __name__ == "__main__":
    main()
