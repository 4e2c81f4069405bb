"""Embeddings throughput: /v1/embeddings against the same texts as max_tokens=1 completions, and
against transformers on the same CPU.

    python scripts/bench_embeddings.py                          # SmolLM2, 1,000 texts, 3 rounds
    python scripts/bench_embeddings.py --model tiny --dtype float32

One ``sluice serve``. Each round sends ``--texts`` short texts (a sentence each, all different,
so the prefix cache helps neither side) ``--batch`` per request with ``--concurrency`` requests in
flight: first as ``/v1/embeddings`` inputs, then as the prompts of ``/v1/completions`` requests
with ``max_tokens`` 1 (what a server without an embeddings route would make a client do: the same
prompt work, plus sampling and the output path). Then ``transformers`` embeds the same texts on
the same CPU, in batches of ``--batch`` (padded, last-token or mean pooled as the server is, its
threads all the cores), from the same weights (SmolLM2: the GGUF file, dequantized to float32,
so compare against ``--dtype float32``). Printed: texts/s of each, per round and as medians, and
the ratios (goal: embeddings >= 1.5x the completions).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(__file__))
import bench_serve

SUBJECTS = ["the river", "a small town", "the old library", "my neighbour's dog", "the winter market",
            "a quiet train", "the new bridge", "our garden", "the city council", "a late summer storm"]
VERBS = ["surprised", "delighted", "worried", "inspired", "confused", "annoyed", "impressed", "calmed"]


def texts(n: int) -> list[str]:
    """``n`` different short sentences (about 15 tokens each)."""
    return [f"Item {i}: {SUBJECTS[i % len(SUBJECTS)]} {VERBS[i % len(VERBS)]} everyone who came by on day {i // 7}."
            for i in range(n)]


async def throughput(url: str, route: str, items: list[str], batch: int, concurrency: int) -> float:
    """Texts per second through ``route``, ``batch`` per request, ``concurrency`` in flight."""
    chunks = [items[i : i + batch] for i in range(0, len(items), batch)]
    queue: asyncio.Queue[list[str]] = asyncio.Queue()
    for chunk in chunks:
        queue.put_nowait(chunk)

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            chunk = queue.get_nowait()
            body = {"input": chunk} if route == "embeddings" else {"prompt": chunk, "max_tokens": 1}
            r = await http.post(f"{url}/v1/{route}", json=body)
            r.raise_for_status()

    async with httpx.AsyncClient(timeout=600) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        return len(items) / (time.perf_counter() - start)


def transformers_throughput(model: str, items: list[str], batch: int, pooling: str) -> float:
    """Texts per second embedding ``items`` with transformers, ``batch`` at a time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model == "smollm2":
        from worker.model.loader import smollm2_path

        path = smollm2_path()
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    else:
        tokenizer = AutoTokenizer.from_pretrained(model)
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    hf.eval()
    tokenizer.padding_side = "left"  # the last position is every row's last token
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    torch.set_num_threads(os.cpu_count() or 1)
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(items), batch):
            enc = tokenizer(items[i : i + batch], return_tensors="pt", padding=True)
            hidden = hf(**enc, output_hidden_states=True).hidden_states[-1]
            if pooling == "last":
                pooled = hidden[:, -1]
            else:
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1)
            torch.nn.functional.normalize(pooled, dim=-1)
    return len(items) / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2, or a Hugging Face-format directory")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--pooling", default="last", choices=["last", "mean"])
    p.add_argument("--texts", type=int, default=1000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--log", type=Path, help="the server's log (default: its warnings, to this terminal)")
    args = p.parse_args()
    items = texts(args.texts)
    rows = []
    flags = ["--dtype", args.dtype, "--pooling", args.pooling, "--no-enable-prefix-caching"]
    with bench_serve.serving(None, args.model, flags, args.log) as url:
        asyncio.run(throughput(url, "embeddings", items[:64], args.batch, args.concurrency))  # warm-up
        for r in range(args.rounds):
            # A round's texts are its own: nothing a previous round computed is reused.
            batch = [f"(round {r}) {t}" for t in items]
            emb = asyncio.run(throughput(url, "embeddings", batch, args.batch, args.concurrency))
            cmpl = asyncio.run(throughput(url, "completions", batch, args.batch, args.concurrency))
            rows.append((emb, cmpl))
            print(f"round {r + 1}: /v1/embeddings {emb:.1f} texts/s | max_tokens=1 completions {cmpl:.1f} texts/s | "
                  f"{emb / cmpl:.2f}x", flush=True)
    emb, cmpl = (statistics.median(col) for col in zip(*rows, strict=True))
    print(f"\nmedian of {args.rounds} rounds ({args.model}, --dtype {args.dtype}, {args.texts} texts, {args.batch} per "
          f"request, {args.concurrency} in flight): embeddings {emb:.1f} texts/s, completions {cmpl:.1f} texts/s: "
          f"{emb / cmpl:.2f}x (goal >= 1.5x)")
    if not args.no_transformers:
        hf = statistics.median(transformers_throughput(args.model, items, args.batch, args.pooling)
                               for _ in range(args.rounds))
        print(f"transformers (float32, batches of {args.batch}): {hf:.1f} texts/s; Sluice's embeddings {emb / hf:.2f}x")


if __name__ == "__main__":
    main()
