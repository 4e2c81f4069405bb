"""CurveZMQ between the components: `sluice keys` writes the pairs; a scheduler started with them
answers a peer holding the client key and nobody else (a wrong key, or no key at all); without
keys no component takes a network address unless told ``--insecure-zmq``."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
from sluice_server import free_port, http_status, stop_processes
from test_components_tcp import _free_port_block

from protocol.config import ConfigError, FrontendConfig, SchedulerConfig, WorkerConfig
from protocol.curve import CurveKeyError, CurveKeys, is_loopback, write_keys
from protocol.messages import Ping, Pong
from protocol.transport import Endpoints, frontend_codec, frontend_identity, make_socket

SLUICE = [sys.executable, "-m", "frontend"]


def test_loopback_addresses() -> None:
    for address in ("tcp://127.0.0.1:5555", "tcp://127.8.0.1:1", "tcp://localhost:5555", "tcp://[::1]:5555",
                    "ipc:///tmp/x", "inproc://x"):
        assert is_loopback(address), address
    for address in ("tcp://0.0.0.0:5555", "tcp://10.0.0.7:5555", "tcp://scheduler:5555", "tcp://*:5555"):
        assert not is_loopback(address), address


def test_a_network_address_needs_keys_or_insecure_zmq(tmp_path: Path) -> None:
    for cls in (SchedulerConfig, FrontendConfig, WorkerConfig):
        with pytest.raises(ConfigError, match="sluice keys"):
            cls(address="tcp://0.0.0.0:5555")
        cls(address="tcp://0.0.0.0:5555", insecure_zmq=True)
        cls(address="tcp://scheduler:5555", curve_keys=str(tmp_path))
        cls(address="tcp://127.0.0.1:5555")
    # The command says so in one line, before binding anything.
    proc = subprocess.run([*SLUICE, "scheduler", "--address", "tcp://0.0.0.0:5555"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("sluice: error: will not bind tcp://0.0.0.0:5555 without CurveZMQ keys")
    assert proc.stderr.count("\n") == 1


def test_keys_command_writes_what_each_role_loads(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    proc = subprocess.run([*SLUICE, "keys", str(keys)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--curve-keys" in proc.stderr
    for secret in ("scheduler.key_secret", "client.key_secret"):
        assert (keys / secret).stat().st_mode & 0o077 == 0, secret
    server, client = CurveKeys.for_server(keys), CurveKeys.for_client(keys)
    assert server.server_public == client.server_public and server.server_secret is not None
    assert client.client_public is not None and client.client_secret is not None
    (keys / "client.key_secret").unlink()
    with pytest.raises(CurveKeyError, match=r"client\.key_secret"):
        CurveKeys.for_client(keys)
    # A component given an incomplete directory says which file is missing, in one line.
    proc = subprocess.run([*SLUICE, "worker", "--address", "tcp://127.0.0.1:5", "--curve-keys", str(keys)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "client.key_secret: no such key file" in proc.stderr


def _pong(address: str, keys: CurveKeys | None, timeout_s: float) -> Pong | None:
    """Ping the scheduler as a frontend would, holding ``keys``; its Pong, or None in time."""
    ctx: zmq.Context[Any] = zmq.Context()
    ep = Endpoints.from_base(address)
    identity = frontend_identity(int(time.monotonic_ns() % 2**31))
    push = make_socket(ctx, zmq.DEALER, ep.frontend_to_scheduler, bind=False, identity=identity, curve=keys)
    pull = make_socket(ctx, zmq.DEALER, ep.scheduler_to_frontend, bind=False, identity=identity, curve=keys)
    codec = frontend_codec()
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(zmq.Again):  # no peer admitted yet: a DEALER would block
                push.send(codec.encode(Ping(time.time())), zmq.NOBLOCK)
            if pull.poll(500):
                msg = codec.decode(pull.recv())
                if isinstance(msg, Pong):
                    return msg
        return None
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


def test_only_a_peer_with_the_client_key_reaches_the_scheduler(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    write_keys(keys)
    address = f"tcp://127.0.0.1:{_free_port_block(4)}"
    log = open(tmp_path / "scheduler.log", "wb")  # noqa: SIM115
    env = os.environ | {"SLUICE_CURVE_KEYS": str(keys)}  # the variable, as the compose file gives it
    scheduler = subprocess.Popen([*SLUICE, "scheduler", "--address", address], stdout=log, stderr=log, env=env)
    try:
        right = CurveKeys.for_client(keys)
        assert _pong(address, right, timeout_s=60) is not None, (tmp_path / "scheduler.log").read_text()
        public, secret = zmq.curve_keypair()
        stranger = CurveKeys(server_public=right.server_public, client_public=public, client_secret=secret)
        assert _pong(address, stranger, timeout_s=3) is None
        assert _pong(address, None, timeout_s=3) is None  # plain ZeroMQ gets nowhere either
        assert _pong(address, right, timeout_s=30) is not None  # and the scheduler still serves
    finally:
        scheduler.send_signal(signal.SIGTERM)
        try:
            assert scheduler.wait(timeout=15) == 0
        finally:
            if scheduler.poll() is None:
                scheduler.kill()
            log.close()


def test_refused_connections_on_the_worker_port_are_not_a_worker_lost(tmp_path: Path) -> None:
    # Review finding: every connection that failed its handshake on the worker port (a port scan, a
    # wrong key) ended in a DISCONNECTED event that the scheduler took for its worker dying, so
    # four of them used up --max-worker-restarts and the engine stopped for good.
    keys = tmp_path / "keys"
    write_keys(keys)
    base, http_port = _free_port_block(4), free_port()
    address = f"tcp://127.0.0.1:{base}"
    env = os.environ | {"SLUICE_CURVE_KEYS": str(keys), "SLUICE_ADDRESS": address}
    logs, procs = [], []
    url = f"http://127.0.0.1:{http_port}"
    try:
        for name, args in (("scheduler", []), ("worker", ["--model", "tiny", "--dtype", "float32",
                                                          "--num-kv-blocks", "64"]),
                           ("frontend", ["--port", str(http_port)])):
            logs.append(open(tmp_path / f"{name}.log", "wb"))  # noqa: SIM115
            procs.append(subprocess.Popen([*SLUICE, name, *args], env=env, stdout=logs[-1], stderr=logs[-1]))

        def complete() -> int:
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True},
                           timeout=60)
            return r.status_code

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and http_status(f"{url}/ready") != 200:
            time.sleep(0.3)
        assert complete() == 200
        worker_port = base + 3
        for _ in range(6):  # a port scan: connect, close
            socket.create_connection(("127.0.0.1", worker_port), timeout=5).close()
        public, secret = zmq.curve_keypair()
        stranger = CurveKeys(server_public=CurveKeys.for_client(keys).server_public, client_public=public,
                             client_secret=secret)
        ctx: zmq.Context[Any] = zmq.Context()
        for curve in (stranger, None):  # a wrong key, and plain ZeroMQ
            sock = make_socket(ctx, zmq.PULL, f"tcp://127.0.0.1:{worker_port}", bind=False, curve=curve)
            time.sleep(1.0)
            sock.close(linger=0)
        ctx.term()
        time.sleep(1.0)
        assert [complete() for _ in range(3)] == [200, 200, 200]
        assert http_status(f"{url}/health") == 200
        scheduler_log = (tmp_path / "scheduler.log").read_text()
        assert "connection dropped" not in scheduler_log and "refused a connection on the worker port" in scheduler_log
    finally:
        stop_processes(procs, timeout=20)
        for f in logs:
            f.close()
