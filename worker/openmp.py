"""How the worker's OpenMP threads wait: spin briefly, then sleep.

torch's operators and Sluice's C kernels share one OpenMP runtime (torch's libgomp; the kernels
link the same soname). A thread that reaches a barrier before the others spins, by libgomp's
default up to 300,000 pause loops (milliseconds) before it sleeps. On an idle machine that is
what makes a barrier cost a microsecond. On a busy one it is a collapse: when another process
holds the core of the thread being waited for, the waiting thread burns its own time slice
spinning, the thread it waits for runs only when a slice frees up, and a decode step's hundreds
of barriers each wait for the scheduler. Measured (SmolLM2 Q4_1, one stream, 2 cores, beside
two processes that each spin a core): see ``SPIN_COUNT``.

A bounded spin keeps the idle speed (barriers inside a step are reached within microseconds of
each other) and lets a waiting thread give its core back under load. ``GOMP_SPINCOUNT`` or
``OMP_WAIT_POLICY`` set by the user win.
"""

from __future__ import annotations

import os

SPIN_COUNT = 10_000


def bound_spinning() -> None:
    """Set libgomp's spin count for this process, unless the user chose a wait policy; must run
    before torch (and so libgomp) is loaded, which reads it once."""
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
