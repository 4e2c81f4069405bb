"""CPU cost of the per-token output path: frontend and scheduler microseconds per streamed token.

    python scripts/bench_output_path.py                         # 1, 64 and 256 streams, 3 rounds
    python scripts/bench_output_path.py --streams 64 --tokens 256 --rounds 5
    python scripts/bench_output_path.py --streams 64 --worker tiny   # the real worker, the tiny model
    python scripts/bench_output_path.py --streams 64 --step-ms 3 --floor

Starts ``sluice scheduler`` and ``sluice frontend`` as separate processes and, in place of the
model, a fake worker (this script, ``--fake-worker``) that answers every plan at once with
tokens of a real text, so the worker is never the bottleneck and what is measured is the path a
token takes: worker -> scheduler (plan bookkeeping, stops, the batch to the frontend) ->
frontend (detokenize, stop strings, SSE chunk, socket write). The client is in this process
(asyncio, a lean HTTP/1.1 reader); it streams ``--streams`` completions of ``--tokens`` tokens
each (``ignore_eos``) at once and counts the chunks it receives.

With ``--worker MODEL`` (``tiny``, or any model ``sluice worker`` takes) a real worker runs the
model instead, on the CPU: its steps take what they take, and each step's tokens reach the
scheduler as one message, as in production.

Each process's CPU time (user + system, from /proc) over the run, divided by the tokens streamed,
is its cost per token. Rounds alternate stream counts; a figure is the median over rounds. The
goal the output-path issue sets: frontend <= 10 us and scheduler <= 2 us per token at 64 streams.

``--floor`` also measures, in the same run, what ZeroMQ alone costs a process that relays one
message per step as the scheduler does (``floor.py``'s relay: receive a step's tokens from a
PUSH socket, decode, encode a batch, send it on a ROUTER; no scheduling), at the rows per step
and the pace of the runs above: the part of the scheduler's figure no scheduling code can remove
while each step's tokens travel as their own message.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from zmq_floor import relay_floor

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S  # utime, stime (fields 14 and 15)


# ------------------------------------------------------------------------------- the fake worker


def run_fake_worker(address: str, step_s: float) -> None:
    """A worker that runs no model: every plan row that has computed its known tokens samples the
    next token of a fixed English text, at once. Follows the plan semantics ``worker.runner``
    does (multi-step windows, speculative plans, cancels, forgets, stops by ``protocol.stop``)."""
    import zmq

    from protocol.messages import (
        Announce,
        CancelRows,
        Shutdown,
        StepPlan,
        StepTokens,
        WorkerHeartbeat,
        WorkerReady,
    )
    from protocol.stop import stop_reason
    from protocol.transport import Endpoints, make_socket, scheduler_worker_codec, worker_codec
    from worker.model.config import LlamaConfig
    from worker.model.info import build_model_info
    from worker.model.tiny import materialize_tiny

    model_dir = materialize_tiny()
    cfg = LlamaConfig.from_file(model_dir / "config.json")
    info = build_model_info(model_dir, cfg, name="fake", max_model_len=8192, num_kv_blocks=65536, block_size=16)
    from tokenizers import Tokenizer

    text = ("Inference servers batch requests, page their key-value caches and stream every token to the "
            "client as soon as it exists. Once upon a time there was a small language model that liked to "
            "count: one, two, three, four. ")
    ids = Tokenizer.from_str(info.tokenizer_json).encode(text, add_special_tokens=False).ids
    eos = tuple(info.eos_token_ids)

    ep = Endpoints.from_base(address)
    ctx: zmq.Context[Any] = zmq.Context()
    inbox = make_socket(ctx, zmq.PULL, ep.scheduler_to_worker, bind=False)
    outbox = make_socket(ctx, zmq.PUSH, ep.worker_to_scheduler, bind=False)
    recv, send = worker_codec(), scheduler_worker_codec()
    outbox.send(send.encode(WorkerReady(0, info)))
    heartbeat = send.encode(WorkerHeartbeat(0))
    # rid -> [tokens known, computed, prompt length, outputs, sampling]
    seqs: dict[int, list[Any]] = {}
    last_beat = time.monotonic()
    while True:
        if not inbox.poll(200):
            outbox.send(heartbeat)
            last_beat = time.monotonic()
            continue
        if time.monotonic() - last_beat > 0.5:
            outbox.send(heartbeat)
            last_beat = time.monotonic()
        cmd = recv.decode(inbox.recv())
        if isinstance(cmd, Shutdown):
            return
        if isinstance(cmd, Announce):
            seqs.clear()
            outbox.send(send.encode(WorkerReady(0, info)))
            continue
        if isinstance(cmd, CancelRows):
            if cmd.forget:
                for rid in cmd.rids:
                    seqs.pop(rid, None)
            continue
        assert isinstance(cmd, StepPlan)
        for rid in cmd.forget:
            seqs.pop(rid, None)
        for new in cmd.new_requests:
            seqs[new.rid] = [len(new.token_ids), new.num_computed, new.num_prompt_tokens,
                             len(new.token_ids) - new.num_prompt_tokens, new.sampling]
        active = []
        for rid, n in zip(cmd.rids, cmd.num_tokens, strict=True):
            s = seqs.get(rid)
            if s is None:
                continue  # stopped or aborted after a speculative plan was made
            s[1] += n
            if s[1] >= s[0]:
                active.append(rid)
        for step in range(cmd.num_steps):
            if step_s:
                time.sleep(step_s)
            tokens = []
            still = []
            for rid in active:
                s = seqs[rid]
                token = ids[s[3] % len(ids)]
                s[0] += 1
                s[3] += 1
                if step:
                    s[1] += 1
                tokens.append(token)
                if stop_reason(token, s[3], s[0], s[4], eos, 8192) is None:
                    still.append(rid)
                else:
                    del seqs[rid]
            last = step == cmd.num_steps - 1 or not still
            outbox.send(send.encode(StepTokens(cmd.plan_id, step, active, tokens, last)))
            if last:
                break
            active = still
        else:
            outbox.send(send.encode(StepTokens(cmd.plan_id, 0, [], [], True)))


# ------------------------------------------------------------------------------- the client


async def stream_all(url: str, streams: int, tokens: int, requests: int) -> int:
    """``requests`` streamed completions of ``tokens`` tokens, ``streams`` at a time; returns the
    chunks received."""
    from client import sse_http

    body = {"prompt": "Tell me about inference servers.", "max_tokens": tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    left = requests

    async def one() -> int:
        response = await sse_http.post(f"{url}/v1/completions", body)
        received = 0
        try:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.read())[:200]!r}")
            async for line in response.lines():
                if line.startswith(b"data: {"):
                    received += 1
        finally:
            response.close()
        return received

    async def lane() -> int:
        nonlocal left
        received = 0
        while left > 0:
            left -= 1
            received += await one()
        return received

    return sum(await asyncio.gather(*(lane() for _ in range(streams))))


# ------------------------------------------------------------------------------- orchestration


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, procs: list[subprocess.Popen[bytes]], timeout: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"a component exited with status {p.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the server did not become ready")


def _start_py_spy(directory: str, procs: dict[str, subprocess.Popen[bytes]], tag: str) -> list[subprocess.Popen[bytes]]:
    Path(directory).mkdir(parents=True, exist_ok=True)
    spies = [subprocess.Popen(["py-spy", "record", "--format", "raw", "--rate", "250", "--nonblocking", "-p",
                               str(procs[name].pid), "-o", f"{directory}/{name}-{tag}.txt"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for name in ("frontend", "scheduler")]
    time.sleep(1.0)  # py-spy attaches
    return spies


def measure(url: str, pids: dict[str, int], streams: int, tokens: int, total: int) -> dict[str, float]:
    import uvloop

    requests = max(streams, -(-total // tokens))
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    start = time.perf_counter()
    received = uvloop.run(stream_all(url, streams, tokens, requests))
    wall = time.perf_counter() - start
    after = {name: cpu_seconds(pid) for name, pid in pids.items()}
    out = {"streams": streams, "tokens": received, "wall_s": wall, "tok_s": received / wall}
    for name in pids:
        out[f"{name}_us_per_token"] = 1e6 * (after[name] - before[name]) / max(1, received)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--tokens", type=int, default=256, help="tokens per request")
    parser.add_argument("--total-tokens", type=int, default=65536,
                        help="tokens per measurement: each stream sends requests one after another until then")
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="the fake worker's time per step (0: as fast as it can; a real model's steps "
                             "take milliseconds, and each step's tokens then reach the frontend on their own)")
    parser.add_argument("--worker", metavar="MODEL",
                        help="run a real worker on this model (tiny, smollm2, a path) instead of the fake one")
    parser.add_argument("--floor", action="store_true",
                        help="also measure a bare ZeroMQ relay's CPU per token at the same rows and pace")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--py-spy", metavar="DIR",
                        help="profile the frontend and the scheduler with py-spy during each measurement "
                             "(collapsed stacks in DIR; the figures then include py-spy's own cost)")
    parser.add_argument("--fake-worker", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fake_worker:
        run_fake_worker(args.fake_worker, args.step_ms / 1000)
        return

    tmp = tempfile.mkdtemp(prefix="sluice-bench-")
    address = f"ipc://{tmp}/engine"
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    sluice = [sys.executable, "-m", "frontend"]
    if args.worker:
        worker = [*sluice, "worker", "--address", address, "--model", args.worker, "--device", "cpu",
                  "--log-level", "warning"]
    else:
        worker = [sys.executable, __file__, "--fake-worker", address, "--step-ms", str(args.step_ms)]
    procs = {
        "scheduler": subprocess.Popen([*sluice, "scheduler", "--address", address, "--log-level", "warning"], **quiet),
        "worker": subprocess.Popen(worker, **quiet),
        "frontend": subprocess.Popen([*sluice, "frontend", "--address", address, "--port", str(port),
                                      "--log-level", "warning"], **quiet),
    }
    results: dict[int, list[dict[str, float]]] = {n: [] for n in args.streams}
    try:
        _wait_ready(url, list(procs.values()), timeout=600.0)  # a real worker may compile its kernels first
        measure(url, {n: p.pid for n, p in procs.items()}, 8, 32, 256)  # warm-up
        for r in range(args.rounds):
            for n in args.streams:
                spies = _start_py_spy(args.py_spy, procs, f"{n}-{r + 1}") if args.py_spy else []
                res = measure(url, {name: p.pid for name, p in procs.items()}, n, args.tokens, args.total_tokens)
                for spy in spies:
                    spy.send_signal(signal.SIGINT)
                    spy.wait()
                results[n].append(res)
                print(f"round {r + 1} streams {n:4d}: {res['tokens']:7d} tokens in {res['wall_s']:6.2f} s "
                      f"({res['tok_s']:8.0f} tok/s)  frontend {res['frontend_us_per_token']:5.1f} us/token  "
                      f"scheduler {res['scheduler_us_per_token']:5.1f}  worker {res['worker_us_per_token']:7.1f}",
                      flush=True)
                if args.floor:
                    # The relay at this run's pace: ``n`` rows a step, as many steps a second.
                    floor = relay_floor(rows=n, step_s=res["wall_s"] * n / res["tokens"])
                    res["floor_us_per_token"] = floor
                    print(f"                   relay floor at {n} rows a step every "
                          f"{1e3 * res['wall_s'] * n / res['tokens']:.2f} ms: {floor:5.1f} us/token", flush=True)
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    pace = (f"the {args.worker} model's steps" if args.worker else
            f"a step every {args.step_ms:g} ms" if args.step_ms else "steps as fast as the fake worker goes")
    print(f"\nmedians of {args.rounds} rounds, {args.total_tokens} tokens each ({args.tokens} per request), {pace}:")
    print(f"{'streams':>8} {'tok/s':>9} {'frontend us/token':>18} {'scheduler us/token':>19}"
          + (f" {'relay floor':>12}" if args.floor else ""))
    summary = []
    for n, rs in results.items():
        row = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        summary.append(row)
        print(f"{n:>8} {row['tok_s']:>9.0f} {row['frontend_us_per_token']:>18.1f} {row['scheduler_us_per_token']:>19.1f}"
              + (f" {row['floor_us_per_token']:>12.1f}" if args.floor else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": results, "medians": summary}, indent=2))


if __name__ == "__main__":
    main()
