"""``sluice scheduler``, ``sluice worker`` and ``sluice frontend`` as separate processes over tcp://,
the way docker-compose runs them — including the worker starting after the frontend."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from sluice_server import free_port


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
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                assert p.wait(timeout=10) == 0
            finally:
                if p.poll() is None:
                    p.kill()
        for f in logs:
            f.close()
