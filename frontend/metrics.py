"""Prometheus metrics (``GET /metrics``), all named ``sluice_*`` and labelled with the model.

Two sources: what the frontend sees itself (tokens, latencies, finishes — recorded once per
request when it ends), and the scheduler's state, which arrives with every ``Pong`` and is
exposed by a collector that reads that latest snapshot at scrape time.

Nothing here costs a Prometheus call per token: generated tokens are a plain count read at
scrape time, and a request's inter-token gaps go into the histogram's buckets in one pass when
it ends (``bisect`` per gap, no lock, no label look-up).
"""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("sluice.requests")

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)

# scheduler stats key -> (metric name, help, kind)
SCHEDULER_METRICS = {
    "running": ("sluice_num_requests_running", "Requests in the running batch", "gauge"),
    "waiting": ("sluice_num_requests_waiting", "Requests waiting to be scheduled", "gauge"),
    "paused": ("sluice_num_requests_paused", "Requests paused by an operator", "gauge"),
    "preempted": ("sluice_num_requests_preempted", "Waiting requests that were preempted", "gauge"),
    "kv_usage": ("sluice_kv_cache_usage_ratio", "Fraction of KV cache blocks in use", "gauge"),
    "device_idle_ratio": ("sluice_device_idle_ratio", "Fraction of wall time the worker did not compute",
                          "gauge"),
    "prefix_cache_queries": ("sluice_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                             "counter"),
    "prefix_cache_hits": ("sluice_prefix_cache_hits", "Prompt tokens served by the prefix cache", "counter"),
    "preemptions": ("sluice_num_preemptions", "Requests preempted (recompute or swap)", "counter"),
    "jump_forward_tokens": ("sluice_jump_forward_tokens", "Output tokens a grammar forced, appended without a "
                            "forward pass of their own (structured output's jump-forward)", "counter"),
    "spec_draft_tokens": ("sluice_spec_decode_num_draft_tokens", "Proposed tokens verified (speculative "
                          "decoding)", "counter"),
    "spec_accepted_tokens": ("sluice_spec_decode_num_accepted_tokens", "Proposed tokens accepted (speculative "
                             "decoding): output tokens without a forward pass of their own", "counter"),
    "worker_busy_s_total": ("sluice_worker_busy_seconds", "Worker compute time", "counter"),
    "internal_errors": ("sluice_internal_errors", "Scheduler bugs caught (a handler or the core raised; "
                        "the request it concerned was ended with an error)", "counter"),
    "malformed_frames": ("sluice_malformed_frames", "Frames on the scheduler's sockets that were not Sluice "
                         "messages (dropped)", "counter"),
    "in_rotation": ("sluice_engine_in_rotation", "1 while the engine takes new requests, 0 while it is out of "
                    "the rotation (down, hung or refused); with several engines only", "gauge"),
    "lost_batches": ("sluice_scheduler_undeliverable_batches", "Token batches the scheduler could not send to "
                     "a frontend (its link was down); their running requests were aborted", "counter"),
}


class _SchedulerCollector(Collector):
    """The schedulers' figures: one sample per family, or, with several engines (data
    parallelism), one per engine, labelled ``engine``."""

    def __init__(self, snapshot: Callable[[], dict[str, Any] | None], model: Callable[[], str],
                 per_engine: Callable[[], list[tuple[str, dict[str, Any]]]] | None = None) -> None:
        self._snapshot = snapshot
        self._model = model
        self._per_engine = per_engine

    def collect(self) -> Iterator[Metric]:
        model = self._model()
        engines = self._per_engine() if self._per_engine is not None else []
        several = len(engines) > 1
        samples = [([model, engine], stats) for engine, stats in engines] if several \
            else [([model], self._snapshot() or {})]
        labels = ["model_name", "engine"] if several else ["model_name"]
        for key, (name, doc, kind) in SCHEDULER_METRICS.items():
            family: Metric
            if kind == "gauge":
                family = GaugeMetricFamily(name, doc, labels=labels)
            else:
                family = CounterMetricFamily(name, doc, labels=labels)
            for values, stats in samples:
                value = stats.get(key)
                if isinstance(value, (int, float)):
                    family.add_metric(values, float(value))
            yield family
        # Speculative decoding's acceptance by draft position (0: a step's first proposed token).
        for key, name, doc in (("spec_drafted_by_position", "sluice_spec_decode_num_draft_tokens_per_pos",
                                "Proposed tokens verified, by position in a step's proposal"),
                               ("spec_accepted_by_position", "sluice_spec_decode_num_accepted_tokens_per_pos",
                                "Proposed tokens accepted, by position in a step's proposal")):
            counts = CounterMetricFamily(name, doc, labels=[*labels, "position"])
            for values, stats in samples:  # (as ``key:0``, ``key:1``, ...: a snapshot holds numbers only)
                for position in itertools.count():
                    count = stats.get(f"{key}:{position}")
                    if count is None:
                        break
                    counts.add_metric([*values, str(position)], float(count))
            yield counts


class _GapHistogram(Collector):
    """``sluice_inter_token_latency_seconds`` and ``sluice_generation_tokens``: per-token figures,
    kept as plain counts and rendered at scrape time."""

    def __init__(self, model: Callable[[], str]) -> None:
        self._model = model
        self.bucket_counts = [0] * (len(LATENCY_BUCKETS) + 1)  # the last one: above every bound
        self.gap_sum = 0.0
        self.generated = 0

    def observe(self, gaps: list[float]) -> None:
        counts, bounds = self.bucket_counts, LATENCY_BUCKETS
        for gap in gaps:
            counts[bisect.bisect_left(bounds, gap)] += 1
        self.gap_sum += sum(gaps)

    def collect(self) -> Iterator[Metric]:
        model = self._model()
        tokens = CounterMetricFamily("sluice_generation_tokens", "Generated tokens", labels=["model_name"])
        tokens.add_metric([model], float(self.generated))
        yield tokens
        cumulative, buckets = 0, []
        for bound, count in zip([*map(str, LATENCY_BUCKETS), "+Inf"], self.bucket_counts, strict=True):
            cumulative += count
            buckets.append((bound, float(cumulative)))
        itl = HistogramMetricFamily("sluice_inter_token_latency_seconds", "Time between tokens of a stream",
                                    labels=["model_name"])
        itl.add_metric([model], buckets, self.gap_sum)
        yield itl


class Metrics:
    def __init__(self, snapshot: Callable[[], dict[str, Any] | None], model: Callable[[], str],
                 per_engine: Callable[[], list[tuple[str, dict[str, Any]]]] | None = None) -> None:
        self.registry = CollectorRegistry()
        self._model = model
        label = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("sluice_prompt_tokens", "Prompt tokens of finished requests", label, registry=r)
        self.requests = Counter("sluice_request_success", "Finished requests by finish reason",
                                [*label, "finished_reason"], registry=r)
        self.by_endpoint = Counter("sluice_endpoint_requests", "Finished requests by endpoint (an engine request "
                                   "each: a choice, a prompt of a batch, an input to embed)", [*label, "endpoint"],
                                   registry=r)
        self.ttft = Histogram("sluice_time_to_first_token_seconds", "Time to first token", label,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("sluice_e2e_request_latency_seconds", "Arrival to finish", label,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("sluice_request_queue_time_seconds", "Arrival to first scheduled", label,
                               buckets=LATENCY_BUCKETS, registry=r)
        self.output_gaps = Counter("sluice_lost_output_batches", "Gaps in the numbers of the scheduler's token "
                                   "batches: output lost on the link; each ended this frontend's live streams with "
                                   "an error", registry=r)
        self.streams_lost = Counter("sluice_streams_ended_by_lost_output", "Streams ended with an error because "
                                    "output was lost on the link to the scheduler", registry=r)
        self._per_token = _GapHistogram(model)
        self.registry.register(self._per_token)
        self.registry.register(_SchedulerCollector(snapshot, model, per_engine))
        self._recent_ttft: collections.deque[float] = collections.deque(maxlen=50)

    @property
    def generated_total(self) -> int:
        return self._per_token.generated

    def count_tokens(self, n: int) -> None:
        """Generated tokens as they stream, so tokens/s is live, not per finished request."""
        self._per_token.generated += n

    def frontend_stats(self) -> dict[str, float | int]:
        """What the dashboard needs beyond the scheduler's stats."""
        recent = self._recent_ttft
        return {
            "generation_tokens_total": self.generated_total,
            "ttft_recent_ms": 1000 * sum(recent) / len(recent) if recent else 0.0,
        }

    def record(self, *, request_id: str, endpoint: str, user: str, priority: int, prompt_tokens: int, completion_tokens: int,
               cached_tokens: int, finish_reason: str, ttft: float | None, itls: list[float], e2e: float,
               queue_s: float | None, preemptions: int | None) -> None:
        """One finished request: metrics, and its structured log line."""
        model = self._model()
        self.prompt_tokens.labels(model).inc(prompt_tokens)

        self.requests.labels(model, finish_reason).inc()
        self.by_endpoint.labels(model, endpoint).inc()
        if ttft is not None:
            self.ttft.labels(model).observe(ttft)
            self._recent_ttft.append(ttft)
        self._per_token.observe(itls)
        self.e2e.labels(model).observe(e2e)
        if queue_s is not None:
            self.queue.labels(model).observe(queue_s)
        log.info(
            "finished id=%s endpoint=%s user=%s priority=%d prompt_tokens=%d completion_tokens=%d cached_tokens=%d "
            "ttft_ms=%s e2e_ms=%.1f finish_reason=%s preemptions=%s",
            request_id, endpoint, user or "-", priority, prompt_tokens, completion_tokens, cached_tokens,
            f"{ttft * 1000:.1f}" if ttft is not None else "-", e2e * 1000, finish_reason,
            preemptions if preemptions is not None else "-",
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
