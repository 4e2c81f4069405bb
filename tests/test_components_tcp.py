"""``sluice scheduler``, ``sluice worker`` and ``sluice frontend`` as separate processes over tcp://,
the way docker-compose runs them — including the worker starting after the frontend."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from sluice_server import free_port, http_status, stop_processes
from tcp_proxy import CuttableProxy


def _free_port_block(n: int) -> int:
    """A base port whose next ``n`` ports are free too."""
    for _ in range(50):
        base = free_port()
        if base + n >= 65535:
            continue
        ok = True
        for p in range(base, base + n):
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            except OSError:
                ok = False
                break
        if ok:
            return base
    raise RuntimeError("no block of free ports")


def test_three_components_over_tcp(tmp_path: Path) -> None:
    base = _free_port_block(4)
    http_port = free_port()
    address = f"tcp://127.0.0.1:{base}"
    sluice = [sys.executable, "-m", "frontend"]
    logs = [open(tmp_path / f"{name}.log", "wb") for name in ("scheduler", "frontend", "worker")]  # noqa: SIM115
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(subprocess.Popen([*sluice, "scheduler", "--address", address], stdout=logs[0], stderr=logs[0]))
        procs.append(subprocess.Popen([*sluice, "frontend", "--address", address, "--port", str(http_port)],
                                      stdout=logs[1], stderr=logs[1]))
        url = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/ready").status_code == 503:
                    break
            time.sleep(0.2)
        # No worker yet: not ready, and requests get a clear 503.
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["message"]
        procs.append(subprocess.Popen([*sluice, "worker", "--address", address, "--model", "tiny", "--dtype", "float32",
                                       "--num-kv-blocks", "64"],
                                      stdout=logs[2], stderr=logs[2]))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and httpx.get(f"{url}/ready").status_code != 200:
            time.sleep(0.2)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 5, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5
    finally:
        statuses = stop_processes(procs)
        for f in logs:
            f.close()
    assert statuses == [0] * len(procs)


def test_output_lost_on_a_dropped_link_ends_the_stream_with_an_error_and_serving_goes_on(tmp_path: Path) -> None:
    """The scheduler->frontend link drops mid-stream (a network blip; ZeroMQ reconnects on its
    own): the batches sent meanwhile are gone. The stream must not go on with tokens missing, nor
    hang on a lost finish: it ends with an error event, and the server serves the next request."""
    sched_base, front_base, http_port = _free_port_block(4), _free_port_block(2), free_port()
    proxies = [CuttableProxy(front_base + i, sched_base + i) for i in range(2)]
    sluice = [sys.executable, "-m", "frontend"]
    logs = [open(tmp_path / f"{name}.log", "wb") for name in ("scheduler", "worker", "frontend")]  # noqa: SIM115
    procs: list[subprocess.Popen[bytes]] = []
    url = f"http://127.0.0.1:{http_port}"
    try:
        procs.append(subprocess.Popen([*sluice, "scheduler", "--address", f"tcp://127.0.0.1:{sched_base}"],
                                      stdout=logs[0], stderr=logs[0]))
        procs.append(subprocess.Popen([*sluice, "worker", "--address", f"tcp://127.0.0.1:{sched_base}", "--model",
                                       "tiny", "--dtype", "float32", "--num-kv-blocks", "600"],
                                      stdout=logs[1], stderr=logs[1]))
        procs.append(subprocess.Popen([*sluice, "frontend", "--address", f"tcp://127.0.0.1:{front_base}", "--port",
                                       str(http_port)], stdout=logs[2], stderr=logs[2]))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and http_status(f"{url}/ready") != 200:
            time.sleep(0.2)
        body = {"prompt": "x", "max_tokens": 6000, "ignore_eos": True, "stream": True}
        lines: list[str] = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if len(lines) == 30:
                        proxies[1].cut()  # scheduler -> frontend
        assert lines[-1] == "data: [DONE]"
        assert '"error"' in lines[-2] and "lost on the link" in lines[-2], lines[-3:]
        assert len(lines) < 6000, "it ended early, with an error, instead of running on with holes"
        # The link comes back by itself: the server serves on.
        deadline = time.monotonic() + 60
        while True:
            r2 = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 5, "ignore_eos": True},
                            timeout=30)
            if r2.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert r2.status_code == 200 and r2.json()["usage"]["completion_tokens"] == 5, r2.text
        metrics = httpx.get(f"{url}/metrics").text
        assert re.search(r"^sluice_lost_output_batches_total [1-9]", metrics, re.M), metrics
        assert proxies[1].connections >= 2, "the frontend reconnected"
    finally:
        stop_processes(procs)
        for proxy in proxies:
            proxy.close()
        for f in logs:
            f.close()
