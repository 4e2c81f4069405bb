"""SmolLM2-135M-Instruct served by Sluice, and by llama.cpp's server on the same weights, same
client, same run.

    python scripts/bench_smollm2.py                                # Sluice alone, 1 16 64 streams
    python scripts/bench_smollm2.py --llama-server ~/llama.cpp/build/bin/llama-server
    python scripts/bench_smollm2.py --dtype bfloat16 --llama-server ... --rounds 3
    python scripts/bench_smollm2.py --dtype q4_1 --llama-server ... --rounds 3      # the shipped file, quantized
    python scripts/bench_smollm2.py --dtype q8_0 --llama-server ...     # (or q4_k_m) requantized, both servers
    python scripts/bench_smollm2.py --concurrency 1 --prompt-tokens 7844 --output-tokens 4   # a long prompt
    python scripts/bench_smollm2.py --concurrency 1 --busy 2 --llama-server ...   # beside two busy processes

Each cell sends ``c`` streaming completions at once (``--prompt-tokens`` token ids each, exactly
``--output-tokens`` generated: ``ignore_eos``) and reports output tokens/s over the cell, time
to first token and inter-token latency (p50/p99 over every stream). The cells are interleaved
(Sluice, llama.cpp, Sluice, ...), ``--rounds`` times; a figure is the median over rounds.
llama.cpp is configured as its users run it for the load: the same GGUF file converted to the
same weight dtype (``llama-quantize --allow-requantize``, found beside ``llama-server``), all
cores (``-t``), one slot per concurrent stream (``-np c``) and 512 tokens of context per slot
(``-c c*512``; more where a stream needs more), started fresh for each cell. Sluice stays up for the whole run, with its
defaults (threads, KV cache size, dtype unless ``--dtype`` is given). Then each server's peak
resident memory (llama.cpp's: at the largest cell).

``--busy N`` runs each timed cell beside N processes that each spin a core (a pure-Python loop,
started 3 s before the cell and stopped after it): a shared VM, a CI runner or a Docker host
where other work takes cores from the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import itertools

from bench_decode import open_completion
from bench_serve import _free_port, _pct

GGUF_TYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "q4_1": "Q4_1", "q8_0": "Q8_0",
              "q4_k_m": "Q4_K_M"}
AS_SHIPPED = "q4_1"  # the file's own type: Sluice serves it quantized (--dtype auto), llama.cpp reads it as is
# Quantized types: both servers read the same file (made by llama-quantize from the shipped one), Sluice with --dtype auto.
QUANTIZED = ("q4_1", "q8_0", "q4_k_m")


def _prompts(n: int, length: int, salt: int) -> list[list[int]]:
    """Token ids of ordinary vocabulary entries (no special tokens), different per request and
    per cell (``salt``), so no server reuses a cached prefix across cells."""
    return [[(1_000 + 37 * i + 101 * j + 7_919 * salt) % 48_000 + 100 for j in range(length)] for i in range(n)]


def _rss_mib(pid: int, field_name: str = "VmHWM") -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(rf"{field_name}:\s+(\d+) kB", status)
    return int(match.group(1)) / 1024 if match else float("nan")


async def _stream(host: str, port: int, prompt: list[int], n_out: int) -> list[float]:
    """One streaming completion; the arrival time of each chunk that carries text (llama.cpp
    orders its chunks' keys differently, so events are decoded, not matched by prefix)."""
    reader, writer = await open_completion(host, port, prompt, n_out)
    stamps: list[float] = []
    while line := await reader.readline():
        if not line.startswith(b"data: {"):
            continue
        now = time.perf_counter()
        event = json.loads(line[6:])
        choices = event.get("choices") or []
        if choices and choices[0].get("text"):
            stamps.append(now)
    writer.close()
    return stamps


@dataclass
class Cell:
    tok_s: float
    ttft: list[float]
    itl: list[float]


async def _cell(url: str, c: int, prompt_tokens: int, output_tokens: int, salt: int) -> Cell:
    host, port = url.removeprefix("http://").split(":")
    start = time.perf_counter()
    streams = await asyncio.gather(*(_stream(host, int(port), p, output_tokens)
                                     for p in _prompts(c, prompt_tokens, salt)))
    elapsed = time.perf_counter() - start
    ttft = [s[0] - start for s in streams if s]
    itl = [b - a for s in streams for a, b in itertools.pairwise(s)]
    return Cell(sum(len(s) for s in streams) / elapsed, ttft, itl)


@dataclass
class Server:
    name: str
    argv: list[str]
    url: str
    ready_path: str = "/ready"
    pid_pattern: str | None = None  # the process whose memory counts (None: the server itself)
    proc: subprocess.Popen[bytes] | None = None
    log: Path = field(default_factory=lambda: Path(tempfile.mkstemp(prefix="bench-smollm2-", suffix=".log")[1]))
    ready_s: float = 0.0

    def start(self) -> None:
        began = time.perf_counter()
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited; see {self.log}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.ready_s = time.perf_counter() - began

    def memory_pid(self) -> int:
        """The process whose memory counts: the server itself, or its child whose command line
        holds ``pid_pattern`` (sluice serve starts its components in sessions of their own)."""
        assert self.proc is not None
        if self.pid_pattern is None:
            return self.proc.pid
        for entry in Path("/proc").iterdir():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError, ValueError):
                continue
            if ppid == self.proc.pid and self.pid_pattern in cmdline:
                return int(entry.name)
        raise RuntimeError(f"{self.name}: no child process matching {self.pid_pattern!r}")

    def process_tree(self) -> list[int]:
        """The server's process and every descendant (sluice serve: frontend, scheduler, worker)."""
        assert self.proc is not None
        parents: dict[int, int] = {}
        for entry in Path("/proc").iterdir():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
        tree = [self.proc.pid]
        for pid in tree:
            tree.extend(child for child, parent in parents.items() if parent == pid)
        return tree

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _spin() -> None:
    while True:
        pass


class Busy:
    """N processes that each spin a core while the block runs, from SETTLE_S before it: a load
    that was there before the request, as on a shared host."""

    SETTLE_S = 3.0

    def __init__(self, n: int) -> None:
        self.n, self.procs = n, []

    def __enter__(self) -> Busy:
        self.procs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(self.n)]
        for proc in self.procs:
            proc.start()
        if self.procs:
            time.sleep(self.SETTLE_S)
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.kill()
            proc.join()


def _llama_gguf(server: Path, dtype: str, out_dir: Path) -> Path:
    from worker.model.loader import smollm2_path

    if dtype == AS_SHIPPED:
        return smollm2_path()
    target = out_dir / f"smollm2-{GGUF_TYPES[dtype].lower()}.gguf"
    if not target.exists():
        quantize = server.parent / "llama-quantize"
        subprocess.run([str(quantize), "--allow-requantize", str(smollm2_path()), str(target), GGUF_TYPES[dtype]],
                       check=True, capture_output=True)
    return target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=sorted(GGUF_TYPES),
                   help="weights' dtype on both sides (Sluice's --dtype; llama.cpp's converted GGUF); q4_1: the "
                        "shipped file as it is (Sluice: --dtype auto, which serves it quantized); q8_0, q4_k_m: "
                        "that file requantized by llama-quantize, both servers reading it")
    p.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's llama-server binary")
    p.add_argument("--sluice-args", default="", help="extra flags for sluice serve, e.g. '--worker-threads 1'")
    p.add_argument("--busy", type=int, default=0, help="processes that each spin a core during every timed cell")
    args = p.parse_args()

    cores = len(os.sched_getaffinity(0))
    most = max(args.concurrency)
    gguf = _llama_gguf(args.llama_server, args.dtype, Path(tempfile.gettempdir())) if args.llama_server else None
    if args.dtype in QUANTIZED and args.dtype != AS_SHIPPED and gguf is None:
        p.error(f"--dtype {args.dtype} is made by llama-quantize: give --llama-server")
    sluice_dtype = "auto" if args.dtype in QUANTIZED else args.dtype
    model = str(gguf) if args.dtype in QUANTIZED and gguf is not None else "smollm2"
    sluice = Server("sluice", [sys.executable, "-m", "frontend", "serve", "--model", model, "--dtype", sluice_dtype,
                               "--port", str(port := _free_port()), *args.sluice_args.split()],
                    f"http://127.0.0.1:{port}", pid_pattern="worker --config")

    def llama_cpp(c: int) -> Server:
        """llama-server as its users run it for c streams: a slot each, 512 tokens of context each
        (or what a stream needs, if more)."""
        per_slot = max(512, args.prompt_tokens + args.output_tokens + 16)
        assert args.llama_server is not None and gguf is not None
        return Server("llama.cpp", [str(args.llama_server), "-m", str(gguf), "--port", str(port := _free_port()),
                                    "-t", str(cores), "-np", str(c), "-c", str(c * per_slot), "--no-webui"],
                      f"http://127.0.0.1:{port}", ready_path="/health")

    names = ["sluice"] + (["llama.cpp"] if gguf is not None else [])
    cells: dict[tuple[str, int], list[Cell]] = {}
    memory: dict[str, float] = {}
    try:
        sluice.start()
        asyncio.run(_cell(sluice.url, 1, 8, 4, salt=0))  # warm-up
        print(f"sluice: ready in {sluice.ready_s:.1f} s", file=sys.stderr)
        salt = 1
        for r in range(args.rounds):
            for c in args.concurrency:
                for name in names:
                    server = sluice if name == "sluice" else llama_cpp(c)
                    try:
                        if server is not sluice:
                            server.start()
                            asyncio.run(_cell(server.url, 1, 8, 4, salt=0))  # warm-up, as Sluice's
                        with Busy(args.busy):
                            cell = asyncio.run(_cell(server.url, c, args.prompt_tokens, args.output_tokens, salt))
                        if server is not sluice and c == most:
                            memory[name] = _rss_mib(server.memory_pid())
                    finally:
                        if server is not sluice:
                            server.stop()
                    salt += 1
                    cells.setdefault((name, c), []).append(cell)
                    print(f"round {r + 1}, {name}, {c} streams: {cell.tok_s:,.1f} tok/s, "
                          f"TTFT p50 {_pct(cell.ttft, 0.5) * 1e3:,.0f} ms", file=sys.stderr)
        memory["sluice"] = _rss_mib(sluice.memory_pid())
        memory["sluice, all processes"] = sum(_rss_mib(pid) for pid in sluice.process_tree())
    finally:
        sluice.stop()

    print(f"\nSmolLM2-135M-Instruct as {args.dtype}, {args.prompt_tokens} prompt / {args.output_tokens} output "
          f"tokens per stream, {cores} cores, median of {args.rounds} round(s)"
          + (f", beside {args.busy} processes spinning a core each" if args.busy else ""))
    print(f"  {'streams':>7} | {'server':<9} | {'tok/s':>7} | {'TTFT p50':>8} | {'TTFT p99':>8} | "
          f"{'ITL p50':>7} | {'ITL p99':>7} | ratio")
    for c in args.concurrency:
        base = None
        for name in names:
            runs = cells[(name, c)]
            tok_s = statistics.median(x.tok_s for x in runs)
            ttft = [t for x in runs for t in x.ttft]
            itl = [t for x in runs for t in x.itl]
            if name == "llama.cpp":
                base = tok_s
            ratio = f"{statistics.median(x.tok_s for x in cells[('sluice', c)]) / base:5.2f}" if base else ""
            print(f"  {c:>7} | {name:<9} | {tok_s:>7,.1f} | {_pct(ttft, 0.5) * 1e3:>6.0f}ms | "
                  f"{_pct(ttft, 0.99) * 1e3:>6.0f}ms | {_pct(itl, 0.5) * 1e3:>5.1f}ms | {_pct(itl, 0.99) * 1e3:>5.1f}ms | "
                  f"{ratio}")
    print("  peak resident memory: " + ", ".join(f"{name} {mib:,.0f} MiB" for name, mib in sorted(memory.items()))
          + f" (Sluice: its worker process, and the sum of its processes' peaks; llama.cpp: at {most} streams)")
    print("  ratio: Sluice's tok/s over llama.cpp's at the same concurrency")


if __name__ == "__main__":
    main()
