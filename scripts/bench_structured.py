"""Structured output: what a JSON-schema constraint costs, what jump-forward saves, what compiling costs.

    python scripts/bench_structured.py                     # SmolLM2: 16 and 64 streams, 3 rounds
    python scripts/bench_structured.py --streams 16 --rounds 5 --output-tokens 128

1. Throughput. Two ``sluice serve`` (the default model), one with jump-forward (the default), one
   ``--no-jump-forward``, both up for the whole run. Each cell sends ``c`` completions at once,
   each exactly ``--output-tokens`` long: free ones (``ignore_eos``), or held to a JSON schema of
   records in a list that never ends within the output (so they too stop at max_tokens). Cells
   are interleaved (free, json, json without jump-forward) ``--rounds`` times; a figure is the
   median over rounds: output tokens/s, and the ratio of the constrained to the free (the issue's
   goal: >= 0.9x). With them, the forward passes the worker ran per output token and the tokens
   jump-forward appended (the servers' /admin/stats over the cell).
2. One stream: the same constrained request alone, end-to-end seconds with and without
   jump-forward (median of ``--rounds``): what one user waits.
3. Compiling, in this process, on the model's tokenizer: the frontend's validation and the
   worker's matcher, cold (a schema never seen: its text differs) and cached (seen before: the
   frontend remembers its verdict, the worker copies its compiled matcher); and the time to fill
   one token mask, over a whole JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import bench_serve

from client.scenarios import JSON_RECORDS as RECORDS  # records in a list that never ends within the output

ADMIN = "bench-structured"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "languages"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0},
                         "languages": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "maxItems": 3}}}


def serving(model: str, *flags: str) -> contextlib.AbstractContextManager[str]:
    return bench_serve.serving(None, model, ["--admin-token", ADMIN, *flags])


def stats(url: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/admin/stats", headers=AUTH, timeout=10).json())


def body(i: int, tokens: int, constrained: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt": f"Customer list {i}, as JSON records:\n", "max_tokens": tokens,
                           "temperature": 0}
    if constrained:
        out["structured_outputs"] = {"json": RECORDS}
    else:
        out["ignore_eos"] = True
    return out


async def cell(url: str, streams: int, tokens: int, constrained: bool) -> dict[str, float]:
    """``streams`` completions at once; output tokens/s over the cell, passes per output token."""
    before = stats(url)
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        replies = await asyncio.gather(*(client.post(f"{url}/v1/completions", json=body(i, tokens, constrained))
                                         for i in range(streams)))
        wall = time.perf_counter() - start
    out = 0
    for r in replies:
        r.raise_for_status()
        doc = r.json()
        out += doc["usage"]["completion_tokens"]
        if doc["choices"][0]["finish_reason"] != "length":
            raise RuntimeError(f"a request ended early: {doc['choices'][0]}")
    after = stats(url)
    return {"tok_s": out / wall, "passes_per_token": streams * (after["steps"] - before["steps"]) / out,
            "jumped": (after["jump_forward_tokens"] - before["jump_forward_tokens"]) / out}


def one_stream(url: str, tokens: int) -> float:
    start = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json=body(0, tokens, True), timeout=600)
    r.raise_for_status()
    return time.perf_counter() - start


# ------------------------------------------------------------------------------------ compiling


async def timed(awaitable: Any) -> float:
    """Seconds ``awaitable`` takes, inside the event loop (the loop's own start not counted)."""
    t = time.perf_counter()
    await awaitable
    return time.perf_counter() - t


def compile_figures(model: str, repeats: int) -> list[tuple[str, float, float, float, float]]:
    """(schema, frontend cold ms, frontend cached ms, worker cold ms, worker cached ms), medians."""
    from frontend.structured import GrammarValidator, constraint_of
    from frontend.tokenizer import ModelTokenizer
    from frontend.tools import calls_constraint, tool_use
    from worker.structured import GrammarEngine

    info = _model_info(model)
    tags = ModelTokenizer(info).tool_tags
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"]}}}
    wide = {"type": "object", "properties": {f"field_{i}": {"type": ["string", "integer", "boolean"]}
                                             for i in range(200)}}
    cases = {"person (3 keys)": PERSON, "records (list)": RECORDS, "200 keys": wide}
    validator = GrammarValidator()
    engine = GrammarEngine(info.tokenizer_json, info.vocab_size, info.eos_token_ids)
    engine._matcher(constraint_of(None, {"json": PERSON}, {}).grammar, [])  # the tokenizer, built once
    asyncio.run(validator.validate(constraint_of(None, {"json": PERSON}, {}), info))
    rows = []

    def grammar_of(name: str, variant: int) -> Any:
        if name == "tool call (required)":
            fn = weather["function"]
            tool = {"type": "function", "function": {**fn, "parameters": {**fn["parameters"], "title": f"v{variant}"}}}
            return calls_constraint(tool_use([tool], "required", None), tags)
        return constraint_of(None, {"json": {**cases[name], "title": f"v{variant}"}}, {})

    for name in [*cases, "tool call (required)"]:
        fe_cold, fe_hot, wk_cold, wk_hot = [], [], [], []
        for variant in range(repeats):
            c = grammar_of(name, variant)
            fe_cold.append(asyncio.run(timed(validator.validate(c, info))))
            fe_hot.append(asyncio.run(timed(validator.validate(c, info))))
            t = time.perf_counter()
            engine._matcher(c.grammar, [])
            wk_cold.append(time.perf_counter() - t)
            t = time.perf_counter()
            engine._matcher(c.grammar, [])
            wk_hot.append(time.perf_counter() - t)
        rows.append((name, *(1e3 * statistics.median(v) for v in (fe_cold, fe_hot, wk_cold, wk_hot))))
    return rows


def mask_figures(model: str) -> tuple[float, float, int]:
    """(median µs, p99 µs, tokens): filling one row's mask at each token of a records document."""
    import torch
    from tokenizers import Tokenizer

    from frontend.structured import constraint_of
    from worker.structured import GrammarEngine

    info = _model_info(model)
    engine = GrammarEngine(info.tokenizer_json, info.vocab_size, info.eos_token_ids)
    grammar = constraint_of(None, {"json": RECORDS}, {}).grammar
    state = engine.start(grammar, [])
    records = [{"id": i, "name": f"Name {i}", "city": "Lima", "active": i % 2 == 0, "score": 7 * i}
               for i in range(12)]
    text = json.dumps(records)[:-1]  # 12 of the 50 records the schema asks for: the list goes on
    ids = Tokenizer.from_str(info.tokenizer_json).encode(text, add_special_tokens=False).ids
    row = torch.empty((info.vocab_size + 31) // 32, dtype=torch.int32)
    times = []
    for token in ids:
        t = time.perf_counter()
        state.fill(row)
        times.append(time.perf_counter() - t)
        state.consume(token)
    times.sort()
    return 1e6 * statistics.median(times), 1e6 * times[int(0.99 * (len(times) - 1))], len(times)


def _model_info(model: str) -> Any:
    from protocol.config import WorkerConfig
    from worker.gguf.checkpoint import GGUFCheckpoint
    from worker.model.config import LlamaConfig
    from worker.model.info import build_gguf_model_info, build_model_info
    from worker.model.loader import is_gguf, resolve_model_dir

    config = WorkerConfig(model=model)
    source = resolve_model_dir(config.model)
    if is_gguf(source):
        gguf = GGUFCheckpoint(source)
        return build_gguf_model_info(gguf, gguf.config, name=model, max_model_len=8192, num_kv_blocks=1,
                                     block_size=16)
    return build_model_info(source, LlamaConfig.from_file(source / "config.json"), name=model, max_model_len=8192,
                            num_kv_blocks=1, block_size=16)


# ------------------------------------------------------------------------------------ main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--streams", type=int, nargs="+", default=[16, 64])
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--skip-serving", action="store_true", help="only the compile and mask figures")
    args = p.parse_args()

    print(f"compiling ({args.model}'s tokenizer; medians of 10 schemas each, ms):")
    print(f"  {'schema':<22} {'frontend cold':>14} {'cached':>8} {'worker cold':>12} {'cached':>8}")
    for name, fe_cold, fe_hot, wk_cold, wk_hot in compile_figures(args.model, 10):
        print(f"  {name:<22} {fe_cold:14.2f} {fe_hot:8.3f} {wk_cold:12.2f} {wk_hot:8.3f}")
    median, p99, n = mask_figures(args.model)
    print(f"one token's mask: median {median:.1f} µs, p99 {p99:.1f} µs over a {n}-token JSON document")
    if args.skip_serving:
        return

    with serving(args.model) as on, serving(args.model, "--no-jump-forward") as off:
        for url in (on, off):  # warm: the schema compiled, the prompt cached, the threads up
            asyncio.run(cell(url, 2, 16, True))
            asyncio.run(cell(url, 2, 16, False))
        figures: dict[tuple[int, str], list[dict[str, float]]] = {}
        for r in range(args.rounds):
            for c in args.streams:
                for mode, url, constrained in (("free", on, False), ("json", on, True), ("json, no jump", off, True)):
                    f = asyncio.run(cell(url, c, args.output_tokens, constrained))
                    figures.setdefault((c, mode), []).append(f)
                    print(f"  round {r + 1}, {c} streams, {mode}: {f['tok_s']:.1f} tok/s", file=sys.stderr)
        alone = {name: statistics.median(one_stream(url, args.output_tokens) for _ in range(args.rounds))
                 for name, url in (("jump-forward", on), ("no jump-forward", off))}

    print(f"\nthroughput ({args.model}, {args.output_tokens} output tokens per stream, median of {args.rounds} "
          f"rounds):")
    print(f"  {'streams':>7} {'mode':<15} {'tok/s':>8} {'x free':>7} {'passes/token':>13} {'jumped/token':>13}")
    for c in args.streams:
        free = statistics.median(f["tok_s"] for f in figures[(c, "free")])
        for mode in ("free", "json", "json, no jump"):
            runs = figures[(c, mode)]
            tok_s = statistics.median(f["tok_s"] for f in runs)
            passes = statistics.median(f["passes_per_token"] for f in runs)
            jumped = statistics.median(f["jumped"] for f in runs)
            print(f"  {c:>7} {mode:<15} {tok_s:8.1f} {tok_s / free:6.2f}x {passes:13.3f} {jumped:13.3f}")
    on_s, off_s = alone["jump-forward"], alone["no jump-forward"]
    print(f"\none stream, {args.output_tokens} constrained tokens: {on_s:.2f} s with jump-forward, {off_s:.2f} s "
          f"without ({on_s / off_s:.2f}x)")


if __name__ == "__main__":
    main()
