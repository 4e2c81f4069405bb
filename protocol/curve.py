"""CurveZMQ on the links between the components: encrypted, and only known peers get a message in.

The scheduler binds every socket, so it is the CURVE server; frontends and workers are clients.
``sluice keys DIR`` writes, with pyzmq's own certificate files:

    DIR/scheduler.key, DIR/scheduler.key_secret   the scheduler's key pair
    DIR/client.key, DIR/client.key_secret          the pair frontends and workers present
    DIR/authorized/client.key                      public keys the scheduler lets in
    DIR/client/                                    what a frontend or worker needs, and no more:
                                                   scheduler.key and the client pair

``--curve-keys`` (``SLUICE_CURVE_KEYS``) names the directory a component reads what its role needs
from: the scheduler DIR (its secret key and ``authorized/``); a frontend or worker DIR, or better
DIR/client, which holds no secret of the scheduler's (hosts that face clients get only that).

A connection whose client key is not in ``authorized/`` is refused during the handshake (ZeroMQ's
ZAP authenticator, run in a thread of the scheduler's context), so no frame of it reaches the
scheduler's loop.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import shutil
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

SERVER = "scheduler"
CLIENT = "client"
AUTHORIZED = "authorized"
CLIENT_ONLY = "client"


class CurveKeyError(ValueError):
    """A keys directory lacks a file its role needs; the message names it."""


@dataclasses.dataclass(frozen=True)
class CurveKeys:
    server_public: bytes
    server_secret: bytes | None = None  # the scheduler's role only
    client_public: bytes | None = None  # a frontend's or worker's role only
    client_secret: bytes | None = None
    authorized_dir: Path | None = None  # the scheduler's role only

    @classmethod
    def load(cls, directory: str | Path | None, *, server: bool) -> CurveKeys | None:
        """The keys a role needs from a ``--curve-keys`` directory; None without one."""
        if directory is None:
            return None
        return cls.for_server(directory) if server else cls.for_client(directory)

    @classmethod
    def for_server(cls, directory: str | Path) -> CurveKeys:
        d = Path(directory)
        public, secret = _load(d / f"{SERVER}.key_secret")
        if not (d / AUTHORIZED).is_dir():
            raise CurveKeyError(f"{d / AUTHORIZED}: no such directory of authorized client keys "
                                "(sluice keys DIR writes it)")
        return cls(server_public=public, server_secret=secret, authorized_dir=d / AUTHORIZED)

    @classmethod
    def for_client(cls, directory: str | Path) -> CurveKeys:
        d = Path(directory)
        server_public, _ = _load(d / f"{SERVER}.key")
        public, secret = _load(d / f"{CLIENT}.key_secret")
        return cls(server_public=server_public, client_public=public, client_secret=secret)

    def apply(self, sock: zmq.Socket[Any], *, server: bool) -> None:
        """Set the socket's CURVE options for its side; before it binds or connects."""
        if server:
            if self.server_secret is None:
                raise CurveKeyError("these keys were loaded for a client, not for the scheduler")
            sock.curve_server = True
            sock.curve_secretkey = self.server_secret
            sock.curve_publickey = self.server_public
        else:
            if self.client_secret is None or self.client_public is None:
                raise CurveKeyError("these keys were loaded for the scheduler, not for a client")
            sock.curve_serverkey = self.server_public
            sock.curve_publickey = self.client_public
            sock.curve_secretkey = self.client_secret


def _load(path: Path) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise CurveKeyError(f"{path}: no such key file (sluice keys DIR writes it)")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (ValueError, OSError) as e:
        raise CurveKeyError(f"{path}: not a ZeroMQ certificate ({e})") from None
    if path.name.endswith("_secret") and secret is None:
        raise CurveKeyError(f"{path}: holds no secret key")
    return public, secret


def write_keys(directory: str | Path) -> list[Path]:
    """Create the directory's key pairs (new ones; an existing directory's keys are replaced) and
    return the files written. Secret key files are readable by their owner only, from creation."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    written = []
    previous = os.umask(0o077)  # no moment in which another user could read a secret
    try:
        for name in (SERVER, CLIENT):
            public, secret = zmq.auth.create_certificates(d, name)
            Path(public).chmod(0o644)
            written += [Path(public), Path(secret)]
        for subdir, files in ((AUTHORIZED, [f"{CLIENT}.key"]),
                              (CLIENT_ONLY, [f"{SERVER}.key", f"{CLIENT}.key", f"{CLIENT}.key_secret"])):
            (d / subdir).mkdir(exist_ok=True)
            (d / subdir).chmod(0o755 if subdir == AUTHORIZED else 0o700)
            written += [Path(shutil.copy(d / f, d / subdir / f)) for f in files]
    finally:
        os.umask(previous)
    return written


def start_authenticator(ctx: zmq.Context[Any], keys: CurveKeys) -> ThreadAuthenticator:
    """The ZAP handler that admits only ``authorized/``'s client keys; start it before binding."""
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(keys.authorized_dir))
    return auth


def is_loopback(address: str) -> bool:
    """Whether a ZeroMQ address stays on this machine: ipc://, inproc://, or tcp on a loopback
    host. ``tcp://0.0.0.0`` (every interface) and host names other than localhost are not."""
    if not address.startswith("tcp://"):
        return address.startswith(("ipc://", "inproc://"))
    host = address[len("tcp://"):].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
