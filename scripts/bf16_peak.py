"""The machine's measured bfloat16 dot-product peak: what the prefill figures are a share of.

    python scripts/bf16_peak.py              # all cores
    python scripts/bf16_peak.py --threads 1

Compiles a few lines of C with the system compiler (``-O2 -march=native -fopenmp``): each thread
runs 30 independent chains of ``vdpbf16ps`` (AVX512-BF16: 32 bfloat16 multiply-adds per
instruction) on registers, with no memory traffic, and the figure is multiply-adds per second
over all threads. On a 2-core Zen 5: ~117 GMAC/s a core, ~230 on both. Needs AVX512-BF16.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#define CHAINS 30
int main(int argc, char **argv) {
    const int threads = atoi(argv[1]);
    const long iters = atol(argv[2]);
    float sink = 0;
    const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        __m512 acc[CHAINS];
        for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_setzero_ps();
        const __m512bh x = (__m512bh)_mm512_set1_epi32(0x00010001), y = (__m512bh)_mm512_set1_epi32(0x00010001);
        for (long n = 0; n < iters; n++) {
#pragma GCC unroll 30
            for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_dpbf16_ps(acc[i], x, y);
        }
        for (int i = 0; i < CHAINS; i++) sink += _mm512_reduce_add_ps(acc[i]);
    }
    const double seconds = omp_get_wtime() - t0;
    printf("%.1f %g\n", (double)iters * CHAINS * 32 * threads / seconds / 1e9, sink);
    return 0;
}
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--iterations", type=int, default=50_000_000, help="per chain")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("no C compiler (cc/gcc) on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "peak.c", Path(tmp) / "peak"
        source.write_text("#include <stdlib.h>\n" + SOURCE)
        subprocess.run([compiler, "-O2", "-march=native", "-fopenmp", str(source), "-o", str(binary)], check=True)
        figures = [float(subprocess.run([str(binary), str(args.threads), str(args.iterations)], check=True,
                                        capture_output=True, text=True).stdout.split()[0])
                   for _ in range(args.rounds)]
    print(f"vdpbf16ps peak: {max(figures):.1f} GMAC/s on {args.threads} thread(s) "
          f"(best of {args.rounds}: {', '.join(f'{f:.1f}' for f in figures)})")


if __name__ == "__main__":
    main()
