"""The tensor-parallel group's collectives and their timeouts, over gloo on the CPU.

Over gloo a peer whose process ends is noticed by the next collective at once, and a peer that
stays silent once the group serves is noticed when the short serving timeout passes (shortened
here so the test takes a second). On CUDA the tensors travel over NCCL, which never notices a
lost peer by itself: the serving timeout set on the NCCL group, with the watchdog's async error
handling, is what ends the wait; its GPU-only test runs a one-rank NCCL group.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from worker import parallel
from worker.parallel import (
    COLLECTIVE_TIMEOUT_S,
    NCCL_COLLECTIVE_TIMEOUT_S,
    STARTUP_COLLECTIVE_TIMEOUT_S,
    TensorParallelGroup,
)

CPU = torch.device("cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pair() -> list[TensorParallelGroup]:
    """Ranks 0 and 1 of a fresh group (each rank's constructor waits for the other)."""
    master = f"127.0.0.1:{_free_port()}"
    groups: dict[int, TensorParallelGroup] = {}
    threads = [threading.Thread(target=lambda r=r: groups.__setitem__(r, TensorParallelGroup(r, 2, CPU, master, 10)))
               for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return [groups[0], groups[1]]


def _both(rank0: Callable[[], Any], rank1: Callable[[], Any]) -> list[Any]:
    """Each rank's side of a collective, side by side (a broadcast's root waits for its receivers)."""
    results: list[Any] = [None, None]
    threads = [threading.Thread(target=lambda i=i, f=f: results.__setitem__(i, f()))
               for i, f in enumerate((rank0, rank1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


@pytest.fixture
def pair() -> Iterator[list[TensorParallelGroup]]:
    groups = _pair()
    yield groups
    for g in groups:
        g.close()


def _timeout_s(group: object) -> float:
    return float(group.options._timeout.total_seconds())  # type: ignore[attr-defined]


def test_serving_shortens_the_timeout_of_every_group(pair: list[TensorParallelGroup]) -> None:
    rank0 = pair[0]
    assert _timeout_s(rank0.control) == STARTUP_COLLECTIVE_TIMEOUT_S  # ranks still loading may be slow
    assert rank0.serving_timeouts() == [(rank0.control, COLLECTIVE_TIMEOUT_S)]  # on a CPU one gloo group
    rank0.serving()
    assert _timeout_s(rank0.control) == COLLECTIVE_TIMEOUT_S
    assert _both(lambda: rank0.relay([b"plan", b"cancel"]), pair[1].receive) == [None, [b"plan", b"cancel"]]


def test_a_peer_whose_process_ends_is_noticed_by_the_next_collective_at_once() -> None:
    master = f"127.0.0.1:{_free_port()}"
    rank1 = (f"import os, torch\n"
             f"from worker.parallel import TensorParallelGroup\n"
             f"g = TensorParallelGroup(1, 2, torch.device('cpu'), '{master}', 30)\n"
             f"g.serving()\n"
             f"assert g.receive() == [b'plan']\n"
             f"os._exit(0)\n")  # as a crash: no clean-up, its sockets closed by the kernel
    child = subprocess.Popen([sys.executable, "-c", rank1], cwd=Path(__file__).parents[1])
    group = TensorParallelGroup(0, 2, CPU, master, 30)
    try:
        group.serving()
        group.relay([b"plan"])
        assert child.wait(timeout=30) == 0
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="closed"):
            for _ in range(3):  # the first send may still fit the socket's buffer
                group.relay([b"next plan"])
        assert time.monotonic() - start < 2.0
    finally:
        group.close()
        child.kill()


def test_a_silent_peer_is_noticed_when_the_serving_timeout_passes(pair: list[TensorParallelGroup],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel, "COLLECTIVE_TIMEOUT_S", 0.5)
    for g in pair:
        g.serving()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"[Tt]imed out"):
        pair[1].receive()  # rank 0 is alive but relays nothing
    assert 0.4 < time.monotonic() - start < 5.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_nccl_group_tears_down_on_error_and_gets_the_short_timeout_once_serving() -> None:
    preset = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")  # a value the user set is kept
    group = TensorParallelGroup(0, 1, torch.device("cuda"), f"127.0.0.1:{_free_port()}", 10)
    try:
        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == (preset or parallel.NCCL_ASYNC_ERROR_HANDLING)
        assert group.tensors is not group.control and "NCCL" in type(group.tensors).__name__
        assert _timeout_s(group.tensors) == STARTUP_COLLECTIVE_TIMEOUT_S
        group.serving()
        assert _timeout_s(group.tensors) == NCCL_COLLECTIVE_TIMEOUT_S < COLLECTIVE_TIMEOUT_S
        assert _timeout_s(group.control) == COLLECTIVE_TIMEOUT_S
        x = torch.arange(4.0, device="cuda")
        torch.testing.assert_close(group.all_reduce(x).cpu(), torch.arange(4.0))
    finally:
        group.close()
