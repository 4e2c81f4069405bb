"""Speculative decoding (``--speculative ngram``) on SmolLM2-135M-Instruct, over text that quotes
its input: Sluice with and without it, and llama.cpp's server with and without its own n-gram
speculation, on the same GGUF file, same client, same run.

    python scripts/bench_speculative.py                                   # Sluice, 1 16 64 streams
    python scripts/bench_speculative.py --llama-server ~/llama.cpp/build/bin/llama-server --rounds 2
    python scripts/bench_speculative.py --sluice-args "--num-speculative-tokens 3" --concurrency 1

The workload ships here: short original passages, each asked about three ways that make a model
repeat its input, as such requests do — edit a paragraph (change one detail, keep the rest),
summarise it with a word-for-word quote, fill a JSON record from it. Every request is a greedy
chat completion of at most ``--max-tokens`` tokens.

A cell sends ``c`` requests at once (1 stream: every request of the workload, one after another;
16 and 64: that many, the workload's requests in turn) and reports output tokens/s over the cell
(end to end: prefill included, the same for every server). Cells are interleaved (each server
in turn), ``--rounds`` times, every server started fresh for its cell; a figure is the median
over rounds. Sluice runs with its defaults plus ``--speculative ngram``, or without it.
llama.cpp runs as its users run it for the load: all cores, one slot per stream, 512 tokens
of context per slot (more where a request needs it), and, for its speculation, ``--spec-type
ngram-simple`` with its own defaults (lookups of 12 tokens, up to 3 drafted) and ``--llama-spec``
(none by default). On the machine of docs/benchmarks.md, those defaults did best: lookups of 2 or
3 tokens with up to 8 or 16 drafted were no faster, or slower.

Also printed: each workload's acceptance (Sluice's proposals accepted / verified, from
``/admin/stats``), and whether Sluice's answers with and without speculation are the same text
(they must be: greedy, and verification keeps only what decoding would have produced).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_serve import _free_port
from bench_smollm2 import Server

ADMIN_TOKEN = "bench-speculative"
PASSAGES = [
    "The lighthouse on Gull Point was built in 1871 from granite cut on the island itself. Its lamp "
    "burned whale oil until 1890, then kerosene, and it has been electric since 1932. The keeper's "
    "house beside it is now a small museum, open from May to September, where visitors can see the "
    "original lens and the logbooks the keepers wrote during storms.",
    "To reset the router, hold the small button on the back for ten seconds until the front light "
    "blinks orange. Wait two minutes for it to restart. Then connect to the network named HOME-SETUP "
    "and open the address 192.168.0.1 in a browser. The default password is printed on the label "
    "under the device; change it before you do anything else.",
    "Maria Lopez joined the company in March 2019 as a junior analyst in the Madrid office. In 2021 "
    "she moved to the London team and led the migration of the billing system to the new platform. "
    "She was promoted to engineering manager in January 2024 and now leads a team of nine people "
    "working on payments and fraud detection.",
    "The bakery opens at seven in the morning and closes at six in the evening, except on Sundays, "
    "when it closes at noon. Bread is baked twice a day, at five and at eleven. The most popular "
    "items are the sourdough loaf, the rye rolls and the almond croissant, which usually sells out "
    "before ten o'clock.",
]
TASKS = {
    "edit": "Rewrite the following paragraph exactly as it is, changing only the first number that appears "
            "in it to a different number. Output only the rewritten paragraph.\n\n{text}",
    "quote": "Summarise the following text in one sentence, then quote its second sentence word for "
             "word.\n\n{text}",
    "json": "Fill this JSON record from the text below and output only the JSON: {{\"subject\": \"\", "
            "\"dates_or_times\": [], \"first_sentence\": \"\", \"last_sentence\": \"\"}}\n\n{text}",
}


def workload() -> list[tuple[str, list[dict[str, str]]]]:
    """(task, chat messages) for every task over every passage, tasks interleaved."""
    return [(task, [{"role": "user", "content": template.format(text=text)}])
            for text in PASSAGES for task, template in TASKS.items()]


async def _complete(client: httpx.AsyncClient, url: str, messages: list[dict[str, str]], max_tokens: int,
                    model: str) -> tuple[str, int]:
    r = await client.post(f"{url}/v1/chat/completions", json={
        "model": model, "messages": messages, "temperature": 0, "max_tokens": max_tokens})
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]


async def _cell(url: str, c: int, max_tokens: int, model: str) -> tuple[float, list[str]]:
    """tok/s of one cell, and the answers (1 stream: the workload's, in order)."""
    items = workload()
    async with httpx.AsyncClient(timeout=1200) as client:
        start = time.perf_counter()
        if c == 1:
            done = [await _complete(client, url, messages, max_tokens, model) for _, messages in items]
        else:
            done = list(await asyncio.gather(*(_complete(client, url, items[i % len(items)][1], max_tokens, model)
                                               for i in range(c))))
        elapsed = time.perf_counter() - start
    return sum(n for _, n in done) / elapsed, [text for text, _ in done]


def _stats(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/admin/stats", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30).json()


def _acceptance(url: str, max_tokens: int) -> dict[str, tuple[int, int, list[float]]]:
    """Per task: (proposals verified, accepted, acceptance by draft position), one stream."""
    out: dict[str, tuple[int, int, list[float]]] = {}
    for task in TASKS:
        before = _stats(url)
        asyncio.run(_one_task(url, task, max_tokens))
        after = _stats(url)
        drafted = [a - b for a, b in zip(after["spec_drafted_by_position"], before["spec_drafted_by_position"]
                                         + [0] * 64, strict=False)]
        accepted = [a - b for a, b in zip(after["spec_accepted_by_position"], before["spec_accepted_by_position"]
                                          + [0] * 64, strict=False)]
        out[task] = (sum(drafted), sum(accepted), [a / d if d else 0.0 for a, d in zip(accepted, drafted,
                                                                                        strict=True)])
    return out


async def _one_task(url: str, task: str, max_tokens: int) -> None:
    async with httpx.AsyncClient(timeout=1200) as client:
        for name, messages in workload():
            if name == task:
                await _complete(client, url, messages, max_tokens, "smollm2")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary")
    p.add_argument("--llama-spec", default="",
                   help="more llama-server flags for its speculation, beside --spec-type ngram-simple")
    p.add_argument("--sluice-args", default="", help="extra flags for both Sluice servers")
    args = p.parse_args()

    from worker.model.loader import smollm2_path

    cores = len(os.sched_getaffinity(0))
    gguf = str(smollm2_path())

    def sluice(speculative: bool) -> Server:
        flags = ["--speculative", "ngram"] if speculative else []
        return Server("sluice", [sys.executable, "-m", "frontend", "serve", "--model", "smollm2", "--port",
                                 str(port := _free_port()), "--admin-token", ADMIN_TOKEN, *flags,
                                 *args.sluice_args.split()], f"http://127.0.0.1:{port}")

    def llama_cpp(c: int, speculative: bool) -> Server:
        per_slot = max(512, 512 + args.max_tokens)
        flags = ["--spec-type", "ngram-simple", *args.llama_spec.split()] if speculative else []
        return Server("llama.cpp", [args.llama_server, "-m", gguf, "--port", str(port := _free_port()), "-t",
                                    str(cores), "-np", str(c), "-c", str(c * per_slot), "--no-webui", *flags],
                      f"http://127.0.0.1:{port}", ready_path="/health")

    systems = {"sluice ngram": lambda c: sluice(True), "sluice": lambda c: sluice(False)}
    if args.llama_server:
        systems |= {"llama.cpp ngram": lambda c: llama_cpp(c, True), "llama.cpp": lambda c: llama_cpp(c, False)}
    cells: dict[tuple[str, int], list[float]] = {}
    answers: dict[str, list[str]] = {}
    acceptance = None
    for r in range(args.rounds):
        for c in args.concurrency:
            for name, make in systems.items():
                server = make(c)
                try:
                    server.start()
                    asyncio.run(_complete(httpx.AsyncClient(timeout=600), server.url,
                                          [{"role": "user", "content": "Hi"}], 4, "smollm2"))  # warm-up
                    tok_s, texts = asyncio.run(_cell(server.url, c, args.max_tokens, "smollm2"))
                    if c == 1 and name.startswith("sluice"):
                        answers.setdefault(name, texts)
                        if name == "sluice ngram" and acceptance is None:
                            acceptance = _acceptance(server.url, args.max_tokens)
                finally:
                    server.stop()
                cells.setdefault((name, c), []).append(tok_s)
                print(f"round {r + 1}, {name}, {c} streams: {tok_s:,.1f} tok/s", file=sys.stderr, flush=True)

    print(f"\nSmolLM2-135M-Instruct (the shipped Q4_1 file), {len(workload())} input-grounded chat requests "
          f"(greedy, up to {args.max_tokens} tokens), {cores} cores, median of {args.rounds} round(s)")
    print(f"  {'streams':>7} | {'server':<15} | {'tok/s':>7} | vs sluice | vs llama.cpp ngram")
    for c in args.concurrency:
        plain = statistics.median(cells[("sluice", c)])
        rival = statistics.median(cells[("llama.cpp ngram", c)]) if args.llama_server else None
        for name in systems:
            tok_s = statistics.median(cells[(name, c)])
            rival_ratio = f"{tok_s / rival:5.2f}" if rival else ""
            print(f"  {c:>7} | {name:<15} | {tok_s:>7,.1f} | {tok_s / plain:8.2f}  | {rival_ratio}")
    if acceptance is not None:
        print("  Sluice's acceptance, one stream (accepted / verified; by draft position):")
        for task, (drafted, accepted, by_position) in acceptance.items():
            rate = accepted / drafted if drafted else 0.0
            print(f"    {task:<6} {accepted:>5} / {drafted:<5} = {rate:4.0%}   "
                  + " ".join(f"{x:.0%}" for x in by_position))
    if len(answers) == 2:
        same = sum(a == b for a, b in zip(answers["sluice ngram"], answers["sluice"], strict=True))
        print(f"  Sluice's answers with and without speculation: {same} of {len(answers['sluice'])} the same text")


if __name__ == "__main__":
    main()
