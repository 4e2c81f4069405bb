"""The benchmark's numbers from its request records: pure functions, no I/O.

Aggregates follow ``vllm bench serve`` (see ``client.stream`` for the per-request definitions):

- only successful requests count in token totals and latency statistics; failed ones are counted;
- **duration**: from the start of the run (before the first request is due) to the end of the last;
- **request / output / total token throughput**: successful requests, their output tokens, and
  their prompt + output tokens, each divided by the duration (per priority class too: a class's
  share of the whole run's rate, over the same duration);
- **TPOT** per request: (latency - TTFT) / (output tokens - 1), for requests of 2+ output tokens;
- **ITL**: every gap of every request, pooled;
- percentiles interpolate linearly between closest ranks (NumPy's default); std is the
  population standard deviation; all latencies are reported in milliseconds; a statistic of no
  values is None (JSON null), never 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from itertools import accumulate
from typing import Any

from client.stream import RequestRecord

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0..100) of ``values``, linear between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def distribution_ms(values: Sequence[float]) -> dict[str, float | None]:
    """mean, median, std and the PERCENTILES of ``values`` (seconds), in milliseconds."""
    keys = ["mean", "median", "std", *(f"p{p}" for p in PERCENTILES)]
    if not values:
        return dict.fromkeys(keys)
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    out = {"mean": mean, "median": percentile(values, 50), "std": std}
    out |= {f"p{p}": percentile(values, p) for p in PERCENTILES}
    return {k: 1000.0 * v for k, v in out.items()}


def tpot(record: RequestRecord) -> float | None:
    if not record.ok or record.output_tokens < 2 or record.latency is None or record.ttft is None:
        return None
    return (record.latency - record.ttft) / (record.output_tokens - 1)


def token_times(record: RequestRecord) -> list[float]:
    """When each token chunk of a successful request arrived, in seconds from the run's start."""
    if not record.ok or record.ttft is None:
        return []
    return list(accumulate(record.itl, initial=record.start + record.ttft))


def bin_widths(duration: float, bin_s: float = 1.0) -> list[float]:
    """Consecutive bins of ``bin_s`` covering the run; the last one ends with the run, so it may
    be shorter."""
    n = max(1, math.ceil(duration / bin_s))
    return [bin_s] * (n - 1) + [max(duration - (n - 1) * bin_s, 1e-9)]


def output_timeline(records: Iterable[RequestRecord], duration: float, bin_s: float = 1.0) -> list[float]:
    """Output tokens per second in each of ``bin_widths(duration, bin_s)``, from the run's start
    (the last, possibly shorter bin divided by its own width). A request's usage-reported tokens
    are spread evenly over its token chunks (a server may send several tokens in one chunk), so
    rate x width adds up to the output token total."""
    widths = bin_widths(duration, bin_s)
    tokens = [0.0] * len(widths)
    for r in records:
        times = token_times(r)
        if not times:
            continue
        weight = r.output_tokens / len(times)
        for t in times:
            tokens[min(len(tokens) - 1, max(0, int(t / bin_s)))] += weight
    return [n / w for n, w in zip(tokens, widths, strict=True)]


def peak_rate(timeline: list[float], duration: float, bin_s: float = 1.0) -> float | None:
    """The highest rate of a full bin (vLLM's "peak output token throughput"); the short last bin
    counts only when there is no full one, as a few tokens in a sliver of time say little."""
    if not timeline:
        return None
    full = timeline[:-1] if duration % bin_s and len(timeline) > 1 else timeline
    return max(full)


def peak_concurrency(records: Iterable[RequestRecord]) -> int:
    """Most requests open at once (sent, stream not yet closed), failed ones included: a sweep
    over half-open intervals [start, start + done), closings before openings at equal times."""
    events = sorted(
        (t, delta)
        for r in records
        if r.done is not None
        for t, delta in ((r.start, 1), (r.start + r.done, -1))
    )
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def summarize(records: Sequence[RequestRecord], duration: float) -> dict[str, Any]:
    """The figures of one set of requests over a run of ``duration`` seconds."""
    good = [r for r in records if r.ok]
    total_in = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in good)
    total_out = sum(r.output_tokens for r in good)
    timeline = output_timeline(good, duration)
    tpots = [t for r in good if (t := tpot(r)) is not None]
    return {
        "completed": len(good),
        "failed": len(records) - len(good),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "cached_input_tokens": sum(r.cached_tokens or 0 for r in good),
        "prompt_tokens_from_usage": all(r.prompt_tokens is not None for r in good),
        "output_tokens_from_usage": all(r.usage_reported for r in good),
        "request_throughput": len(good) / duration if duration > 0 else None,
        "output_throughput": total_out / duration if duration > 0 else None,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else None,
        "ttft_ms": distribution_ms([r.ttft for r in good if r.ttft is not None]),
        "tpot_ms": distribution_ms(tpots),
        "itl_ms": distribution_ms([gap for r in good for gap in r.itl]),
        "e2el_ms": distribution_ms([r.latency for r in good if r.latency is not None]),
        "max_output_tokens_per_s": peak_rate(timeline, duration) if good else None,
        "peak_concurrency": peak_concurrency(records),
    }


def priority_label(priority: int | None) -> str:
    return "default" if priority is None else str(priority)


def class_labels(records: Iterable[RequestRecord]) -> list[str]:
    """The workload classes of labelled records (``RequestRecord.label``), in order of first appearance."""
    return list(dict.fromkeys(r.label for r in records if r.label is not None))


def build_report(records: Sequence[RequestRecord], duration: float, *, by_priority: bool,
                 by_class: bool = False) -> dict[str, Any]:
    """The overall summary, one per priority class (when the run mixed them), one per workload
    class (a scenario's labelled requests), the output throughput timeline and the most common
    errors."""
    report: dict[str, Any] = {"summary": summarize(records, duration)}
    if by_priority:
        classes = sorted({r.priority for r in records}, key=lambda p: (p is None, p or 0))
        report["by_priority"] = {
            priority_label(p): summarize([r for r in records if r.priority == p], duration) for p in classes
        }
    if by_class:
        report["by_class"] = {c: summarize([r for r in records if r.label == c], duration)
                              for c in class_labels(records)}
    report["timeline"] = {"bin_s": 1.0, "bin_widths_s": bin_widths(duration),
                          "output_tokens_per_s": output_timeline(records, duration)}
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    report["errors"] = dict(sorted(errors.items(), key=lambda kv: -kv[1]))
    return report
