"""``sluice bench``'s pure parts on known inputs: percentiles, the report's figures, the workload
(lengths, priorities, shared prefixes, arrivals) and the request bodies."""

from __future__ import annotations

import math
import random
import statistics

import numpy as np
import pytest
from rich.console import Console

from client.report import ROWS, print_report, report_table
from client.stats import (
    bin_widths,
    build_report,
    distribution_ms,
    output_timeline,
    peak_concurrency,
    peak_rate,
    percentile,
    summarize,
)
from client.stream import RequestRecord, request_body
from client.workload import (
    WORDS,
    DatasetRow,
    Length,
    PromptShape,
    RequestSpec,
    arrival_times,
    assign_priorities,
    build_requests,
    calibration_prompts,
    draw_seed,
    fit_shape,
    parse_length,
    parse_priority_mix,
    parse_token_id_range,
)


def record(i: int, *, start: float, ttft: float | None, itl: list[float], out: int, prompt: int | None = 10,
           priority: int | None = None, error: str | None = None) -> RequestRecord:
    latency = None if error or ttft is None else ttft + sum(itl)
    done = (latency or ttft or 0.1) + 0.001
    return RequestRecord(i, priority, input_len=12, max_tokens=out, start=start, ttft=ttft, itl=itl, latency=latency,
                         done=done, prompt_tokens=prompt, output_tokens=out, usage_reported=error is None,
                         status=200, error=error)


# ------------------------------------------------------------------------------ percentiles


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([4, 1, 3, 2], 0) == 1 and percentile([4, 1, 3, 2], 100) == 4
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_percentile_matches_numpy() -> None:
    rng = random.Random(1)
    for n in (1, 2, 5, 100, 1001):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for p in (0, 1, 50, 90, 99, 99.9, 100):
            assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)), rel=1e-12)


def test_distribution_in_milliseconds() -> None:
    d = distribution_ms([0.1, 0.2, 0.3, 0.4])
    assert d["mean"] == pytest.approx(250) and d["median"] == pytest.approx(250) and d["p50"] == pytest.approx(250)
    assert d["std"] == pytest.approx(1000 * statistics.pstdev([0.1, 0.2, 0.3, 0.4]))
    assert d["p90"] == pytest.approx(370) and d["p99"] == pytest.approx(397)
    assert distribution_ms([]) == dict.fromkeys(["mean", "median", "std", "p50", "p90", "p99"])


# ------------------------------------------------------------------------------ the report


def test_summary_of_known_records() -> None:
    records = [
        record(0, start=0.0, ttft=0.2, itl=[0.1, 0.1, 0.1], out=4, prompt=10, priority=0),
        record(1, start=0.5, ttft=0.4, itl=[0.2], out=2, prompt=20, priority=5),
        record(2, start=0.6, ttft=None, itl=[], out=0, prompt=None, priority=5, error="HTTP 503: busy"),
    ]
    s = summarize(records, duration=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (30, 6)
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 3.0 and s["total_token_throughput"] == 18.0
    assert s["ttft_ms"]["mean"] == pytest.approx(300) and s["ttft_ms"]["p50"] == pytest.approx(300)
    # TPOT per request: (latency - ttft) / (out - 1): 0.3/3 and 0.2/1.
    assert s["tpot_ms"]["mean"] == pytest.approx(150) and s["tpot_ms"]["p99"] == pytest.approx(199)
    # ITL: every gap pooled, 0.1 x 3 and 0.2.
    assert s["itl_ms"]["mean"] == pytest.approx(125) and s["itl_ms"]["median"] == pytest.approx(100)
    assert s["e2el_ms"]["mean"] == pytest.approx(550)
    # Open intervals [0, 0.501), [0.5, 1.101), [0.6, 0.701), the failed one too: two at once at most.
    assert s["peak_concurrency"] == 2
    assert s["prompt_tokens_from_usage"] and s["output_tokens_from_usage"]


def test_missing_usage_falls_back_and_says_so() -> None:
    r = record(0, start=0.0, ttft=0.1, itl=[0.1], out=2, prompt=None)
    s = summarize([r], duration=1.0)
    assert s["total_input_tokens"] == 12 and not s["prompt_tokens_from_usage"]


def test_single_token_requests_have_no_tpot() -> None:
    s = summarize([record(0, start=0, ttft=0.1, itl=[], out=1)], duration=1.0)
    assert s["tpot_ms"]["mean"] is None and s["itl_ms"]["mean"] is None and s["ttft_ms"]["mean"] == pytest.approx(100)


def test_nothing_succeeded() -> None:
    s = summarize([record(0, start=0, ttft=None, itl=[], out=0, error="boom")], duration=1.0)
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (0, 1, 0)
    assert s["ttft_ms"]["p99"] is None and s["max_output_tokens_per_s"] is None


def test_timeline_spreads_usage_tokens_over_chunks() -> None:
    # Chunks at 0.7, 1.2, 1.7 s carrying 6 tokens in all: 2 each.
    r = record(0, start=0.5, ttft=0.2, itl=[0.5, 0.5], out=6)
    assert output_timeline([r], duration=2.0) == [2.0, 4.0]
    # A run of 2.5 s: the last bin is 0.5 s wide and its rate is over those 0.5 s.
    late = record(1, start=2.0, ttft=0.1, itl=[], out=1)
    assert bin_widths(2.5) == [1.0, 1.0, 0.5]
    assert output_timeline([r, late], duration=2.5) == [2.0, 4.0, 2.0]
    assert peak_rate([2.0, 4.0, 9.0], duration=2.5) == 4.0  # the sliver at the end does not count
    assert peak_rate([2.0, 4.0], duration=2.0) == 4.0


def test_peak_concurrency_half_open_intervals() -> None:
    a = record(0, start=0.0, ttft=0.5, itl=[], out=1)
    b = record(1, start=0.0, ttft=0.5, itl=[], out=1)
    a.done, b.start, b.done = 1.0, 1.0, 1.0  # b opens when a closes
    assert peak_concurrency([a, b]) == 1


def test_report_per_priority_and_errors() -> None:
    records = [record(i, start=0.1 * i, ttft=0.1, itl=[0.05], out=2, priority=p)
               for i, p in enumerate([0, 5, 5, None])]
    records += [record(4, start=0, ttft=None, itl=[], out=0, priority=5, error="HTTP 503: busy"),
                record(5, start=0, ttft=None, itl=[], out=0, priority=0, error="HTTP 503: busy"),
                record(6, start=0, ttft=None, itl=[], out=0, priority=0, error="ReadError")]
    report = build_report(records, duration=1.0, by_priority=True)
    assert list(report["by_priority"]) == ["0", "5", "default"]
    assert {k: (v["completed"], v["failed"]) for k, v in report["by_priority"].items()} == {
        "0": (1, 2), "5": (2, 1), "default": (1, 0)}
    assert report["errors"] == {"HTTP 503: busy": 2, "ReadError": 1}
    table = report_table(report)
    assert [c.header for c in table.columns] == ["metric", "all", "priority 0", "priority 5", "priority default"]
    assert table.row_count == len(ROWS)
    console = Console(record=True, width=140)
    print_report(report | {"notes": ["a note"]}, "title", console)
    text = console.export_text()
    assert "3 request(s) failed" in text and "2 x HTTP 503: busy" in text and "a note" in text
    narrow = Console(record=True, width=80)
    long_title = "sluice bench: smollm2 at http://127.0.0.1:8000 (completions), 64 requests, C=16"
    print_report(report, long_title, narrow)
    assert narrow.export_text().splitlines()[0] == long_title, "the title on one line at 80 columns"
    assert "by_priority" not in build_report(records, 1.0, by_priority=False)


# ------------------------------------------------------------------------------ the workload


def test_parsers() -> None:
    assert parse_length("128") == Length(128, 128) and parse_length("32:512") == Length(32, 512)
    assert parse_priority_mix("0:0.2,5:0.8") == [(0, 0.2), (5, 0.8)]
    assert parse_priority_mix("-1:1") == [(-1, 1.0)]
    assert parse_token_id_range("10:20") == (10, 20)
    for bad in ("0", "5:4", "x", "1:"):
        with pytest.raises(ValueError):
            parse_length(bad)
    for bad in ("0:0.5", "0:0.5,0:0.5", "0", "a:1", "0:0,1:1"):
        with pytest.raises(ValueError):
            parse_priority_mix(bad)
    with pytest.raises(ValueError):
        parse_token_id_range("20:10")


def test_priorities_come_in_exact_counts() -> None:
    mix = [(0, 0.2), (5, 0.8)]
    got = assign_priorities(10, mix, random.Random(0))
    assert sorted(p or 0 for p in got) == [0] * 2 + [5] * 8 and None not in got
    thirds = assign_priorities(10, [(1, 1 / 3), (2, 1 / 3), (3, 1 / 3)], random.Random(0))
    assert len(thirds) == 10 and sorted({thirds.count(p) for p in (1, 2, 3)}) == [3, 4]
    assert assign_priorities(3, None, random.Random(0)) == [None] * 3


def test_text_prompts_follow_the_shape_and_share_the_prefix() -> None:
    shape = PromptShape(per_word=2.0, overhead=1.0)
    specs = build_requests(20, seed=3, input_len=Length(41, 41), output_len=Length(5, 9), shape=shape, shared_prefix=10)
    texts = [s.prompt.split() for s in specs if isinstance(s.prompt, str)]
    assert len(texts) == 20
    assert len({tuple(words[:5]) for words in texts}) == 1  # 10 tokens at 2 per word: the same 5 words first
    # (41 - 1 overhead - 10 prefix) / 2 per word = 15 words after the prefix.
    assert all(len(words) == 5 + 15 for words in texts)
    assert all(w in WORDS for words in texts for w in words)
    assert len({tuple(words) for words in texts}) == 20
    assert {s.output_len for s in specs} <= set(range(5, 10)) and len({s.output_len for s in specs}) > 1
    again = build_requests(20, seed=3, input_len=Length(41, 41), output_len=Length(5, 9), shape=shape, shared_prefix=10)
    assert again == specs
    warm = build_requests(2, seed=3, input_len=Length(41, 41), output_len=Length(5, 9), shape=shape, shared_prefix=10,
                          stream="warmup")
    assert isinstance(warm[0].prompt, str) and warm[0].prompt != specs[0].prompt
    assert warm[0].prompt.split()[:5] == texts[0][:5]


def test_drawn_seeds_differ_and_so_do_their_requests() -> None:
    a, b = draw_seed(), draw_seed()
    assert a != b and all(0 <= s < 2**31 for s in (a, b))

    def specs(seed: int) -> list[RequestSpec]:
        return build_requests(4, seed=seed, input_len=Length(8, 8), output_len=Length(2, 2), token_ids=(100, 500))

    assert specs(a) == specs(a) and specs(a) != specs(b)


def test_token_id_prompts_are_exact() -> None:
    specs = build_requests(8, seed=0, input_len=Length(16, 64), output_len=Length(4, 4), token_ids=(1000, 2000),
                           shared_prefix=8, priority_mix=[(0, 0.5), (3, 0.5)])
    ids = [s.prompt for s in specs if isinstance(s.prompt, list)]
    assert len(ids) == 8 and [len(p) for p in ids] == [s.input_len for s in specs]
    assert all(1000 <= t < 2000 for p in ids for t in p)
    assert len({tuple(p[:8]) for p in ids}) == 1
    assert sorted(s.priority or 0 for s in specs) == [0] * 4 + [3] * 4


def test_dataset_rows_replace_generated_prompts() -> None:
    rows = [DatasetRow("hello there", 3), DatasetRow([5, 6, 7], 4)]
    specs = build_requests(5, seed=0, input_len=Length(1, 1), output_len=Length(1, 1), dataset=rows)
    assert sorted(str(s.prompt) for s in specs[:2]) == sorted(["hello there", "[5, 6, 7]"])
    assert [s.prompt for s in specs[2:4]] == [s.prompt for s in specs[:2]]  # cycled
    assert {(str(s.prompt), s.output_len, s.input_len) for s in specs} == {("hello there", 3, 0), ("[5, 6, 7]", 4, 3)}


def test_calibration_fit() -> None:
    (w1, _), (w2, _) = calibration_prompts()
    assert (w1, w2) == (len(WORDS), 2 * len(WORDS))
    shape = fit_shape([(w1, 1 + 3 * w1), (w2, 1 + 3 * w2)])
    assert shape == PromptShape(3.0, 1.0)
    assert shape.words_for(31) == 10
    assert fit_shape([(10, 5), (20, 5)]) == PromptShape()  # a server that counts nothing: 1 per word


def test_poisson_arrivals() -> None:
    n, rate = 4000, 10.0
    times = arrival_times(n, rate, 1.0, seed=5)
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert times[-1] == pytest.approx(n / rate)  # scaled to offer exactly n / rate
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=1e-9)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.05)  # exponential
    even = arrival_times(n, rate, 4.0, seed=5)  # gamma of shape 4: coefficient of variation 1/2
    even_gaps = [b - a for a, b in zip([0.0, *even], even, strict=False)]
    assert statistics.pstdev(even_gaps) / statistics.fmean(even_gaps) == pytest.approx(0.5, abs=0.05)
    assert arrival_times(5, math.inf, 1.0, seed=5) == [0.0] * 5
    assert arrival_times(50, rate, 1.0, seed=5) == arrival_times(50, rate, 1.0, seed=5)
    assert arrival_times(50, rate, 1.0, seed=5) != arrival_times(50, rate, 1.0, seed=6)


def test_request_bodies() -> None:
    from client.workload import RequestSpec

    spec = RequestSpec("a b c", 3, 7, None)
    body = request_body(spec, "m", "completions", ignore_eos=False)
    assert body == {"model": "m", "max_tokens": 7, "stream": True, "stream_options": {"include_usage": True},
                    "temperature": 0.0, "prompt": "a b c"}  # greedy by default, as vllm bench serve asks
    assert "temperature" not in request_body(spec, "m", "completions", ignore_eos=False, temperature=None)
    chat = request_body(RequestSpec("a b c", 3, 7, 5), "m", "chat", ignore_eos=True)
    assert chat["messages"] == [{"role": "user", "content": "a b c"}] and "prompt" not in chat
    assert chat["ignore_eos"] is True and chat["priority"] == 5 and "min_tokens" not in chat
