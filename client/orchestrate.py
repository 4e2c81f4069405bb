"""One ``sluice bench`` run from its parsed flags: model, prompt calibration, warm-up, the measured
run with the admin sampler beside it, then the report, the JSON and the plots."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from client.report import print_report
from client.runner import run_load
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


async def warm_up(url: str, bodies: list[dict[str, Any]], *,
                  max_concurrency: int | None, timeout: float | None, headers: dict[str, str] | None) -> str | None:
    """Send ``bodies`` and await them, uncounted. Raises BenchError if every one failed; returns a
    note if some did."""
    warm = [RequestRecord(i, None, 0, b["max_tokens"]) for i, b in enumerate(bodies)]
    await run_load(url, bodies, warm, t0=time.perf_counter(), arrivals=[0.0] * len(bodies),
                   max_concurrency=max_concurrency, timeout=timeout, headers=headers, label="warm-up")
    failed = [r for r in warm if not r.ok]
    if len(failed) == len(warm):
        raise BenchError(f"every warm-up request failed, e.g. {failed[0].error}")
    return f"{len(failed)} of {len(warm)} warm-up requests failed (not counted)" if failed else None


async def measure(base: str, url: str, bodies: list[dict[str, Any]],
                  records: list[RequestRecord], arrivals: list[float], *, max_concurrency: int | None,
                  timeout: float | None, headers: dict[str, str] | None, admin_token: str | None,
                  label: str = "requests") -> tuple[float, AdminSampler | None]:
    """The measured run, with GET /admin/stats sampled beside it when there is an admin token:
    the run's duration and the sampler (None without a token)."""
    async with httpx.AsyncClient() as admin_client:
        t0 = time.perf_counter()
        sampler = AdminSampler(admin_client, base, admin_token, t0) if admin_token else None
        if sampler:
            sampler.start()
        duration = await run_load(url, bodies, records, t0=t0, arrivals=arrivals,
                                  max_concurrency=max_concurrency, timeout=timeout, headers=headers, label=label)
        if sampler:
            await sampler.stop()
    return duration, sampler


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


def _write_outputs(args: argparse.Namespace, doc: dict[str, Any], records: list[RequestRecord],
                   samples: list[ServerSample], err: Console) -> None:
    if args.save:
        doc = doc | {"requests": [dataclasses.asdict(r) for r in records]}
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save).write_text(json.dumps(doc, indent=1) + "\n")
        err.print(f"saved {args.save}", markup=False)
    if args.plot_dir:
        from client.plots import write_plots

        for path in write_plots(Path(args.plot_dir), records, doc, samples):
            err.print(f"wrote {path}", markup=False)


async def benchmark(args: argparse.Namespace) -> int:
    out = Console()
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
        model = args.model or await first_model(client, base, headers)
        measured: PromptShape | None = None  # generated text prompts only
        if args.token_ids is None and (dataset is None or args.shared_prefix):
            measured, note = await calibrate(url, model, args.endpoint, headers)
            err.print(note, markup=False)
            if measured is None:
                notes.append(note)
        shape = measured or PromptShape()
        workload = dict(seed=args.seed, input_len=args.input_len, output_len=args.output_len, shape=shape,
                        shared_prefix=args.shared_prefix, token_ids=args.token_ids,
                        priority_mix=args.priority_mix, dataset=dataset)

        def bodies(specs: list[RequestSpec]) -> list[dict[str, Any]]:
            return [request_body(s, model, args.endpoint, args.ignore_eos, args.temperature) for s in specs]

        if args.warmup:
            warm = bodies(build_requests(args.warmup, stream="warmup", **workload))
            if failed := await warm_up(url, warm, max_concurrency=args.max_concurrency, timeout=timeout,
                                       headers=headers):
                notes.append(failed)

        specs = build_requests(args.num_prompts, **workload)
        records = records_for(specs)
        arrivals = arrival_times(len(specs), args.request_rate, args.burstiness, args.seed)
        duration, sampler = await measure(base, url, bodies(specs), records, arrivals,
                                          max_concurrency=args.max_concurrency, timeout=timeout, headers=headers,
                                          admin_token=args.admin_token)

    report = build_report(records, duration, by_priority=bool(args.priority_mix))
    if args.ignore_eos and (short := sum(1 for r in records if r.ok and r.output_tokens != r.max_tokens)):
        notes.append(f"{short} request(s) got other than max_tokens output tokens although --ignore-eos "
                     "was sent: the server may not support ignore_eos")
    if sampler and sampler.note:
        notes.append(f"{sampler.note}: no KV cache or queue plots")
    report["notes"] = notes
    samples = sampler.samples if sampler else []
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}/s"
    title = (f"sluice bench: {model} at {base} ({args.endpoint}), {args.num_prompts} requests, "
             f"concurrency {args.max_concurrency or 'unlimited'}, rate {rate}")
    print_report(report, title, out)

    doc = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "config": _config(args, model),
           "prompt_shape": dataclasses.asdict(measured) if measured else None, **report,
           "server_stats": {"samples": [s.as_dict() for s in samples],
                            "note": sampler.note if sampler else "no --admin-token"}}
    _write_outputs(args, doc, records, samples, err)
    return 0 if report["summary"]["failed"] == 0 else 1
