"""The scenarios of ``sluice bench --scenario NAME``: one per upstream discussion Sluice answers.

A scenario is a workload and the server settings it compares (name -> ``sluice serve`` flags).
The runner (``client.compare``) starts one server per setting, one after another, sends the same
seeded workload to each and tabulates ``metrics`` side by side; ``headline`` names the figures
summed up in a line under the table. A workload is groups of requests (a class label, a count,
exact prompt and output lengths, when each is sent), so adding a scenario is a builder and a
``Scenario(...)`` entry.

Sizes are for SmolLM2-135M on a 2-core CPU at ``--scale 1`` (measured here: about 100 output
tok/s for one stream, 600 for 16; a 1,024-token prompt prefills in 0.8 s, an 8,000-token one in
about 19 s, attention dominating): each scenario is sized to run in one to three minutes.
``--scale`` multiplies request counts and token lengths (within the bounds each builder states),
and the gaps between arrivals with them, so the load keeps its shape at any size.

Prompts are token ids (exact lengths on any tokenizer; ``ignore_eos`` makes outputs exact too).
Everything here is pure: the same scale and seed give the same requests at the same offsets.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from client.workload import DEFAULT_TOKEN_IDS, Length, RequestSpec, build_requests

BLOCK_SIZE = 16  # sluice serve's default --block-size; the preemption scenario sets it explicitly


@dataclass(frozen=True)
class Group:
    """``count`` requests of one class: ``input_len`` prompt tokens, ``output_len`` output tokens,
    the first sent ``start_s`` after the run begins and each next one ``interval_s`` later
    (0: all at once). ``priority`` None: no priority field is sent. ``extra``: body fields every
    request of the group carries (``RequestSpec.extra``)."""

    label: str
    count: int
    input_len: int
    output_len: int
    start_s: float = 0.0
    interval_s: float = 0.0
    priority: int | None = None
    extra: Mapping[str, Any] | None = None

    def offsets(self) -> list[float]:
        return [self.start_s + i * self.interval_s for i in range(self.count)]

    def kv_blocks(self, block_size: int = BLOCK_SIZE) -> int:
        """KV blocks the group's requests hold at their full length, all together."""
        return self.count * math.ceil((self.input_len + self.output_len) / block_size)


@dataclass(frozen=True)
class Workload:
    """``shared_prefix``: the fraction of every prompt that all prompts share (one group only:
    groups of other lengths would draw other prefixes). ``server_flags``: flags every setting's
    server gets, derived from the workload (they must not depend on the model's length)."""

    groups: tuple[Group, ...]
    shared_prefix: float = 0.0
    server_flags: tuple[str, ...] = ()

    def requests(self, seed: int) -> tuple[list[RequestSpec], list[float]]:
        """Every request and its send offset (s from the run's start), in sending order."""
        sent: list[tuple[float, RequestSpec]] = []
        for g in self.groups:
            specs = build_requests(g.count, seed=seed, input_len=Length(g.input_len, g.input_len),
                                   output_len=Length(g.output_len, g.output_len),
                                   shared_prefix=round(g.input_len * self.shared_prefix),
                                   token_ids=DEFAULT_TOKEN_IDS,
                                   priority_mix=None if g.priority is None else [(g.priority, 1.0)],
                                   stream=g.label, label=g.label)
            if g.extra:
                specs = [dataclasses.replace(s, extra=g.extra) for s in specs]
            sent += zip(g.offsets(), specs, strict=True)
        sent.sort(key=lambda pair: pair[0])  # stable: a group's order holds at equal offsets
        return [s for _, s in sent], [t for t, _ in sent]

    def kv_blocks(self, block_size: int = BLOCK_SIZE) -> int:
        return sum(g.kv_blocks(block_size) for g in self.groups)


@dataclass(frozen=True)
class Metric:
    """One row of the comparison: ``path`` leads into a setting's report, e.g. ``("by_class",
    "short", "ttft_ms", "p99")`` or ``("server", "preemptions")``."""

    label: str
    path: tuple[str, ...]

    def value(self, report: Mapping[str, Any]) -> Any:
        node: Any = report
        for key in self.path:
            node = node.get(key) if isinstance(node, Mapping) else None
        return node


@dataclass(frozen=True)
class Scenario:
    name: str
    upstream: str  # the upstream discussion whose situation it measures
    question: str  # what the comparison answers, one line
    settings: Mapping[str, tuple[str, ...]]  # setting name -> sluice serve flags; the first is the baseline
    build: Callable[[float, int | None], Workload]  # (scale, the server's max_model_len or None)
    metrics: tuple[Metric, ...]
    headline: tuple[str, ...]  # labels of metrics summed up under the table


def _scaled(n: int, scale: float, least: int = 1) -> int:
    """A request count or a token length at ``--scale``, never below ``least``."""
    return max(least, round(n * scale))


def _summary(cls: str | None, key: str, sub: str | None = None) -> tuple[str, ...]:
    return (*(("summary",) if cls is None else ("by_class", cls)), key, *((sub,) if sub else ()))


# --- long-prefill (vLLM's feature request for concurrent partial prefills): one long prompt must not block everyone --------------------------

LONG_PROMPT = 8000  # the example in that request, and SmolLM2's context is 8192: never longer, at any scale
LONG_OUTPUT, SHORT_PROMPT, SHORT_OUTPUT = 16, 300, 32
SHORT_DELAY_S = 0.3  # the first short prompt arrives this long after the first long one
# A long prompt arrives every LONG_GAP_PER_TOKEN_S x its length: 20 s at 8000 tokens, about what its
# prefill alone takes on SmolLM2 here, so one long prompt is (mostly) being prefilled at a time.
# All of them at once would put two long prompts in the two prefill slots of
# --min-concurrent-prefills 2 and tell nothing about the short ones. One long prompt at scale 1
# (the example in that request): here each takes 20 to 50 s to prefill, two made the run 3.5 minutes.
LONG_GAP_PER_TOKEN_S = 0.0025


def long_prefill(scale: float, max_model_len: int | None) -> Workload:
    long_len = min(LONG_PROMPT, _scaled(LONG_PROMPT, scale, 64))
    if max_model_len is not None:
        long_len = min(long_len, max_model_len - LONG_OUTPUT)
    n_long, n_short = _scaled(1, scale), _scaled(12, scale, least=4)
    gap = long_len * LONG_GAP_PER_TOKEN_S
    return Workload((
        Group("long", n_long, long_len, LONG_OUTPUT, 0.0, gap),
        # Short prompts one by one over the long prompts' whole span.
        Group("short", n_short, _scaled(SHORT_PROMPT, scale, 16), SHORT_OUTPUT, SHORT_DELAY_S, n_long * gap / n_short),
    ))


LONG_PREFILL = Scenario(
    name="long-prefill",
    upstream="vLLM's feature request for concurrent partial prefills",
    question="does a long prompt being prefilled hold up the short ones arriving behind it?",
    settings={
        # The default budget (2048) chunks a long prompt, and the prompt takes all of it.
        "min-prefills-1": ("--min-concurrent-prefills", "1"),
        # The budget split across two prompts: a short one advances beside the long one.
        "min-prefills-2": ("--min-concurrent-prefills", "2"),
        # A budget the long prompt fits in whole: it prefills in one step, everything else waits.
        "no-chunking": ("--max-num-batched-tokens", str(LONG_PROMPT + 192)),
    },
    build=long_prefill,
    metrics=(
        Metric("short TTFT p50 (ms)", _summary("short", "ttft_ms", "p50")),
        Metric("short TTFT p99 (ms)", _summary("short", "ttft_ms", "p99")),
        Metric("short ITL p99 (ms)", _summary("short", "itl_ms", "p99")),
        Metric("short E2E p50 (ms)", _summary("short", "e2el_ms", "p50")),
        Metric("long TTFT p50 (ms)", _summary("long", "ttft_ms", "p50")),
        Metric("long TTFT p99 (ms)", _summary("long", "ttft_ms", "p99")),
        Metric("output tokens/s", _summary(None, "output_throughput")),
    ),
    headline=("short TTFT p99 (ms)", "long TTFT p50 (ms)"),
)


# --- priority (vLLM's priority-scheduling RFC): interactive requests amid a saturating batch load ---------------------

SEATS = 8  # --max-num-seqs: the batch load alone keeps more requests than this in the server


def priority(scale: float, max_model_len: int | None) -> Workload:
    n_batch, n_inter = _scaled(48, scale, least=2 * SEATS), _scaled(16, scale, least=4)
    return Workload((
        # All queued at once: every seat stays taken by a batch request until the queue drains,
        # after the last interactive request has come.
        Group("batch", n_batch, _scaled(256, scale, 16), _scaled(128, scale, 16), priority=5),
        Group("interactive", n_inter, _scaled(256, scale, 16), _scaled(32, scale, 8),
              start_s=1.0 * scale, interval_s=1.0 * scale, priority=0),
    ), server_flags=("--max-num-seqs", str(SEATS)))


PRIORITY = Scenario(
    name="priority",
    upstream="vLLM's priority-scheduling RFC",
    question="do interactive (priority 0) requests get a seat at once amid batch (priority 5) traffic, and at what cost?",
    settings={
        # Priority orders the waiting queue only: an interactive request waits for a seat to free.
        "no-preemption": ("--scheduling-policy", "priority", "--no-priority-preemption"),
        # It takes the seat of a running batch request at once (Sluice's default).
        "preemption": ("--scheduling-policy", "priority", "--priority-preemption"),
    },
    build=priority,
    metrics=(
        Metric("interactive TTFT p50 (ms)", _summary("interactive", "ttft_ms", "p50")),
        Metric("interactive TTFT p99 (ms)", _summary("interactive", "ttft_ms", "p99")),
        Metric("interactive E2E p99 (ms)", _summary("interactive", "e2el_ms", "p99")),
        Metric("batch output tokens/s", _summary("batch", "output_throughput")),
        Metric("batch E2E p99 (ms)", _summary("batch", "e2el_ms", "p99")),
        Metric("server preemptions", ("server", "preemptions")),
    ),
    headline=("interactive TTFT p99 (ms)", "batch output tokens/s"),
)


# --- shared-prefix (vLLM's proposal for prefix-cache-aware admission): prompts that share 90% of their tokens ---------------------------

def shared_prefix(scale: float, max_model_len: int | None) -> Workload:
    prompt = _scaled(1024, scale, 64)
    # About 0.8 s of prefill per whole prompt on SmolLM2 here: a request every 0.9 s keeps a server
    # that recomputes the prefix nearly busy, and one that caches it mostly idle.
    return Workload((Group("shared", _scaled(40, scale, least=4), prompt, _scaled(32, scale, 8),
                           interval_s=0.9 * prompt / 1024),), shared_prefix=0.9)


SHARED_PREFIX = Scenario(
    name="shared-prefix",
    upstream="vLLM's proposal for prefix-cache-aware admission",
    question="what does prefix caching save when every prompt starts with the same 90%?",
    settings={"no-caching": ("--no-enable-prefix-caching",), "caching": ("--enable-prefix-caching",)},
    build=shared_prefix,
    metrics=(
        Metric("TTFT p50 (ms)", _summary(None, "ttft_ms", "p50")),
        Metric("TTFT p99 (ms)", _summary(None, "ttft_ms", "p99")),
        Metric("E2E p50 (ms)", _summary(None, "e2el_ms", "p50")),
        Metric("output tokens/s", _summary(None, "output_throughput")),
        Metric("input tokens", _summary(None, "total_input_tokens")),
        Metric("  of which cached", _summary(None, "cached_input_tokens")),
    ),
    headline=("TTFT p50 (ms)", "output tokens/s"),
)


# --- preemption (vLLM's guide to preemption and chunked prefill): more demand than KV blocks ------------------------------------------

KV_SHARE = 3  # the cache holds a third of the workload's blocks at full length


def preemption(scale: float, max_model_len: int | None) -> Workload:
    groups = (Group("all", _scaled(24, scale, least=KV_SHARE * 2), _scaled(256, scale, 32), _scaled(256, scale, 32)),)
    blocks = math.ceil(sum(g.kv_blocks() for g in groups) / KV_SHARE)
    return Workload(groups, server_flags=("--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(blocks)))


PREEMPTION = Scenario(
    name="preemption",
    upstream="vLLM's guide to preemption and chunked prefill",
    question="when the KV cache runs out, is it cheaper to recompute a preempted request or swap it to host memory?",
    settings={"recompute": ("--preemption-mode", "recompute"), "swap": ("--preemption-mode", "swap")},
    build=preemption,
    metrics=(
        Metric("output tokens/s", _summary(None, "output_throughput")),
        Metric("E2E p50 (ms)", _summary(None, "e2el_ms", "p50")),
        Metric("E2E p99 (ms)", _summary(None, "e2el_ms", "p99")),
        Metric("TTFT p99 (ms)", _summary(None, "ttft_ms", "p99")),
        Metric("ITL p99 (ms)", _summary(None, "itl_ms", "p99")),
        Metric("server preemptions", ("server", "preemptions")),
        Metric("  of which swapped", ("server", "swaps")),
    ),
    headline=("output tokens/s", "E2E p99 (ms)"),
)


# --- json (structured output; SGLang's jump-forward decoding): JSON-constrained streams beside free ones ----------

# Records in a list that never ends within the output (at least 50 of them): every constrained
# request generates exactly its output_len, as the free ones do with ignore_eos, so their
# throughputs compare. Keys and punctuation are forced: about half of each record. Every value is
# bounded (a model given random token ids as its prompt writes a number's digits forever).
JSON_RECORDS = {"type": "array", "minItems": 50, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "city", "active", "score"],
    "properties": {"id": {"type": "integer", "minimum": 0}, "name": {"type": "string", "maxLength": 16},
                   "city": {"enum": ["Paris", "Berlin", "Lagos", "Lima", "Osaka"]},
                   "active": {"type": "boolean"}, "score": {"type": "integer", "minimum": 0, "maximum": 100}}}}


def json_output(scale: float, max_model_len: int | None) -> Workload:
    n, prompt, output = _scaled(16, scale, least=2), _scaled(64, scale, 8), _scaled(128, scale, 16)
    return Workload((
        Group("json", n, prompt, output, extra={"structured_outputs": {"json": JSON_RECORDS}}),
        Group("free", n, prompt, output),
    ))


JSON_OUTPUT = Scenario(
    name="json",
    upstream="SGLang's jump-forward decoding for structured output",
    question="what do JSON-constrained streams cost beside free ones, and what does jump-forward save them?",
    settings={"no-jump-forward": ("--no-jump-forward",), "jump-forward": ("--jump-forward",)},
    build=json_output,
    # Both classes send all their requests at once and share the run: per class, time per token
    # and end-to-end latency tell them apart (tokens/s over the run's duration would not).
    metrics=(
        Metric("json TPOT p50 (ms)", _summary("json", "tpot_ms", "p50")),
        Metric("free TPOT p50 (ms)", _summary("free", "tpot_ms", "p50")),
        Metric("json E2E p50 (ms)", _summary("json", "e2el_ms", "p50")),
        Metric("free E2E p50 (ms)", _summary("free", "e2el_ms", "p50")),
        Metric("output tokens/s", _summary(None, "output_throughput")),
        Metric("server forward passes", ("server", "steps")),
        Metric("jump-forward tokens", ("server", "jump_forward_tokens")),
    ),
    headline=("json TPOT p50 (ms)", "output tokens/s"),
)


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (LONG_PREFILL, PRIORITY, SHARED_PREFIX, PREEMPTION, JSON_OUTPUT)}
