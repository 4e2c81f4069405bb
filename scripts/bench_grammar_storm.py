"""A grammar storm: does compiling other clients' schemas stall a plain stream?

    python scripts/bench_grammar_storm.py                   # SmolLM2, 16 schemas, 3 rounds
    python scripts/bench_grammar_storm.py --schemas 32 --rounds 5

One ``sluice serve`` (the default model). Each round streams one plain greedy completion
(``--output-tokens`` long, ``ignore_eos``) three times: alone; while ``--schemas`` requests
arrive at once, all held to one JSON schema compiled before (the load of constrained neighbours,
no compiling); and while as many arrive each held to a schema never seen before (distinct texts:
nothing is cached; each expensive to compile: an ``anyOf`` of many objects, a large enum). The
plain stream's inter-token latencies are read by the client as chunks arrive. Printed per round
and as medians over rounds: p50 and p99 of those latencies and the longest gap, in each case;
the ratio of new schemas to a compiled one isolates what compiling costs the stream (1.0: nothing),
and the ratio to alone is issue 37's figure (goal: p99 within 3x). Every schema must be served
(a document that parses, or cut at max_tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import time
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(__file__))
import bench_serve


def expensive_schema(i: int) -> dict[str, Any]:
    """A schema whose matcher takes tens of milliseconds to build on SmolLM2's vocabulary (an
    anyOf of 40 objects of 20 keys, and an enum of 1,000 values), distinct for each ``i``."""
    variants = [{"type": "object", "properties": {f"k{i}_{j}_{k}": {"type": "integer"} for k in range(20)},
                 "required": [f"k{i}_{j}_0"], "additionalProperties": False} for j in range(40)]
    return {"type": "object", "additionalProperties": False, "required": ["kind", "record"],
            "properties": {"kind": {"enum": [f"kind_{i}_{n}" for n in range(1000)]}, "record": {"anyOf": variants}}}


async def plain_stream(client: httpx.AsyncClient, url: str, tokens: int) -> list[float]:
    """Inter-token gaps (s) of one plain greedy stream, as the client sees them."""
    body = {"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    arrivals = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(arrivals)]


async def constrained(client: httpx.AsyncClient, url: str, i: int) -> bool:
    body = {"prompt": f"Record {i} as JSON:\n", "max_tokens": 64, "temperature": 0,
            "structured_outputs": {"json": expensive_schema(i)}}
    r = await client.post(f"{url}/v1/completions", json=body)
    if r.status_code != 200:
        print(f"  schema {i}: {r.status_code} {r.text[:200]}", file=sys.stderr)
        return False
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "length":
        return True
    try:
        json.loads(choice["text"])
    except ValueError:
        return False
    return True


async def storm_beside(client: httpx.AsyncClient, url: str, tokens: int, schemas: list[int]) -> tuple[list[float], int]:
    stream = asyncio.ensure_future(plain_stream(client, url, tokens))
    await asyncio.sleep(1.0)  # the stream is decoding when the storm comes
    served = await asyncio.gather(*(constrained(client, url, i) for i in schemas))
    return await stream, sum(served)


async def round_(url: str, tokens: int, schemas: int) -> tuple[list[float], list[float], list[float], int]:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=schemas + 8)) as client:
        alone = await plain_stream(client, url, tokens)
        known = 7
        await constrained(client, url, known)  # compiled now: the next storm compiles nothing
        compiled, _ = await storm_beside(client, url, tokens, [known] * schemas)
        fresh = int(time.time() * 1000) * 100
        new, served = await storm_beside(client, url, tokens, [fresh + i for i in range(schemas)])
    return alone, compiled, new, served


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--schemas", type=int, default=16)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    rows = []
    with bench_serve.serving(None, args.model, []) as url:
        for r in range(args.rounds):
            alone, compiled, new, served = asyncio.run(round_(url, args.output_tokens, args.schemas))
            row = [f(x) for x in (alone, compiled, new) for f in (lambda v: pct(v, 0.5), lambda v: pct(v, 0.99), max)]
            rows.append((*row, served))
            print(f"round {r + 1}: ITL p50/p99/longest ms: alone {_ms(row[0:3])} | beside {args.schemas} requests of "
                  f"a compiled schema {_ms(row[3:6])} | beside {args.schemas} new schemas {_ms(row[6:9])} | "
                  f"new schemas served {served}/{args.schemas}", flush=True)
    med = [statistics.median(col) for col in zip(*rows, strict=True)]
    print(f"\nmedian of {args.rounds} rounds, plain stream ITL p50/p99/longest ms: alone {_ms(med[0:3])}; beside "
          f"{args.schemas} requests of a compiled schema {_ms(med[3:6])}; beside {args.schemas} new schemas "
          f"{_ms(med[6:9])}")
    print(f"p99 beside new schemas: {med[7] / med[4]:.2f}x beside a compiled one (what compiling costs), "
          f"{med[7] / med[1]:.2f}x alone (goal <= 3x); new schemas served {min(r[-1] for r in rows)}/{args.schemas} "
          "(worst round)")


def _ms(values: list[float]) -> str:
    return "/".join(f"{v * 1e3:.0f}" for v in values)


if __name__ == "__main__":
    main()
