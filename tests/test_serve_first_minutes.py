"""A new user's first minutes with ``sluice serve``, each seen once as a new user would see it.

- a bad ``--model`` is one ``sluice: error:`` line and exit 1 (it was printed four times, once
  per process, between start-up lines), and so is a port already taken (said before any model
  loads, with a ``--port`` hint);
- start-up says what it is doing (loading, warming up) and prints the URL once, when the server
  is ready, never uvicorn's "running on" while the model is still loading;
- an idle server says nothing alarming (the worker called a scheduler it was connected to
  "not reachable" every 5 s: its monitor was attached after the connection was made);
- a misspelt request field is a 400 naming it, a wrong method a 405 typed as the client's, and
  a client that gives up mid-request is no ERROR;
- ``--help`` shows every default, but never the admin token's value;
- a Hugging Face Hub id is fetched through ``huggingface_hub`` (here from a cache prepared on
  disk, offline) and served under its id; when the Hub cannot be reached, the error says so.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from sluice_server import free_port, running_server

from worker.model.tiny import materialize_tiny

SERVE = [sys.executable, "-m", "frontend", "serve"]


def run_serve(*flags: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SERVE, "--port", str(free_port()), *flags], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_a_bad_model_is_one_error_line_and_exit_1() -> None:
    done = run_serve("--model", "/nowhere/model-dir")
    said = (done.stdout + done.stderr).splitlines()
    errors = [line for line in said if "no such file or directory" in line]
    assert done.returncode == 1, said
    assert len(errors) == 1 and errors[0].startswith("sluice: error: "), said
    assert not any("Uvicorn running" in line or "Traceback" in line for line in said), said


def test_a_mistyped_model_or_flag_is_answered_with_the_closest_one() -> None:
    model = run_serve("--model", "smollm3", timeout=60)
    assert model.returncode == 1 and model.stderr.strip().splitlines() == [
        "sluice: error: --model smollm3: no such file or directory; did you mean 'smollm2'? (--model takes "
        "'smollm2', 'tiny', a .gguf file, a Hugging Face-format directory or a Hugging Face Hub id)"]
    flag = run_serve("--modle", "tiny", timeout=60)
    last = flag.stderr.strip().splitlines()[-1]
    assert flag.returncode == 2 and flag.stderr.startswith("usage: sluice serve "), flag.stderr[:200]
    assert last == "sluice serve: error: unrecognized arguments: --modle tiny (did you mean --model?)"


def test_a_port_in_use_is_one_error_line_with_a_hint_before_anything_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        began = time.monotonic()
        done = subprocess.run([*SERVE, "--port", str(port), "--model", "smollm2"], capture_output=True, text=True,
                              timeout=120)
    said = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 1
    assert said == [f"sluice: error: cannot listen on 127.0.0.1:{port}: Address already in use (another server is "
                    "listening there); choose another port with --port"], said
    assert time.monotonic() - began < 30  # no model was loaded first


def test_help_shows_every_default_but_not_the_admin_token() -> None:
    env = dict(os.environ, SLUICE_ADMIN_TOKEN="do-not-print-me")
    text = subprocess.run([*SERVE, "--help"], capture_output=True, text=True, env=env, timeout=60).stdout
    assert "do-not-print-me" not in text
    options = re.split(r"\n  (?=-)", text.split("options:", 1)[1])[1:]
    assert len(options) > 25
    for option in options:
        if option.startswith("-h"):
            continue
        flat = " ".join(option.split())
        assert "default" in flat, flat
        assert "(default: None)" not in flat, flat


async def _give_up_mid_request(url: str, stream: bool) -> None:
    body = {"prompt": "hello", "max_tokens": 4000, "ignore_eos": True, "stream": stream}

    async def request() -> None:
        async with httpx.AsyncClient() as client:
            if stream:
                async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass
            else:
                await client.post(f"{url}/v1/completions", json=body)

    with pytest.raises(TimeoutError):
        await asyncio.wait_for(request(), 0.2)


def test_start_up_idle_and_the_first_mistakes_read_well(tmp_path: Path) -> None:
    with running_server("--num-scheduler-steps", "1", log_dir=tmp_path) as server:
        time.sleep(6.5)  # longer than the worker's 5 s "waiting for the scheduler" interval
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temprature": 0.5})
        assert r.status_code == 400
        assert r.json()["error"] == {"message": "Unrecognized request argument supplied: temprature",
                                     "type": "invalid_request_error", "param": "temprature", "code": "unknown_field"}
        r = httpx.post(f"{server.url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": [{"type": "function"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0]"
        r = httpx.get(f"{server.url}/v1/completions")
        assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
        for stream in (False, True):
            asyncio.run(_give_up_mid_request(server.url, stream))
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200  # still serving
        time.sleep(1.0)  # the aborts' log lines
        log = server.log()
    lines = log.splitlines()
    ready = [i for i, line in enumerate(lines) if line.startswith("Sluice is ready: serving tiny at http://")]
    assert len(ready) == 1, log
    starting = next(i for i, line in enumerate(lines) if "sluice.serve: starting the scheduler and the worker for tiny" in line)
    loading = next(i for i, line in enumerate(lines) if re.search(r"worker\[0\]: loading .* on cpu", line))
    warming = next(i for i, line in enumerate(lines) if line.endswith("worker[0]: warming up"))
    assert starting < loading < warming < ready[0], log
    for bad in ("Uvicorn running", "not reachable", "Traceback", " ERROR "):
        assert bad not in log, (bad, log)


def _fake_hub_cache(root: Path, repo_id: str) -> None:
    """The Hub cache layout huggingface_hub reads offline: the tiny model as one snapshot."""
    repo = root / "hub" / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in materialize_tiny(root / "tiny-source").iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_a_hub_id_is_fetched_through_the_hub_cache_and_served_under_its_id(tmp_path: Path) -> None:
    pytest.importorskip("huggingface_hub")
    _fake_hub_cache(tmp_path / "hf", "sluice-tests/tiny-llama")
    os.environ["HF_HOME"], os.environ["HF_HUB_OFFLINE"] = str(tmp_path / "hf"), "1"
    try:
        with running_server("--model", "sluice-tests/tiny-llama", log_dir=tmp_path) as server:
            assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == "sluice-tests/tiny-llama"
            r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        missing = run_serve("--model", "sluice-tests/not-there", env=dict(os.environ))
    finally:
        del os.environ["HF_HOME"], os.environ["HF_HUB_OFFLINE"]
    errors = [line for line in (missing.stdout + missing.stderr).splitlines() if "sluice: error:" in line]
    assert missing.returncode == 1 and len(errors) == 1
    assert "--model sluice-tests/not-there: cannot download it from the Hugging Face Hub" in errors[0]
