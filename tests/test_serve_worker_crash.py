"""A worker killed under ``sluice serve``: noticed at once, restarted, and every live request
recomputed from its prompt and the tokens already streamed, so streams simply continue with the
text an undisturbed run gives. Past ``--max-worker-restarts``, streams end with an error chunk."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
from sluice_server import SluiceServer, child_pid, running_servers

AUTH = {"Authorization": "Bearer t"}
SHORT = [1, *((5 * j) % 250 + 3 for j in range(20))]
LONG_PROMPT = [1, *((11 * j + 7) % 250 + 3 for j in range(700))]


def worker_pid(server: SluiceServer) -> int:
    return child_pid(server, b"worker")


def scheduler_pid(server: SluiceServer) -> int:
    return child_pid(server, b"scheduler")


class Stream:
    """A greedy streaming completion read in a thread: its text, token count and any error. ``body``
    replaces fields of the request (a None value drops one); with several choices, ``texts`` and
    ``finishes`` hold each one's by index (``text`` and ``finish_reason`` are all of them together)."""

    def __init__(self, url: str, prompt: list[int], max_tokens: int, **body: object) -> None:
        self.text, self.tokens, self.errors, self.finish_reason = "", 0, [], None
        self.texts: dict[int, str] = {}
        self.finishes: dict[int, str] = {}
        request = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                   "stream": True} | body
        request = {k: v for k, v in request.items() if v is not None}
        self._thread = threading.Thread(target=self._run, args=(url, request), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict[str, object]) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=180) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    self.errors.append(data["error"]["message"])
                    continue
                choice = data["choices"][0]
                self.text += choice["text"]
                self.texts[choice["index"]] = self.texts.get(choice["index"], "") + choice["text"]
                self.tokens += 1 if choice["text"] or choice.get("finish_reason") is None else 0
                self.finish_reason = choice.get("finish_reason") or self.finish_reason
                if choice.get("finish_reason"):
                    self.finishes[choice["index"]] = choice["finish_reason"]

    def join(self) -> None:
        self._thread.join(180)
        assert not self._thread.is_alive()


def complete(url: str, prompt: list[int], max_tokens: int) -> str:
    r = httpx.post(f"{url}/v1/completions", timeout=180,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


# The half-precision servers: each where its kernels run (else the test skips, saying why).
HALF = {"bfloat16": ("--dtype", "bfloat16"), "smollm2-quantized": ("--model", "smollm2", "--dtype", "auto")}


def _half_unsupported(name: str) -> str | None:
    from worker.kernels import cpu as cpu_kernels

    if not cpu_kernels.has_linear(cpu_kernels.load(), torch.bfloat16):
        return "no bfloat16 linear kernel here (AVX512-BF16): bfloat16 products depend on the batch"
    if name == "smollm2-quantized" and not cpu_kernels.has_quantized_linear(cpu_kernels.load()):
        return "no quantized kernel here (AVX-512 VNNI or AVX2)"
    return None


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SluiceServer]]:
    """Every server the tests below use, started side by side."""
    # A small token budget: the long prompt takes several steps to prefill.
    crash = ("--admin-token", "t", "--max-num-batched-tokens", "64")
    flags = {"crash": crash, "no-restarts": ("--max-worker-restarts", "0"), "auto": ("--dtype", "auto"),
             "speculative": (*crash, "--speculative", "ngram")}
    flags |= {name: (*half, *crash) for name, half in HALF.items() if _half_unsupported(name) is None}
    with running_servers(*flags.values(), log_dir=tmp_path_factory.mktemp("crash")) as started:
        yield dict(zip(flags, started, strict=True))


@pytest.fixture(scope="module")
def server(servers: dict[str, SluiceServer]) -> SluiceServer:
    return servers["crash"]


def wait_until(predicate, timeout: float) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout} s")


# "speculative": a worker killed in the middle of windows that verify proposals (the tiny model
# repeats itself, so they are accepted), whose accepted tokens the scheduler counts as computed
# only from the next step on.
@pytest.mark.parametrize("name", ["crash", "speculative"])
def test_killed_worker_is_restarted_and_streams_continue_with_the_undisturbed_text(
        servers: dict[str, SluiceServer], name: str) -> None:
    server = servers[name]
    url = server.url
    want_decode = complete(url, SHORT, 1500)
    want_prefill = complete(url, LONG_PROMPT, 16)
    httpx.post(f"{url}/admin/prefix-cache/reset", headers=AUTH)  # the prompts are prefilled afresh
    decoding = Stream(url, SHORT, 1500)
    wait_until(lambda: decoding.tokens >= 20, 60)
    prefilling = Stream(url, LONG_PROMPT, 16)  # 700 tokens at 64 a step: killed mid-prefill

    def live() -> list[dict]:
        return list(httpx.get(f"{url}/admin/requests", headers=AUTH).json()["data"])

    def mid_prefill() -> bool:
        return any(0 < r["computed_tokens"] < r["prompt_tokens"] for r in live())

    wait_until(mid_prefill, 30)
    os.kill(worker_pid(server), signal.SIGKILL)
    assert len(live()) == 2  # one decoding, one mid-prefill, both lost with the worker
    noticed = wait_until(lambda: httpx.get(f"{url}/health").status_code == 503, 5)
    health = httpx.get(f"{url}/health").json()
    assert noticed < 1.0, f"/health turned 503 only after {noticed:.2f} s"
    assert "worker lost" in health["reason"], health
    decoding.join()
    prefilling.join()
    assert decoding.errors == [] and prefilling.errors == []
    assert decoding.finish_reason == prefilling.finish_reason == "length"
    assert decoding.text == want_decode
    assert prefilling.text == want_prefill
    assert httpx.get(f"{url}/health").status_code == 200
    stats = httpx.get(f"{url}/admin/stats", headers=AUTH).json()
    assert stats["running"] == stats["waiting"] == 0 and stats["kv_blocks_used"] == 0
    assert (stats["spec_accepted_tokens"] > 0) == (name == "speculative")


def test_past_the_restart_limit_streams_end_with_an_error_naming_the_cause(
        servers: dict[str, SluiceServer]) -> None:
    server = servers["no-restarts"]
    stream = Stream(server.url, SHORT, 2000)
    wait_until(lambda: stream.tokens >= 5, 60)
    os.kill(worker_pid(server), signal.SIGKILL)
    stream.join()
    assert stream.errors and "max-worker-restarts 0" in stream.errors[-1], stream.errors
    reason = httpx.get(f"{server.url}/health").json()["reason"]
    assert "max-worker-restarts" in reason


def test_killed_scheduler_ends_open_streams_with_an_error_and_serving_resumes(server: SluiceServer) -> None:
    url = server.url
    stream = Stream(url, SHORT, 5000)
    wait_until(lambda: stream.tokens >= 5, 60)
    old = scheduler_pid(server)
    os.kill(old, signal.SIGKILL)
    started = time.monotonic()
    stream.join()
    assert time.monotonic() - started < 10, "the open stream ended within a few seconds"
    assert stream.errors and "scheduler" in stream.errors[-1], stream.errors
    wait_until(lambda: httpx.get(f"{url}/ready").status_code == 200, 60)
    assert scheduler_pid(server) != old  # sluice serve started a new one
    assert complete(url, SHORT, 8) == complete(url, SHORT, 8)


def test_streams_ended_by_a_scheduler_restart_leave_nothing_running(server: SluiceServer) -> None:
    # Requests sent in the moment after the kill may reach the new scheduler before the frontend
    # learns of it; the streams it then ends must not go on computing there for nobody.
    url = server.url
    os.kill(scheduler_pid(server), signal.SIGKILL)
    ended: list[tuple[str, bool]] = []

    def burst() -> None:
        body = {"prompt": SHORT, "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=180) as r:
            if r.status_code != 200:
                return
            lines = list(r.iter_lines())
            ended.append((r.headers["X-Request-Id"], any('"error"' in line for line in lines)))

    threads = []
    for _ in range(20):
        threads.append(threading.Thread(target=burst, daemon=True))
        threads[-1].start()
        time.sleep(0.075)
    wait_until(lambda: httpx.get(f"{url}/ready").status_code == 200, 60)
    time.sleep(3)  # a leaked request would be running now
    live = {r["id"] for r in httpx.get(f"{url}/admin/requests", headers=AUTH).json()["data"]}
    errored = {request_id for request_id, error in ended if error}
    assert not errored & live, f"ended with an error yet still running: {errored & live}"
    for request_id in live:
        httpx.post(f"{url}/admin/requests/{request_id}/abort", headers=AUTH)
    for t in threads:
        t.join(60)


def test_a_worker_restarted_on_a_busy_machine_keeps_its_engines_dtype(
        servers: dict[str, SluiceServer]) -> None:
    # --dtype auto was once decided by timing two matmuls at start-up: under load the timing is
    # noise, and a worker restarted after a crash came back as float32 where the first ran
    # bfloat16, so the streams it recomputed went on in another precision. Now the hardware decides.
    from worker.model.cpu_matmul import choose_dtype

    want = str(choose_dtype().dtype).removeprefix("torch.")
    server = servers["auto"]
    url = server.url

    def dtype() -> str:
        return str(httpx.get(f"{url}/v1/models").json()["data"][0]["dtype"])

    assert dtype() == want
    before = complete(url, SHORT, 24)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        old = worker_pid(server)
        os.kill(old, signal.SIGKILL)
        wait_until(lambda: httpx.get(f"{url}/health").status_code == 503, 10)
        wait_until(lambda: httpx.get(f"{url}/health").status_code == 200, 120)  # loaded while the cores are busy
        assert worker_pid(server) != old
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert dtype() == want
    assert complete(url, SHORT, 24) == before  # the same precision: the same greedy text
    assert f"dtype: {want} (auto: " in server.log()


@pytest.mark.parametrize("name", list(HALF))
def test_a_half_precision_stream_recomputed_after_a_restart_continues_with_the_undisturbed_text(
        servers: dict[str, SluiceServer], name: str) -> None:
    # The recompute prefills the prompt and the tokens so far in one chunk. When prefill chunks
    # went through a masked SDPA that rounds differently from the decode kernel, greedy text in
    # bfloat16 parted from the undisturbed run after the restart. Every kernel now computes a
    # token's row the same way whatever the step's shape, so it continues exactly: in bfloat16,
    # and with the weights kept quantized (each row's activations quantized on their own).
    unsupported = _half_unsupported(name)
    if unsupported is not None:
        pytest.skip(unsupported)
    server = servers[name]
    url = server.url
    want_decode = complete(url, SHORT, 1200)
    want_prefill = complete(url, LONG_PROMPT, 16)
    httpx.post(f"{url}/admin/prefix-cache/reset", headers=AUTH)
    decoding = Stream(url, SHORT, 1200)
    wait_until(lambda: decoding.tokens >= 300, 60)
    prefilling = Stream(url, LONG_PROMPT, 16)
    wait_until(lambda: any(0 < r["computed_tokens"] < r["prompt_tokens"] for r in
                           httpx.get(f"{url}/admin/requests", headers=AUTH).json()["data"]), 30)
    os.kill(worker_pid(server), signal.SIGKILL)
    decoding.join()
    prefilling.join()
    assert decoding.errors == [] and prefilling.errors == []
    assert decoding.text == want_decode
    assert prefilling.text == want_prefill
