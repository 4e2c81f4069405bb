"""What ZeroMQ alone costs the scheduler per streamed token: a bare relay's CPU time.

    python scripts/zmq_floor.py --rows 64 --step-ms 3

Three processes, as the token path has them: a source (the worker) sends a step's tokens of
``--rows`` rows every ``--step-ms`` milliseconds on a PUSH socket; the relay (the scheduler) waits
for each, decodes it, encodes a ``TokenBatch`` of the same tokens and sends it on a ROUTER; a
sink (the frontend) receives them on a DEALER. The relay does nothing else: no scheduling, no
bookkeeping. Its CPU time per token (user + system, all its threads, from /proc: ZeroMQ's I/O
thread included) is the floor under the scheduler's own figure, for as long as each step's
tokens travel as their own message. ``bench_output_path.py --floor`` runs it beside its runs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _source(address: str, rows: int, step_s: float, steps: int) -> None:
    import zmq

    from protocol.messages import StepTokens
    from protocol.transport import scheduler_worker_codec

    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(address + "-in")
    codec = scheduler_worker_codec()
    rids, tokens = list(range(rows)), [1000 + i for i in range(rows)]
    time.sleep(0.5)  # the relay and the sink connect
    next_at = time.monotonic()
    for step in range(steps):
        sock.send(codec.encode(StepTokens(1, step, rids, tokens, False)))
        next_at += step_s
        time.sleep(max(0.0, next_at - time.monotonic()))
    sock.send(b"")  # the end
    sock.close(linger=1000)
    ctx.term()


def _sink(address: str) -> None:
    import zmq

    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"frontend")
    sock.connect(address + "-out")
    sock.send(b"hello")
    while sock.recv() != b"":
        pass
    sock.close(linger=0)
    ctx.term()


def _relay(address: str) -> None:
    """Reads ``StepTokens``, sends ``TokenBatch``es until the source's empty frame; prints its CPU seconds."""
    import select

    import zmq

    from protocol.messages import TokenBatch
    from protocol.transport import scheduler_frontend_codec, scheduler_worker_codec

    ctx: zmq.Context[Any] = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(address + "-in")
    outbox = ctx.socket(zmq.ROUTER)
    outbox.bind(address + "-out")
    frontend = outbox.recv_multipart()[0]
    decode, encode = scheduler_worker_codec().decode, scheduler_frontend_codec().encode
    # Waits as the scheduler does: epoll on the socket's descriptor, then a drain.
    waiter = select.epoll()
    waiter.register(inbox.get(zmq.FD), select.EPOLLIN)
    events, pollin = int(zmq.EVENTS), int(zmq.POLLIN)
    start = _cpu_s(os.getpid())
    tokens = 0
    while True:
        waiter.poll(1.0)
        while inbox.get(events) & pollin:
            frame = inbox.recv(copy=False)
            if not frame.bytes:
                outbox.send_multipart([frontend, b""])
                print(_cpu_s(os.getpid()) - start, tokens, flush=True)
                outbox.close(linger=1000)
                inbox.close(linger=0)
                ctx.term()
                return
            msg = decode(frame.buffer)
            tokens += len(msg.rids)
            outbox.send_multipart([frontend, encode(TokenBatch(msg.rids, msg.token_ids, []))], zmq.NOBLOCK)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


def relay_floor(rows: int, step_s: float, seconds: float = 3.0) -> float:
    """The relay's CPU microseconds per token at ``rows`` rows a step, a step every ``step_s``."""
    address = f"ipc://{tempfile.mkdtemp(prefix='sluice-floor-')}/relay"
    steps = max(50, int(seconds / max(step_s, 1e-4)))
    me = [sys.executable, __file__]
    relay = subprocess.Popen([*me, "--role", "relay", "--address", address], stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)  # bound before the others connect
    sink = subprocess.Popen([*me, "--role", "sink", "--address", address])
    source = subprocess.Popen([*me, "--role", "source", "--address", address, "--rows", str(rows),
                               "--step-ms", str(1e3 * step_s), "--steps", str(steps)])
    try:
        out, _ = relay.communicate(timeout=seconds * 4 + 60)
    finally:
        for p in (source, sink, relay):
            if p.poll() is None:
                p.kill()
            p.wait()
    cpu_s, tokens = out.split()
    return 1e6 * float(cpu_s) / max(1, int(tokens))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64, help="tokens per step message")
    parser.add_argument("--step-ms", type=float, default=3.0, help="a step every this many milliseconds")
    parser.add_argument("--seconds", type=float, default=3.0, help="how long each measurement runs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--role", choices=["relay", "source", "sink"], help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "relay":
        _relay(args.address)
    elif args.role == "sink":
        _sink(args.address)
    elif args.role == "source":
        _source(args.address, args.rows, args.step_ms / 1e3, args.steps)
    else:
        figures = sorted(relay_floor(args.rows, args.step_ms / 1e3, args.seconds) for _ in range(args.rounds))
        print(f"relay: {args.rows} rows a step every {args.step_ms:g} ms: "
              f"{figures[len(figures) // 2]:.2f} us of CPU per token (median of {args.rounds}; "
              f"all: {', '.join(f'{f:.2f}' for f in figures)})")


if __name__ == "__main__":
    main()
