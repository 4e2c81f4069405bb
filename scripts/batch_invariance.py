"""How far greedy output stays the same alone and batched, per dtype, through the server.

    python scripts/batch_invariance.py                          # SmolLM2, float32 and bfloat16
    python scripts/batch_invariance.py --dtypes bfloat16 --prompts 48 --max-tokens 96

For each dtype a fresh ``sluice serve`` answers every prompt alone (one request at a time), then
all of them at once (one batch: prefills and decodes of different lengths mixed), greedy, the
same ``--max-tokens`` each. It prints how many completions are identical both ways and, for
those that differ, where they part (characters of agreeing text). SPEC promises identical
greedy text however a request is batched. Where the CPU kernels run (Sluice's linear kernel,
the paged attention kernel for decode rows and prefill chunks alike, C norm, rotation and silu)
every token's row is computed the same way whatever the step, in float32 and bfloat16 alike;
on other paths (oneDNN's or torch's bfloat16 products, SDPA) a product's rounding depends on
how the batch was tiled, so a near tie between two tokens can go either way: this measures how
often that happens.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from bench_serve import _free_port
from bench_smollm2 import Server

SUBJECTS = ["France", "Japan", "the Moon", "photosynthesis", "the Roman Empire", "a binary search", "the ocean",
            "jazz", "volcanoes", "the printing press", "honey bees", "electric cars", "chess", "the Nile",
            "vaccines", "glaciers"]
TEMPLATES = ["Question: What is the most interesting fact about {}? Answer:", "Write two sentences about {}.",
             "Explain {} to a child:", "The history of {} begins"]


def prompts(n: int) -> list[str]:
    every = [t.format(s) for s in SUBJECTS for t in TEMPLATES]
    return every[:n]


async def complete(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> str:
    r = await client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                         "temperature": 0, "ignore_eos": True}, timeout=600)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


async def alone_then_batched(url: str, texts: list[str], max_tokens: int) -> tuple[list[str], list[str]]:
    async with httpx.AsyncClient() as client:
        alone = [await complete(client, url, t, max_tokens) for t in texts]
        batched = await asyncio.gather(*(complete(client, url, t, max_tokens) for t in texts))
    return alone, list(batched)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    texts = prompts(args.prompts)
    print(f"{args.model}: {len(texts)} prompts, {args.max_tokens} greedy tokens each, alone vs all at once")
    for dtype in args.dtypes:
        port = _free_port()
        server = Server(dtype, [sys.executable, "-m", "frontend", "serve", "--model", args.model, "--dtype", dtype,
                                "--port", str(port)], f"http://127.0.0.1:{port}")
        server.start()
        try:
            alone, batched = asyncio.run(alone_then_batched(server.url, texts, args.max_tokens))
        finally:
            server.stop()
        parted = [next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y)))
                  for x, y in zip(alone, batched, strict=True) if x != y]
        same = len(texts) - len(parted)
        where = (f"; the others part after {statistics.median(parted):.0f} characters (median; "
                 f"min {min(parted)}, of ~{statistics.median(len(a) for a in alone):.0f})") if parted else ""
        print(f"  {dtype:<9} identical alone and batched: {same}/{len(texts)}{where}")


if __name__ == "__main__":
    main()
