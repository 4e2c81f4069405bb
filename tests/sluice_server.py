"""Start a real ``sluice serve`` for a test: free port, own process group, always stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import ClassVar

import httpx

READY_TIMEOUT_S = 180.0


def http_status(url: str, **kwargs: object) -> int | None:
    """GET ``url``'s status code; None while nothing answers there."""
    try:
        return httpx.get(url, timeout=5, **kwargs).status_code  # type: ignore[arg-type]
    except httpx.HTTPError:
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SluiceServer:
    live: ClassVar[list[SluiceServer]] = []  # started and not yet stopped: conftest shows their logs when a test fails

    def __init__(self, *flags: str, log_dir: Path) -> None:
        if "--model" not in flags:
            flags = ("--model", "tiny", *flags)  # tests run the built-in model unless they say otherwise
        if "--dtype" not in flags:
            flags = ("--dtype", "float32", *flags)  # exact greedy parity on any CPU, AMX or not
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"sluice-{self.port}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "frontend", "serve", "--port", str(self.port), *flags],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: stop() can reach every child
        )
        SluiceServer.live.append(self)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sluice serve exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"sluice serve not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-8000:]

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL to the whole group if it lingers. Returns the exit code."""
        if self in SluiceServer.live:
            SluiceServer.live.remove(self)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()
        return self.proc.returncode


def settled_stats(server: SluiceServer, headers: dict[str, str], timeout: float = 30.0) -> dict:
    """``/admin/stats`` once no request runs and no KV block is held (or ``timeout`` passed)."""
    deadline = time.monotonic() + timeout
    stats = httpx.get(f"{server.url}/admin/stats", headers=headers).json()
    while (stats["kv_blocks_used"] or stats["running"]) and time.monotonic() < deadline:
        time.sleep(0.1)
        stats = httpx.get(f"{server.url}/admin/stats", headers=headers).json()
    return dict(stats)


def child_pid(server: SluiceServer, module: bytes, config_contains: bytes = b"") -> int:
    """A child of ``sluice serve`` running ``-m module`` (scheduler, worker) whose command line
    contains ``config_contains`` (a rank, an engine's address)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == server.proc.pid and module in cmdline and any(config_contains in arg for arg in cmdline):
            return int(entry.name)
    raise AssertionError(f"no {module.decode()} process found" + (f" with {config_contains!r}" if config_contains else ""))


def stop_processes(procs: list[subprocess.Popen[bytes]], timeout: float = 10.0) -> list[int]:
    """SIGTERM to each (the last started first), then wait; SIGKILL whatever is still running
    after ``timeout``. Returns the exit statuses, in ``procs``' order."""
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    statuses = []
    for proc in procs:
        try:
            statuses.append(proc.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            proc.kill()
            statuses.append(proc.wait())
    return statuses


@contextlib.contextmanager
def started_server(*flags: str, log_dir: Path) -> Iterator[SluiceServer]:
    """A server still starting: ``wait_ready()`` before using it. Its start-up (seconds of CPU,
    mostly one process at a time) goes on beside whatever the test computes meanwhile."""
    server = SluiceServer(*flags, log_dir=log_dir)
    try:
        yield server
    except Exception as e:  # a test failing inside the with: its report shows what the server logged
        e.add_note(f"sluice serve log, {server.url} (its last lines):\n{server.log()[-3000:]}")
        raise
    finally:
        server.stop()


@contextlib.contextmanager
def running_server(*flags: str, log_dir: Path) -> Iterator[SluiceServer]:
    with started_server(*flags, log_dir=log_dir) as server:
        server.wait_ready()
        yield server


@contextlib.contextmanager
def running_servers(*flag_sets: Sequence[str], log_dir: Path) -> Iterator[list[SluiceServer]]:
    """Servers started side by side, each ready: on two cores, three take about twice as long
    as one, not three times."""
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(started_server(*flags, log_dir=log_dir)) for flags in flag_sets]
        for server in servers:
            server.wait_ready()
        yield servers
