"""``sluice bench`` stopped by Ctrl-C reports, saves and plots what finished, and exits 130.

Each Ctrl-C test runs ``sluice bench`` as a process and sends it SIGINT once some requests have
finished, which it learns from the server, never from a sleep: the paced server's arrivals (with
``--max-concurrency 1`` a request is sent only once the one before it finished). The run left after that point lasts seconds, so the signal lands
in it however late the test reads; what is asserted holds wherever in it the signal lands, and no
timing is asserted.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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
