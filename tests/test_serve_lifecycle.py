"""``sluice serve`` as a user runs it: prints its URL when ready, stops cleanly on SIGTERM."""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from sluice_server import SluiceServer, free_port


def _session_pids(sid: int) -> set[int]:
    """Live processes of session ``sid`` (the server started its own session)."""
    pids = set()
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # After the command name: state, ppid, pgrp, session, ...
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.add(int(stat.split("/")[2]))
    return pids


def _assert_nothing_left(server: SluiceServer, socket_dirs_before: set[str]) -> None:
    """After ``sluice serve`` exited: no process of its session, no socket directory of its own."""
    deadline = time.monotonic() + 2
    while _session_pids(server.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _session_pids(server.proc.pid), "no orphan processes"
    assert set(glob.glob("/tmp/sluice-*")) <= socket_dirs_before, "socket directory removed"


def test_serve_prints_url_and_stops_all_processes_on_sigterm(tmp_path: Path) -> None:
    before = set(glob.glob("/tmp/sluice-*"))
    server = SluiceServer("--num-kv-blocks", "64", log_dir=tmp_path)
    try:
        server.wait_ready()
        assert f"at http://127.0.0.1:{server.port}" in server.log()
        assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}).status_code == 200
        off = httpx.get(f"{server.url}/admin/stats")  # no token configured: the admin API is off
        assert off.status_code == 403 and "--admin-token" in off.json()["error"]["message"]
        children = _session_pids(server.proc.pid) - {server.proc.pid}
        assert len(children) >= 2, "scheduler and worker run as child processes"

        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=10)
        elapsed = time.monotonic() - started
        assert elapsed < 5.0, f"took {elapsed:.1f} s to stop"
        assert server.proc.returncode == 0, server.log()
        _assert_nothing_left(server, before)
    finally:
        server.stop()
        for pid in _session_pids(server.proc.pid):
            os.kill(pid, signal.SIGKILL)


def test_a_crashed_worker_is_reported_and_streams_end_with_an_error(tmp_path: Path) -> None:
    # No restarts allowed: the crash ends the engine (with restarts, see test_serve_worker_crash).
    server = SluiceServer("--num-kv-blocks", "256", "--max-worker-restarts", "0", log_dir=tmp_path)
    try:
        server.wait_ready()
        worker_pid = next(pid for pid in _session_pids(server.proc.pid)
                          if b"-m\x00worker" in Path(f"/proc/{pid}/cmdline").read_bytes())
        body = {"prompt": "x", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        chunks: list[str] = []
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line)
                    if len(chunks) == 5:
                        os.kill(worker_pid, signal.SIGKILL)
        assert chunks[-1] == "data: [DONE]"
        assert '"error"' in chunks[-2], chunks[-3:]
        deadline = time.monotonic() + 10
        while httpx.get(f"{server.url}/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert httpx.get(f"{server.url}/health").status_code == 503
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["message"]
    finally:
        server.stop()


def test_a_model_that_cannot_load_ends_serve_with_one_line_and_status_1(tmp_path: Path) -> None:
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    server = SluiceServer("--model", str(model), log_dir=tmp_path)
    try:
        status = server.proc.wait(timeout=120)
        log = server.log()
        assert status == 1, log
        errors = [line for line in log.splitlines() if line.startswith("sluice: error:")]
        assert len(errors) == 1, log
        assert str(model / "config.json") in errors[0] and "unsupported architecture" in errors[0]
        assert "Traceback" not in log, "a model that cannot load is a user's mistake: no traceback"
        deadline = time.monotonic() + 5
        while _session_pids(server.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _session_pids(server.proc.pid), "scheduler and worker stopped too"
    finally:
        server.stop()


def test_sigterm_drains_requests_in_flight_then_aborts_the_rest_with_done(tmp_path: Path) -> None:
    before = set(glob.glob("/tmp/sluice-*"))
    server = SluiceServer("--shutdown-grace", "2", log_dir=tmp_path)
    try:
        server.wait_ready()
        results: dict[str, list[str]] = {}

        def stream(name: str, max_tokens: int) -> None:
            body = {"prompt": "x", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
                results[name] = [line for line in r.iter_lines() if line.startswith("data: ")]

        threads = [threading.Thread(target=stream, args=("short", 40)),
                   threading.Thread(target=stream, args=("long", 8000))]
        for t in threads:
            t.start()
        time.sleep(0.5)
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        # Admission stops at once, while the server still answers.
        assert httpx.get(f"{server.url}/ready").status_code == 503
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        for t in threads:
            t.join(30)
        assert server.proc.wait(timeout=20) == 0, server.log()
        # The grace, then at most STOP_AFTER_GRACE_S (2 s) to stop; 2 s of slack for this machine.
        assert time.monotonic() - started < 2 + 2 + 2
        log = server.log()
        assert "worker lost" not in log and "starting it again" not in log, "a stop is not a crash"
        # Ctrl-C is answered at once, and its end said.
        assert re.search(r"^Stopping: (1 request in flight gets|2 requests in flight get) up to 2 s to finish", log,
                         re.M), log[-2000:]
        assert log.rstrip().endswith("Stopped."), log[-500:]
        short, long = results["short"], results["long"]
        assert short[-1] == "data: [DONE]" and '"finish_reason":"length"' in short[-2].replace(" ", "")
        # The long one ran out of grace: ended with abort and [DONE], not cut mid-way.
        assert long[-1] == "data: [DONE]" and '"finish_reason":"abort"' in long[-2].replace(" ", ""), long[-3:]
        _assert_nothing_left(server, before)
    finally:
        server.stop()
        for pid in _session_pids(server.proc.pid):
            os.kill(pid, signal.SIGKILL)


def test_sigterm_to_the_whole_process_group_stops_in_order_without_restarts(tmp_path: Path) -> None:
    """What ``kill -- -PGID``, a supervisor or Ctrl-C's whole foreground group does: the children
    are in a group of their own, so the signal reaches ``sluice serve`` alone, which drains and
    then stops them — the scheduler is not restarted, the worker not counted as lost."""
    server = SluiceServer("--shutdown-grace", "1", log_dir=tmp_path)
    try:
        server.wait_ready()
        results: list[str] = []

        def stream() -> None:
            body = {"prompt": "x", "max_tokens": 8000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
                results.extend(line for line in r.iter_lines() if line.startswith("data: "))

        thread = threading.Thread(target=stream)
        thread.start()
        time.sleep(0.5)
        os.killpg(server.proc.pid, signal.SIGTERM)
        thread.join(30)
        assert server.proc.wait(timeout=20) == 0, server.log()
        log = server.log()
        assert "starting it again" not in log and "worker lost" not in log, log
        assert results[-1] == "data: [DONE]" and '"finish_reason":"abort"' in results[-2].replace(" ", ""), results[-3:]
    finally:
        server.stop()
        for pid in _session_pids(server.proc.pid):
            os.kill(pid, signal.SIGKILL)


def test_the_ready_line_names_a_url_one_can_open() -> None:
    from frontend.serve import where

    assert where("127.0.0.1", 8000) == "at http://127.0.0.1:8000"
    assert where("::1", 8000) == "at http://[::1]:8000"
    assert where("0.0.0.0", 8000).startswith("at http://127.0.0.1:8000 on all interfaces (0.0.0.0:8000;")


def test_ctrl_c_stops_serve_when_its_stdout_is_a_closed_pipe(tmp_path: Path) -> None:
    """``sluice serve | head -1`` then Ctrl-C: the handler's "Stopping…" line met a closed pipe,
    raised BrokenPipeError after draining began and before the drain was scheduled, and the
    server answered 503 to everything and held its port until a second signal."""
    before = set(glob.glob("/tmp/sluice-*"))
    port = free_port()
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "frontend", "serve", "--model", "tiny", "--dtype", "float32",
                             "--num-kv-blocks", "64", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=log, start_new_session=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # what ``head -1`` reads; then it exits
        assert b"Sluice is ready" in first, (tmp_path / "serve.log").read_text()
        proc.stdout.close()
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 3},
                          timeout=60).status_code == 200
        started = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the terminal's whole process group
        proc.wait(timeout=30)
        elapsed = time.monotonic() - started
        assert elapsed < 5.0, f"took {elapsed:.1f} s to stop"
        assert proc.returncode in (0, 120), (tmp_path / "serve.log").read_text()  # 120: stdout lost at exit
        deadline = time.monotonic() + 2
        while _session_pids(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _session_pids(proc.pid), "no orphan processes"
        assert set(glob.glob("/tmp/sluice-*")) <= before, "socket directory removed"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
