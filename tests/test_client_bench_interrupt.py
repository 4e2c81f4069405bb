"""``sluice bench`` stopped by Ctrl-C reports, saves and plots what finished, and exits 130.

Each Ctrl-C test runs ``sluice bench`` as a process and sends it SIGINT once some requests have
finished, which it learns from the server, never from a sleep: the paced server's arrivals (with
``--max-concurrency 1`` a request is sent only once the one before it finished), or a real
``sluice serve``'s ``/metrics``. The run left after that point lasts seconds, so the signal lands
in it however late the test reads; what is asserted holds wherever in it the signal lands, and no
timing is asserted.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from paced_server import paced_server

WAIT_S = 180.0  # for anything a busy 2-core machine does in seconds
# ``python -m frontend`` with Python's own SIGINT handler whatever this process inherited: a shell
# without job control starts background jobs with SIGINT ignored, and Python keeps it so.
SLUICE = [sys.executable, "-c", "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                                "from frontend.cli import main; main()"]


def wait_for(what: str, ready: Callable[[], Any], proc: subprocess.Popen[bytes], log: Path) -> Any:
    """``ready()``'s first truthy value, polled while ``proc`` runs."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if value := ready():
            return value
        if proc.poll() is not None:
            raise AssertionError(f"sluice bench exited ({proc.returncode}) before {what}:\n{log.read_text()}")
        time.sleep(0.02)
    raise AssertionError(f"no {what} after {WAIT_S:.0f} s:\n{log.read_text()}")


@pytest.fixture
def bench_process(tmp_path: Path) -> Iterator[Callable[..., tuple[subprocess.Popen[bytes], Path, Path]]]:
    """Starts ``sluice bench FLAGS`` (stdout and stderr to files); kills it if the test left it running."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(*flags: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
        out, err = tmp_path / "bench.out", tmp_path / "bench.err"
        with out.open("wb") as o, err.open("wb") as e:
            procs.append(subprocess.Popen([*SLUICE, "bench", *flags], stdout=o, stderr=e))
        return procs[-1], out, err

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------------------ Ctrl-C, one run


def test_ctrl_c_reports_saves_and_plots_what_finished(tmp_path: Path, bench_process: Any) -> None:
    n, out_len = 6, 60  # one at a time, 0.2 + 59 x 0.05 = 3.15 s each: the run would take 19 s
    with paced_server(ttft=0.2, itl=0.05) as server:
        proc, out, err = bench_process(
            "--url", server.url, "--num-prompts", str(n), "--max-concurrency", "1", "--token-ids",
            "--input-len", "4", "--output-len", str(out_len), "--warmup", "0",
            "--save", str(tmp_path / "run.json"), "--plot-dir", str(tmp_path / "plots"))
        # The second request arrived: the first has finished (its slot is free).
        wait_for("a second request", lambda: len(server.arrivals) >= 2, proc, err)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=WAIT_S) == 130, err.read_text()
        # The request in flight was cancelled: its connection closed, the server stopped streaming it.
        deadline = time.monotonic() + WAIT_S
        while server.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.in_flight == 0
        sent = len(server.arrivals)

    doc = json.loads((tmp_path / "run.json").read_text())
    assert doc["completed"] is False
    gone = doc["interrupted"]
    done = gone["finished"]
    assert 1 <= done < n and gone["in_flight"] <= 1 and done + gone["in_flight"] + gone["not_sent"] == n
    assert done <= sent <= done + gone["in_flight"]  # what reached the server had been sent
    assert gone["after_s"] > 0 and doc["summary"]["duration_s"] == gone["after_s"]
    # Only the finished requests, all of them whole, in the figures and the file.
    assert len(doc["requests"]) == done
    assert all(r["error"] is None and r["output_tokens"] == out_len and r["done"] is not None for r in doc["requests"])
    s = doc["summary"]
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (done, 0, done * out_len)
    assert s["e2el_ms"]["p50"] is not None
    note = doc["notes"][0]
    assert note.startswith("interrupted by Ctrl-C") and f"{done} of {n} requests finished" in note
    assert f"{gone['not_sent']} not sent" in note
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {"latency_cdf.png", "throughput.png"}
    report = " ".join(out.read_text().split())  # rich wraps at 80 columns off a terminal
    assert "successful requests" in report and f"{done} of {n} requests (interrupted)" in report
    assert "saved" in err.read_text()


def test_ctrl_c_before_the_measured_run_reports_nothing(tmp_path: Path, bench_process: Any) -> None:
    with paced_server(ttft=0.2, itl=0.05) as server:
        proc, _, err = bench_process("--url", server.url, "--num-prompts", "4", "--token-ids", "--input-len", "4",
                                     "--output-len", "200", "--warmup", "1", "--save", str(tmp_path / "run.json"))
        wait_for("the warm-up request", lambda: server.arrivals, proc, err)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=WAIT_S) == 130
        assert len(server.arrivals) == 1  # the measured requests never went
    assert "sluice bench: interrupted before the measured run; no report" in err.read_text()
    assert not (tmp_path / "run.json").exists()


# ------------------------------------------------------------------------------ Ctrl-C, --scenario


def serve_child(parent: int) -> tuple[int, int] | None:
    """(pid, port) of the ``sluice serve`` that ``parent`` started, if it is running."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().decode().split("\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and "serve" in cmdline and "--port" in cmdline:
            return int(entry.name), int(cmdline[cmdline.index("--port") + 1])
    return None


def group_alive(pgid: int) -> list[int]:
    """The processes of group ``pgid`` not yet dead (zombies waiting for a reaper count as dead)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, _, pgrp = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(pgrp) == pgid and state != "Z":
            alive.append(int(entry.name))
    return alive


def requests_served(port: int) -> int:
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0
    return int(sum(float(m) for m in re.findall(r"^sluice_request_success_total\{.*\} (\S+)$", text, re.M)))


def test_ctrl_c_in_a_scenario_keeps_the_finished_settings(tmp_path: Path, bench_process: Any) -> None:
    # shared-prefix at scale 0.4: 16 requests per setting, one every 0.36 s, so each run lasts over
    # 5 s; the Ctrl-C comes once the second setting's first request is done.
    proc, out, err = bench_process("--scenario", "shared-prefix", "--server-model", "tiny",
                                   "--server-args=--dtype float32", "--scale", "0.4", "--warmup", "1",
                                   "--save", str(tmp_path / "run.json"), "--plot-dir", str(tmp_path / "plots"))
    server_pid = None
    try:
        wait_for("the second setting", lambda: "[2/2] caching" in err.read_text(), proc, err)
        server_pid, port = wait_for("its server", lambda: serve_child(proc.pid), proc, err)
        wait_for("a measured request", lambda: requests_served(port) >= 1 + 1, proc, err)  # and the warm-up
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=WAIT_S) == 130, err.read_text()
        # Stopped by sluice bench, the whole group (scheduler and worker too), not left behind.
        deadline = time.monotonic() + 30
        while group_alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert group_alive(server_pid) == []
    finally:
        if server_pid is not None and group_alive(server_pid):
            os.killpg(server_pid, signal.SIGKILL)

    doc = json.loads((tmp_path / "run.json").read_text())
    assert doc["completed"] is False
    assert doc["interrupted"] == {"setting": "caching", "measured": True, "not_run": []}
    (group,) = doc["workload"]["groups"]
    whole, cut = doc["settings"]["no-caching"], doc["settings"]["caching"]
    assert whole["completed"] is True and whole["interrupted"] is None
    assert (whole["summary"]["completed"], whole["summary"]["failed"]) == (group["count"], 0)
    assert cut["completed"] is False
    done = cut["interrupted"]["finished"]
    assert 1 <= done < group["count"] and len(cut["requests"]) == done
    assert cut["summary"]["completed"] + cut["summary"]["failed"] == done
    # The comparison is of the settings that finished; the interrupted one is saved beside it.
    assert all(list(values) == ["no-caching"] for values in doc["comparison"].values())
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {"no-caching", "caching", "settings.png"}
    assert (tmp_path / "plots" / "caching" / "latency_cdf.png").stat().st_size > 0
    report = " ".join(out.read_text().split())
    assert "TTFT p50 (ms)" in report and "caching: interrupted by Ctrl-C" in report
    assert f"seed {doc['seed']} for every setting (drawn for this run" in " ".join(err.read_text().split())
