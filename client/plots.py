"""PNG plots of a run (matplotlib's Agg renderer: no display needed, no pyplot global state).

- ``latency_cdf.png``: CDFs of TTFT and of end-to-end latency, one line per workload class (a
  scenario's) or else per priority class;
- ``throughput.png``: output tokens per second in 1 s bins;
- ``kv_cache.png`` and ``queues.png``: the server's KV cache usage and its running / waiting queue
  lengths, from the ``/admin/stats`` samples (Sluice only; skipped without samples);
- ``settings.png`` (``sluice bench --scenario``): one line per server setting, the TTFT CDF of the
  scenario's class of interest and the output throughput over time, side by side.

Every file is WIDTH_PX x HEIGHT_PX pixels.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from client.server_stats import ServerSample
from client.stats import class_labels, priority_label
from client.stream import RequestRecord

DPI = 100
WIDTH_PX, HEIGHT_PX = 1000, 500


def _figure(ncols: int = 1) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return fig, list(axes)


def _save(fig: Figure, path: Path) -> Path:
    # No bbox_inches="tight": the pixel size stays exactly the figure's.
    fig.savefig(path, dpi=DPI, format="png")
    return path


def _cdf(ax: Axes, values_ms: Sequence[float], label: str) -> None:
    ordered = sorted(values_ms)
    n = len(ordered)
    if n:  # from 0 at the smallest value, a step up at each
        ax.step([ordered[0], *ordered], [0.0, *((i + 1) / n for i in range(n))], where="post", label=f"{label} (n={n})")


def latency_cdf(records: Sequence[RequestRecord], path: Path) -> Path:
    fig, (ax_ttft, ax_e2e) = _figure(2)
    good = [r for r in records if r.ok]
    groups: list[tuple[str, list[RequestRecord]]] = [("all", good)]
    if labels := class_labels(records):  # a scenario's workload classes
        groups += [(label, [r for r in good if r.label == label]) for label in labels]
    elif len(classes := sorted({r.priority for r in good}, key=lambda p: (p is None, p or 0))) > 1:
        groups += [(f"priority {priority_label(p)}", [r for r in good if r.priority == p]) for p in classes]
    for label, rs in groups:
        if rs:
            _cdf(ax_ttft, [1000 * r.ttft for r in rs if r.ttft is not None], label)
            _cdf(ax_e2e, [1000 * r.latency for r in rs if r.latency is not None], label)
    for ax, name in ((ax_ttft, "time to first token"), (ax_e2e, "end-to-end latency")):
        ax.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        if good:
            ax.legend(loc="lower right")
    return _save(fig, path)


def throughput(timeline: dict[str, Any], path: Path) -> Path:
    fig, (ax,) = _figure()
    rates, widths = timeline["output_tokens_per_s"], timeline["bin_widths_s"]
    starts = [sum(widths[:i]) for i in range(len(widths))]
    ax.bar(starts, rates, width=widths, align="edge", alpha=0.7, edgecolor="white")
    ax.set(title="output throughput", xlabel=f"time (s), {timeline['bin_s']:g} s bins", ylabel="output tokens/s")
    return _save(fig, path)


def kv_cache(samples: Sequence[ServerSample], path: Path) -> Path:
    """Scaled to the data (a run that used 3% of the cache must not be a flat line at the
    bottom), with the capacity drawn when it is in view and said in the corner when it is not."""
    fig, (ax,) = _figure()
    usage = [100 * s.kv_usage for s in samples]
    ax.plot([s.t for s in samples], usage, marker=".", drawstyle="steps-post", label="in use")
    top = min(105.0, max(5.0, 1.25 * max(usage, default=0.0)))
    ax.set(title="server KV cache usage (GET /admin/stats)", xlabel="time (s)", ylabel="KV blocks in use (%)",
           ylim=(0, top))
    if top >= 100:
        ax.axhline(100, color="tab:red", linestyle="--", linewidth=1, label="capacity")
        ax.legend(loc="lower right")
    else:
        ax.text(0.99, 0.97, f"capacity: 100% (above this view; peak {max(usage, default=0.0):.1f}%)",
                transform=ax.transAxes, ha="right", va="top", fontsize=8, color="tab:red")
    return _save(fig, path)


def queues(samples: Sequence[ServerSample], path: Path) -> Path:
    fig, (ax,) = _figure()
    ts = [s.t for s in samples]
    # Counts held until the next sample: steps, not slopes between samples.
    ax.plot(ts, [s.running for s in samples], marker=".", drawstyle="steps-post", label="running")
    ax.plot(ts, [s.waiting for s in samples], marker=".", drawstyle="steps-post", label="waiting")
    ax.set(title="server queues (GET /admin/stats)", xlabel="time (s)", ylabel="requests")
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    # Outside the axes: inside, it covered a line whichever corner it took.
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return _save(fig, path)


def settings_compared(runs: Sequence[tuple[str, Sequence[RequestRecord], dict[str, Any]]], focus: str | None,
                      path: Path) -> Path:
    """``runs``: (setting name, its records, its report) each; ``focus``: the workload class whose
    TTFT the scenario is about (None: every request)."""
    fig, (ax_ttft, ax_rate) = _figure(2)
    for name, records, report in runs:
        good = [r for r in records if r.ok and r.ttft is not None and (focus is None or r.label == focus)]
        _cdf(ax_ttft, [1000 * r.ttft for r in good if r.ttft is not None], name)
        timeline = report["timeline"]
        widths = timeline["bin_widths_s"]
        mids = [sum(widths[:i]) + w / 2 for i, w in enumerate(widths)]
        ax_rate.plot(mids, timeline["output_tokens_per_s"], marker=".", label=name)
    who = "every request" if focus is None else f"{focus} requests"
    ax_ttft.set(title=f"time to first token CDF, {who}", xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
    ax_rate.set(title="output throughput, all requests", xlabel="time (s), 1 s bins", ylabel="output tokens/s")
    ax_rate.set_ylim(bottom=0)
    for ax in (ax_ttft, ax_rate):
        ax.legend(loc="lower right")
    return _save(fig, path)


def write_plots(out_dir: Path, records: Sequence[RequestRecord], report: dict[str, Any],
                samples: Sequence[ServerSample]) -> list[Path]:
    """Every plot the run's data allows, into ``out_dir`` (created); returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [latency_cdf(records, out_dir / "latency_cdf.png"), throughput(report["timeline"], out_dir / "throughput.png")]
    if samples:
        paths += [kv_cache(samples, out_dir / "kv_cache.png"), queues(samples, out_dir / "queues.png")]
    return paths
