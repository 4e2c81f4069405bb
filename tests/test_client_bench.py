"""``sluice bench`` end to end: against a server whose stream timing is known exactly (the
figures must come out as the pacing says), and against a real ``sluice serve``.

The paced server runs in a thread of this process and the bench runs through the real CLI parser
and ``client.bench.run``; tolerances allow for a loaded 2-core machine.
"""

from __future__ import annotations

import json
import statistics
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from paced_server import BREAK_STREAM_PRIORITY, FAIL_HTTP_PRIORITY, PacedServer, paced_server
from sluice_server import running_server

from client import bench
from client.workload import arrival_times
from frontend.cli import build_parser

TTFT, ITL = 0.2, 0.05
# The paced server never sends a token before its time, so each measured time has an exact
# lower bound (less 5 ms: the two clocks are read in different processes). Upper bounds are
# generous: two shared cores can hold a chunk back by hundreds of milliseconds now and then.
SLACK_S = 1.0


def run_bench(tmp_path: Path, server: PacedServer, *flags: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "run.json"
    out.unlink(missing_ok=True)
    args = build_parser().parse_args(["bench", "--url", server.url, "--save", str(out), *flags])
    rc = bench.run(args)
    return rc, json.loads(out.read_text()) if out.exists() else {}


@pytest.fixture(scope="module")
def server() -> Any:
    with paced_server(TTFT, ITL) as s:
        yield s


@pytest.fixture(autouse=True)
def fresh_counters(server: PacedServer) -> None:
    server.arrivals.clear()
    server.bodies.clear()
    server.max_in_flight = 0


def test_metrics_match_the_pacing(tmp_path: Path, server: PacedServer) -> None:
    n, out_len, in_len = 4, 10, 24
    rc, doc = run_bench(tmp_path, server, "--num-prompts", str(n), "--input-len", str(in_len), "--output-len",
                        str(out_len), "--warmup", "2", "--ignore-eos")
    assert rc == 0
    s = doc["summary"]
    assert (s["completed"], s["failed"]) == (n, 0)
    # Two calibration probes (max_tokens 1), two warm-ups, then the measured four: only those count.
    assert [b["max_tokens"] for b in server.bodies[:2]] == [1, 1]
    assert len(server.bodies) == 2 + 2 + n and len(doc["requests"]) == n
    measured = server.bodies[-n:]
    assert all(b["ignore_eos"] is True and b["stream_options"] == {"include_usage": True} for b in measured)
    assert all("priority" not in b and b["model"] == "paced" for b in measured)
    # The server counts a word as a token: calibration found 1 token per word, so the prompts
    # have exactly the asked length, and the report takes the server's counts.
    assert doc["prompt_shape"] == {"per_word": 1.0, "overhead": 0.0}
    assert [PacedServer.prompt_tokens(b) for b in measured] == [in_len] * n
    assert s["total_input_tokens"] == n * in_len and s["total_output_tokens"] == n * out_len
    assert s["prompt_tokens_from_usage"] and s["output_tokens_from_usage"]

    e2e = TTFT + (out_len - 1) * ITL
    for r in doc["requests"]:
        assert r["output_tokens"] == out_len and len(r["itl"]) == out_len - 1
        assert TTFT - 0.005 <= r["ttft"] <= TTFT + SLACK_S
        assert e2e - 0.005 <= r["latency"] <= e2e + SLACK_S and r["done"] >= r["latency"]
    assert TTFT * 1000 - 5 <= s["ttft_ms"]["median"] <= (TTFT + SLACK_S) * 1000
    # Gaps between chunks as they arrived: a late chunk makes one gap longer and the next
    # shorter, so the median stays near the pacing.
    assert ITL * 1000 / 2 <= s["itl_ms"]["median"] <= ITL * 1000 * 3
    tpots = [(r["latency"] - r["ttft"]) / (out_len - 1) for r in doc["requests"]]
    assert s["tpot_ms"]["mean"] == pytest.approx(1000 * statistics.fmean(tpots))
    assert e2e * 1000 - 5 <= s["e2el_ms"]["median"] <= (e2e + SLACK_S) * 1000
    # All four at once: the run lasts about one request.
    assert e2e - 0.005 <= s["duration_s"] <= e2e + SLACK_S
    assert s["request_throughput"] == pytest.approx(n / s["duration_s"])
    assert s["output_throughput"] == pytest.approx(n * out_len / s["duration_s"])
    assert s["total_token_throughput"] == pytest.approx(n * (in_len + out_len) / s["duration_s"])
    assert s["peak_concurrency"] == n and server.max_in_flight == n
    timeline = doc["timeline"]
    assert sum(timeline["bin_widths_s"]) == pytest.approx(s["duration_s"])
    rates_x_widths = [r * w for r, w in zip(timeline["output_tokens_per_s"], timeline["bin_widths_s"], strict=True)]
    assert sum(rates_x_widths) == pytest.approx(n * out_len)
    assert "by_priority" not in doc and doc["errors"] == {}


def test_chat_endpoint(tmp_path: Path, server: PacedServer) -> None:
    rc, doc = run_bench(tmp_path, server, "--endpoint", "chat", "--num-prompts", "2", "--input-len", "8",
                        "--output-len", "5", "--warmup", "0")
    assert rc == 0
    assert all(b["messages"][0]["role"] == "user" for b in server.bodies)
    assert doc["summary"]["total_output_tokens"] == 10
    assert TTFT * 1000 - 5 <= doc["summary"]["ttft_ms"]["median"] <= (TTFT + SLACK_S) * 1000


def test_max_concurrency_limits_requests_in_flight(tmp_path: Path, server: PacedServer) -> None:
    n, out_len, in_len = 6, 8, 12
    rc, doc = run_bench(tmp_path, server, "--num-prompts", str(n), "--max-concurrency", "2", "--token-ids",
                        "--input-len", str(in_len), "--output-len", str(out_len), "--warmup", "0")
    assert rc == 0
    assert server.max_in_flight == 2 and doc["summary"]["peak_concurrency"] == 2
    # Token-id prompts: no calibration probe, exactly the asked length, ids in the default range.
    assert len(server.bodies) == n
    assert all(len(b["prompt"]) == in_len and all(100 <= t < 500 for t in b["prompt"]) for b in server.bodies)
    one = TTFT + (out_len - 1) * ITL
    assert 3 * one - 0.005 <= doc["summary"]["duration_s"] <= 3 * one + 2 * SLACK_S  # ceil(6 / 2) rounds


def test_poisson_arrivals_follow_the_schedule(tmp_path: Path, server: PacedServer) -> None:
    n, rate, seed = 40, 20.0, 7
    rc, doc = run_bench(tmp_path, server, "--num-prompts", str(n), "--request-rate", str(rate), "--seed", str(seed),
                        "--token-ids", "--input-len", "4", "--output-len", "2", "--warmup", "0")
    assert rc == 0 and doc["summary"]["completed"] == n
    expected = arrival_times(n, rate, 1.0, seed)
    lateness = [r["start"] - t for r, t in zip(doc["requests"], expected, strict=True)]
    assert min(lateness) >= -0.002 and max(lateness) <= SLACK_S and statistics.median(lateness) <= SLACK_S / 4
    # On the wire: the arrivals at the server span the schedule's span (a second of slack in all).
    span = server.arrivals[-1] - server.arrivals[0]
    assert span == pytest.approx(expected[-1] - expected[0], abs=SLACK_S)


def test_rate_and_concurrency_limit_together(tmp_path: Path, server: PacedServer) -> None:
    # 20/s of 0.25 s requests would keep ~5 in flight; the limit holds it to 3.
    rc, doc = run_bench(tmp_path, server, "--num-prompts", "20", "--request-rate", "20", "--max-concurrency", "3",
                        "--seed", "3", "--token-ids", "--input-len", "4", "--output-len", "2", "--warmup", "0")
    assert rc == 0 and doc["summary"]["completed"] == 20
    assert server.max_in_flight == 3 and doc["summary"]["peak_concurrency"] == 3


def test_failed_requests_are_counted_per_class(tmp_path: Path, server: PacedServer) -> None:
    mix = f"0:0.5,{BREAK_STREAM_PRIORITY}:0.25,{FAIL_HTTP_PRIORITY}:0.25"
    rc, doc = run_bench(tmp_path, server, "--num-prompts", "8", "--priority-mix", mix, "--token-ids",
                        "--input-len", "4", "--output-len", "4", "--warmup", "0")
    assert rc == 1  # a run with failures says so in its exit status
    s = doc["summary"]
    assert (s["completed"], s["failed"]) == (4, 4)
    assert s["total_output_tokens"] == 16 and s["total_input_tokens"] == 16
    classes = doc["by_priority"]
    assert {k: (v["completed"], v["failed"]) for k, v in classes.items()} == {
        "0": (4, 0), str(BREAK_STREAM_PRIORITY): (0, 2), str(FAIL_HTTP_PRIORITY): (0, 2)}
    assert sorted(b["priority"] for b in server.bodies) == [0] * 4 + [8] * 2 + [9] * 2
    assert doc["errors"]["HTTP 503: paced server: overloaded on purpose"] == 2
    broken = [r for r in doc["requests"] if r["priority"] == BREAK_STREAM_PRIORITY]
    assert all(r["status"] == 200 and r["error"] and r["latency"] is None for r in broken)
    assert all(len(r["itl"]) == 1 for r in broken)  # two tokens came before the break
    assert classes["0"]["ttft_ms"]["median"] is not None and classes["9"]["ttft_ms"]["median"] is None


def test_a_warmup_that_fails_entirely_stops_the_run(tmp_path: Path, server: PacedServer,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    rc, doc = run_bench(tmp_path, server, "--num-prompts", "4", "--priority-mix", f"{FAIL_HTTP_PRIORITY}:1",
                        "--token-ids", "--warmup", "1")
    assert rc == 1 and doc == {}
    assert len(server.bodies) == 1
    assert "every warm-up request failed, e.g. HTTP 503" in capsys.readouterr().err


def test_dataset_rows(tmp_path: Path, server: PacedServer) -> None:
    data = tmp_path / "rows.jsonl"
    rows = [{"prompt": "one two three", "output_len": 2}, {"prompt": [7, 8], "output_len": 3},
            {"prompt": "four five", "output_len": 4, "other": "ignored"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, doc = run_bench(tmp_path, server, "--dataset", str(data), "--num-prompts", "3", "--warmup", "0")
    assert rc == 0 and len(server.bodies) == 3  # no calibration: the dataset's text is sent as it is
    assert sorted((str(b["prompt"]), b["max_tokens"]) for b in server.bodies) == sorted(
        (str(r["prompt"]), r["output_len"]) for r in rows)
    s = doc["summary"]
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (3 + 2 + 2, 2 + 3 + 4)
    assert doc["prompt_shape"] is None
    rc, _ = run_bench(tmp_path, server, "--dataset", str(data), "--input-len", "8")
    assert rc == 2


def test_a_seed_is_drawn_per_run_printed_and_repeatable(tmp_path: Path, server: PacedServer,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    def run(*flags: str) -> tuple[dict[str, Any], list[Any], str]:
        server.bodies.clear()
        rc, doc = run_bench(tmp_path, server, "--num-prompts", "3", "--token-ids", "--input-len", "8",
                            "--output-len", "2", "--warmup", "1", *flags)
        assert rc == 0
        return doc, [b["prompt"] for b in server.bodies], capsys.readouterr().err

    first, first_prompts, first_err = run()
    second, second_prompts, second_err = run()
    seed = first["config"]["seed"]
    again, again_prompts, again_err = run("--seed", str(seed))
    for doc, err in ((first, first_err), (second, second_err)):
        drawn = doc["config"]["seed"]
        assert doc["config"]["seed_drawn"] is True
        assert f"seed {drawn} (drawn for this run: --seed {drawn} repeats its workload)" in err
    assert second["config"]["seed"] != seed and second_prompts != first_prompts
    # The warm-up's and the measured prompts, in order: the same workload again.
    assert again_prompts == first_prompts and again["config"] == first["config"] | {"seed_drawn": False}
    assert f"seed {seed} (--seed)" in again_err


def test_the_default_seed_is_drawn() -> None:
    args = build_parser().parse_args(["bench"])
    assert args.seed is None
    bench._resolve_defaults(args)
    assert args.seed_drawn and isinstance(args.seed, int)
    args = build_parser().parse_args(["bench", "--seed", "0"])
    bench._resolve_defaults(args)
    assert (args.seed, args.seed_drawn) == (0, False)


def test_the_module_imports_cheaply() -> None:
    """``client.bench`` is imported whenever any ``sluice`` command builds its parser."""
    code = ("import argparse, sys; from client import bench; p = argparse.ArgumentParser(); bench.add_arguments(p); "
            "p.parse_args(['--input-len', '3:9', '--priority-mix', '0:1']); "
            "print(sorted(m for m in ('httpx', 'rich', 'matplotlib', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_against_sluice_serve(tmp_path: Path) -> None:
    with running_server("--admin-token", "T", log_dir=tmp_path) as s:
        proc = subprocess.run(
            [sys.executable, "-m", "frontend", "bench", "--url", s.url, "--num-prompts", "8", "--max-concurrency", "4",
             "--input-len", "16", "--output-len", "8", "--ignore-eos", "--priority-mix", "0:0.5,5:0.5",
             "--save", str(tmp_path / "out.json"), "--plot-dir", str(tmp_path / "plots"), "--admin-token", "T"],
            capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TTFT p99 (ms)" in proc.stdout
    doc = json.loads((tmp_path / "out.json").read_text())
    s = doc["summary"]
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (8, 0, 64)
    assert s["prompt_tokens_from_usage"] and s["output_tokens_from_usage"]
    assert all(r["output_tokens"] == 8 and r["prompt_tokens"] > 0 for r in doc["requests"])
    # Calibrated on the tiny model's own tokenizer: the prompts come out near the asked length.
    assert abs(statistics.fmean(r["prompt_tokens"] for r in doc["requests"]) - 16) <= 6
    assert {k: v["completed"] for k, v in doc["by_priority"].items()} == {"0": 4, "5": 4}
    assert doc["by_priority"]["5"]["total_output_tokens"] == 32
    samples = doc["server_stats"]["samples"]
    assert len(samples) >= 2 and all(0 <= x["kv_usage"] <= 1 and x["waiting"] >= 0 for x in samples)
    for name in ("latency_cdf", "throughput", "kv_cache", "queues"):
        assert png_size(tmp_path / "plots" / f"{name}.png") == (1000, 500)
    assert "admin_token" not in doc["config"] and "api_key" not in doc["config"]  # secrets stay out of files
