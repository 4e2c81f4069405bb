"""The soak's server: ``sluice serve`` in its own process group on a free port, with the admin
token the soak's controls use, and the RSS of its processes (scripts/soak.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

TOKEN = "soak-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``sluice serve`` in its own process group, its output in ``log_path``."""

    def __init__(self, flags: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "frontend", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--admin-token", TOKEN, "--dtype", "float32", *flags]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sluice serve exited with {self.proc.returncode}; see {self.log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"sluice serve not ready after {timeout:.0f} s; see {self.log_path}")

    def children(self) -> dict[str, int]:
        """The serve process's direct children by role (``-m scheduler``, ``-m worker``)."""
        found: dict[str, int] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            if ppid == self.proc.pid and len(argv) > 2 and argv[1] == b"-m":
                found[argv[2].decode(errors="replace")] = int(entry.name)
        return found

    def memory(self) -> dict[str, tuple[int, int | None]]:
        """(pid, RSS in KiB) of the frontend (the serve process), the scheduler and the worker."""
        pids = {"frontend": self.proc.pid} | self.children()
        return {role: (pid, rss_kib(pid)) for role, pid in pids.items()}

    def stop(self) -> int | None:
        """SIGTERM (``sluice serve`` stops its children), then SIGKILL to the whole group."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=15)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()
        return self.proc.returncode


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None
