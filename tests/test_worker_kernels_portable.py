"""The CPU kernels at each instruction-set level a CPU may have (``worker/cpu_isa.py``), on a
machine that has more: the library built for x86-64 with no AVX at all (the plain loops: no
packed linear, no whole-stack decoder, no quantized kernel) must pass the kernel tests and the
transformers parity tests; the AVX2 build's quantized and float32 products, its silu and its float32
attention must be the AVX-512 build's bit for bit; and the parity tests pass with the kernels off altogether
(torch's operators only). Each runs in a child process, whose environment builds that library.
(The whole worker suite runs as an AVX2-only CPU in CI: ``.ci/run``.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
AVX2 = {"SLUICE_CPU_ISA": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2"}


def _pytest(env: dict[str, str], *files: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files], cwd=ROOT,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=900)


def test_kernels_built_without_avx_pass_the_kernel_and_parity_tests() -> None:
    env = {"SLUICE_CPU_ISA": "x86-64", "ATEN_CPU_CAPABILITY": "default"}
    probe = subprocess.run([sys.executable, "-c", "from worker.kernels import cpu; lib = cpu.load(); "
                            "print(lib is not None and (lib.linear_available(), lib.linear_q_available()))"], cwd=ROOT,
                           env={**os.environ, **env}, capture_output=True, text=True, timeout=900)
    if probe.stdout.strip() == "False":
        pytest.skip("no C compiler here")
    assert probe.stdout.strip() == "(0, 0)", probe.stdout + probe.stderr  # really the portable build
    done = _pytest(env, "tests/test_worker_cpu_kernels.py", "tests/test_worker_cpu_decoder.py",
                   "tests/test_worker_parity.py", "tests/test_worker_quantized.py")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


# Products of every quantized format, both activation dtypes and row counts that leave every
# remainder of both builds' row blocks, float32 products and silu(gate) * up, saved for the parent
# to compare.
_PRODUCTS = """
import sys, torch
sys.path.insert(0, "tests")
from test_worker_quantized import FORMS, _weight
from worker.kernels import cpu, quant_records
lib = cpu.load()
results = {"instructions": (cpu.quantized_instructions(lib), cpu.linear_instructions(lib, torch.float32))}
for i, qtype in enumerate(FORMS):
    packed, fmt = quant_records.pack(_weight(qtype, 70, 512, seed=i))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(75, 512, generator=torch.Generator().manual_seed(i)).to(dtype)
        bias = torch.linspace(-1, 1, 70).to(dtype)
        results[(str(qtype), str(dtype))] = cpu.linear_q(lib, x, packed, bias, 70, fmt)
gen = torch.Generator().manual_seed(0)
w, bias = torch.randn(130, 96, generator=gen), torch.randn(130, generator=gen)
for rows in (1, 7, 13):
    results[("linear", rows)] = cpu.linear(lib, torch.randn(rows, 96, generator=gen), cpu.pack_linear(w), bias, 130)
gate_up = torch.randn(5, 2 * 70, generator=gen) * 8
for dtype in (torch.float32, torch.bfloat16):
    results[("silu", str(dtype))] = cpu.silu_mul(lib, gate_up.to(dtype), 70)
# float32 attention: a 37-token chunk after a 20-token prefix, and a decode row over 50 positions
i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
for head_dim in (64, 128):
    keys, values = (torch.randn(8, 16, 3, head_dim, generator=gen) for _ in range(2))
    keys, values = cpu.kernel_layout(keys, values, cpu.kv_layout(lib, torch.float32, head_dim, 16))
    q = torch.randn(38, 9, head_dim, generator=gen)
    results[("attention", head_dim)] = cpu.attention(
        lib, q, keys.view(-1, 3, head_dim), values.view(-1, 3, head_dim), i32(0, 1, 2, 3, 4, 5, 6, 7).view(2, 4),
        i32(57, 50), i32(37, 1), i32(0, 37), i32(0, 0), 0, 16, head_dim ** -0.5)
torch.save(results, sys.argv[1])
"""


def test_avx2_products_are_the_avx512_kernels_bit_for_bit(tmp_path: Path) -> None:
    products = {}
    for name, env in (("native", {}), ("avx2", AVX2)):
        target = tmp_path / f"{name}.pt"
        done = subprocess.run([sys.executable, "-c", _PRODUCTS, str(target)], cwd=ROOT, env={**os.environ, **env},
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-2000:]
        products[name] = torch.load(target)
    native, avx2 = products["native"], products["avx2"]
    if native["instructions"] != ("AVX-512 VNNI", "AVX-512") or avx2["instructions"] != ("AVX2", "AVX2"):
        pytest.skip(f"needs a CPU with AVX-512 VNNI (here: {native['instructions']}, {avx2['instructions']})")
    for key, y in native.items():
        if key != "instructions":
            assert torch.equal(y, avx2[key]), key


def test_parity_with_the_kernels_off() -> None:
    done = _pytest({"SLUICE_NO_C_KERNELS": "1"}, "tests/test_worker_parity.py")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
