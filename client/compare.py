"""``sluice bench --scenario NAME``: one ``sluice serve`` per setting of a scenario
(``client.scenarios``), one after another and never two at once, the same seeded workload sent to
each, then one table of the scenario's figures per setting with the ratio to the first setting,
and a line per other setting saying what its headline figures came to.

Each server gets a fresh admin token (in its environment), so the run samples ``GET /admin/stats``
for the KV and queue plots and reads the server's preemption and swap counts before and after the
measured requests. A warm-up request (``--warmup``) goes to each server first, uncounted. Every
setting gets the same seed (``--seed``, or the one drawn for the run), so the same workload.

Ctrl-C stops the setting that is running (its server is stopped; its requests that finished are
saved, marked ``"completed": false``); the settings that finished before it are tabulated, saved
and plotted as usual, those after it are named as not run, and the exit status is 130.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import secrets
import shlex
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from client.interrupt import Interrupted, ctrl_c_stops, unless_stopped
from client.orchestrate import (
    BenchError,
    interruption,
    interruption_note,
    measure,
    records_for,
    warm_up,
    write_json,
)
from client.report import fmt
from client.runner import finished
from client.scenarios import SCENARIOS, Metric, Scenario, Workload
from client.serve_process import ServeError, serving
from client.server_stats import ServerSample
from client.stats import build_report
from client.stream import RequestRecord, request_body, run_loop
from client.workload import DEFAULT_TOKEN_IDS, Length, RequestSpec, build_requests

# Rows every comparison starts with (no ratio: counts, not figures of merit).
COMMON_ROWS = (Metric("successful requests", ("summary", "completed")),
               Metric("failed requests", ("summary", "failed")),
               Metric("duration (s)", ("summary", "duration_s")))
SERVER_COUNTERS = ("preemptions", "swaps", "steps", "jump_forward_tokens", "spec_draft_tokens",
                   "spec_accepted_tokens")  # /admin/stats' changes over the run


@dataclasses.dataclass
class SettingRun:
    name: str
    flags: list[str]
    report: dict[str, Any]  # the bench's report, with "server" (counters) and "server_stats" (samples)
    records: list[RequestRecord]  # the finished requests'
    samples: list[ServerSample]
    completed: bool = True  # False: Ctrl-C stopped it (report["interrupted"] says what was left)
    ctrl_c: bool = False  # Ctrl-C came during it (after its last request, it still completed)


def describe(workload: Workload) -> str:
    parts = []
    for g in workload.groups:
        if g.count == 1:
            when = f"sent at {g.start_s:.1f} s"
        elif g.interval_s == 0:
            when = f"all sent at {g.start_s:.1f} s"
        else:
            when = f"one every {g.interval_s:.2f} s from {g.start_s:.1f} s"
        prio = "" if g.priority is None else f", priority {g.priority}"
        parts.append(f"{g.count} {g.label} ({g.input_len} in, {g.output_len} out{prio}, {when})")
    share = f"; every prompt shares its first {workload.shared_prefix:.0%}" if workload.shared_prefix else ""
    return "workload: " + ", ".join(parts) + share


async def _served_model(client: httpx.AsyncClient, base: str) -> tuple[str, int | None]:
    try:
        r = await client.get(f"{base}/v1/models")
        r.raise_for_status()
        entry = r.json()["data"][0]
        return str(entry["id"]), entry.get("max_model_len")
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise BenchError(f"GET {base}/v1/models failed ({type(e).__name__}: {e})") from None


async def _counters(client: httpx.AsyncClient, base: str, token: str) -> dict[str, Any]:
    try:
        r = await client.get(f"{base}/admin/stats", headers={"Authorization": f"Bearer {token}"}, timeout=30.0)
        r.raise_for_status()
        return dict(r.json())
    except (httpx.HTTPError, ValueError) as e:
        raise BenchError(f"GET {base}/admin/stats failed ({type(e).__name__}: {e})") from None


async def run_setting(base: str, name: str, flags: list[str], scenario: Scenario, args: argparse.Namespace,
                      token: str) -> tuple[SettingRun, Workload]:
    """The workload, fitted to the server's max_model_len, against the server at ``base``. Ctrl-C
    before the measured requests raises Interrupted; during them, it ends the run (not completed)."""
    with ctrl_c_stops() as stop:
        return await _run_setting(base, name, flags, scenario, args, token, stop)


async def _run_setting(base: str, name: str, flags: list[str], scenario: Scenario, args: argparse.Namespace,
                       token: str, stop: asyncio.Event) -> tuple[SettingRun, Workload]:
    timeout = args.timeout or None
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout)) as client:  # the model lookup and counters
        model, max_model_len = await unless_stopped(_served_model(client, base), stop)
        workload = scenario.build(args.scale, max_model_len)
        url = f"{base}/v1/completions"

        def bodies(specs: list[RequestSpec]) -> list[dict[str, Any]]:
            return [request_body(s, model, "completions", ignore_eos=True, temperature=args.temperature) for s in specs]

        notes: list[str] = []
        if args.warmup:
            warm = build_requests(args.warmup, seed=args.seed, input_len=Length(16, 16), output_len=Length(4, 4),
                                  token_ids=DEFAULT_TOKEN_IDS, stream="warmup")
            if note := await warm_up(url, bodies(warm), max_concurrency=None, timeout=timeout, headers=None,
                                     stop=stop):
                notes.append(note)
        specs, arrivals = workload.requests(args.seed)
        records = records_for(specs)
        before = await unless_stopped(_counters(client, base, token), stop)
        load, sampler = await measure(base, url, bodies(specs), records, arrivals, max_concurrency=None,
                                      timeout=timeout, headers=None, admin_token=token, label=name, stop=stop)
        after = await _counters(client, base, token)

    done = finished(records)
    report = build_report(done, load.duration, by_priority=False, by_class=True)
    report["notes"] = [interruption_note(load, len(records))] if load.stopped else []
    report["notes"] += notes
    samples = sampler.samples if sampler else []
    doc = {"completed": not load.stopped, "interrupted": interruption(load, len(records)),
           "flags": flags, "model": model, "max_model_len": max_model_len, **report,
           "server": {k: after[k] - before[k] for k in SERVER_COUNTERS if k in after and k in before}
           | {"kv_blocks_total": after.get("kv_blocks_total")},
           "server_stats": {"samples": [s.as_dict() for s in samples], "note": sampler.note if sampler else None}}
    return SettingRun(name, flags, doc, done, samples, completed=not load.stopped, ctrl_c=stop.is_set()), workload


def _ratio(value: Any, base: Any) -> float | None:
    if not isinstance(value, int | float) or not isinstance(base, int | float) or base == 0:
        return None
    return value / base


def comparison_table(scenario: Scenario, runs: list[SettingRun], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("metric")
    for run in runs:
        table.add_column(run.name if run is runs[0] else f"{run.name} (x {runs[0].name})", justify="right")
    for metric in (*COMMON_ROWS, *scenario.metrics):
        values = [metric.value(run.report) for run in runs]
        cells = [fmt(values[0])]
        for value in values[1:]:
            ratio = None if metric in COMMON_ROWS else _ratio(value, values[0])
            cells.append(fmt(value) + ("" if ratio is None else f" ({ratio:.2f}x)"))
        table.add_row(metric.label, *cells)
    return table


def headline(scenario: Scenario, runs: list[SettingRun]) -> list[str]:
    """One line per setting after the first: its headline figures as ratios to the first's."""
    metrics = [m for m in scenario.metrics if m.label in scenario.headline]
    base = runs[0]
    lines = []
    for run in runs[1:]:
        parts = []
        for m in metrics:
            v0, v = m.value(base.report), m.value(run.report)
            ratio = _ratio(v, v0)
            parts.append(f"{m.label} {ratio:.2f}x ({fmt(v0)} → {fmt(v)})" if ratio is not None
                         else f"{m.label} {fmt(v0)} → {fmt(v)}")
        lines.append(f"{run.name} against {base.name}: " + "; ".join(parts))
    return lines


def focus_class(scenario: Scenario) -> str | None:
    """The workload class the scenario's first headline figure is about (None: all requests)."""
    first = next(m for m in scenario.metrics if m.label == scenario.headline[0])
    return first.path[1] if first.path[0] == "by_class" else None


def _save(path: Path, scenario: Scenario, args: argparse.Namespace, workload: Workload, runs: list[SettingRun],
          stopped: SettingRun | None, interrupted: dict[str, Any] | None) -> None:
    """``runs``: the settings that finished (compared); ``stopped``: the one Ctrl-C ended, if it had
    begun its measured requests; ``interrupted``: None, or which setting and which were not run."""
    doc = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "completed": interrupted is None, "interrupted": interrupted,
        "scenario": scenario.name, "upstream": scenario.upstream, "question": scenario.question,
        "scale": args.scale, "seed": args.seed, "seed_drawn": args.seed_drawn, "server_model": args.server_model,
        "server_args": args.server_args, "workload": dataclasses.asdict(workload),
        "comparison": {m.label: {run.name: m.value(run.report) for run in runs}
                       for m in (*COMMON_ROWS, *scenario.metrics)},
        "settings": {run.name: run.report | {"requests": [dataclasses.asdict(r) for r in run.records]}
                     for run in [*runs, *([stopped] if stopped else [])]},
    }
    write_json(path, doc)


def run_scenario(args: argparse.Namespace) -> int:
    scenario = SCENARIOS[args.scenario]
    err = Console(stderr=True)
    token = secrets.token_hex(16)
    # The workload is fitted to each server's max_model_len once it is up; the flags it gives the
    # servers must be known before, so they may not depend on that length.
    unfitted = scenario.build(args.scale, None)
    common = ["--model", args.server_model, *shlex.split(args.server_args), *unfitted.server_flags]
    err.print(f"scenario {scenario.name} ({scenario.upstream}): {scenario.question}", markup=False, highlight=False)
    err.print(describe(unfitted), markup=False, highlight=False)
    names = list(scenario.settings)
    runs: list[SettingRun] = []  # the settings that finished
    stopped: SettingRun | None = None  # the one Ctrl-C ended during its measured requests
    stopped_at: str | None = None  # the one Ctrl-C came in (starting, warming up or measuring)
    last = ""  # the last setting that finished
    ctrl_c = False
    workload: Workload | None = None
    with tempfile.TemporaryDirectory(prefix="sluice-scenario-") as logs:
        for i, (name, setting) in enumerate(scenario.settings.items(), 1):
            flags = [*common, *setting]
            err.print(f"[{i}/{len(scenario.settings)}] {name}: sluice serve {shlex.join(flags)}",
                      markup=False, highlight=False)
            try:
                with serving(flags, Path(logs) / f"{name}.log", env={"SLUICE_ADMIN_TOKEN": token}) as server:
                    run, fitted = run_loop(run_setting(server.url, name, flags, scenario, args, token))
            except ServeError as e:
                raise BenchError(f"setting {name}: {e}") from None
            except (Interrupted, KeyboardInterrupt):  # `serving` has stopped the server
                stopped_at, ctrl_c = name, True
                err.print("    interrupted before its measured requests; its server stopped", markup=False)
                break
            if fitted.server_flags != unfitted.server_flags:
                raise BenchError(f"scenario {scenario.name}: its server flags depend on the model's length")
            if workload is not None and fitted != workload:
                raise BenchError("the servers report different max_model_len: the settings got different workloads")
            workload = fitted
            if not run.completed:
                stopped, stopped_at, ctrl_c = run, name, True
                err.print(f"    {run.report['notes'][0]}; its server stopped", markup=False, highlight=False)
                break
            summary = run.report["summary"]
            err.print(f"    {summary['completed']} requests done, {summary['failed']} failed, "
                      f"{summary['duration_s']:.1f} s", markup=False, highlight=False)
            runs.append(run)
            if run.ctrl_c:  # after its last request: it counts, the next ones are not run
                last, ctrl_c = name, True
                break

    interrupted = None
    if ctrl_c:
        # stopped_at: the setting cut short (None: Ctrl-C came after the last request of `last`).
        not_run = names[names.index(stopped_at or last) + 1:]
        interrupted = {"setting": stopped_at, "measured": stopped is not None, "not_run": not_run}
        err.print((f"interrupted in setting {stopped_at}" if stopped_at else f"interrupted after setting {last}")
                  + (f"; not run: {', '.join(not_run)}" if not_run else ""), markup=False, highlight=False)
        if workload is None:
            err.print("sluice bench: no setting measured anything: no report (the servers were stopped)",
                      markup=False)
            return 130
    assert workload is not None  # a scenario has settings
    try:
        _report(scenario, args, workload, runs, stopped, interrupted)
    except KeyboardInterrupt:
        err.print("sluice bench: interrupted again: outputs not written (or only some)", markup=False)
        return 130
    if interrupted is not None:
        return 130
    return 0 if all(run.report["summary"]["failed"] == 0 for run in runs) else 1


def _report(scenario: Scenario, args: argparse.Namespace, workload: Workload, runs: list[SettingRun],
            stopped: SettingRun | None, interrupted: dict[str, Any] | None) -> None:
    """The table of the settings that finished, the JSON and the plots (``stopped``'s too)."""
    out, err = Console(), Console(stderr=True)
    n = sum(g.count for g in workload.groups)
    out.print(describe(workload), markup=False, highlight=False)
    if runs:
        model = runs[0].report["model"]
        out.print(comparison_table(scenario, runs, f"sluice bench --scenario {scenario.name} ({scenario.upstream}): "
                                   f"{model}, scale {args.scale:g}, {n} requests per setting"))
    for run in runs:
        out.print(f"  {run.name}: {shlex.join(run.flags)}", style="dim", markup=False, highlight=False)
    for line in headline(scenario, runs):
        out.print(line, markup=False, highlight=False)
    for run in runs:
        for note in run.report["notes"]:
            out.print(f"{run.name}: {note}", style="yellow", markup=False, highlight=False)
        if run.report["errors"]:
            out.print(f"{run.name}: {run.report['summary']['failed']} request(s) failed, e.g. "
                      f"{next(iter(run.report['errors']))}", style="red", markup=False, highlight=False)
    if interrupted is not None and interrupted["setting"]:
        what = (f"{stopped.report['notes'][0]} (not in the table)" if stopped
                else "interrupted before its measured requests")
        out.print(f"{interrupted['setting']}: {what}", style="yellow", markup=False, highlight=False)
    if interrupted is not None and interrupted["not_run"]:
        out.print(f"not run: {', '.join(interrupted['not_run'])}", style="yellow", markup=False, highlight=False)

    if args.save:
        _save(Path(args.save), scenario, args, workload, runs, stopped, interrupted)
        err.print(f"saved {args.save}", markup=False)
    if args.plot_dir:
        from client.plots import settings_compared, write_plots

        for run in [*runs, *([stopped] if stopped else [])]:
            for path in write_plots(Path(args.plot_dir) / run.name, run.records, run.report, run.samples):
                err.print(f"wrote {path}", markup=False)
        if runs:
            path = settings_compared([(run.name, run.records, run.report) for run in runs], focus_class(scenario),
                                     Path(args.plot_dir) / "settings.png")
            err.print(f"wrote {path}", markup=False)
