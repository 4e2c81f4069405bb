"""The CPU kernels' portable path, on a machine that has AVX-512: the library built again with
``-mno-avx512f`` (the plain loops a CPU without AVX-512 runs: no packed linear, no whole-stack
decoder, the scalar attention, norm, rotation and silu) must pass the kernel tests and the
transformers parity tests; and those parity tests pass with the kernels off altogether (torch's
operators only). Each runs the tests in a child process, whose environment builds that library."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _pytest(env: dict[str, str], *files: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files], cwd=ROOT,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=900)


def test_kernels_built_without_avx512_pass_the_kernel_and_parity_tests() -> None:
    env = {"SLUICE_KERNEL_CFLAGS": "-mno-avx512f"}
    probe = subprocess.run([sys.executable, "-c", "from worker.kernels import cpu; lib = cpu.load(); "
                            "print(lib is not None and lib.linear_f32_available())"], cwd=ROOT,
                           env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    if probe.stdout.strip() == "False":
        pytest.skip("no C compiler here")
    assert probe.stdout.strip() == "0", probe.stdout + probe.stderr  # really the portable build
    done = _pytest(env, "tests/test_worker_cpu_kernels.py", "tests/test_worker_cpu_decoder.py",
                   "tests/test_worker_parity.py")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def test_parity_with_the_kernels_off() -> None:
    done = _pytest({"SLUICE_NO_C_KERNELS": "1"}, "tests/test_worker_parity.py")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
