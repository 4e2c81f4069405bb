"""How long a GPU sat idle between its kernels and copies, from an nsys ``cuda_gpu_trace`` CSV
(``nsys stats --report cuda_gpu_trace --format csv``): the busy span, the idle time inside it,
and the longest gaps. Used by scripts/gpu_checks.sh on a multi-step decode.

    python scripts/gpu_idle.py decode_cuda_gpu_trace.csv
"""

from __future__ import annotations

import csv
import sys


def main(path: str) -> None:
    spans = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            start, duration = int(row["Start (ns)"]), int(row["Duration (ns)"])
            spans.append((start, start + duration))
    if not spans:
        raise SystemExit(f"{path}: no device activity")
    spans.sort()
    gaps, end = [], spans[0][1]
    for start, stop in spans[1:]:
        if start > end:
            gaps.append(start - end)
        end = max(end, stop)
    total = end - spans[0][0]
    idle = sum(gaps)
    print(f"{len(spans)} device operations over {total / 1e6:.1f} ms: idle {idle / 1e6:.1f} ms "
          f"({100 * idle / total:.1f}%) in {len(gaps)} gaps")
    print("longest gaps (ms): " + ", ".join(f"{g / 1e6:.2f}" for g in sorted(gaps, reverse=True)[:10]))


if __name__ == "__main__":
    main(sys.argv[1])
