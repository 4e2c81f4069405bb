"""Threads that do background work (compiling grammars) yield the CPU to the ones serving tokens.

On a machine with few cores, a grammar compiling on a thread of its own competes for a core
with the forward pass and the event loop: with sixteen new schemas at once, every stream's
tokens came later. A niced thread still uses any core nobody else wants, so on an idle machine
it runs as fast as before; under load it waits, and only the requests that wait for it wait.
"""

from __future__ import annotations

import contextlib
import os
import threading

BACKGROUND_NICE = 10


def lower_thread_priority() -> None:
    """Give the calling thread a lower CPU priority (Linux: nice is per thread); a no-op where
    threads cannot be reniced. Use as a thread pool's ``initializer``."""
    with contextlib.suppress(AttributeError, OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(BACKGROUND_NICE, os.getpriority(os.PRIO_PROCESS, tid)))
