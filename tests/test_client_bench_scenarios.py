"""``sluice bench --scenario``: the scenario definitions (workload shapes, arrival offsets, KV
blocks computed from the workload, metrics that exist in a report), the comparison's arithmetic,
the flags it refuses, and two scenarios end to end against real ``sluice serve`` processes with
the tiny model. No performance ratio is asserted: on a shared 2-core machine they are figures for
docs, not facts to test."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from client import bench
from client.compare import COMMON_ROWS, SERVER_COUNTERS, SettingRun, comparison_table, headline
from client.scenarios import (
    BLOCK_SIZE,
    LONG_GAP_PER_TOKEN_S,
    LONG_OUTPUT,
    SCENARIOS,
    SEATS,
    SHORT_DELAY_S,
    Group,
    Workload,
)
from client.stats import build_report
from client.stream import RequestRecord
from frontend.cli import build_parser

SCALES = (0.05, 0.1, 0.5, 1.0, 2.0)
E2E_TIMEOUT_S = 300  # two tiny servers and a few dozen requests; minutes only on a very busy machine


def by_label(workload: Workload, seed: int = 0) -> dict[str, list[tuple[float, Any]]]:
    specs, arrivals = workload.requests(seed)
    out: dict[str, list[tuple[float, Any]]] = {}
    for t, spec in zip(arrivals, specs, strict=True):
        out.setdefault(spec.label, []).append((t, spec))
    return out


# ------------------------------------------------------------------------------ definitions


def test_the_cli_offers_every_scenario() -> None:
    assert tuple(SCENARIOS) == bench.SCENARIO_NAMES
    assert all(s.upstream.startswith(("vLLM's ", "SGLang's ")) for s in SCENARIOS.values())  # named by what it is
    for s in SCENARIOS.values():
        assert len(s.settings) >= 2 and set(s.headline) <= {m.label for m in s.metrics}


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("scale", SCALES)
def test_workloads_are_exact_sorted_and_seeded(name: str, scale: float) -> None:
    workload = SCENARIOS[name].build(scale, None)
    specs, arrivals = workload.requests(seed=3)
    assert len(specs) == sum(g.count for g in workload.groups) and arrivals == sorted(arrivals)
    lengths = {g.label: (g.input_len, g.output_len, g.priority) for g in workload.groups}
    for spec in specs:  # token-id prompts of exactly the group's lengths, from the default id range
        assert isinstance(spec.prompt, list) and all(100 <= t < 500 for t in spec.prompt)
        assert (len(spec.prompt), spec.output_len, spec.priority) == lengths[spec.label]
    assert workload.requests(seed=3) == (specs, arrivals)
    assert workload.requests(seed=4)[0] != specs
    # The flags a workload gives every server are known before any server says its length.
    assert workload.server_flags == SCENARIOS[name].build(scale, 1024).server_flags


def test_shared_prefix_prompts_share_ninety_percent() -> None:
    workload = SCENARIOS["shared-prefix"].build(1.0, None)
    (group,) = workload.groups
    assert workload.shared_prefix == 0.9 and group.input_len == 1024
    prompts = [s.prompt for s in workload.requests(0)[0]]
    shared = round(0.9 * 1024)
    assert len({tuple(p[:shared]) for p in prompts}) == 1  # one prefix
    assert len({tuple(p[shared:]) for p in prompts}) == len(prompts)  # a unique tail each
    # Arrivals one at a time, evenly spaced.
    _, arrivals = workload.requests(0)
    assert arrivals == pytest.approx([i * group.interval_s for i in range(group.count)]) and group.interval_s > 0


def test_long_prefill_arrivals_and_lengths() -> None:
    workload = SCENARIOS["long-prefill"].build(1.0, 8192)
    classes = by_label(workload)
    longs, shorts = classes["long"], classes["short"]
    gap = 8000 * LONG_GAP_PER_TOKEN_S
    assert [len(s.prompt) for _, s in longs] == [8000]
    assert [t for t, _ in longs] == [0.0]
    two = by_label(SCENARIOS["long-prefill"].build(2.0, 8192))["long"]  # more scale, more long prompts
    assert [t for t, _ in two] == pytest.approx([0.0, gap]) and {len(s.prompt) for _, s in two} == {8000}
    assert all(len(s.prompt) == 300 for _, s in shorts)
    # The short prompts come one by one, from just after the first long one over all of them.
    times = [t for t, _ in shorts]
    assert times[0] == pytest.approx(SHORT_DELAY_S)
    assert times[-1] < gap and all(b - a == pytest.approx(gap / len(times)) for a, b in itertools.pairwise(times))
    assert workload.requests(0)[0][0].label == "long"  # the first to go
    # A shorter context: the long prompt shrinks to fit it with its output; more scale never
    # makes it longer than the 8000 tokens of the request's example.
    assert {g.label: g.input_len for g in SCENARIOS["long-prefill"].build(1.0, 2048).groups}["long"] == 2048 - LONG_OUTPUT
    assert {g.label: g.input_len for g in SCENARIOS["long-prefill"].build(3.0, None).groups}["long"] == 8000
    # "no chunking" is a budget the long prompt fits in whole.
    budget = SCENARIOS["long-prefill"].settings["no-chunking"]
    assert int(budget[budget.index("--max-num-batched-tokens") + 1]) >= 8000


def test_priority_batch_saturates_the_seats() -> None:
    workload = SCENARIOS["priority"].build(1.0, None)
    classes = by_label(workload)
    assert workload.server_flags == ("--max-num-seqs", str(SEATS))
    batch, interactive = classes["batch"], classes["interactive"]
    assert len(batch) > SEATS and {s.priority for _, s in batch} == {5} and {t for t, _ in batch} == {0.0}
    assert {s.priority for _, s in interactive} == {0}
    times = [t for t, _ in interactive]
    assert times[0] > 0 and len({round(b - a, 9) for a, b in itertools.pairwise(times)}) == 1
    for flags in SCENARIOS["priority"].settings.values():
        assert flags[:2] == ("--scheduling-policy", "priority")


@pytest.mark.parametrize("scale", SCALES)
def test_preemption_kv_blocks_come_from_the_workload(scale: float) -> None:
    workload = SCENARIOS["preemption"].build(scale, None)
    (group,) = workload.groups
    per_request = math.ceil((group.input_len + group.output_len) / BLOCK_SIZE)
    flags = workload.server_flags
    blocks = int(flags[flags.index("--num-kv-blocks") + 1])
    assert flags[flags.index("--block-size") + 1] == str(BLOCK_SIZE)
    assert blocks == math.ceil(group.count * per_request / 3)  # a third of the demand at full length
    assert blocks >= per_request  # every request fits on its own (else the server refuses it)
    assert group.count * per_request >= 2 * blocks  # and all of them together overflow it twice
    assert SCENARIOS["preemption"].build(1.0, None).server_flags[-1] == str(24 * 32 // 3)  # 24 x (256 + 256)


def test_group_kv_blocks_round_up_per_request() -> None:
    assert Group("g", 3, 20, 5).kv_blocks(16) == 3 * 2
    assert Workload((Group("a", 2, 16, 16), Group("b", 1, 1, 1))).kv_blocks(16) == 2 * 2 + 1


def fake_report(workload: Workload, ttft: float) -> dict[str, Any]:
    records = []
    for i, (spec, start) in enumerate(zip(*workload.requests(0), strict=True)):
        records.append(RequestRecord(i, spec.priority, spec.input_len, spec.output_len, spec.label, start=start,
                                     ttft=ttft, itl=[0.01] * (spec.output_len - 1), latency=ttft + 0.01 * (spec.output_len - 1),
                                     done=1.0, prompt_tokens=spec.input_len, cached_tokens=0,
                                     output_tokens=spec.output_len, usage_reported=True, status=200))
    # As run_setting reports the server's counters: every one of them.
    return build_report(records, 10.0, by_priority=False, by_class=True) | {
        "server": dict.fromkeys(SERVER_COUNTERS, 1) | {"preemptions": 4, "swaps": 1}}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_metric_is_in_a_report(name: str) -> None:
    scenario = SCENARIOS[name]
    report = fake_report(scenario.build(0.1, None), ttft=0.5)
    for metric in (*COMMON_ROWS, *scenario.metrics):
        assert metric.value(report) is not None, metric.label


def test_the_comparison_is_computed_from_the_numbers() -> None:
    scenario = SCENARIOS["shared-prefix"]
    workload = scenario.build(0.1, None)
    runs = [SettingRun(name, [], fake_report(workload, ttft), [], [])
            for name, ttft in (("no-caching", 0.4), ("caching", 0.1))]
    (line,) = headline(scenario, runs)
    assert line.startswith("caching against no-caching: TTFT p50 (ms) 0.25x (400.00 → 100.00)")
    assert "output tokens/s 1.00x" in line
    console = Console(width=200, file=io.StringIO(), record=True)
    console.print(comparison_table(scenario, runs, "t"))
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in console.export_text().splitlines() if line.count("│") == 4}
    assert rows["TTFT p99 (ms)"] == ["400.00", "100.00 (0.25x)"]
    assert rows["failed requests"] == ["0", "0"]  # counts get no ratio


def run_cli(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = bench.run(build_parser().parse_args(["bench", *argv]))
    return rc, err.getvalue()


def test_a_scenario_refuses_workload_flags() -> None:
    rc, err = run_cli("--scenario", "priority", "--num-prompts", "5", "--input-len", "8")
    assert rc == 2 and "--scenario priority sets its own workload: drop --num-prompts, --input-len" in err
    rc, err = run_cli("--scenario", "preemption", "--endpoint", "chat")
    assert rc == 2 and "drop --endpoint" in err
    rc, err = run_cli("--scale", "0.5", "--server-model", "tiny")
    assert rc == 2 and "--server-model, --scale: only with --scenario" in err


# ------------------------------------------------------------------------------ end to end


def bench_scenario(tmp_path: Path, name: str, *flags: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "frontend", "bench", "--scenario", name, "--server-model", "tiny",
         "--server-args=--dtype float32", "--save", str(out), *flags],
        capture_output=True, text=True, timeout=E2E_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


def test_shared_prefix_end_to_end(tmp_path: Path) -> None:
    proc, doc = bench_scenario(tmp_path, "shared-prefix", "--scale", "0.1", "--plot-dir", str(tmp_path / "plots"))
    assert list(doc["settings"]) == ["no-caching", "caching"]
    assert doc["completed"] is True and doc["interrupted"] is None
    assert doc["seed_drawn"] is True and f"seed {doc['seed']} for every setting (drawn" in proc.stderr  # one seed, every setting
    (group,) = doc["workload"]["groups"]
    for name, run in doc["settings"].items():
        s = run["summary"]
        assert (s["completed"], s["failed"]) == (group["count"], 0), name
        assert s["total_input_tokens"] == group["count"] * group["input_len"]
        assert s["total_output_tokens"] == group["count"] * group["output_len"]
        assert run["server_stats"]["samples"], name  # the admin token it generated works
        assert {p.name for p in (tmp_path / "plots" / name).iterdir()} >= {"latency_cdf.png", "throughput.png"}
    assert (tmp_path / "plots" / "settings.png").stat().st_size > 0
    assert doc["settings"]["no-caching"]["summary"]["cached_input_tokens"] == 0
    assert doc["settings"]["caching"]["summary"]["cached_input_tokens"] > 0
    assert "--no-enable-prefix-caching" in doc["settings"]["no-caching"]["flags"]
    assert "--dtype" in doc["settings"]["caching"]["flags"]
    assert "caching against no-caching: TTFT p50 (ms)" in proc.stdout.replace("\n", " ")


def test_preemption_end_to_end(tmp_path: Path) -> None:
    _, doc = bench_scenario(tmp_path, "preemption", "--scale", "0.3")
    (group,) = doc["workload"]["groups"]
    blocks = int(doc["workload"]["server_flags"][-1])
    for name in ("recompute", "swap"):
        run = doc["settings"][name]
        s = run["summary"]
        assert (s["completed"], s["failed"]) == (group["count"], 0), name
        assert s["total_output_tokens"] == group["count"] * group["output_len"]
        assert run["server"]["kv_blocks_total"] == blocks
        assert run["server"]["preemptions"] > 0, name
    assert doc["settings"]["recompute"]["server"]["swaps"] == 0


def test_json_end_to_end(tmp_path: Path) -> None:
    _, doc = bench_scenario(tmp_path, "json", "--scale", "0.25")
    groups = {g["label"]: g for g in doc["workload"]["groups"]}
    for name in ("no-jump-forward", "jump-forward"):
        run = doc["settings"][name]
        s = run["summary"]
        assert (s["completed"], s["failed"]) == (len(doc["workload"]["groups"]) * groups["json"]["count"], 0), name
        # The constrained requests, sent without ignore_eos, run to max_tokens too (the schema's list never ends).
        assert run["by_class"]["json"]["total_output_tokens"] == groups["json"]["count"] * groups["json"]["output_len"]
        assert run["server"]["steps"] > 0
    assert doc["settings"]["no-jump-forward"]["server"]["jump_forward_tokens"] == 0
    assert doc["settings"]["jump-forward"]["server"]["jump_forward_tokens"] > 0


def test_a_server_that_cannot_start_is_one_error_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "frontend", "bench", "--scenario", "preemption", "--server-model", "tiny",
         "--server-args=--no-such-flag"], capture_output=True, text=True, timeout=E2E_TIMEOUT_S)
    assert proc.returncode == 1
    assert "sluice bench: error: setting recompute: sluice serve exited with status 2" in proc.stderr
    assert "--no-such-flag" in proc.stderr
