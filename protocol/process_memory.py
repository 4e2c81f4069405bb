"""A process's resident memory, as ``/admin/stats`` reports it for each component.

Each component measures itself (the frontend when asked, the scheduler with its stats, each
worker in its heartbeat): no process reads another's ``/proc`` entry, so the figures stay right
when the components run on different hosts.
"""

from __future__ import annotations

import re
import resource
from pathlib import Path

_STATUS = Path("/proc/self/status")


def resident_mib() -> dict[str, float]:
    """``{"rss_mib": now, "peak_rss_mib": the most so far}``; where ``/proc`` is missing, both
    are the peak ``getrusage`` reports."""
    try:
        status = _STATUS.read_text()
        now, peak = (int(re.search(rf"{key}:\s+(\d+) kB", status).group(1)) / 1024  # type: ignore[union-attr]
                     for key in ("VmRSS", "VmHWM"))
    except (OSError, AttributeError):
        now = peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"rss_mib": round(now, 1), "peak_rss_mib": round(peak, 1)}
