"""``sluice bench --plot-dir``: the PNG files are written, valid, and of the stated pixel size."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

from client.plots import HEIGHT_PX, WIDTH_PX, settings_compared, write_plots
from client.server_stats import ServerSample
from client.stats import build_report
from client.stream import RequestRecord


def png_header(path: Path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, after checking the signature and the chunk's CRC."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name}: not a PNG"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    body = data[16:16 + length]
    (crc,) = struct.unpack(">I", data[16 + length:20 + length])
    assert zlib.crc32(kind + body) == crc
    assert data.endswith(b"IEND\xaeB`\x82")  # the file was written to its end
    return struct.unpack(">II", body[:8])


def records() -> list[RequestRecord]:
    out = []
    for i in range(12):
        ttft, itl = 0.05 + 0.01 * i, [0.02] * 7
        out.append(RequestRecord(i, priority=i % 2 * 5, input_len=16, max_tokens=8, start=0.2 * i, ttft=ttft,
                                 itl=itl, latency=ttft + sum(itl), done=ttft + sum(itl), prompt_tokens=16,
                                 output_tokens=8, usage_reported=True, status=200))
    out.append(RequestRecord(12, priority=5, input_len=16, max_tokens=8, start=0.1, done=0.01, status=503,
                             error="HTTP 503: busy"))
    return out


def test_every_plot_is_a_png_of_the_stated_size(tmp_path: Path) -> None:
    rs = records()
    report = build_report(rs, duration=2.6, by_priority=True)
    samples = [ServerSample(0.5 * k, kv_usage=0.1 * k, running=k, waiting=max(0, 3 - k), preemptions=0)
               for k in range(6)]
    paths = write_plots(tmp_path / "plots", rs, report, samples)
    names = sorted(p.name for p in paths)
    assert names == ["kv_cache.png", "latency_cdf.png", "queues.png", "throughput.png"]
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == names
    for p in paths:
        assert png_header(p) == (WIDTH_PX, HEIGHT_PX), p.name


def test_without_server_samples_no_kv_plots(tmp_path: Path) -> None:
    rs = records()
    paths = write_plots(tmp_path, rs, build_report(rs, duration=2.6, by_priority=False), samples=[])
    assert sorted(p.name for p in paths) == ["latency_cdf.png", "throughput.png"]
    assert all(png_header(p) == (WIDTH_PX, HEIGHT_PX) for p in paths)


def test_a_run_where_everything_failed_still_plots(tmp_path: Path) -> None:
    failed = [RequestRecord(0, None, 16, 8, start=0.0, done=0.01, status=503, error="HTTP 503: busy")]
    paths = write_plots(tmp_path, failed, build_report(failed, duration=0.05, by_priority=False), samples=[])
    assert all(png_header(p) == (WIDTH_PX, HEIGHT_PX) for p in paths)


def test_the_settings_comparison_is_a_png_of_the_stated_size(tmp_path: Path) -> None:
    rs = records()
    for r in rs:
        r.label = "short" if r.index % 3 else "long"
    report = build_report(rs, duration=2.6, by_priority=False, by_class=True)
    runs = [("a", rs, report), ("b", rs[:5], build_report(rs[:5], duration=1.1, by_priority=False, by_class=True))]
    for focus in ("short", None):
        path = settings_compared(runs, focus, tmp_path / f"settings-{focus}.png")
        assert png_header(path) == (WIDTH_PX, HEIGHT_PX)
