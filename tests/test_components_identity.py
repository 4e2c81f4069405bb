"""Request identity across frontends and restarts, with the components run separately over tcp://
(as docker-compose runs them): two frontends on one scheduler never see each other's tokens, a
frontend that dies has its requests aborted and their blocks freed, a frontend's admin read of a
scheduler that does not answer is a 503, and a restarted scheduler gets the worker back."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import zmq
from sluice_server import free_port
from test_components_tcp import _free_port_block

TOKEN = "admin-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Components:
    """Scheduler, worker and frontends as separate processes; every one stopped at the end."""

    def __init__(self, tmp_path: Path) -> None:
        self.address = f"tcp://127.0.0.1:{_free_port_block(4)}"
        self.tmp_path = tmp_path
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = open(self.tmp_path / f"{name}.log", "ab")  # noqa: SIM115 - the child holds it
        proc = subprocess.Popen([sys.executable, "-m", "frontend", *args, "--address", self.address],
                                stdout=log, stderr=log, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        log.close()
        self.procs[name] = proc
        return proc

    def frontend(self, name: str) -> str:
        port = free_port()
        self.start(name, "frontend", "--port", str(port), "--admin-token", TOKEN)
        return f"http://127.0.0.1:{port}"

    def kill(self, name: str) -> None:
        self.procs[name].kill()
        self.procs[name].wait()

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.tmp_path.glob("*.log"))


@pytest.fixture
def components(tmp_path: Path) -> Iterator[Components]:
    c = Components(tmp_path)
    try:
        yield c
    finally:
        c.stop_all()


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, c: Components) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if predicate():
                return
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout} s\n{c.logs()}")


def ready(url: str) -> bool:
    return httpx.get(f"{url}/ready", timeout=2).status_code == 200


def complete(url: str, prompt: str, n: int = 24) -> tuple[str, int]:
    r = httpx.post(f"{url}/v1/completions", timeout=120,
                   json={"prompt": prompt, "max_tokens": n, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"]


def stats(url: str) -> dict:
    return httpx.get(f"{url}/admin/stats", headers=AUTH, timeout=10).json()


def open_paused_stream(url: str) -> tuple[httpx.Client, httpx.Response, str]:
    """A long streaming request, paused once running: it holds its KV blocks indefinitely."""
    client = httpx.Client(timeout=60)
    body = {"prompt": "a long story", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    response = client.send(client.build_request("POST", f"{url}/v1/completions", json=body), stream=True)
    request_id = response.headers["X-Request-Id"]
    r = httpx.post(f"{url}/admin/requests/{request_id}/pause", headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    return client, response, request_id


def test_frontends_own_their_requests_across_restarts(components: Components) -> None:
    c = components
    c.start("scheduler", "scheduler")
    c.start("worker", "worker", "--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "256")
    a, b = c.frontend("frontend-a"), c.frontend("frontend-b")
    wait_for(lambda: ready(a) and ready(b), 180, "both frontends ready", c)

    # Two frontends at once: each client gets exactly its own tokens (rids of both frontends
    # started at 1 and the scheduler pushed results round-robin to whichever frontend).
    prompts = [f"request number {i} says" for i in range(6)]
    expected = [complete(a, p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        on_a = [pool.submit(complete, a, p) for p in prompts]
        on_b = [pool.submit(complete, b, p) for p in prompts]
        assert [f.result() for f in on_a] == expected
        assert [f.result() for f in on_b] == expected

    # A frontend killed with a request in flight: the scheduler aborts what it owned (a paused
    # request would otherwise hold its blocks forever) and the other frontend serves on.
    client, stream, _ = open_paused_stream(a)
    assert stats(b)["paused"] == 1 and stats(b)["kv_blocks_used"] > 0
    c.kill("frontend-a")
    client.close()
    wait_for(lambda: (s := stats(b))["paused"] == 0 and s["kv_blocks_used"] == 0 and s["running"] == 0,
             20, "the dead frontend's request aborted and its blocks freed", c)
    assert complete(b, "still serving")[1] == 24

    # The scheduler stops answering: an admin read is a clear 503, not a 500.
    client, stream, request_id = open_paused_stream(b)
    os.kill(c.procs["scheduler"].pid, signal.SIGSTOP)
    try:
        r = httpx.get(f"{b}/admin/requests/{request_id}", headers=AUTH, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_down", r.text
    finally:
        os.kill(c.procs["scheduler"].pid, signal.SIGCONT)

    # The scheduler dies and a new one starts: the open stream ends with an error (it never
    # hangs), the worker announces itself to the new scheduler and /ready recovers.
    c.kill("scheduler")
    # /ready says so at once (the connection dropped), not after the 5 s without a pong
    # that once was the only sign: a balancer kept sending requests to a scheduler-less frontend.
    wait_for(lambda: not ready(b), 3.0, "/ready 503 once the scheduler's connection dropped", c)
    c.start("scheduler", "scheduler")
    lines = [line for line in stream.iter_lines() if line.startswith("data: {")]
    client.close()
    assert '"finish_reason":"error"' in lines[-1].replace(" ", "") or "error" in lines[-1], lines[-1]
    # Served again once the worker has announced itself to the new scheduler (a request sent in
    # the instant before the new scheduler's first answer is refused, as it should be).
    def serves() -> bool:
        return ready(b) and httpx.post(f"{b}/v1/completions", timeout=60, json={
            "prompt": "x", "max_tokens": 2, "ignore_eos": True}).status_code == 200

    wait_for(serves, 60, "/ready and a completion after the scheduler restarted", c)
    assert complete(b, "after the restart") == complete(b, "after the restart")


def test_bad_frames_on_the_scheduler_socket_are_dropped(components: Components) -> None:
    c = components
    c.start("scheduler", "scheduler")
    c.start("worker", "worker", "--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64")
    url = c.frontend("frontend")
    wait_for(lambda: ready(url), 180, "ready", c)
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(c.address)  # the scheduler's frontend inbox
        for junk in (b"", b"\x00", b"\xff" * 64, b"\x92\xa5hello\x01", b"not msgpack at all"):
            sock.send(junk)
        sock.send_multipart([b"two", b"frames"])
        # The workers' inbox too: a truncated StepTokens-looking frame and plain junk.
        base = int(c.address.rsplit(":", 1)[1])
        workers = ctx.socket(zmq.PUSH)
        workers.setsockopt(zmq.LINGER, 0)
        workers.connect(f"tcp://127.0.0.1:{base + 2}")
        for junk in (b"\x97\xaaStepTokens\x01", b"\xde\xad\xbe\xef"):
            workers.send(junk)
        wait_for(lambda: stats(url)["malformed_frames"] >= 8, 10, "bad frames counted", c)
    finally:
        ctx.destroy(linger=0)
    assert c.procs["scheduler"].poll() is None
    assert complete(url, "still here")[1] == 24


def test_components_wait_for_the_scheduler_saying_so_and_recover_from_a_new_worker(components: Components) -> None:
    c = components
    url = c.frontend("frontend")
    c.start("worker", "worker", "--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64")

    def said_waiting(name: str) -> bool:
        return "waiting for the scheduler at" in (c.tmp_path / f"{name}.log").read_text(errors="replace")

    wait_for(lambda: said_waiting("frontend") and said_waiting("worker"), 60, "both say what they wait for", c)
    c.start("scheduler", "scheduler")
    wait_for(lambda: ready(url), 60, "ready once the scheduler is up", c)
    assert complete(url, "first")[1] == 24
    # A worker killed and a new one started by hand: the frontend recovers by itself. Meanwhile
    # new requests are refused (503), so serving again is what to wait for, not a /ready that
    # has not heard of the loss yet.
    c.kill("worker")
    c.start("worker", "worker", "--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64")

    def serves() -> bool:
        return ready(url) and httpx.post(f"{url}/v1/completions", timeout=60, json={
            "prompt": "x", "max_tokens": 2, "ignore_eos": True}).status_code == 200

    wait_for(serves, 120, "serving again with the new worker", c)
    assert complete(url, "second")[1] == 24
