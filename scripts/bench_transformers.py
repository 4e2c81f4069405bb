"""Sluice against what a CPU user would otherwise write: Hugging Face ``transformers`` ``generate``
in static batches, on the same model, dtype, cores and requests, in the same run.

    python scripts/bench_transformers.py                      # SmolLM2, 256 requests, batches of 16
    python scripts/bench_transformers.py --model tiny --rounds 3
    python scripts/bench_transformers.py --model tiny --quick  # a smoke run, seconds

One seeded workload: ``--num-requests`` prompts of token ids (ordinary vocabulary entries, no
special tokens, different per request so no prefix cache helps), prompt and output lengths drawn
uniformly from ``--input-len`` and ``--output-len``. Every request generates exactly its output
length (EOS ignored). Each round runs both sides, one after the other, with the machine to itself:

* transformers: all cores (``torch.set_num_threads``), the requests in arrival order in static
  batches of ``--batch-size``, each left-padded to its longest prompt and generating, greedily, as
  many tokens as its longest request asks for (``min_new_tokens`` = ``max_new_tokens``, so EOS does
  not end it early). Only each request's own output length counts as useful; the rest (padding,
  tokens generated past a request's length) is reported as waste.
* Sluice: a fresh ``sluice serve`` (its defaults, but the same ``--dtype``), the same requests as
  non-streaming ``/v1/completions`` (``ignore_eos``, ``temperature`` 0) with ``--max-concurrency``
  in flight; output tokens from each response's ``usage.completion_tokens``.

``--dtype auto`` is resolved here the way Sluice's worker resolves it on a CPU
(``worker.model.cpu_matmul.choose_dtype``, from the CPU's instructions) and the result is given to both sides.
Peak memory is VmHWM (model loading included): this process for transformers (it also runs the
HTTP client, a few MiB), Sluice's worker process, and the sum over all Sluice's processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `worker` is importable when run as scripts/bench_transformers.py

# Token ids above the special tokens (SmolLM2 0..16, tiny 0..2) and below 512, so they exist in
# both vocabularies (the same range as `sluice bench --token-ids`).
TOKEN_IDS = (100, 500)
TARGET_RATIO = 3.0
QUICK = {"num_requests": 16, "input_len": (8, 32), "output_len": (8, 32), "batch_size": 4, "max_concurrency": 8}
DEFAULTS = {"num_requests": 256, "input_len": (32, 512), "output_len": (16, 256), "batch_size": 16,
            "max_concurrency": 64}


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_len: int


@dataclass(frozen=True)
class Waste:
    """What static batching costs a workload: tokens computed that no request asked for."""

    useful_output: int  # sum of the requests' own output lengths
    computed_output: int  # sum over batches of batch size x its longest output
    prompt: int  # sum of the prompts' lengths
    padded_prompt: int  # sum over batches of batch size x its longest prompt

    @property
    def overrun_output(self) -> int:
        return self.computed_output - self.useful_output

    @property
    def padding(self) -> int:
        return self.padded_prompt - self.prompt


@dataclass
class Result:
    side: str
    round: int
    useful_tokens: int
    wall_s: float
    peak_mib: float
    other_cores: float  # CPU used by processes not part of this side while it ran (see CpuWatch)
    note: str = ""

    @property
    def tok_s(self) -> float:
        return self.useful_tokens / self.wall_s if self.wall_s > 0 else 0.0


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be >= 1")
    return value


def parse_range(text: str) -> tuple[int, int]:
    """``LO:HI`` or ``N`` -> (lo, hi), 1 <= lo <= hi."""
    lo_s, sep, hi_s = text.partition(":")
    try:
        lo, hi = int(lo_s), int(hi_s if sep else lo_s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected N or LO:HI") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= LO <= HI")
    return lo, hi


def build_workload(n: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int) -> list[Request]:
    """``n`` requests, a pure function of the arguments."""
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        prompt_len, out_len = rng.randint(*input_len), rng.randint(*output_len)
        requests.append(Request([rng.randrange(*TOKEN_IDS) for _ in range(prompt_len)], out_len))
    return requests


def static_batches(requests: list[Request], batch_size: int) -> list[list[Request]]:
    """Consecutive requests, in arrival order; the last batch may be smaller."""
    return [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]


def static_waste(requests: list[Request], batch_size: int) -> Waste:
    batches = static_batches(requests, batch_size)
    return Waste(
        useful_output=sum(r.output_len for r in requests),
        computed_output=sum(len(b) * max(r.output_len for r in b) for b in batches),
        prompt=sum(len(r.prompt) for r in requests),
        padded_prompt=sum(len(b) * max(len(r.prompt) for r in b) for b in batches),
    )


def peak_mib(pid: int | str = "self") -> float:
    """VmHWM, the peak resident set of a process, in MiB (nan if it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return float("nan")
    match = re.search(r"VmHWM:\s+(\d+) kB", status)
    return int(match.group(1)) / 1024 if match else float("nan")


def cores() -> int:
    return len(os.sched_getaffinity(0))


def _busy_ticks() -> int:
    """Clock ticks every CPU of the machine spent busy, from /proc/stat."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return user + nice + system + irq + softirq + steal


def _process_ticks(pid: int | str) -> int:
    """utime + stime of a process, all its threads (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


class CpuWatch:
    """How many cores *other* processes kept busy during a measurement. The cores are shared and
    a torch forward pass on all of them stalls at every barrier when one is taken, so a busy
    neighbour can slow a side many times over: a figure well above 0 means re-run on an idle
    machine."""

    def __init__(self, pids: list[int | str]) -> None:
        self.pids = pids
        self.began = (time.perf_counter(), _busy_ticks(), sum(_process_ticks(p) for p in pids))

    def other_cores(self) -> float:
        t0, busy0, own0 = self.began
        busy = _busy_ticks() - busy0
        own = sum(_process_ticks(p) for p in self.pids) - own0
        return max(0.0, (busy - own) / os.sysconf("SC_CLK_TCK") / (time.perf_counter() - t0))


# ---- transformers ----------------------------------------------------------------------------

def model_source(model: str) -> tuple[str, dict[str, Any]]:
    """The directory (and ``gguf_file`` keyword) ``from_pretrained`` takes for ``--model``: the
    very files ``sluice serve --model`` loads."""
    if model == "tiny":
        from worker.model.tiny import materialize_tiny

        return str(materialize_tiny()), {}
    from worker.model.loader import smollm2_path

    path = smollm2_path()
    return str(path.parent), {"gguf_file": path.name}


def resolve_dtype(name: str, model: str) -> tuple[str, str]:
    """``--dtype``, with ``auto`` chosen as Sluice's CPU worker chooses it; with the reason."""
    if name != "auto":
        return name, "--dtype"
    from worker.model.cpu_matmul import choose_dtype

    choice = choose_dtype()
    return str(choice.dtype).removeprefix("torch."), f"auto: {choice.reason}"


def load_transformers(model: str, dtype: str) -> tuple[Any, float, str]:
    """The model, its load time, and what its weights are. transformers 5 can keep a GGUF file's
    weights packed (its GGUF quantizer, with a kernel from the Hub); without one it dequantizes
    the file into dense weights, as Sluice does. 5.24 warns that they "stay quantized" either way,
    so the caller prints what the loaded parameters really are."""
    import torch
    from transformers import AutoModelForCausalLM

    directory, kw = model_source(model)
    began = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype), **kw).eval()
    load_s = time.perf_counter() - began
    params = list(hf.parameters())
    packed = sum(1 for p in params if not p.is_floating_point())
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params if p.is_floating_point()})
    what = f"dense {'/'.join(dtypes)} weights" + (f", {packed} tensors kept as packed GGUF blocks" if packed else "")
    return hf, load_s, what


def hf_generate(hf: Any, batch: list[Request], new_tokens: int) -> int:
    """One static batch: left-padded to its longest prompt, ``new_tokens`` greedy tokens for every
    row whatever it asked for. Returns the tokens generated per row."""
    import torch

    pad = hf.generation_config.pad_token_id
    if pad is None:
        eos = hf.generation_config.eos_token_id
        pad = (eos[0] if isinstance(eos, list) else eos) or 0
    longest = max(len(r.prompt) for r in batch)
    ids = torch.full((len(batch), longest), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, longest - len(r.prompt):] = torch.tensor(r.prompt)
        mask[i, longest - len(r.prompt):] = 1
    # min_new_tokens = max_new_tokens: EOS is masked out until the end, so no row stops early
    # (what ignore_eos asks of Sluice).
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                      do_sample=False, pad_token_id=pad)
    return int(out.shape[1]) - longest


def run_transformers(hf: Any, requests: list[Request], batch_size: int, rnd: int) -> Result:
    import torch

    with torch.inference_mode():
        hf_generate(hf, [Request(r.prompt[:8], 4) for r in requests[:2]], 4)  # warm-up, not timed
        watch = CpuWatch(["self"])
        began = time.perf_counter()
        for batch in static_batches(requests, batch_size):
            want = max(r.output_len for r in batch)
            got = hf_generate(hf, batch, want)
            if got != want:
                raise RuntimeError(f"transformers generated {got} tokens, {want} asked")
        wall = time.perf_counter() - began
    # Useful = each request's own length; the batch's longest request made the others compute more.
    return Result("transformers", rnd, sum(r.output_len for r in requests), wall, peak_mib(), watch.other_cores())


# ---- Sluice ----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``sluice serve`` in its own process group, so stop() reaches the scheduler and worker."""

    def __init__(self, model: str, dtype: str, extra: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix="bench-transformers-sluice-", suffix=".log")[1])
        argv = [sys.executable, "-m", "frontend", "serve", "--model", model, "--dtype", dtype,
                "--port", str(self.port), *extra]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def wait_ready(self, timeout: float = 300.0) -> float:
        import httpx

        began = time.monotonic()
        while time.monotonic() - began < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sluice serve exited with {self.proc.returncode}; log: {self.log}\n"
                                   + self.log.read_text(errors="replace")[-3000:])
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return time.monotonic() - began
            time.sleep(0.2)
        raise TimeoutError(f"sluice serve not ready after {timeout:.0f} s; log: {self.log}")

    def pids(self, *pattern: str) -> list[int]:
        """The server's processes (frontend, scheduler, worker), or those matching ``-f PATTERN``."""
        found = subprocess.run(["pgrep", "-g", str(self.proc.pid), *pattern], capture_output=True, text=True)
        return [int(p) for p in found.stdout.split()]

    def peaks(self) -> tuple[float, float]:
        """(the worker's VmHWM, the sum of every process's VmHWM in the group), MiB."""
        workers = self.pids("-f", "worker --config")
        worker = sum(peak_mib(p) for p in workers) if workers else float("nan")
        return worker, sum(peak_mib(p) for p in self.pids())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=15)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything left in the group
        self.proc.wait()


async def send_all(url: str, model: str, requests: list[Request], concurrency: int,
                   server_pids: list[int]) -> tuple[list[int], float, float]:
    """Every request at once, at most ``concurrency`` in flight; each one's completion_tokens,
    the wall time and the other processes' cores. Raises on the first failed request (a partial
    count would flatter)."""
    import httpx

    slots = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        async def one(r: Request) -> int:
            body = {"model": model, "prompt": r.prompt, "max_tokens": r.output_len, "temperature": 0,
                    "ignore_eos": True, "stream": False}
            async with slots:
                resp = await client.post(f"{url}/v1/completions", json=body)
            if resp.status_code != 200:
                raise RuntimeError(f"sluice: HTTP {resp.status_code}: {resp.text[:300]}")
            return int(resp.json()["usage"]["completion_tokens"])

        await one(Request([TOKEN_IDS[0] + i for i in range(8)], 4))  # warm-up, not timed or counted
        watch = CpuWatch([*server_pids, "self"])  # this process is the HTTP client
        began = time.perf_counter()
        counts = await asyncio.gather(*(one(r) for r in requests))
        return list(counts), time.perf_counter() - began, watch.other_cores()


def run_sluice(args: argparse.Namespace, dtype: str, requests: list[Request], rnd: int) -> tuple[Result, float]:
    server = Server(args.model, dtype, args.sluice_args.split())
    try:
        ready_s = server.wait_ready()
        counts, wall, other = asyncio.run(send_all(server.url, args.model, requests, args.max_concurrency,
                                                   server.pids()))
        worker, total = server.peaks()
    finally:
        server.stop()
    short = sum(1 for c, r in zip(counts, requests, strict=True) if c != r.output_len)
    note = f"all Sluice processes: {total:,.0f} MiB"
    if short:
        note += f"; {short} request(s) got other than max_tokens tokens"
    # Counted from usage, not assumed: a request that came back short counts for less.
    return Result("sluice", rnd, sum(counts), wall, worker, other, note), ready_s


# ---- main ------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="both sides' dtype; auto: as Sluice's CPU worker would choose")
    p.add_argument("--num-requests", type=positive, default=None, help=f"default {DEFAULTS['num_requests']}")
    p.add_argument("--input-len", type=parse_range, default=None, metavar="LO:HI", help="default 32:512")
    p.add_argument("--output-len", type=parse_range, default=None, metavar="LO:HI", help="default 16:256")
    p.add_argument("--batch-size", type=positive, default=None, help=f"transformers' static batch, default "
                                                                f"{DEFAULTS['batch_size']}")
    p.add_argument("--max-concurrency", type=positive, default=None, help=f"Sluice requests in flight, default "
                                                                     f"{DEFAULTS['max_concurrency']}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=positive, default=1, help="transformers then Sluice, this many times")
    p.add_argument("--quick", action="store_true", help="a smoke run: 16 requests of 8:32 in and out, batches "
                                                        "of 4, 8 in flight (flags given explicitly still win)")
    p.add_argument("--sluice-args", default="", help="extra flags for sluice serve, e.g. '--kv-cache-memory 2GiB'")
    args = p.parse_args(argv)
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def print_table(results: list[Result], waste: Waste, batch_size: int) -> float:
    """The table; returns the median Sluice / transformers ratio over rounds."""
    print(f"\n{'round':>5} | {'side':<12} | {'useful out tok/s':>16} | {'wall s':>8} | {'useful tokens':>13} | "
          f"{'peak RSS MiB':>12} | {'other load':>10} | ratio")
    ratios = []
    for rnd in sorted({r.round for r in results}):
        pair = {r.side: r for r in results if r.round == rnd}
        hf, sl = pair["transformers"], pair["sluice"]
        ratio = sl.tok_s / hf.tok_s if hf.tok_s else float("nan")
        ratios.append(ratio)
        for r in (hf, sl):
            cell = f"{ratio:.2f}x" if r is sl else ""
            print(f"{r.round:>5} | {r.side:<12} | {r.tok_s:>16,.1f} | {r.wall_s:>8.2f} | {r.useful_tokens:>13,} | "
                  f"{r.peak_mib:>12,.0f} | {r.other_cores:>10.2f} | {cell}")
    print(f"\ntransformers, static batches of {batch_size}: {waste.useful_output:,} useful output tokens, "
          f"{waste.computed_output:,} generated ({waste.overrun_output:,} past their request's length, "
          f"{waste.overrun_output / waste.computed_output:.0%}); {waste.prompt:,} prompt tokens, "
          f"{waste.padded_prompt:,} prefilled ({waste.padding:,} padding, {waste.padding / waste.padded_prompt:.0%}).")
    for r in results:
        if r.note:
            print(f"round {r.round} {r.side}: {r.note}")
    return statistics.median(ratios)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import transformers

    torch.set_num_threads(cores())
    requests = build_workload(args.num_requests, args.input_len, args.output_len, args.seed)
    dtype, why = resolve_dtype(args.dtype, args.model)
    print(f"model {args.model}, dtype {dtype} ({why}), {cores()} cores, {len(requests)} requests, "
          f"input {args.input_len[0]}:{args.input_len[1]}, output {args.output_len[0]}:{args.output_len[1]}, "
          f"seed {args.seed}; transformers {transformers.__version__} batch {args.batch_size}, "
          f"sluice concurrency {args.max_concurrency}", file=sys.stderr, flush=True)
    hf, load_s, weights = load_transformers(args.model, dtype)
    print(f"transformers loaded the model in {load_s:.1f} s: {weights} (peak RSS so far {peak_mib():,.0f} MiB)",
          file=sys.stderr, flush=True)

    results: list[Result] = []
    for rnd in range(1, args.rounds + 1):
        results.append(hf_result := run_transformers(hf, requests, args.batch_size, rnd))
        print(f"round {rnd}: transformers {hf_result.tok_s:,.1f} useful tok/s in {hf_result.wall_s:.1f} s",
              file=sys.stderr, flush=True)
        sl_result, ready_s = run_sluice(args, dtype, requests, rnd)
        results.append(sl_result)
        print(f"round {rnd}: sluice ready in {ready_s:.1f} s, {sl_result.tok_s:,.1f} useful tok/s in "
              f"{sl_result.wall_s:.1f} s", file=sys.stderr, flush=True)

    print(f"\nSluice vs transformers generate: {args.model} as {dtype} ({why}), {cores()} cores, "
          f"{len(requests)} requests, prompts {args.input_len[0]}:{args.input_len[1]}, outputs "
          f"{args.output_len[0]}:{args.output_len[1]} tokens (EOS ignored), seed {args.seed}; transformers "
          f"{transformers.__version__}: {weights}, loaded in {load_s:.1f} s")
    ratio = print_table(results, static_waste(requests, args.batch_size), args.batch_size)
    verdict = "met" if ratio >= TARGET_RATIO else "NOT met"
    median = " (median over rounds)" if args.rounds > 1 else ""
    print(f"Sluice / transformers useful output tokens/s: {ratio:.2f}x{median}; target >= {TARGET_RATIO:.0f}x: "
          f"{verdict}")
    print("peak RSS: VmHWM, model loading included; transformers = this process, sluice = its worker process. "
          f"other load: cores kept busy by other processes during the side's run (of {cores()}; "
          "well above 0: re-run on an idle machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
