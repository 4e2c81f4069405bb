"""The report on the terminal: one rich table, overall, per priority class and per workload class,
then the errors."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

# (row label, key in a summary, sub-key of a distribution or None)
ROWS: list[tuple[str, str, str | None]] = [
    ("successful requests", "completed", None),
    ("failed requests", "failed", None),
    ("duration (s)", "duration_s", None),
    ("input tokens", "total_input_tokens", None),
    ("  of which cached", "cached_input_tokens", None),
    ("output tokens", "total_output_tokens", None),
    ("requests/s", "request_throughput", None),
    ("output tokens/s", "output_throughput", None),
    ("total tokens/s (in + out)", "total_token_throughput", None),
    ("peak output tokens/s (1 s)", "max_output_tokens_per_s", None),
    ("peak concurrency", "peak_concurrency", None),
]
for _name, _key in [("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms")]:
    ROWS += [(f"{_name} {s} (ms)", _key, s) for s in ("mean", "p50", "p90", "p99")]
ROWS += [(f"E2E latency {s} (ms)", "e2el_ms", s) for s in ("mean", "p50", "p90", "p99")]


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:,.2f}"


def report_table(report: dict[str, Any]) -> Table:
    columns = ({"all": report["summary"]} | {f"priority {k}": v for k, v in report.get("by_priority", {}).items()}
               | dict(report.get("by_class", {})))
    table = Table()
    table.add_column("metric")
    for name in columns:
        table.add_column(name, justify="right")
    for label, key, sub in ROWS:
        cells = [s[key] if sub is None else s[key][sub] for s in columns.values()]
        table.add_row(label, *(fmt(c) for c in cells))
    return table


def print_report(report: dict[str, Any], title: str, console: Console | None = None) -> None:
    console = console or Console()
    # The title on its own line, at the console's width: as the table's title it wrapped to the
    # table's (three lines at 80 columns).
    console.print(title, markup=False, highlight=False)
    console.print(report_table(report))
    summary = report["summary"]
    notes = list(report.get("notes", []))
    if not summary["prompt_tokens_from_usage"]:
        notes.append("input tokens: the server reported no usage for some requests; their intended lengths are counted")
    if not summary["output_tokens_from_usage"]:
        notes.append("output tokens: the server sent no usage chunk for some requests; their token chunks are counted")
    for note in notes:
        console.print(note, style="yellow", markup=False, highlight=False)
    if report["errors"]:
        console.print(f"{summary['failed']} request(s) failed:", style="red", markup=False)
        for message, count in list(report["errors"].items())[:10]:
            console.print(f"  {count} x {message}", markup=False, highlight=False)
