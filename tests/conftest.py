"""Every test sees the same environment whatever the developer's shell holds: the SLUICE_*
variables that set a server flag (SLUICE_MODEL, SLUICE_PORT, SLUICE_INSECURE_ZMQ, ...) are removed
before any test runs, so the servers tests start (children inherit the environment) take only the
flags the tests give them. Variables that are not flags (SLUICE_CACHE, SLUICE_NO_C_KERNELS) stay.

Also the servers that modules share (``smollm2_server``)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import pytest
from sluice_server import SluiceServer, running_server

from frontend.cli import environment_table

for _name in re.findall(r"`(SLUICE_[A-Z_]+)`", environment_table()):
    os.environ.pop(_name, None)


@pytest.fixture(scope="session")
def smollm2_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SluiceServer]:
    """``sluice serve --model smollm2`` (float32, 256 KV blocks) for the modules that need only its
    answers (test_serve_smollm2, _structured, _tools): it starts once, not once a module. It has
    no admin token, so no test can read another's counters."""
    with running_server("--model", "smollm2", "--num-kv-blocks", "256", log_dir=tmp_path_factory.mktemp("smollm2")) as s:
        yield s
