"""Every test sees the same environment whatever the developer's shell holds: the SLUICE_*
variables that set a server flag (SLUICE_MODEL, SLUICE_PORT, SLUICE_INSECURE_ZMQ, ...) are removed
before any test runs, so the servers tests start (children inherit the environment) take only the
flags the tests give them. Variables that are not flags (SLUICE_CACHE, SLUICE_NO_C_KERNELS) stay."""

from __future__ import annotations

import os
import re

from frontend.cli import environment_table

for _name in re.findall(r"`(SLUICE_[A-Z_]+)`", environment_table()):
    os.environ.pop(_name, None)
