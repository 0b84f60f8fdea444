"""The read-only status page: a timeline of the GPUs, sessions, rejected bookings, calendars.

Plain HTML and CSS, no script: the server forbids scripts outright (its
Content-Security-Policy), and every text that came from a calendar (keys are
event UIDs, reasons quote event fields) goes through `gpuresa.inert.inert` and
`html.escape`. Shows
logins, reservation keys and SSH ports; never FTP passwords or e-mail addresses
(the `ObservedState` does not hold them).
"""

from __future__ import annotations

from datetime import datetime, timedelta, tzinfo
from html import escape

from gpuresa.inert import inert
from gpuresa.observe.free import free_lines
from gpuresa.observe.state import BookingView, ObservedState, SessionView

# one colour per state; the page test finds the timeline's bars by them
COLOURS = {
    "running": "#2e7d32",
    "upcoming": "#1565c0",
    "idle": "#ef6c00",
    "lost": "#c62828",
}

_STYLE = """
body { font: 14px/1.4 "DejaVu Sans", system-ui, sans-serif; margin: 24px; color: #212121;
       background: #fafafa; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 8px; }
.muted { color: #616161; }
table { border-collapse: collapse; background: #fff; }
th, td { border: 1px solid #e0e0e0; padding: 4px 10px; text-align: left; vertical-align: top; }
th { background: #eeeeee; }
td.number { text-align: right; font-variant-numeric: tabular-nums; }
.timeline { position: relative; background: #fff; border: 1px solid #bdbdbd; }
.row { position: relative; height: 34px; border-top: 1px solid #e0e0e0; }
.row:first-of-type { border-top: none; }
.label { position: absolute; left: 0; width: 110px; top: 0; bottom: 0; padding: 7px 8px;
         box-sizing: border-box; background: #f5f5f5; border-right: 1px solid #bdbdbd;
         font-weight: bold; white-space: nowrap; overflow: hidden; }
.track { position: absolute; left: 110px; right: 0; top: 0; bottom: 0; overflow: hidden; }
.day { position: absolute; top: 0; bottom: 0; border-left: 1px dashed #bdbdbd; }
.day span { position: absolute; top: 4px; left: 5px; font-size: 12px; color: #616161;
            white-space: nowrap; }
.now { position: absolute; top: 0; bottom: 0; border-left: 2px solid #212121; z-index: 2; }
.bar { position: absolute; top: 7px; bottom: 5px; border-radius: 3px; color: #fff;
       font-size: 12px; padding: 3px 6px; box-sizing: border-box; white-space: nowrap;
       overflow: hidden; text-overflow: ellipsis; min-width: 3px; }
.axis { height: 26px; background: #f5f5f5; }
.badge { display: inline-block; padding: 0 6px; border-radius: 3px; color: #fff; }
.legend span { margin-right: 14px; }
"""


def _text(value: object) -> str:
    # inert first: control and bidi characters become visible escapes, then HTML-escaped
    return escape(inert(str(value)), quote=True)


def _when(instant: datetime | None, zone: tzinfo) -> str:
    return instant.astimezone(zone).strftime("%a %d %b %H:%M") if instant else "–"


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f} %"


def _session_state(session: SessionView) -> str:
    if session.lost:
        return "lost"
    if session.idle:
        return "idle"
    return "running" if session.state == "running" else "upcoming"


class _Timeline:
    """Positions of instants over the window [start, start + days), in percent of the track."""

    def __init__(self, start: datetime, days: int) -> None:
        self.start, self.end = start, start + timedelta(days=days)

    def percent(self, instant: datetime) -> float:
        span = (self.end - self.start).total_seconds()
        offset = (min(max(instant, self.start), self.end) - self.start).total_seconds()
        return 100.0 * offset / span

    def bar(self, start: datetime, end: datetime, state: str, text: str, title: str) -> str:
        if end <= self.start or start >= self.end:
            return ""
        left, right = self.percent(start), self.percent(end)
        return (
            f'<div class="bar {state}" style="left:{left:.3f}%;width:{right - left:.3f}%;'
            f'background:{COLOURS[state]}" title="{_text(title)}">{_text(text)}</div>'
        )


def _timeline(state: ObservedState, zone: tzinfo, days: int) -> str:
    local_now = state.taken.astimezone(zone)
    start = local_now.replace(hour=0, minute=0, second=0, microsecond=0)
    line = _Timeline(start, days)
    gpus = sorted(
        {gpu.index for gpu in state.gpus}
        | {index for session in state.sessions for index in session.gpus}
        | {index for booking in state.upcoming for index in booking.gpus}
    )
    bars: dict[int | None, list[str]] = {index: [] for index in gpus}
    for session in state.sessions:
        for index in session.gpus:
            title = (
                f"{session.key}: {session.user}, {_when(session.start, zone)} → "
                f"{_when(session.end, zone)}, use now {_percent(session.utilization)}"
            )
            text = f"{session.user} · {session.key}"
            state_name = _session_state(session)
            bars[index].append(line.bar(session.start, session.end, state_name, text, title))
    unplaced: list[BookingView] = []
    for booking in state.upcoming:
        title = (
            f"{booking.key}: {booking.user}, {booking.template}, {booking.count} GPU(s), "
            f"{_when(booking.start, zone)} → {_when(booking.end, zone)}"
        )
        if not booking.gpus:
            unplaced.append(booking)
        for index in booking.gpus:
            bars[index].append(
                line.bar(
                    booking.start, booking.end, "upcoming", f"{booking.user} · {booking.key}", title
                )
            )
    if unplaced:
        bars[None] = [
            line.bar(b.start, b.end, "upcoming", f"{b.user} · {b.key}", b.key) for b in unplaced
        ]
    names = {gpu.index: gpu.name for gpu in state.gpus}
    midnights = [start + timedelta(days=n) for n in range(days)]
    day_marks = "".join(
        f'<div class="day" style="left:{line.percent(day):.3f}%"></div>' for day in midnights
    )
    day_labels = "".join(
        f'<div class="day" style="left:{line.percent(day):.3f}%">'
        f"<span>{_text(day.strftime('%a %d %b'))}</span></div>"
        for day in midnights
    )
    now_mark = f'<div class="now" style="left:{line.percent(state.taken):.3f}%"></div>'
    rows = [
        f'<div class="row axis"><div class="label">GPU</div>'
        f'<div class="track">{day_labels}{now_mark}</div></div>'
    ]
    for row, items in bars.items():
        label = f"GPU {row}" if row is not None else "no GPU free"
        title = names.get(row, "") if row is not None else "bookings no GPU is free for"
        rows.append(
            f'<div class="row gpu-row" id="gpu-{row if row is not None else "none"}">'
            f'<div class="label" title="{_text(title)}">{_text(label)}</div>'
            f'<div class="track">{day_marks}{now_mark}{"".join(items)}</div></div>'
        )
    legend = "".join(
        f'<span><span class="badge" style="background:{colour}">&nbsp;</span> {name}</span>'
        for name, colour in COLOURS.items()
    )
    return f'<div class="timeline">{"".join(rows)}</div><p class="legend muted">{legend}</p>'


def _table(headers: list[str], rows: list[list[str]], empty: str) -> str:
    if not rows:
        return f'<p class="muted">{_text(empty)}</p>'
    head = "".join(f"<th>{_text(header)}</th>" for header in headers)
    body = "".join("<tr>" + "".join(rows_cell for rows_cell in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _cell(value: object, number: bool = False) -> str:
    return f'<td class="number">{_text(value)}</td>' if number else f"<td>{_text(value)}</td>"


# the week's table shows the logins that booked most, then the total
WEEK_ROWS = 15


def _week(state: ObservedState) -> str:
    """This week's GPU-hours by login (`gpuresa report`'s default), the largest first."""
    week = state.usage.week if state.usage is not None else None
    if week is None:
        return '<p class="muted">Not read yet.</p>'
    shown = sorted(week.rows, key=lambda row: (-row.booked, row.key))[:WEEK_ROWS]
    rows = [
        [
            _cell(row.key),
            _cell(f"{row.booked:.1f}", True),
            _cell(f"{row.held:.1f}", True),
            _cell("–" if row.held == row.unmeasured else f"{row.busy:.1f}", True),
            _cell(row.sessions, True),
            _cell(row.no_shows, True),
            _cell(sum(row.refused.values()), True),
        ]
        for row in [*shown, week.total]
    ]
    headers = ["user", "booked", "held", "busy", "sessions", "no-shows", "refused"]
    more = len(week.rows) - len(shown)
    note = f" The {more} other login(s): `gpuresa report`." if more > 0 else ""
    return (
        f'<p class="muted">GPU-hours since Monday; busy: held × GPU utilization; no-shows: '
        f"sessions nobody used.{_text(note)}</p>"
        + _table(headers, rows if week.rows else [], "No booking this week.")
    )


def render_page(state: ObservedState, zone: tzinfo, days: int = 3) -> str:
    """The whole page for `state`, times shown in `zone`, the timeline `days` long."""
    sessions = [
        [
            _cell(s.key),
            _cell(s.user),
            _cell(", ".join(map(str, s.gpus)) or "none"),
            _cell(_when(s.start, zone)),
            _cell(_when(s.end, zone)),
            _cell(s.ssh_port, True),
            _cell(_percent(s.utilization), True),
            _cell(_percent(s.average_utilization), True),
            f'<td><span class="badge" style="background:{COLOURS[_session_state(s)]}">'
            f"{_text(_session_state(s) if s.state == 'running' else s.state)}</span></td>",
        ]
        for s in state.sessions
    ]
    gpus = [
        [
            _cell(g.index, True),
            _cell(g.name),
            _cell(_percent(g.utilization), True),
            _cell(
                "–"
                if g.memory_used is None or g.memory_total is None
                else f"{g.memory_used / 2**30:.1f} / {g.memory_total / 2**30:.0f} GiB",
                True,
            ),
            _cell(f"{g.user} · {g.key}" if g.key else "free"),
        ]
        for g in state.gpus
    ]
    unbooked = [
        [
            _cell(p.pid, True),
            _cell(p.gpu_index, True),
            _cell(p.host_user),
            _cell(p.command),
            _cell(p.where),
            _cell(p.holder_key or "not booked"),
        ]
        for p in state.unbooked
    ]
    rejected = [
        [_cell(r.key), _cell(r.user or "?"), _cell(_when(r.start, zone)), _cell(r.reason)]
        for r in state.rejected
    ]
    calendars = [
        [
            _cell(c.name),
            _cell(_when(c.last_success, zone)),
            _cell(
                f"{(state.taken - c.last_success).total_seconds() / 60:.0f} min ago"
                if c.last_success
                else "never read"
            ),
            _cell(c.last_error or "ok"),
        ]
        for c in state.calendars
    ]
    free = [[_cell(label), _cell(sentence)] for label, sentence in free_lines(state.free, zone)]
    telemetry = (
        f"GPUs read through {_text(state.telemetry_source)}"
        if state.telemetry_error is None
        else f"GPUs not readable: {_text(state.telemetry_error)}"
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="refresh" content="60">
<title>gpuresa · {_text(state.host)}</title><style>{_STYLE}</style></head>
<body>
<h1>GPU reservations on {_text(state.host)}</h1>
<p class="muted">as of {_text(_when(state.taken, zone))} ({_text(str(zone))}) · {telemetry}</p>
<h2>Next {days} days</h2>
{_timeline(state, zone, days)}
<h2>Free from now</h2>
<p class="muted">What a walk-in booking can get, as bookings stand now.</p>
{_table(["GPU", "free"], free, "No GPU on this host.")}
<h2>Sessions</h2>
{
        _table(
            [
                "reservation",
                "user",
                "GPUs",
                "from",
                "until",
                "ssh port",
                "use now",
                "average",
                "state",
            ],
            sessions,
            "No session on this host.",
        )
    }
<h2>GPUs</h2>
{_table(["GPU", "model", "use", "memory", "held by"], gpus, "No GPU readings.")}
<h2>Processes outside their booking</h2>
{
        _table(
            ["pid", "GPU", "host user", "command", "runs in", "GPU booked by"],
            unbooked,
            "None: every process on a GPU belongs to the session that booked it.",
        )
    }
<h2>This week</h2>
{_week(state)}
<h2>Rejected bookings</h2>
{_table(["reservation", "user", "start", "reason"], rejected, "No rejected booking.")}
<h2>Calendars</h2>
{_table(["calendar", "last read", "age", "last error"], calendars, "No calendar read yet.")}
</body></html>
"""
