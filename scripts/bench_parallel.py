"""Decode throughput and per-rank memory of ``sluice serve`` with k tensor-parallel ranks or m
data-parallel engines.

    python scripts/bench_parallel.py                                   # tiny: k = 1, 2; m = 2; 64 streams
    python scripts/bench_parallel.py --model smollm2 --tp-sizes 1 3    # SmolLM2 has 9 heads: 1, 3 or 9

Each cell starts a fresh server with ``--tensor-parallel-size k`` (or ``--data-parallel-size m``)
and a fixed ``--num-kv-blocks`` (each rank holds that many blocks of its own KV heads, so its
cache is ~1/k of one worker's; each engine that many blocks),
sends ``--concurrency`` streaming completions at once (``scripts/bench_serve.py``'s load) and
reports output tokens/s; then, from the server's log and ``/admin/stats``, each rank's weights,
KV cache and resident memory. Cells are interleaved over ``--rounds``; figures are medians, and the
ratio is against k = m = 1 on the same run. On a CPU the ranks and engines share its cores: this
measures what sharding costs (the all-reduces) and what routing costs, not a speed-up, which needs
a device per rank or engine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from bench_serve import run_load, serving

TOKEN = "bench"


def per_rank(log: str, pattern: str) -> dict[int, float]:
    """A figure each worker logged: ``worker[r]`` (or, with several engines, ``worker[e.r]``) lines
    matching ``pattern`` (one group), by the worker's order in the log."""
    found = re.finditer(r"worker\[([\d.]+)\]: " + pattern, log)
    return {i: float(m.group(2)) for i, m in enumerate(found)}


def cell(model: str, k: int, m: int, args: argparse.Namespace, log: Path) -> dict[str, object]:
    flags = ["--tensor-parallel-size", str(k), "--data-parallel-size", str(m), "--admin-token", TOKEN,
             "--num-kv-blocks", str(args.num_kv_blocks), *args.serve_args.split()]
    with serving(None, model, flags, log) as url:
        load = asyncio.run(run_load(url, args.concurrency, args.prompt_tokens, args.output_tokens))
        memory = httpx.get(f"{url}/admin/stats", headers={"Authorization": f"Bearer {TOKEN}"}).json()["process_memory"]
    text = log.read_text(errors="replace")
    weights = per_rank(text, r"loaded .*?, ([\d.]+) MiB of weights\)")
    kv = per_rank(text, r"KV cache: .*?tokens, ([\d.]+) MiB")
    rss = {i: float(figures.get("peak_rss_mib", figures.get("rss_mib", 0.0)))
           for i, (name, figures) in enumerate(memory.items()) if "worker" in name}
    return {"tok_s": load["output_tok_per_s"], "weights": weights, "kv": kv, "rss": rss}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2], help="k of each cell (m = 1)")
    p.add_argument("--dp-sizes", type=int, nargs="*", default=[2], help="m of each further cell (k = 1)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--num-kv-blocks", type=int, default=1100, help="per rank (64 streams of 256 tokens: 1,024)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--serve-args", default="", help="more flags for `sluice serve` (--dtype bfloat16, ...)")
    args = p.parse_args()

    shapes = [(k, 1) for k in args.tp_sizes] + [(1, m) for m in args.dp_sizes if m > 1]
    results: dict[tuple[int, int], list[dict[str, object]]] = {shape: [] for shape in shapes}
    with tempfile.TemporaryDirectory(prefix="bench-parallel-") as tmp:
        for r in range(args.rounds):
            for k, m in shapes:
                got = cell(args.model, k, m, args, Path(tmp) / f"k{k}-m{m}-r{r}.log")
                results[(k, m)].append(got)
                print(f"round {r + 1}, k = {k}, m = {m}: {got['tok_s']:.1f} tok/s", flush=True)
    base = statistics.median(float(c["tok_s"]) for c in results[shapes[0]])  # type: ignore[arg-type]
    print(f"\n{args.model}, {args.concurrency} streams, {args.prompt_tokens} + {args.output_tokens} tokens, "
          f"{args.num_kv_blocks} KV blocks per rank, {os.cpu_count()} CPUs; medians of {args.rounds} rounds")
    print("| k | m | output tok/s | vs the first | weights per rank | KV cache per rank | worker peak RSS |")
    print("|---|---|---|---|---|---|---|")
    for k, m in shapes:
        tok_s = statistics.median(float(c["tok_s"]) for c in results[(k, m)])  # type: ignore[arg-type]
        last = results[(k, m)][-1]

        def spread(figures: object) -> str:
            values = sorted(figures.values()) if isinstance(figures, dict) else []
            return "-" if not values else (f"{values[0]:.1f} MiB" if values[0] == values[-1]
                                           else f"{values[0]:.1f}-{values[-1]:.1f} MiB")

        print(f"| {k} | {m} | {tok_s:.1f} | {tok_s / base:.2f}x | {spread(last['weights'])} | {spread(last['kv'])} | "
              f"{spread(last['rss'])} |")


if __name__ == "__main__":
    main()
