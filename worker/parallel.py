"""The tensor-parallel group: k worker ranks that hold one model between them (torch.distributed).

Rank 0 hosts the rendezvous (a ``TCPStore`` on ``--tp-master``, bound to that address only); the
other ranks connect to it within ``--tp-timeout`` seconds or stop with an error naming it. Then
each rank opens its collectives: gloo on a CPU, NCCL for the tensors on CUDA (with a gloo group
beside it for the host-side messages below). Every peer-to-peer socket is bound to the address
this rank reaches the master from, never to every interface.

What crosses the group:

* the all-reduces of the row-parallel projections (``all_reduce``) and the vocabulary-parallel
  embedding, and the gather of the vocabulary shards' logits to rank 0 (``gather_columns``);
* each step's sampled ids, from rank 0 (the only rank that samples) to the others
  (``broadcast_tokens``): their next step's input;
* the commands rank 0 reads from the scheduler, relayed in the order and at the step boundary
  where rank 0 acts on them (``relay`` / ``receive``): every rank applies each plan once and
  each cancel at the same step. While idle, rank 0 relays an empty list every
  ``KEEPALIVE_S``, so a peer's collective never waits long for nothing and a rank that died
  is noticed within a second.

A peer that exits breaks the group. Over gloo the next collective raises on every other rank
(its sockets close), whose worker then fails like a crashed one (``sluice serve`` restarts the
whole group). NCCL never raises on a lost peer: a collective that waits for a dead rank spins on
the device, and the host blocks at its next wait for the step's ids. What ends that is NCCL's
watchdog: with ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` 1 it aborts the communicator and tears the
process down once a collective has waited longer than its timeout, so the collectives' timeout is
how long a dead peer goes unnoticed. It is ``STARTUP_COLLECTIVE_TIMEOUT_S`` while the ranks load
(each reads its own shard at its own pace), then, once the group serves (``serving``),
``NCCL_COLLECTIVE_TIMEOUT_S`` for the NCCL group and ``COLLECTIVE_TIMEOUT_S`` for gloo's, which
raises at once on a closed peer and times out only on a hung one. A peer that hangs is also the
scheduler's to find: its plan in flight makes no progress (``scheduler.workers.PlanClock``,
seconds for a decode step), and it kills every rank of the group; the timeouts are the backstop
where it cannot (ranks on other machines).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import struct
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from protocol.config import ConfigError

log = logging.getLogger("sluice.worker")

KEEPALIVE_S = 1.0
# Until the group serves, a collective may wait for a rank still loading its shard (each reads
# its own files at its own pace) or warming up.
STARTUP_COLLECTIVE_TIMEOUT_S = 300.0
# Then one collective waits only for what another rank does between two collectives: its part of
# a layer (the ranks compute the same layers side by side, so a long prefill makes each wait no
# longer: its work is split over the same collectives), rank 0's sampling and prompt scoring
# while the others wait for the sampled ids, or rank 0's command relay (at least every
# KEEPALIVE_S while idle). Seconds at most; six times the scheduler's 5 s hang floor, so the
# scheduler, which kills the whole group at once, normally acts first.
COLLECTIVE_TIMEOUT_S = 30.0
# NCCL's timeout runs from when the host enqueues a collective to when the device completes it,
# so it also covers the device's queue ahead of it: at most about two steps, as the host runs one
# step ahead (the warm-up compiled the attention kernels, so no step compiles while serving).
# Ten seconds is many times a step and short enough that a rank that died is noticed in seconds:
# NCCL has no other way to notice one on the same machine.
NCCL_COLLECTIVE_TIMEOUT_S = 10.0
# NCCL: a collective past its timeout has the watchdog abort the communicator and end the process
# ("tear down"): the scheduler sees the rank's link drop and the group is restarted. (0 would
# leave the stream stuck on the device; blocking wait would make every all-reduce wait on the host;
# torch's default, 3, tears down without aborting the communicator first.)
NCCL_ASYNC_ERROR_HANDLING = "1"


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) -> (host, port); a ``ConfigError`` naming the flag if malformed."""
    host, sep, port = address.removeprefix("tcp://").rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--tp-master must be HOST:PORT (such as 127.0.0.1:29500), got {address!r}")
    return host, int(port)


def local_address_towards(host: str, port: int) -> str:
    """The address of this machine's interface that reaches ``host`` (no packet is sent): the
    one a rank's peers can connect back to."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return str(probe.getsockname()[0])


class TensorParallelGroup:
    def __init__(self, rank: int, size: int, device: torch.device, master: str, timeout_s: float) -> None:
        if not 0 <= rank < size:
            raise ConfigError(f"--tp-rank {rank} is not in 0..{size - 1} (--tensor-parallel-size {size})")
        self.rank, self.size = rank, size
        host, port = split_address(master)
        self.master = f"{host}:{port}"
        rendezvous = datetime.timedelta(seconds=timeout_s)
        try:
            listener = self._listen(host, port) if rank == 0 else None
            self.store = dist.TCPStore(host, port, size, rank == 0, timeout=rendezvous, wait_for_workers=True,
                                       master_listen_fd=listener)
        except (RuntimeError, OSError) as e:
            why = " ".join(str(e).split())[:300]
            what = ("not every rank reached it" if rank == 0 else "cannot reach it")
            raise ConfigError(f"tensor-parallel rank {rank} of {size}: rendezvous at tcp://{self.master} failed "
                              f"within {timeout_s:g} s (--tp-timeout): {what} ({why})") from None
        own = local_address_towards(host, port)
        # The constructor that takes devices (so the links bind where we say) has no public options type.
        options: Any = getattr(dist.ProcessGroupGloo, "_Options")()  # noqa: B009
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=own)]
        options._timeout = datetime.timedelta(seconds=STARTUP_COLLECTIVE_TIMEOUT_S)
        self.control: Any = dist.ProcessGroupGloo(dist.PrefixStore("control", self.store), rank, size, options)
        self.tensors: Any = self.control
        if device.type == "cuda" and torch.cuda.is_available():
            # Read when the process group is made; a value the user set is kept.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", NCCL_ASYNC_ERROR_HANDLING)
            nccl_options = dist.ProcessGroupNCCL.Options()
            nccl_options._timeout = datetime.timedelta(seconds=STARTUP_COLLECTIVE_TIMEOUT_S)
            self.tensors = dist.ProcessGroupNCCL(dist.PrefixStore("tensors", self.store), rank, size, nccl_options)
        self._root = dist.BroadcastOptions()
        self._root.rootRank = 0
        self._to_root = dist.GatherOptions()
        self._to_root.rootRank = 0
        log.info("tensor-parallel rank %d of %d: joined at tcp://%s (this rank on %s, %s)", rank, size, self.master,
                 own, "NCCL + gloo" if device.type == "cuda" else "gloo")

    @staticmethod
    def _listen(host: str, port: int) -> int:
        """The rendezvous socket, bound to ``host`` alone (torch's store would bind every interface)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted group binds it again at once
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            raise ConfigError(f"tensor-parallel rank 0 cannot listen on tcp://{host}:{port} (--tp-master): "
                              f"{e.strerror or e}") from None
        sock.listen(128)
        return sock.detach()

    def serving(self) -> None:
        """Loaded and warmed up, about to serve: collectives get their short timeout from now on
        (``NCCL_COLLECTIVE_TIMEOUT_S`` for the NCCL group, ``COLLECTIVE_TIMEOUT_S`` for gloo's)."""
        for group, seconds in self.serving_timeouts():
            setter = getattr(group, "set_timeout", None) or getattr(group, "_set_default_timeout", None)
            if setter is None:
                log.warning("tensor-parallel rank %d: %s has no way to shorten its collectives' timeout; it stays "
                            "%g s", self.rank, type(group).__name__, STARTUP_COLLECTIVE_TIMEOUT_S)
                continue
            setter(datetime.timedelta(seconds=seconds))

    def serving_timeouts(self) -> list[tuple[Any, float]]:
        """Each process group once, with the timeout its collectives get once the group serves."""
        if self.tensors is self.control:
            return [(self.control, COLLECTIVE_TIMEOUT_S)]
        return [(self.control, COLLECTIVE_TIMEOUT_S), (self.tensors, NCCL_COLLECTIVE_TIMEOUT_S)]

    # ------------------------------------------------------------------ the model's collectives

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place."""
        self.tensors.allreduce([x]).wait()
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``x`` [n, c], side by side ([n, k*c]) on rank 0; None on the others."""
        x = x.contiguous()
        parts = [[torch.empty_like(x) for _ in range(self.size)]] if self.rank == 0 else []
        self.tensors.gather(parts, [x], self._to_root).wait()
        return torch.cat(parts[0], dim=1) if self.rank == 0 else None

    def broadcast_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``ids`` on every rank, in place."""
        self.tensors.broadcast([ids], self._root).wait()
        return ids

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value`` (the KV blocks every rank can hold)."""
        t = torch.tensor([value], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]
        self.control.allreduce([t], options).wait()
        return int(t.item())

    def check_same(self, what: dict[str, str]) -> None:
        """Every rank must have been started alike (model, dtype, ...): rank 0's values win, and a
        rank that differs stops with an error naming each difference."""
        theirs = self.relay_bytes(msgspec.json.encode(what) if self.rank == 0 else None)
        if self.rank == 0:
            return
        rank0 = msgspec.json.decode(theirs, type=dict[str, str])
        differ = [f"{key} {value!r} (rank 0: {rank0.get(key)!r})" for key, value in what.items()
                  if rank0.get(key) != value]
        if differ:
            raise ConfigError(f"tensor-parallel rank {self.rank} was started unlike rank 0 at tcp://{self.master}: "
                              + "; ".join(differ))

    # ------------------------------------------------------------------ the command relay

    def relay_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank (the others pass None). Host tensors over the gloo
        group, on CUDA too: reading their size never waits for the device."""
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        self.control.broadcast([size], self._root).wait()
        n = int(size.item())
        if not n:
            return b""
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None else torch.empty(n, dtype=torch.uint8)
        self.control.broadcast([buf], self._root).wait()
        return data if data is not None else buf.numpy().tobytes()

    def relay(self, frames: list[bytes]) -> None:
        """Rank 0: hand the others the command frames it is about to act on (may be none)."""
        self.relay_bytes(b"".join(struct.pack("<I", len(f)) + f for f in frames) if frames else None)

    def receive(self) -> list[bytes]:
        """Ranks 1..k-1: the frames rank 0 relayed at this point (an empty list: nothing new)."""
        data, frames, at = self.relay_bytes(None), [], 0
        while at < len(data):
            (n,) = struct.unpack_from("<I", data, at)
            frames.append(data[at + 4 : at + 4 + n])
            at += 4 + n
        return frames

    def close(self) -> None:
        for group in {id(self.control): self.control, id(self.tensors): self.tensors}.values():
            with contextlib.suppress(Exception):
                group.shutdown()
