"""Prometheus metrics (``GET /metrics``), all named ``sluice_*`` and labelled with the model.

Two sources: what the frontend sees itself (tokens, latencies, finishes — recorded once per
request when it ends), and the scheduler's state, which arrives with every ``Pong`` and is
exposed by a collector that reads that latest snapshot at scrape time.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
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
    "worker_busy_s_total": ("sluice_worker_busy_seconds", "Worker compute time", "counter"),
    "internal_errors": ("sluice_internal_errors", "Scheduler bugs caught (a handler or the core raised; "
                        "the request it concerned was ended with an error)", "counter"),
    "malformed_frames": ("sluice_malformed_frames", "Frames on the scheduler's sockets that were not Sluice "
                         "messages (dropped)", "counter"),
}


class _SchedulerCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, Any] | None], model: Callable[[], str]) -> None:
        self._snapshot = snapshot
        self._model = model

    def collect(self) -> Iterator[Metric]:
        stats = self._snapshot() or {}
        model = self._model()
        for key, (name, doc, kind) in SCHEDULER_METRICS.items():
            family: Metric
            if kind == "gauge":
                family = GaugeMetricFamily(name, doc, labels=["model_name"])
            else:
                family = CounterMetricFamily(name, doc, labels=["model_name"])
            value = stats.get(key)
            if isinstance(value, (int, float)):
                family.add_metric([model], float(value))
            yield family


class Metrics:
    def __init__(self, snapshot: Callable[[], dict[str, Any] | None], model: Callable[[], str]) -> None:
        self.registry = CollectorRegistry()
        self._model = model
        label = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("sluice_prompt_tokens", "Prompt tokens of finished requests", label, registry=r)
        self.generation_tokens = Counter("sluice_generation_tokens", "Generated tokens", label, registry=r)
        self.requests = Counter("sluice_request_success", "Finished requests by finish reason",
                                [*label, "finished_reason"], registry=r)
        self.ttft = Histogram("sluice_time_to_first_token_seconds", "Time to first token", label,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("sluice_inter_token_latency_seconds", "Time between tokens of a stream", label,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("sluice_e2e_request_latency_seconds", "Arrival to finish", label,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("sluice_request_queue_time_seconds", "Arrival to first scheduled", label,
                               buckets=LATENCY_BUCKETS, registry=r)
        self.registry.register(_SchedulerCollector(snapshot, model))
        self.generated_total = 0
        self._recent_ttft: collections.deque[float] = collections.deque(maxlen=50)

    def count_tokens(self, n: int) -> None:
        """Generated tokens as they stream, so tokens/s is live, not per finished request."""
        self.generation_tokens.labels(self._model()).inc(n)
        self.generated_total += n

    def frontend_stats(self) -> dict[str, float | int]:
        """What the dashboard needs beyond the scheduler's stats."""
        recent = self._recent_ttft
        return {
            "generation_tokens_total": self.generated_total,
            "ttft_recent_ms": 1000 * sum(recent) / len(recent) if recent else 0.0,
        }

    def record(self, *, request_id: str, user: str, priority: int, prompt_tokens: int, completion_tokens: int,
               cached_tokens: int, finish_reason: str, ttft: float | None, itls: list[float], e2e: float,
               queue_s: float | None, preemptions: int | None) -> None:
        """One finished request: metrics, and its structured log line."""
        model = self._model()
        self.prompt_tokens.labels(model).inc(prompt_tokens)

        self.requests.labels(model, finish_reason).inc()
        if ttft is not None:
            self.ttft.labels(model).observe(ttft)
            self._recent_ttft.append(ttft)
        itl = self.itl.labels(model)
        for gap in itls:
            itl.observe(gap)
        self.e2e.labels(model).observe(e2e)
        if queue_s is not None:
            self.queue.labels(model).observe(queue_s)
        log.info(
            "finished id=%s user=%s priority=%d prompt_tokens=%d completion_tokens=%d cached_tokens=%d "
            "ttft_ms=%s e2e_ms=%.1f finish_reason=%s preemptions=%s",
            request_id, user or "-", priority, prompt_tokens, completion_tokens, cached_tokens,
            f"{ttft * 1000:.1f}" if ttft is not None else "-", e2e * 1000, finish_reason,
            preemptions if preemptions is not None else "-",
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
