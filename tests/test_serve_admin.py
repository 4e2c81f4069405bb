"""The admin API, /metrics and the dashboard through a real ``sluice serve``."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sluice_server import SluiceServer, running_server

TOKEN = "admin-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LONG = {"prompt": "a long story", "max_tokens": 3000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SluiceServer]:
    with running_server("--admin-token", TOKEN, "--num-kv-blocks", "512",
                        log_dir=tmp_path_factory.mktemp("admin")) as s:
        yield s


class Background:
    """A long streaming request running in a thread; ``request_id`` once its headers arrive."""

    def __init__(self, url: str, body: dict) -> None:
        self.request_id: str | None = None
        self.finish_reason: str | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self._thread.start()
        assert self._ready.wait(60)

    def _run(self, url: str, body: dict) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=120) as r:
            self.request_id = r.headers["X-Request-Id"]
            self._ready.set()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    reason = httpx.Response(200, content=line[6:]).json()["choices"][0]["finish_reason"]
                    self.finish_reason = reason or self.finish_reason

    def join(self, timeout: float = 60) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive()


def wait_for(predicate, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


ROUTES = [
    ("GET", "/admin/stats"), ("GET", "/admin/requests"), ("GET", "/admin/requests/{id}"),
    ("POST", "/admin/requests/{id}/abort"), ("POST", "/admin/requests/{id}/priority"),
    ("POST", "/admin/requests/{id}/pause"), ("POST", "/admin/requests/{id}/resume"),
    ("POST", "/admin/pause"), ("POST", "/admin/resume"), ("POST", "/admin/prefix-cache/reset"),
]


@pytest.mark.parametrize(("method", "route"), ROUTES)
def test_admin_routes_need_the_right_token(server: SluiceServer, method: str, route: str) -> None:
    url = server.url + route.format(id="cmpl-unknown")
    body = {"priority": 1}
    assert httpx.request(method, url, json=body).status_code == 401
    assert httpx.request(method, url, json=body, headers={"Authorization": "Bearer nope"}).status_code == 403
    r = httpx.request(method, url, json=body, headers=AUTH)
    if "{id}" in route:
        assert r.status_code == 404 and r.json()["error"]["code"] == "request_not_found"
    else:
        assert r.status_code == 200, r.text
    if route == "/admin/pause":
        httpx.post(f"{server.url}/admin/resume", headers=AUTH)


def test_finished_request_is_404_and_live_one_is_listed(server: SluiceServer) -> None:
    done = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    finished_id = done.headers["X-Request-Id"]
    assert httpx.get(f"{server.url}/admin/requests/{finished_id}", headers=AUTH).status_code == 404
    bg = Background(server.url, LONG)
    info = httpx.get(f"{server.url}/admin/requests/{bg.request_id}", headers=AUTH).json()
    assert info["id"] == bg.request_id and info["state"] in ("waiting", "running")
    assert set(info) >= {"priority", "user", "prompt_tokens", "output_tokens", "computed_tokens", "kv_blocks",
                         "preemptions", "arrival_time", "queue_s"}
    listing = httpx.get(f"{server.url}/admin/requests", headers=AUTH).json()["data"]
    assert bg.request_id in [r["id"] for r in listing]
    r = httpx.post(f"{server.url}/admin/requests/{bg.request_id}/abort", headers=AUTH)
    assert r.status_code == 200
    bg.join()
    assert bg.finish_reason == "abort"
    assert httpx.post(f"{server.url}/admin/requests/{bg.request_id}/abort", headers=AUTH).status_code == 404


def test_a_200_from_a_control_means_applied(server: SluiceServer) -> None:
    # Issue 13, defect 7: a priority change answered 200 and a GET right after still showed the
    # old priority; a pause right after a cut-in answered 200 and was undone by the cut-in.
    bg = Background(server.url, LONG | {"max_tokens": 1500})
    base = f"{server.url}/admin/requests/{bg.request_id}"
    for priority in (3, -2, 7):
        assert httpx.post(f"{base}/priority", json={"priority": priority}, headers=AUTH).json()["status"] == "applied"
        assert httpx.get(base, headers=AUTH).json()["priority"] == priority
    assert httpx.post(f"{base}/priority", json={"priority": 0, "cut_in": True}, headers=AUTH).status_code == 200
    assert httpx.post(f"{base}/pause", headers=AUTH).status_code == 200
    assert httpx.get(base, headers=AUTH).json()["state"] == "paused"

    def output() -> int:
        return int(httpx.get(base, headers=AUTH).json()["output_tokens"])

    wait_for(lambda: not httpx.get(base, headers=AUTH).json()["in_flight"])
    frozen = output()
    time.sleep(0.6)
    assert output() == frozen and httpx.get(base, headers=AUTH).json()["state"] == "paused"
    assert httpx.post(f"{base}/resume", headers=AUTH).json()["status"] == "applied"
    bg.join()
    assert bg.finish_reason == "length"
    # The request is gone now: controls on it say so.
    assert httpx.post(f"{base}/pause", headers=AUTH).status_code == 404


def test_server_pause_stops_decoding_and_resume_continues(server: SluiceServer) -> None:
    bg = Background(server.url, LONG | {"max_tokens": 400})
    httpx.post(f"{server.url}/admin/pause", headers=AUTH)

    def output() -> int:
        return int(httpx.get(f"{server.url}/admin/requests/{bg.request_id}", headers=AUTH).json()["output_tokens"])

    def quiet() -> bool:  # paused, and the multi-step window in flight has ended
        stats = httpx.get(f"{server.url}/admin/stats", headers=AUTH).json()
        return bool(stats["server_paused"]) and stats["plan_in_flight"] is None

    wait_for(quiet)
    frozen = output()
    time.sleep(0.5)
    assert output() == frozen
    httpx.post(f"{server.url}/admin/resume", headers=AUTH)
    bg.join()
    assert bg.finish_reason == "length"


def test_metrics_parse_and_counters_move(server: SluiceServer) -> None:
    def scrape() -> dict[str, float]:
        text = httpx.get(f"{server.url}/metrics").text
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.labels.get("model_name") in ("tiny", None):
                    key = sample.name + ("" if "finished_reason" not in sample.labels
                                         else f"[{sample.labels['finished_reason']}]")
                    values[key] = values.get(key, 0.0) + sample.value
        return values

    before = scrape()
    prompt = [1, *range(30, 70)]

    async def load() -> None:
        async with httpx.AsyncClient(timeout=60) as c:
            body = {"prompt": prompt, "max_tokens": 8, "ignore_eos": True}
            await c.post(f"{server.url}/v1/completions", json=body)  # its full blocks get cached...
            await asyncio.gather(*(c.post(f"{server.url}/v1/completions", json=body)  # ...and hit
                                   for _ in range(3)))

    asyncio.run(load())
    time.sleep(1.2)  # scheduler gauges/counters arrive with the next pings
    after = scrape()
    assert after["sluice_generation_tokens_total"] - before.get("sluice_generation_tokens_total", 0) == 32
    assert after["sluice_prompt_tokens_total"] - before.get("sluice_prompt_tokens_total", 0) == 4 * len(prompt)
    assert after["sluice_request_success_total[length]"] - before.get("sluice_request_success_total[length]", 0) == 4
    assert after["sluice_time_to_first_token_seconds_count"] - before.get(
        "sluice_time_to_first_token_seconds_count", 0) == 4
    assert after["sluice_inter_token_latency_seconds_count"] - before.get(
        "sluice_inter_token_latency_seconds_count", 0) == 4 * 7
    assert after["sluice_request_queue_time_seconds_count"] >= 4
    assert after["sluice_prefix_cache_queries_total"] > before.get("sluice_prefix_cache_queries_total", 0)
    assert after["sluice_prefix_cache_hits_total"] > before.get("sluice_prefix_cache_hits_total", 0)
    for gauge in ("sluice_num_requests_running", "sluice_num_requests_waiting", "sluice_kv_cache_usage_ratio",
                  "sluice_device_idle_ratio", "sluice_num_requests_paused", "sluice_num_preemptions_total",
                  "sluice_internal_errors_total", "sluice_malformed_frames_total"):
        assert gauge in after


def test_dashboard_shows_a_request_and_its_abort_button_ends_it(server: SluiceServer, tmp_path: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    if chromium is None:
        pytest.skip("no Chromium on this machine (Debian package `chromium`); .ci/run installs it when it can")
    bg = Background(server.url, LONG)
    # Held still, so it cannot finish on its own before the browser clicks (a fast worker ends 3000 tokens
    # in a few seconds, about what Chromium takes to start on a loaded 2-core machine).
    assert httpx.post(f"{server.url}/admin/requests/{bg.request_id}/pause", headers=AUTH).json()["status"] == "applied"
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        try:
            page = browser.new_page()
            page.goto(f"{server.url}/admin/ui")
            page.fill("#token", TOKEN)
            page.click("#connect")
            row = page.locator(f'tr[data-id="{bg.request_id}"]')
            row.wait_for(timeout=30_000)
            assert row.locator("td").nth(1).inner_text() == "paused"
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            row.locator('button[data-action="abort"]').click()
            bg.join()
            assert bg.finish_reason == "abort"
            page.locator(f'tr[data-id="{bg.request_id}"]').wait_for(state="detached", timeout=30_000)
        finally:
            browser.close()
    assert (tmp_path / "dashboard.png").stat().st_size > 0


def test_stats_report_each_process_resident_memory(server: SluiceServer) -> None:
    """Each component measures itself: the frontend, the scheduler (with its stats) and the worker
    (in its heartbeat); the frontend and scheduler never import torch, so they stay small."""
    deadline = time.monotonic() + 30
    while True:
        memory = httpx.get(f"{server.url}/admin/stats", headers=AUTH).json()["process_memory"]
        if "worker 0" in memory or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert set(memory) == {"frontend", "scheduler", "worker 0", "total_rss_mib"}, memory
    parts = [memory[name] for name in ("frontend", "scheduler", "worker 0")]
    assert all(0 < m["rss_mib"] <= m["peak_rss_mib"] for m in parts)
    assert memory["total_rss_mib"] == pytest.approx(sum(m["rss_mib"] for m in parts), abs=0.2)
    assert memory["worker 0"]["rss_mib"] > max(memory["frontend"]["rss_mib"], memory["scheduler"]["rss_mib"])


def test_frontend_and_scheduler_do_not_import_torch() -> None:
    code = ("import sys, frontend.serve, frontend.app, scheduler.process; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
