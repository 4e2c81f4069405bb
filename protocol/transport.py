"""ZeroMQ socket owners with typed msgspec (msgpack) codecs.

The scheduler binds every socket; frontend and workers connect. That makes the scheduler's
address the only one a deployment must know, and lets workers and frontends come and go.

``Endpoints.from_base`` derives the four addresses from one base: ``tcp://host:PORT`` gives
ports PORT..PORT+3, ``ipc:///path/name`` gives ``name-0`` .. ``name-3``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio

from protocol.curve import CurveKeys
from protocol.messages import FrontendMessage, SchedulerMessage, WorkerCommand, WorkerMessage

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Endpoints:
    frontend_to_scheduler: str
    scheduler_to_frontend: str
    worker_to_scheduler: str
    scheduler_to_worker: str

    @classmethod
    def from_base(cls, base: str) -> Endpoints:
        if base.startswith("tcp://"):
            host, _, port = base[len("tcp://") :].rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"tcp address must look like tcp://host:port, got {base!r}")
            p = int(port)
            return cls(*(f"tcp://{host}:{p + i}" for i in range(4)))
        if base.startswith("ipc://"):
            return cls(*(f"{base}-{i}" for i in range(4)))
        raise ValueError(f"scheduler address must start with tcp:// or ipc://, got {base!r}")


class Codec(Generic[T]):
    """A msgpack encoder plus a decoder typed to one union of messages."""

    def __init__(self, decode_type: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(decode_type)

    def encode(self, msg: object) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, data: bytes | memoryview) -> T:
        return self._decoder.decode(data)


def frontend_identity(epoch: int) -> bytes:
    """A frontend's routing id on the scheduler's ROUTER sockets."""
    return b"frontend-%08x" % epoch


def frontend_codec() -> Codec[SchedulerMessage]:
    """What the frontend decodes: scheduler messages."""
    return Codec(SchedulerMessage)


def scheduler_frontend_codec() -> Codec[FrontendMessage]:
    return Codec(FrontendMessage)


def scheduler_worker_codec() -> Codec[WorkerMessage]:
    return Codec(WorkerMessage)


def worker_codec() -> Codec[WorkerCommand]:
    return Codec(WorkerCommand)


def make_socket(ctx: zmq.Context[Any], kind: int, address: str, *, bind: bool | None,
                identity: bytes | None = None, curve: CurveKeys | None = None) -> zmq.Socket[Any]:
    """A socket with the options every Sluice link wants: no linger at close (peers acknowledge
    what matters instead), unbounded queues (back-pressure is the scheduler's job, not ZMQ's).

    The frontend link is DEALER (each frontend, ``identity`` = its epoch) to ROUTER (the
    scheduler) both ways: the scheduler learns who sent each message and answers that frontend
    alone, and a send to a frontend that is gone fails at once (``ROUTER_MANDATORY``) instead of
    queueing for nobody; a frontend that reconnects takes its id back (``ROUTER_HANDOVER``).

    ``bind=None`` neither binds nor connects: the caller attaches a monitor first, so that no
    connection event can happen before anyone listens for it, then connects.

    ``curve``: CurveZMQ keys; the side that binds is the CURVE server, the other a client."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    # A peer that is not there yet (components start in any order) is retried from 100 ms,
    # doubling to at most 2 s: quick to find a restarted peer, no busy loop against a missing one.
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A frontend that reconnects (a tcp link that dropped) comes back with its routing id:
        # the new connection takes it over. Without this, the id stayed with the dead connection
        # and every later send to that frontend failed as unreachable, for good.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    if curve is not None:
        curve.apply(sock, server=bind is True)
    if bind:
        sock.bind(address)
    elif bind is not None:
        sock.connect(address)
    return sock
