"""One ``sluice bench`` run from its parsed flags: model, prompt calibration, warm-up, the measured
run with the admin sampler beside it (``benchmark``, in the event loop), then the report, the JSON
and the plots (``finish``, after it).

Ctrl-C during the measured run stops it (``client.interrupt``): nothing more is sent, the requests
in flight are cancelled, and the report, the JSON (``"completed": false``, with the counts) and the
plots cover the requests that finished; the exit status is then 130. A second Ctrl-C aborts at once.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from client.interrupt import Interrupted, ctrl_c_stops, unless_stopped
from client.report import print_report
from client.runner import LoadResult, finished, run_load
from client.server_stats import AdminSampler, ServerSample
from client.stats import build_report
from client.stream import ENDPOINT_PATHS, RequestRecord, request_body, stream_request
from client.workload import (
    Length,
    PromptShape,
    RequestSpec,
    arrival_times,
    build_requests,
    calibration_prompts,
    fit_shape,
    load_dataset,
)


class BenchError(Exception):
    """The run cannot go on (no server, no model, a warm-up that failed entirely)."""


async def first_model(client: httpx.AsyncClient, base: str, headers: dict[str, str] | None) -> str:
    try:
        r = await client.get(f"{base}/v1/models", headers=headers)
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise BenchError(f"cannot get a model from {base}/v1/models ({type(e).__name__}: {e}); "
                         "is the server up? else pass --model") from None


async def calibrate(url: str, model: str, endpoint: str,
                    headers: dict[str, str] | None) -> tuple[PromptShape | None, str]:
    """Tokens per generated word on this server: two probe prompts (max_tokens 1) and the
    prompt_tokens the server reports for each; None (and why) when the server does not say."""
    probes = calibration_prompts()
    bodies = [request_body(RequestSpec(text, 0, 1, None), model, endpoint, ignore_eos=False) for _, text in probes]
    records = [RequestRecord(i, None, 0, 1) for i in range(len(bodies))]
    await asyncio.gather(*(stream_request(url, b, r, t0=time.perf_counter(), timeout=60.0, headers=headers)
                           for b, r in zip(bodies, records, strict=True)))
    points = [(words, r.prompt_tokens) for (words, _), r in zip(probes, records, strict=True)
              if r.ok and r.prompt_tokens is not None]
    if len(points) < len(probes):
        why = next((r.error for r in records if r.error), "no usage.prompt_tokens")
        return None, f"prompt lengths not calibrated ({why}): one token per word assumed"
    shape = fit_shape(points)
    return shape, (f"prompt lengths calibrated on the server: {shape.per_word:.2f} tokens per word "
                   f"+ {shape.overhead:.0f} per prompt")


def records_for(specs: list[RequestSpec]) -> list[RequestRecord]:
    return [RequestRecord(i, s.priority, s.input_len, s.output_len, s.label) for i, s in enumerate(specs)]


async def warm_up(url: str, bodies: list[dict[str, Any]], *, max_concurrency: int | None,
                  timeout: float | None, headers: dict[str, str] | None,
                  stop: asyncio.Event | None = None) -> str | None:
    """Send ``bodies`` and await them, uncounted. Raises BenchError if every one failed, Interrupted
    if ``stop`` was set; returns a note if some failed."""
    warm = [RequestRecord(i, None, 0, b["max_tokens"]) for i, b in enumerate(bodies)]
    load = await run_load(url, bodies, warm, t0=time.perf_counter(), arrivals=[0.0] * len(bodies),
                          max_concurrency=max_concurrency, timeout=timeout, headers=headers, label="warm-up",
                          stop=stop)
    if load.stopped:
        raise Interrupted
    failed = [r for r in warm if not r.ok]
    if len(failed) == len(warm):
        raise BenchError(f"every warm-up request failed, e.g. {failed[0].error}")
    return f"{len(failed)} of {len(warm)} warm-up requests failed (not counted)" if failed else None


async def measure(base: str, url: str, bodies: list[dict[str, Any]],
                  records: list[RequestRecord], arrivals: list[float], *, max_concurrency: int | None,
                  timeout: float | None, headers: dict[str, str] | None, admin_token: str | None,
                  label: str = "requests",
                  stop: asyncio.Event | None = None) -> tuple[LoadResult, AdminSampler | None]:
    """The measured run, with GET /admin/stats sampled beside it when there is an admin token:
    how it ended (``stop`` ends it early) and the sampler (None without a token)."""
    async with httpx.AsyncClient() as admin_client:
        t0 = time.perf_counter()
        sampler = AdminSampler(admin_client, base, admin_token, t0) if admin_token else None
        if sampler:
            sampler.start()
        load = await run_load(url, bodies, records, t0=t0, arrivals=arrivals, max_concurrency=max_concurrency,
                              timeout=timeout, headers=headers, label=label, stop=stop)
        if sampler:
            await sampler.stop()
    return load, sampler


def interruption(load: LoadResult, total: int) -> dict[str, Any] | None:
    """What a stopped run left undone, for the JSON; None for a run that finished."""
    if not load.stopped:
        return None
    return {"after_s": load.duration, "finished": total - load.in_flight - load.not_sent,
            "in_flight": load.in_flight, "not_sent": load.not_sent}


def interruption_note(load: LoadResult, total: int) -> str:
    return (f"interrupted by Ctrl-C after {load.duration:.1f} s: {total - load.in_flight - load.not_sent} of "
            f"{total} requests finished and are reported; {load.in_flight} in flight (cancelled, not counted), "
            f"{load.not_sent} not sent")


def _config(args: argparse.Namespace, model: str) -> dict[str, Any]:
    def plain(v: Any) -> Any:
        if isinstance(v, Length):
            return f"{v.lo}" if v.lo == v.hi else f"{v.lo}:{v.hi}"
        if isinstance(v, float) and math.isinf(v):
            return "inf"
        return v

    skip = {"command", "api_key", "admin_token"}  # secrets stay out of files
    config = {k: plain(v) for k, v in vars(args).items() if k not in skip}
    return config | {"model": model, "admin_stats": bool(args.admin_token)}


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """``doc`` as JSON at ``path``, whole or not at all: written beside it, then renamed over it (a
    second Ctrl-C while writing leaves no half file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        part.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)


def _write_outputs(args: argparse.Namespace, doc: dict[str, Any], records: list[RequestRecord],
                   samples: list[ServerSample], err: Console) -> None:
    if args.save:
        write_json(Path(args.save), doc | {"requests": [dataclasses.asdict(r) for r in records]})
        err.print(f"saved {args.save}", markup=False)
    if args.plot_dir:
        from client.plots import write_plots

        for path in write_plots(Path(args.plot_dir), records, doc, samples):
            err.print(f"wrote {path}", markup=False)


@dataclasses.dataclass
class Measured:
    """A measured run, ready to report: the JSON document (without the requests), the title, the
    finished requests' records, the admin samples, and whether Ctrl-C was pressed."""

    doc: dict[str, Any]
    title: str
    records: list[RequestRecord]
    samples: list[ServerSample]
    interrupted: bool


async def benchmark(args: argparse.Namespace) -> Measured:
    """Everything that talks to the server. Ctrl-C before the measured run raises Interrupted;
    during it, it ends the run (the result says so)."""
    with ctrl_c_stops() as stop:
        return await _benchmark(args, stop)


async def _benchmark(args: argparse.Namespace, stop: asyncio.Event) -> Measured:
    err = Console(stderr=True)
    try:
        dataset = load_dataset(Path(args.dataset)) if args.dataset else None
    except (OSError, ValueError) as e:
        raise BenchError(str(e)) from None
    base = args.url.rstrip("/")
    url = base + ENDPOINT_PATHS[args.endpoint]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    timeout = args.timeout or None
    notes: list[str] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout)) as client:  # the model lookup

        async def model_and_shape() -> tuple[str, PromptShape | None]:
            model = args.model or await first_model(client, base, headers)
            measured: PromptShape | None = None  # generated text prompts only
            if args.token_ids is None and (dataset is None or args.shared_prefix):
                measured, note = await calibrate(url, model, args.endpoint, headers)
                err.print(note, markup=False)
                if measured is None:
                    notes.append(note)
            return model, measured

        model, measured = await unless_stopped(model_and_shape(), stop)
        shape = measured or PromptShape()
        workload = dict(seed=args.seed, input_len=args.input_len, output_len=args.output_len, shape=shape,
                        shared_prefix=args.shared_prefix, token_ids=args.token_ids,
                        priority_mix=args.priority_mix, dataset=dataset)

        def bodies(specs: list[RequestSpec]) -> list[dict[str, Any]]:
            return [request_body(s, model, args.endpoint, args.ignore_eos, args.temperature) for s in specs]

        if args.warmup:
            warm = bodies(build_requests(args.warmup, stream="warmup", **workload))
            if failed := await warm_up(url, warm, max_concurrency=args.max_concurrency, timeout=timeout,
                                       headers=headers, stop=stop):
                notes.append(failed)

        specs = build_requests(args.num_prompts, **workload)
        records = records_for(specs)
        arrivals = arrival_times(len(specs), args.request_rate, args.burstiness, args.seed)
        load, sampler = await measure(base, url, bodies(specs), records, arrivals,
                                      max_concurrency=args.max_concurrency, timeout=timeout, headers=headers,
                                      admin_token=args.admin_token, stop=stop)

    done = finished(records)  # a stopped run's unfinished requests count in no figure
    report = build_report(done, load.duration, by_priority=bool(args.priority_mix))
    if load.stopped:
        notes.insert(0, interruption_note(load, len(records)))
        err.print(notes[0], markup=False, highlight=False)
    if args.ignore_eos and (short := sum(1 for r in done if r.ok and r.output_tokens != r.max_tokens)):
        notes.append(f"{short} request(s) got other than max_tokens output tokens although --ignore-eos "
                     "was sent: the server may not support ignore_eos")
    if sampler and sampler.note:
        notes.append(f"{sampler.note}: no KV cache or queue plots")
    report["notes"] = notes
    samples = sampler.samples if sampler else []
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}/s"
    requests = f"{len(done)} of {args.num_prompts} requests (interrupted)" if load.stopped else \
        f"{args.num_prompts} requests"
    title = (f"sluice bench: {model} at {base} ({args.endpoint}), {requests}, "
             f"concurrency {args.max_concurrency or 'unlimited'}, rate {rate}")
    doc = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
           "completed": not load.stopped, "interrupted": interruption(load, len(records)),
           "config": _config(args, model),
           "prompt_shape": dataclasses.asdict(measured) if measured else None, **report,
           "server_stats": {"samples": [s.as_dict() for s in samples],
                            "note": sampler.note if sampler else "no --admin-token"}}
    return Measured(doc, title, done, samples, interrupted=stop.is_set())


def finish(args: argparse.Namespace, run: Measured) -> int:
    """Print the report, write the JSON and the plots; the exit status: 130 after Ctrl-C, else 1
    if a request failed, else 0. A Ctrl-C here stops the writing (the JSON is whole or absent)."""
    err = Console(stderr=True)
    try:
        print_report(run.doc, run.title, Console())
        _write_outputs(args, run.doc, run.records, run.samples, err)
    except KeyboardInterrupt:
        err.print("sluice bench: interrupted again: outputs not written (or only some)", markup=False)
        return 130
    if run.interrupted:
        return 130
    return 0 if run.doc["summary"]["failed"] == 0 else 1
