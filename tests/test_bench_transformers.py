"""Smoke tests of scripts/bench_transformers.py's workload and counting (no timing, no server)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_transformers.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_transformers", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_workload_is_seeded_within_bounds_and_distinct(bench: ModuleType) -> None:
    a = bench.build_workload(64, (32, 512), (16, 256), seed=3)
    assert a == bench.build_workload(64, (32, 512), (16, 256), seed=3)
    assert a != bench.build_workload(64, (32, 512), (16, 256), seed=4)
    lo, hi = bench.TOKEN_IDS
    for r in a:
        assert 32 <= len(r.prompt) <= 512 and 16 <= r.output_len <= 256
        assert all(lo <= t < hi for t in r.prompt)
    # No two prompts share their first KV block (16 tokens), so no prefix cache helps.
    assert len({tuple(r.prompt[:16]) for r in a}) == len(a)


def test_static_waste_counts_padding_and_overrun(bench: ModuleType) -> None:
    R = bench.Request
    requests = [R([100] * 4, 2), R([100] * 10, 5), R([100] * 3, 7)]  # batches of 2: [0, 1], [2]
    w = bench.static_waste(requests, batch_size=2)
    assert (w.useful_output, w.computed_output, w.overrun_output) == (14, 2 * 5 + 7, 3)
    assert (w.prompt, w.padded_prompt, w.padding) == (17, 2 * 10 + 3, 6)
    assert [len(b) for b in bench.static_batches(requests, 2)] == [2, 1]


def test_flags_quick_defaults_and_explicit_wins(bench: ModuleType) -> None:
    full = bench.parse_args([])
    assert (full.num_requests, full.input_len, full.output_len, full.batch_size, full.max_concurrency) == (
        256, (32, 512), (16, 256), 16, 64)
    quick = bench.parse_args(["--quick", "--batch-size", "8", "--input-len", "5"])
    assert (quick.num_requests, quick.input_len, quick.batch_size) == (16, (5, 5), 8)
    with pytest.raises(SystemExit):
        bench.parse_args(["--input-len", "9:3"])


def test_process_figures(bench: ModuleType) -> None:
    assert bench.peak_mib() > 0


def test_cpu_watch_sees_a_busy_neighbour_unless_it_is_watched(bench: ModuleType) -> None:
    """A process spinning for 2 s is seen as most of a core kept busy by others; named among the
    watched processes, it is not. (Bounds generous for a loaded 2-core machine: the spinner gets
    at least a third of a core; both watches span the same 2 s, so other load cancels out.)"""
    spin = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end:\n    pass"
    spinner = subprocess.Popen([sys.executable, "-c", spin])
    try:
        others = bench.CpuWatch(["self"])
        others_but_spinner = bench.CpuWatch(["self", spinner.pid])
        time.sleep(2.0)
        seen, seen_without = others.other_cores(), others_but_spinner.other_cores()
        assert spinner.poll() is None, "the spinner must still run when read: a gone process counts 0 ticks"
    finally:
        spinner.kill()
        spinner.wait()
    assert seen > 0.3, f"a spinning process kept only {seen:.2f} cores busy"
    assert seen - seen_without > 0.3, f"watching the spinner took only {seen - seen_without:.2f} cores off"


def test_hf_generate_makes_every_row_the_batch_length(bench: ModuleType) -> None:
    pytest.importorskip("transformers")
    hf, _, weights = bench.load_transformers("tiny", "float32")
    assert weights == "dense float32 weights"
    batch = bench.build_workload(3, (4, 12), (2, 6), seed=0)
    assert bench.hf_generate(hf, batch, 6) == 6
