"""A ``sluice serve`` child for ``sluice bench --scenario``: a free port, its own process group
(``start_new_session``), ready when ``GET /ready`` answers 200, always stopped (``serving`` is a
context manager: SIGTERM, then SIGKILL to the whole group if it lingers)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

READY_TIMEOUT_S = 300.0  # loading a model and warming up on a busy 2-core machine
STOP_TIMEOUT_S = 15.0


class ServeError(Exception):
    """The server exited or did not get ready; the message ends with its log's tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServeProcess:
    """``python -m frontend serve --port P *flags``, its output in ``log_path``. ``env`` is added
    to this process's environment (the admin token goes there, not on a command line others can read)."""

    def __init__(self, flags: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.flags = flags
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "frontend", "serve", "--port", str(self.port), *flags],
            stdout=self._log, stderr=subprocess.STDOUT, env=os.environ | {"PYTHONUNBUFFERED": "1"} | (env or {}),
            start_new_session=True,  # its own process group: stop() reaches the scheduler and worker too
        )

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServeError(f"sluice serve exited with status {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/ready", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.2)
        raise ServeError(f"sluice serve not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        """SIGTERM and up to STOP_TIMEOUT_S to exit, then SIGKILL to whatever of the group is left:
        a Ctrl-C while it waits goes straight to the SIGKILL, so no server outlives ``sluice bench``."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=STOP_TIMEOUT_S)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self._log.close()


@contextlib.contextmanager
def serving(flags: list[str], log_path: Path, env: dict[str, str] | None = None,
            ready_timeout: float = READY_TIMEOUT_S) -> Iterator[ServeProcess]:
    server = ServeProcess(flags, log_path, env)
    try:
        server.wait_ready(ready_timeout)
        yield server
    finally:
        server.stop()
