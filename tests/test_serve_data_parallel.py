"""Data parallelism through the real server: ``sluice serve --data-parallel-size 2`` runs two
engines (a scheduler and a worker each) behind one frontend. Requests spread over them by load;
prompts sharing a prefix land where it is cached; admin calls reach the engine holding the
request; a killed worker's requests continue on its restarted worker; an engine whose scheduler
hangs leaves the rotation within seconds (the other serves) and rejoins when it answers again."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from sluice_server import SluiceServer, child_pid, running_server
from test_serve_worker_crash import Stream, complete, wait_until

AUTH = {"Authorization": "Bearer t"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SluiceServer]:
    with running_server("--data-parallel-size", "2", "--admin-token", "t", "--num-kv-blocks", "256",
                        log_dir=tmp_path_factory.mktemp("dp")) as s:
        yield s


def _prompt(seed: int, n: int = 24) -> list[int]:
    return [1, *((seed * 37 + 5 * j) % 250 + 3 for j in range(n - 1))]


def _live(url: str) -> list[dict]:
    return list(httpx.get(f"{url}/admin/requests", headers=AUTH).json()["data"])


def _stats(url: str) -> dict:
    return dict(httpx.get(f"{url}/admin/stats", headers=AUTH).json())


def _component_pid(server: SluiceServer, module: bytes, engine: int) -> int:
    """The ``module`` child (scheduler or worker) of engine ``engine`` (its address ends in engineN)."""
    return child_pid(server, module, f'/engine{engine}"'.encode())


def _wait_producing(streams: list[Stream]) -> None:
    """Until every stream has had 20 tokens: counted by the clients themselves, so a slow admin
    call cannot let the streams finish unseen."""
    wait_until(lambda: all(s.tokens >= 20 for s in streams), 60)


def _kill_mid_stream(server: SluiceServer, module: bytes, prompts: list[list[int]]
                     ) -> tuple[list[Stream], list[str], list[dict]]:
    """Each prompt's undisturbed greedy text; then the prompts streamed at once (one per engine:
    routed while the server is held, so the live list is returned), and engine 1's ``module``
    killed once every stream has had 20 tokens. Returns the streams, the texts and that list.
    The process is found before the streams start: a scan of /proc on a loaded machine once took
    long enough for a stream to finish unkilled."""
    want = [complete(server.url, p, 4000) for p in prompts]
    victim = _component_pid(server, module, 1)
    with _held(server.url):
        streams = [Stream(server.url, p, 4000) for p in prompts]
        wait_until(lambda: len(_live(server.url)) == len(prompts), 60)
        live = _live(server.url)
    _wait_producing(streams)
    os.kill(victim, signal.SIGKILL)
    return streams, want, live


def _stop_all(url: str) -> None:
    for request in _live(url):
        httpx.post(f"{url}/admin/requests/{request['id']}/abort", headers=AUTH)
    wait_until(lambda: not _live(url), 30)


def _quiet(url: str) -> None:
    """Until every engine is idle as the router sees it (the loads come with pongs, every 0.5 s)."""
    wait_until(lambda: all(e.get("running", 1) + e.get("waiting", 1) == 0 for e in _stats(url)["engines"]), 30)
    time.sleep(1.0)


@contextlib.contextmanager
def _held(url: str) -> Iterator[None]:
    """The whole server paused (every engine), from idle: requests sent meanwhile wait, and stay live."""
    _quiet(url)
    assert httpx.post(f"{url}/admin/pause", headers=AUTH).status_code == 200
    try:
        yield
    finally:
        httpx.post(f"{url}/admin/resume", headers=AUTH)


def test_requests_spread_over_the_engines_by_load(server: SluiceServer) -> None:
    with _held(server.url):
        streams = [Stream(server.url, _prompt(i), 3000) for i in range(8)]
        wait_until(lambda: len(_live(server.url)) == 8, 60)
        engines = [r["engine"] for r in _live(server.url)]
        assert sorted(engines) == [0, 0, 0, 0, 1, 1, 1, 1], engines
        stats = _stats(server.url)
        assert [e["running"] + e["waiting"] for e in stats["engines"]] == [4, 4]
        assert stats["running"] + stats["waiting"] == 8  # the whole server's, added up
        assert set(stats["process_memory"]) >= {"frontend", "engine 0 scheduler", "engine 1 worker 0"}
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'sluice_num_requests_waiting{engine="0",model_name="tiny"}' in metrics
        assert 'sluice_num_requests_waiting{engine="1",model_name="tiny"}' in metrics
        assert 'sluice_engine_in_rotation{engine="1",model_name="tiny"} 1.0' in metrics
        _stop_all(server.url)
    for stream in streams:
        stream.join()


def test_prompts_sharing_a_prefix_land_on_the_engine_that_has_it(server: SluiceServer) -> None:
    before = _stats(server.url)
    shared = _prompt(99, 96)
    for i in range(6):
        complete(server.url, [*shared, 10 + i, 20 + i, 30 + i], 4)
    after = _stats(server.url)
    assert after["routed_by_prefix"] - before["routed_by_prefix"] == 5  # all but the first
    hits = [a["prefix_cache_hits"] - b["prefix_cache_hits"]
            for a, b in zip(after["engines"], before["engines"], strict=True)]
    assert sorted(hits)[0] == 0 and sorted(hits)[1] >= 5 * 80, hits  # one engine served them all, from cache


def test_admin_calls_reach_the_engine_that_holds_the_request(server: SluiceServer) -> None:
    with _held(server.url):
        streams = [Stream(server.url, _prompt(50 + i), 3000) for i in range(2)]
        wait_until(lambda: len(_live(server.url)) == 2, 60)
        live = _live(server.url)
        assert sorted(r["engine"] for r in live) == [0, 1]
        for request in live:
            base = f"{server.url}/admin/requests/{request['id']}"
            assert httpx.get(base, headers=AUTH).status_code == 200
            r = httpx.post(f"{base}/priority", headers=AUTH, json={"priority": 3})
            assert r.status_code == 200 and r.json()["status"] == "applied", r.text
            assert httpx.post(f"{base}/pause", headers=AUTH).status_code == 200
    for request in live:  # the server runs again; each request is held by its own pause
        base = f"{server.url}/admin/requests/{request['id']}"
        got = httpx.get(base, headers=AUTH)
        assert got.status_code == 200 and got.json()["state"] == "paused" and got.json()["priority"] == 3, got.text
        assert httpx.post(f"{base}/resume", headers=AUTH).status_code == 200
        assert httpx.post(f"{base}/abort", headers=AUTH).status_code == 200
    for stream in streams:
        stream.join()
        assert stream.finish_reason == "abort"


def test_a_killed_worker_of_one_engine_loses_no_request(server: SluiceServer) -> None:
    streams, want, live = _kill_mid_stream(server, b"worker", [_prompt(70), _prompt(71)])
    assert sorted(r["engine"] for r in live) == [0, 1]
    for stream, text in zip(streams, want, strict=True):
        stream.join()
        assert stream.errors == [] and stream.finish_reason == "length"
        assert stream.text == text
    assert "1 live requests will be recomputed" in server.log()  # the kill hit a live stream


def test_an_engine_whose_scheduler_hangs_leaves_the_rotation_and_rejoins(server: SluiceServer) -> None:
    wait_until(lambda: all(e["in_rotation"] for e in _stats(server.url)["engines"]), 60)
    scheduler = _component_pid(server, b"scheduler", 1)
    os.kill(scheduler, signal.SIGSTOP)  # hung: alive, silent
    try:
        seen: list[dict] = []

        def out_of_rotation() -> bool:
            seen[:] = [_stats(server.url)["engines"][1]]
            return not seen[0]["in_rotation"]

        wait_until(out_of_rotation, 20)
        assert "scheduler" in seen[0]["reason"] or "answer" in seen[0]["reason"], seen[0]
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'sluice_engine_in_rotation{engine="1",model_name="tiny"} 0.0' in metrics
        assert httpx.get(f"{server.url}/ready").status_code == 200  # the other engine serves
        for i in range(4):  # every request goes to the engine in rotation, none waits on the hung one
            assert complete(server.url, _prompt(80 + i), 4)
    finally:
        os.kill(scheduler, signal.SIGCONT)
    wait_until(lambda: _stats(server.url)["engines"][1]["in_rotation"], 30)
    with _held(server.url):  # back in rotation: it gets its share again
        streams = [Stream(server.url, _prompt(90 + i), 3000) for i in range(4)]
        wait_until(lambda: len(_live(server.url)) == 4, 60)
        assert sorted(r["engine"] for r in _live(server.url)) == [0, 0, 1, 1]
        _stop_all(server.url)
    for stream in streams:
        stream.join()


def test_a_killed_engines_streams_continue_on_the_other_engine(server: SluiceServer) -> None:
    """The scheduler of one engine dies: its live requests are recomputed on the other engine from
    their prompts and the tokens already streamed, and the streams go on with the text an
    undisturbed run gives (greedy), without an error."""
    before = _stats(server.url)["failed_over"]
    streams, want, _ = _kill_mid_stream(server, b"scheduler", [_prompt(110), _prompt(111)])
    for stream, text in zip(streams, want, strict=True):
        stream.join()
        assert stream.errors == [] and stream.finish_reason == "length"
        assert stream.text == text
    assert _stats(server.url)["failed_over"] == before + 1


def test_a_constrained_request_with_two_choices_fails_over_whole(server: SluiceServer) -> None:
    """Failover carries each choice's output so far as output (``output_token_ids``): the grammar
    goes on from where it was, both choices continue, and the text is the undisturbed run's."""
    # 600 pairs exactly: the grammar lets the output end only there, well after the kill.
    bodies: list[dict] = [{"prompt": _prompt(120 + i), "max_tokens": 1500, "temperature": 0, "n": 2,
                           "structured_outputs": {"regex": "(ab|cd){600}"}} for i in range(2)]
    want, reasons = [], []
    for body in bodies:
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=180)
        assert r.status_code == 200, r.text
        want.append({c["index"]: c["text"] for c in r.json()["choices"]})
        reasons.append({c["index"]: c["finish_reason"] for c in r.json()["choices"]})
    before = _stats(server.url)["failed_over"]
    with _held(server.url):
        streams = [Stream(server.url, body["prompt"], body["max_tokens"], ignore_eos=None, n=2,
                          structured_outputs=body["structured_outputs"]) for body in bodies]
        wait_until(lambda: len(_live(server.url)) == 4, 60)  # two choices each
        assert sorted(r["engine"] for r in _live(server.url)) == [0, 0, 1, 1]
    wait_until(lambda: all(s.tokens >= 40 for s in streams), 60)
    os.kill(_component_pid(server, b"scheduler", 1), signal.SIGKILL)
    for stream, expected, reason in zip(streams, want, reasons, strict=True):
        stream.join()
        assert stream.errors == [] and stream.finishes == reason == {0: "stop", 1: "stop"}
        assert stream.texts == expected
        assert all(re.fullmatch("(ab|cd){600}", text) for text in stream.texts.values())
    assert _stats(server.url)["failed_over"] == before + 1
