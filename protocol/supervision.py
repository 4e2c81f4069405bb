"""Whether a component runs under ``sluice serve``, which supervises its children.

The parent sets ``SLUICE_SUPERVISED`` in its children's environment. It then handles Ctrl-C for
them (it drains first, then stops them), and it says a start-up failure once, as
``sluice: error: …``: a child that reports such a failure upstream need not log it too (the same
failure was printed four times, once per process, between the other start-up lines)."""

from __future__ import annotations

import logging
import os

ENV = "SLUICE_SUPERVISED"


def supervised() -> bool:
    return bool(os.environ.get(ENV))


def startup_failure_level() -> int:
    """The log level of a start-up failure this process reports upstream: DEBUG under
    ``sluice serve`` (the parent prints it), ERROR when the process runs on its own."""
    return logging.DEBUG if supervised() else logging.ERROR
