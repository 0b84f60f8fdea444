"""A usage report written out: a plain table, JSON or CSV (pure: text in, text out).

The three carry the same figures. GPU-hours are rounded to 0.01 in the table
and CSV (36 s of one GPU) and to 0.0001 in JSON; the refusals are one column
per reason class in CSV (classes found in the report, sorted), a mapping in
JSON and "class count, …" in the table.
"""

from __future__ import annotations

import csv
import io
import json
from datetime import tzinfo
from typing import Any

from gpuresa.reports.usage import NO_SHOW_PERCENT, UsageReport, UsageRow

DEFINITIONS = {
    "booked_gpu_hours": "booking intervals within the period × their GPUs",
    "held_gpu_hours": "time a session held the GPUs (running to its end) × GPUs",
    "busy_gpu_hours": "held × mean GPU utilization from telemetry",
    "unmeasured_gpu_hours": "held by sessions without telemetry (busy time unknown)",
    "sessions": "sessions that started holding GPUs in the period",
    "no_shows": (
        "of those, sessions nobody used: released for want of a login, or GPUs never busy "
        f"(mean utilization under {NO_SHOW_PERCENT:g} %)"
    ),
    "refused": "refused bookings starting in the period, by reason class",
}
_HEADERS = ("booked", "held", "busy", "unmeasured", "sessions", "no-shows", "refused")


def _hours(value: float) -> str:
    return f"{value:.2f}"


def _refused_text(row: UsageRow) -> str:
    return ", ".join(f"{name} {count}" for name, count in sorted(row.refused.items())) or "-"


def _cells(row: UsageRow) -> list[str]:
    return [
        row.key,
        _hours(row.booked),
        _hours(row.held),
        _hours(row.busy),
        _hours(row.unmeasured),
        str(row.sessions),
        str(row.no_shows),
        _refused_text(row),
    ]


def _span(report: UsageReport, zone: tzinfo) -> str:
    start = report.period.start.astimezone(zone)
    end = report.period.end.astimezone(zone)
    return f"{start:%Y-%m-%d %H:%M} to {end:%Y-%m-%d %H:%M} ({zone})"


def as_table(report: UsageReport, zone: tzinfo) -> str:
    """The report as aligned text: a line of period, a header, a row per key, the total."""
    lines = [_cells(row) for row in report.rows] + [_cells(report.total)]
    header = [report.by, *(f"{name}" for name in _HEADERS)]
    widths = [max(len(line[i]) for line in [header, *lines]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        # the key left, numbers right, the refusals (last) left and unpadded
        parts = [cells[0].ljust(widths[0])]
        parts += [cell.rjust(width) for cell, width in zip(cells[1:-1], widths[1:-1], strict=True)]
        parts.append(cells[-1])
        return "  ".join(parts).rstrip()

    text = [
        f"GPU usage from {_span(report, zone)}, by {report.by}; GPU-hours",
        line(header),
        *(line(cells) for cells in lines[:-1]),
        "-" * min(sum(widths) + 2 * len(widths), 100),
        line(lines[-1]),
        "busy: held × mean GPU utilization; unmeasured: held without telemetry; "
        f"no-shows: released unused, or GPUs never busy (under {NO_SHOW_PERCENT:g} %)",
    ]
    return "\n".join(text) + "\n"


def _row_json(row: UsageRow) -> dict[str, Any]:
    return {
        "key": row.key,
        "booked_gpu_hours": round(row.booked, 4),
        "held_gpu_hours": round(row.held, 4),
        "busy_gpu_hours": round(row.busy, 4),
        "unmeasured_gpu_hours": round(row.unmeasured, 4),
        "sessions": row.sessions,
        "no_shows": row.no_shows,
        "refused": dict(sorted(row.refused.items())),
    }


def as_json(report: UsageReport) -> str:
    """The report as a JSON document: period (UTC), by, rows, total and the definitions."""
    document = {
        "from": report.period.start.isoformat(),
        "to": report.period.end.isoformat(),
        "by": report.by,
        "rows": [_row_json(row) for row in report.rows],
        "total": _row_json(report.total),
        "definitions": DEFINITIONS,
    }
    return json.dumps(document, indent=2) + "\n"


def as_csv(report: UsageReport) -> str:
    """The report as CSV: a header, a row per key, then the total (key "total")."""
    classes = sorted({name for row in (*report.rows, report.total) for name in row.refused})
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(
        [
            report.by,
            "booked_gpu_hours",
            "held_gpu_hours",
            "busy_gpu_hours",
            "unmeasured_gpu_hours",
            "sessions",
            "no_shows",
            *(f"refused:{name}" for name in classes),
        ]
    )
    for row in (*report.rows, report.total):
        writer.writerow(
            [
                row.key,
                *(_hours(value) for value in (row.booked, row.held, row.busy, row.unmeasured)),
                row.sessions,
                row.no_shows,
                *(row.refused.get(name, 0) for name in classes),
            ]
        )
    return buffer.getvalue()
