"""Tensor parallelism through the real server: ``--tensor-parallel-size 2`` runs two worker ranks
(gloo, two CPU processes) that hold half of each layer and half of the vocabulary each, and
greedy text equals transformers' on the same checkpoint; a rank killed mid-stream takes its group
down and the restarted group continues every stream; ranks started separately over tcp:// serve
as ``sluice serve`` does; a size the model cannot be split by, a rendezvous nobody comes to, and
ranks started unlike each other are start-up errors that say so."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from checkpoints import hf_greedy, hf_prompt_logprobs, save_llama_checkpoint
from sluice_server import SluiceServer, child_pid, free_port, running_servers, stop_processes
from test_components_tcp import _free_port_block
from test_serve_worker_crash import Stream, complete, wait_until

from protocol.config import WorkerConfig

AUTH = {"Authorization": "Bearer t"}
PROMPTS = [[1, 5, 9, 33, 70, 12], [1, *range(100, 140)], [1, 200, 3, 4]]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def kv2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 query heads, 2 KV heads: each rank holds 2 and 1."""
    return save_llama_checkpoint(tmp_path_factory.mktemp("tp") / "kv2")


@pytest.fixture(scope="module")
def kv1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One KV head (replicated on both ranks), tied embeddings and an odd vocabulary (the second
    rank's shard padded)."""
    return save_llama_checkpoint(tmp_path_factory.mktemp("tp") / "kv1", num_key_value_heads=1,
                                 tie_word_embeddings=True, vocab_size=321)


@pytest.fixture(scope="module")
def servers(kv2: Path, kv1: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SluiceServer]]:
    """Two ranks on kv2, one worker on kv2 (the same flags otherwise), two ranks on kv1: side by side."""
    # A small token budget: prompts prefill in chunks, beside other rows' decodes.
    chunked = ("--max-num-batched-tokens", "16", "--max-model-len", "512")
    flags = {"tp": ("--model", str(kv2), "--tensor-parallel-size", "2", "--admin-token", "t", *chunked),
             "one": ("--model", str(kv2), *chunked),
             "kv1": ("--model", str(kv1), "--tensor-parallel-size", "2", "--max-model-len", "512")}
    with running_servers(*flags.values(), log_dir=tmp_path_factory.mktemp("tp-serve")) as started:
        yield dict(zip(flags, started, strict=True))


@pytest.fixture(scope="module")
def server(servers: dict[str, SluiceServer]) -> SluiceServer:
    return servers["tp"]


async def _generate(url: str, prompt: list[int]) -> list[int]:
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    async with httpx.AsyncClient(timeout=120) as client:
        r = await client.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    ids: list[int] = r.json()["choices"][0]["token_ids"]
    return ids


async def _all_at_once(url: str) -> list[list[int]]:
    return list(await asyncio.gather(*(_generate(url, p) for p in PROMPTS)))


def test_two_ranks_generate_what_one_worker_and_transformers_generate(servers: dict[str, SluiceServer],
                                                                        kv2: Path) -> None:
    server = servers["tp"]
    want = hf_greedy(kv2, PROMPTS, NEW_TOKENS)
    for prompt, expected in zip(PROMPTS, want, strict=True):
        assert asyncio.run(_generate(server.url, prompt)) == expected
    assert asyncio.run(_all_at_once(server.url)) == want
    assert asyncio.run(_all_at_once(servers["one"].url)) == want
    log = server.log()
    assert "rank 0 of 2: heads 0-1 of 4, KV heads 0-0 of 2" in log and "rank 1 of 2: heads 2-3 of 4" in log
    memory = httpx.get(f"{server.url}/admin/stats", headers=AUTH).json()["process_memory"]
    assert {"worker 0", "worker 1"} <= set(memory), memory  # each rank reports its own


def test_two_ranks_score_an_echoed_prompt_as_transformers_does(server: SluiceServer, kv2: Path) -> None:
    prompt = PROMPTS[1]  # 41 tokens: three chunks of the 16-token budget, every rank computing its part
    body = {"prompt": prompt, "max_tokens": 1, "logprobs": 2, "echo": True, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    want, want_top = hf_prompt_logprobs(kv2, prompt, 2)
    assert lp["token_logprobs"][1 : len(prompt)] == pytest.approx(want, abs=1e-4)
    for top, values in zip(lp["top_logprobs"][1 : len(prompt)], want_top, strict=True):
        assert sorted(top.values(), reverse=True)[:2] == pytest.approx(values, abs=1e-4)  # (and the token itself)


def test_one_replicated_kv_head_and_a_padded_vocabulary(servers: dict[str, SluiceServer], kv1: Path) -> None:
    s = servers["kv1"]
    assert asyncio.run(_all_at_once(s.url)) == hf_greedy(kv1, PROMPTS, NEW_TOKENS)
    assert "KV head 0 (replicated: 1 KV heads for 2 ranks)" in s.log()


def _rank_pid(server: SluiceServer, rank: int) -> int:
    return child_pid(server, b"worker", f'"rank":{rank},'.encode())


def test_a_killed_rank_restarts_the_group_and_streams_continue(server: SluiceServer) -> None:
    prompt = [1, *((5 * j) % 250 + 3 for j in range(20))]
    want = complete(server.url, prompt, 480)
    stream = Stream(server.url, prompt, 480)
    wait_until(lambda: stream.tokens >= 10, 60)
    old = _rank_pid(server, 0)
    os.kill(_rank_pid(server, 1), signal.SIGKILL)
    stream.join()
    assert stream.errors == [] and stream.finish_reason == "length"
    assert stream.text == want
    assert "1 live requests will be recomputed" in server.log()  # the kill hit the stream
    assert _rank_pid(server, 0) != old  # the whole group started again
    stats = httpx.get(f"{server.url}/admin/stats", headers=AUTH).json()
    assert stats["running"] == stats["waiting"] == 0 and stats["kv_blocks_used"] == 0


def _listening(port: int) -> list[str]:
    """The local addresses a TCP socket listens on ``port`` at (IPv4, from /proc/net/tcp)."""
    found = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        host, _, hex_port = local.partition(":")
        if state == "0A" and int(hex_port, 16) == port:
            found.append(".".join(str(b) for b in reversed(bytes.fromhex(host))))
    return found


def test_ranks_started_separately_over_tcp(kv2: Path, tmp_path: Path) -> None:
    """The way two hosts run it: a scheduler, a frontend, and each rank its own ``sluice worker``
    with ``--tp-rank`` and the rendezvous address, every ZeroMQ link with CurveZMQ keys; rank 1
    starts first and waits for rank 0, whose rendezvous listens on the address given alone."""
    base, http_port, master = _free_port_block(4), free_port(), free_port()
    address = f"tcp://127.0.0.1:{base}"
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "frontend", "keys", str(keys)], check=True, capture_output=True)
    client_keys = ["--curve-keys", str(keys / "client")]
    sluice = [sys.executable, "-m", "frontend"]
    worker = [*sluice, "worker", "--address", address, *client_keys, "--model", str(kv2), "--dtype", "float32",
              "--num-kv-blocks", "64", "--max-model-len", "512", "--tensor-parallel-size", "2",
              "--tp-master", f"127.0.0.1:{master}"]
    # The scheduler is not told the group's size: the ranks announce it.
    commands = [[*sluice, "scheduler", "--address", address, "--curve-keys", str(keys)],
                [*sluice, "frontend", "--address", address, *client_keys, "--port", str(http_port)],
                [*worker, "--tp-rank", "1"], [*worker, "--tp-rank", "0"]]
    logs = [open(tmp_path / f"{i}.log", "wb") for i in range(len(commands))]  # noqa: SIM115
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for command, log in zip(commands, logs, strict=True):
            procs.append(subprocess.Popen(command, stdout=log, stderr=log))
        url = f"http://127.0.0.1:{http_port}"
        wait_until(lambda: _status(f"{url}/ready") == 200, 120)
        assert asyncio.run(_generate(url, PROMPTS[1])) == hf_greedy(kv2, PROMPTS[1:2], NEW_TOKENS)[0]
        rank0 = (tmp_path / "3.log").read_text()
        assert f"joined at tcp://127.0.0.1:{master} (this rank on 127.0.0.1" in rank0
        assert _listening(master) == ["127.0.0.1"]  # never every interface
    finally:
        stop_processes(procs)
        for log in logs:
            log.close()


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return None


def test_a_size_that_does_not_split_the_heads_is_a_start_up_error(kv2: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "frontend", "serve", "--model", str(kv2), "--port", str(free_port()),
                        "--tensor-parallel-size", "3"], capture_output=True, text=True, timeout=180)
    assert r.returncode == 1
    assert "--tensor-parallel-size 3 does not divide the model's 4 attention heads" in r.stderr, r.stderr[-3000:]


def _worker(kv2: Path, rank: int, master: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "frontend", "worker", "--address", f"ipc:///tmp/sluice-tp-{master}",
            "--model", str(kv2), "--num-kv-blocks", "16", "--max-model-len", "512", "--tensor-parallel-size", "2",
            "--tp-rank", str(rank), "--tp-master", f"127.0.0.1:{master}", *flags]


def test_a_rank_nobody_meets_stops_naming_the_rendezvous(kv2: Path) -> None:
    master = free_port()
    began = time.monotonic()
    r = subprocess.run(_worker(kv2, 1, master, "--tp-timeout", "3"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert f"rendezvous at tcp://127.0.0.1:{master} failed within 3 s (--tp-timeout)" in r.stderr, r.stderr[-3000:]
    assert time.monotonic() - began < 60


def test_ranks_started_unlike_each_other_stop_with_the_difference(kv2: Path) -> None:
    master = free_port()
    procs = [subprocess.Popen(_worker(kv2, 0, master, "--dtype", "float32"), stderr=subprocess.PIPE, text=True),
             subprocess.Popen(_worker(kv2, 1, master, "--dtype", "bfloat16"), stderr=subprocess.PIPE, text=True)]
    try:
        errors = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        stop_processes(procs)  # type: ignore[arg-type]
    assert procs[1].returncode == 1 and procs[0].returncode == 1
    assert "dtype 'bfloat16' (rank 0: 'float32')" in errors[1], errors[1][-3000:]


def test_a_rendezvous_off_this_machine_needs_insecure_tp(kv2: Path) -> None:
    """torch.distributed's links have no keys: a rank on a network address is refused unless the
    user says the network is private (before, anyone reaching the port first could take a rank)."""
    command = [*_worker(kv2, 1, 29500), "--tp-master", "10.255.0.1:29500"]
    r = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "--insecure-tp" in r.stderr and "10.255.0.1:29500" in r.stderr, r.stderr[-3000:]
    config = WorkerConfig(tensor_parallel_size=2, tp_master="10.255.0.1:29500", insecure_tp=True)
    assert config.insecure_tp  # said explicitly: accepted
    assert WorkerConfig(tensor_parallel_size=2, tp_master="localhost:29500").tp_master == "localhost:29500"
