"""The CPU kernels' portable path, on a machine that has AVX-512: the library built again with
``-mno-avx512f`` (the plain loops a CPU without AVX-512 runs: no packed linear, no whole-stack
decoder, the scalar attention, norm, rotation and silu; the quantized linear in AVX2) must pass
the kernel tests, the quantized kernel's tests and the transformers parity tests, and its
quantized products must be the AVX-512 VNNI build's bit for bit; and the parity tests pass with
the kernels off altogether (torch's operators only). Each runs in a child process, whose
environment builds that library."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
                   "tests/test_worker_parity.py", "tests/test_worker_quantized.py")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


# Products of every layout, both activation dtypes and row counts that leave every remainder of
# both builds' row blocks, saved for the parent to compare.
_PRODUCTS = """
import sys, torch
sys.path.insert(0, "tests")
from test_worker_quantized import _weight
from worker.kernels import cpu
lib = cpu.load()
results = {"instructions": cpu.quantized_instructions(lib)}
for layout in (4, 8, 16):
    w = _weight(70, 96, layout, seed=layout)
    packed = cpu.pack_quantized(w)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(11, 96, generator=torch.Generator().manual_seed(layout)).to(dtype)
        bias = torch.linspace(-1, 1, 70).to(dtype)
        results[(layout, str(dtype))] = cpu.linear_q(lib, x, packed, bias, 70, layout)
torch.save(results, sys.argv[1])
"""


def test_avx2_quantized_products_are_the_vnni_kernels_bit_for_bit(tmp_path: Path) -> None:
    products = {}
    for name, env in (("native", {}), ("portable", {"SLUICE_KERNEL_CFLAGS": "-mno-avx512f"})):
        target = tmp_path / f"{name}.pt"
        done = subprocess.run([sys.executable, "-c", _PRODUCTS, str(target)], cwd=ROOT, env={**os.environ, **env},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        products[name] = torch.load(target)
    native, portable = products["native"], products["portable"]
    if native["instructions"] != "AVX-512 VNNI" or portable["instructions"] != "AVX2":
        pytest.skip(f"needs a CPU with AVX-512 VNNI (here: {native['instructions']}, {portable['instructions']})")
    for key, y in native.items():
        if key != "instructions":
            assert torch.equal(y, portable[key]), key


def test_parity_with_the_kernels_off() -> None:
    done = _pytest({"SLUICE_NO_C_KERNELS": "1"}, "tests/test_worker_parity.py")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
