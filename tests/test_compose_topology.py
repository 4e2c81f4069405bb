"""The three components as separate processes, wired exactly as docker-compose.yml wires them (its
commands and environment, read from the file; the `keys` service's key pairs), started in reverse
order — frontend, then worker, then scheduler — on 127.0.0.1 instead of the compose network. They
must find one another and stream a chat completion; while the scheduler is missing, each waiting
component says so in the log rather than failing."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import httpx
import pytest
from sluice_server import free_port, http_status
from test_components_tcp import _free_port_block

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
SLUICE = [sys.executable, "-m", "frontend"]


def _substitute(value: str) -> str:
    """Compose's ``${VAR:-default}`` with nothing set in the environment: the default."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def compose_services() -> dict[str, dict[str, Any]]:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return doc["services"]


def service_process(service: dict[str, Any], overrides: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    # Sluice's own variables only: the container's others (HF_HOME=/cache/...) are its business.
    env = {k: _substitute(str(v)) for k, v in service["environment"].items() if k.startswith("SLUICE_")}
    env.update({k: v for k, v in overrides.items() if k in env})
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    return [*SLUICE, *service["command"]], base | env


def test_compose_wiring_started_in_reverse_order_streams_a_chat(tmp_path: Path) -> None:
    services = compose_services()
    assert set(services) >= {"keys", "scheduler", "worker", "frontend"}
    # The keys service's work: key pairs in the directory every component reads.
    keys = tmp_path / "keys"
    subprocess.run([*SLUICE, "keys", str(keys)], check=True, capture_output=True, timeout=60)
    # What each service mounts at /keys: the scheduler its volume, the others the client subset.
    mounted = {name: [v.split(":")[0] for v in services[name]["volumes"] if v.split(":")[1] == "/keys"]
               for name in ("scheduler", "worker", "frontend")}
    assert mounted == {"scheduler": ["sluice-keys"], "worker": ["sluice-client-keys"],
                       "frontend": ["sluice-client-keys"]}
    keys_dir = {"scheduler": keys, "worker": keys / "client", "frontend": keys / "client"}

    zmq_port, http_port = _free_port_block(4), free_port()
    scheduler_env = services["scheduler"]["environment"]
    assert scheduler_env["SLUICE_ADDRESS"] == "tcp://0.0.0.0:5555" and scheduler_env["SLUICE_CURVE_KEYS"] == "/keys"
    overrides = {"SLUICE_PORT": str(http_port), "SLUICE_HOST": "127.0.0.1"}
    addresses = {"scheduler": f"tcp://127.0.0.1:{zmq_port}", "worker": f"tcp://127.0.0.1:{zmq_port}",
                 "frontend": f"tcp://127.0.0.1:{zmq_port}"}
    logs: dict[str, IO[bytes]] = {}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    url = f"http://127.0.0.1:{http_port}"
    try:
        for name in ("frontend", "worker", "scheduler"):
            command, env = service_process(services[name], overrides | {"SLUICE_ADDRESS": addresses[name],
                                                                        "SLUICE_CURVE_KEYS": str(keys_dir[name])})
            logs[name] = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115
            procs[name] = subprocess.Popen(command, env=env, stdout=logs[name], stderr=logs[name])
            if name == "frontend":
                _wait(lambda: http_status(f"{url}/health") is not None, 60, "the frontend to listen")
                assert http_status(f"{url}/ready") == 503  # no scheduler yet: up, not ready
            time.sleep({"frontend": 3, "worker": 8, "scheduler": 0}[name])  # each waits a while for what it needs
        _wait(lambda: http_status(f"{url}/ready") == 200, 180, "/ready", tmp_path)
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120, json={
                "model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
                "max_tokens": 16, "temperature": 0, "stream": True}) as r:
            assert r.status_code == 200
            chunks = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert chunks[-1] == "data: [DONE]" and len(chunks) > 3
        text = "".join(httpx.Response(200, content=c[6:]).json()["choices"][0]["delta"].get("content") or ""
                       for c in chunks[:-1])
        assert "Paris" in text, text
        # The frontend waited 11 s: it said so once (not once a retry) and said when it ended.
        frontend_log = (tmp_path / "frontend.log").read_text()
        assert frontend_log.count("waiting for the scheduler at") == 1, frontend_log
        assert "answers" in frontend_log.split("waiting for the scheduler at")[1], frontend_log
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for name, proc in procs.items():
            try:
                proc.wait(timeout=20)
            finally:
                if proc.poll() is None:
                    proc.kill()
                logs[name].close()


def _wait(predicate: Any, timeout_s: float, what: str, log_dir: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    logs = "" if log_dir is None else "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in log_dir.glob("*.log"))
    raise AssertionError(f"waited {timeout_s} s for {what}\n{logs}")


def test_every_service_is_given_longer_to_stop_than_its_own_drain() -> None:
    """``docker stop`` and ``compose down`` SIGKILL a container 10 s after SIGTERM unless told
    otherwise: each long-running service's period must exceed the frontend's whole stop
    (--shutdown-grace, then at most STOP_AFTER_GRACE_S), or the drain is cut short."""
    from frontend.serve import STOP_AFTER_GRACE_S
    from protocol.config import FrontendConfig

    stop = FrontendConfig().shutdown_grace + STOP_AFTER_GRACE_S
    for name, service in compose_services().items():
        if name == "keys":
            continue
        period = service.get("stop_grace_period")
        assert period is not None and period.endswith("s"), f"{name} sets no stop_grace_period"
        assert float(period[:-1]) > stop, f"{name}: {period} is not longer than a {stop:g} s stop"
