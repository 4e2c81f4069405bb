"""Which process a pid is, on this machine: what a worker's heartbeats say of themselves and what
the scheduler checks before it kills a hung worker by pid."""

from __future__ import annotations

import os
from pathlib import Path


def process_identity(pid: int | str = "self") -> str:
    """Boot id, pid namespace and the process's start time (clock ticks since boot): a pid that
    was reused, or one in another container or on another machine, never has the same; "" where
    ``/proc`` cannot say (no such process, not Linux)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")
        start = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""
    return f"{boot} {namespace} {start}"
