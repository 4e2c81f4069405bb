"""Every test sees the same environment whatever the developer's shell holds: the SLUICE_*
variables that set a server flag (SLUICE_MODEL, SLUICE_PORT, SLUICE_INSECURE_ZMQ, ...) are removed
before any test runs, so the servers tests start (children inherit the environment) take only the
flags the tests give them. Variables that are not flags (SLUICE_CACHE, SLUICE_NO_C_KERNELS) stay.

Also what modules share that takes long to build: a SmolLM2 server, transformers' SmolLM2 tokenizer,
the hostile-input tests' server."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import pytest
from hostile import Served, hostile_server
from sluice_server import SluiceServer, running_server

from frontend.cli import environment_table

for _name in re.findall(r"`(SLUICE_[A-Z_]+)`", environment_table()):
    os.environ.pop(_name, None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failing test's report ends with the log of every ``sluice serve`` running at the time
    (its frontend's, scheduler's and worker's lines): what happened inside the server is then in
    CI's output, not only in a temporary directory that is gone by the time anyone looks."""
    outcome: Any = yield
    report = outcome.get_result()
    if report.failed:
        for server in list(SluiceServer.live):
            report.sections.append((f"sluice serve log, {server.url} (its last lines)", server.log()[-3000:]))


@pytest.fixture(scope="session")
def smollm2_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SluiceServer]:
    """``sluice serve --model smollm2`` (float32, 256 KV blocks) for the modules that need only its
    answers (test_serve_smollm2, _structured, _tools): it starts once, not once a module. It has
    no admin token, so no test can read another's counters."""
    with running_server("--model", "smollm2", "--num-kv-blocks", "256", log_dir=tmp_path_factory.mktemp("smollm2")) as s:
        yield s


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer() -> Any:
    """transformers' tokenizer from SmolLM2's GGUF file (about ten seconds to build), for
    test_gguf and test_serve_smollm2: they only encode, decode and apply the chat template."""
    from transformers import AutoTokenizer

    from worker.model.loader import smollm2_path

    path = smollm2_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def hostile_served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The tiny-model server (with an admin token) that test_serve_hostile and _admin attack: it
    starts once, not once a module; the admin file's last test checks it after both."""
    with hostile_server(tmp_path_factory.mktemp("serve-hostile")) as served:
        yield served
