"""The site's days, weeks (from Monday) and months, which max_gpu_hours counts over.

Pure. A period is cut at local midnight in the site's time zone, so a week
of a DST change lasts 167 or 169 hours, and a booking that crosses a
period's end counts in each period for the part it spends there.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta, tzinfo
from typing import Literal

Period = Literal["day", "week", "month"]


def _first_day(day: date, period: Period) -> date:
    if period == "week":
        return day - timedelta(days=day.weekday())
    if period == "month":
        return day.replace(day=1)
    return day


def _next_first_day(first: date, period: Period) -> date:
    if period == "week":
        return first + timedelta(days=7)
    if period == "month":
        return (first.replace(day=28) + timedelta(days=4)).replace(day=1)
    return first + timedelta(days=1)


def _midnight(day: date, zone: tzinfo) -> datetime:
    return datetime.combine(day, time(0), tzinfo=zone).astimezone(UTC)


def period_of(instant: datetime, period: Period, zone: tzinfo) -> tuple[datetime, datetime]:
    """The [start, end) in UTC of the period (in `zone`) that holds `instant`."""
    first = _first_day(instant.astimezone(zone).date(), period)
    return _midnight(first, zone), _midnight(_next_first_day(first, period), zone)


def periods_over(
    start: datetime, end: datetime, period: Period, zone: tzinfo
) -> list[tuple[datetime, datetime]]:
    """Every period that [start, end) meets, in order (one at least, for start < end)."""
    found = [period_of(start, period, zone)]
    while found[-1][1] < end:
        found.append(period_of(found[-1][1], period, zone))
    return found


def hours_within(start: datetime, end: datetime, bounds: tuple[datetime, datetime]) -> float:
    """The hours of [start, end) that fall inside `bounds`."""
    inside = min(end, bounds[1]) - max(start, bounds[0])
    return max(inside.total_seconds(), 0.0) / 3600


def period_name(bounds: tuple[datetime, datetime], period: Period, zone: tzinfo) -> str:
    """The period as a refusal names it: "the week Mon 23 Nov-Sun 29 Nov", "Mon 23 Nov",
    "November 2026" (local dates in `zone`)."""
    first = bounds[0].astimezone(zone).date()
    if period == "month":
        return f"{first:%B %Y}"
    if period == "day":
        return _day(first)
    last = bounds[1].astimezone(zone).date() - timedelta(days=1)
    return f"the week {_day(first)}-{_day(last)}"


def _day(day: date) -> str:
    return f"{day:%a} {day.day} {day:%b}"
